"""The owned manifest of a NomicBERT embedder (nomic-embed-text v1 / v1.5), read from a Hugging
Face / sentence-transformers directory. `manifest.build_body` hands `model_type: nomic_bert`
directories here for the config and weights; the head (mean or first-token pooling, a Dense
module or a prompt-less pooling refused) and everything else about the artifact are the owned
format's, as for BERT.

What the NomicBERT graph (`workers.ane.builder_nomic`) computes, and so what is accepted: the
function `formats.nomic_config` states for llama.cpp's nomic-bert graph too (token + token-type
embeddings -> LayerNorm, no position table; per layer post-norm with a fused bias-free QKV,
NEOX rotary over the whole head at the config's base, bidirectional attention, bias-free
output projection, SwiGLU MLP `down(silu(gate(x)) * up(x))`). The same readers refuse the same
directories on both lanes, by name; the graph adds one limit of its own: one or two token types
(it adds them arithmetically, as BERT's does).

Weights are stored under nomic's original names, what the Hub's checkpoints and transformers 5
save (`emb_ln`, `encoder.layers.N.attn.Wqkv`, `attn.out_proj`, `mlp.fc11` = up, `mlp.fc12` =
gate, `mlp.fc2` = down, `norm1`, `norm2`). A checkpoint under transformers' in-memory names
(split `q/k/v_proj`, `up/gate/down_proj`, ...) is renamed and its q/k/v fused in that order, so
the same model is the same artifact, and the same digest, whichever naming it came in. A tensor
the graph does not read (a bias, an extra layer) is refused: ignoring it would serve another
function.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from formats.hf_config import HfConfig
from formats.nomic_config import NomicSizes, check_config, nomic_sizes
from formats.owned.model import ManifestError, ModelConfig, UnsupportedModel, source_layout
from formats.safetensors_io import read_safetensors, weight_files

EMBEDDINGS = (
    "embeddings.word_embeddings.weight",
    "embeddings.token_type_embeddings.weight",
    "emb_ln.weight",
    "emb_ln.bias",
)
# transformers' in-memory names -> nomic's original ones (transformers' own conversion mapping).
_RENAMES = (
    ("embeddings.LayerNorm.", "emb_ln."),
    ("self_attn.o_proj.", "attn.out_proj."),
    ("mlp.up_proj.", "mlp.fc11."),
    ("mlp.gate_proj.", "mlp.fc12."),
    ("mlp.down_proj.", "mlp.fc2."),
    ("post_attention_layernorm.", "norm1."),
    ("post_mlp_layernorm.", "norm2."),
)
_SPLIT_QKV = ("q_proj", "k_proj", "v_proj")
_SPLIT = re.compile(r"^encoder\.layers\.(\d+)\.self_attn\.([qkv]_proj)\.weight$")
# The MLM head, the pooler and buffers carry nothing the embedding uses.
_IGNORED = re.compile(
    r"^(lm_head\..*|cls\..*|pooler\..*|embeddings\.(position_ids|token_type_ids)"
    r"|.*rotary_emb\.inv_freq)$"
)


def config_from_hf(src: Path, cfg: HfConfig) -> tuple[ModelConfig, NomicSizes]:
    sizes = nomic_sizes(cfg)
    check_config(cfg, sizes)
    if not 1 <= sizes.type_vocab <= 2:
        # The graph adds token types arithmetically (type 0 + tt * (type 1 - type 0)).
        raise UnsupportedModel(f"type_vocab_size={sizes.type_vocab}: 1 or 2 supported")
    if (sizes.hidden // sizes.heads) % 2:
        raise UnsupportedModel("an odd head size: rotary embeddings rotate half of it")
    pad = cfg.value("pad_token_id", 0)  # BERT's WordPiece [PAD]
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise UnsupportedModel(f"pad_token_id={pad!r}: not a token id")
    max_seq = source_layout(src).max_seq_length or sizes.context
    config = ModelConfig(
        architecture=cfg.architecture("NomicBertModel"),
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        num_layers=sizes.layers,
        num_heads=sizes.heads,
        intermediate_size=sizes.ffn,
        max_positions=sizes.context,
        type_vocab_size=sizes.type_vocab,
        layer_norm_eps=sizes.norm_eps,
        hidden_act="silu",
        pad_token_id=pad,
        max_seq_length=min(max_seq, sizes.context),
        rope_theta=sizes.rope_base,
    )
    return config, sizes


def required_tensors(sizes: NomicSizes) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph reads, with the shape the config implies."""
    h, ff = sizes.hidden, sizes.ffn
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (sizes.vocab, h),
        "embeddings.token_type_embeddings.weight": (sizes.type_vocab, h),
        "emb_ln.weight": (h,),
        "emb_ln.bias": (h,),
    }
    for i in range(sizes.layers):
        p = f"encoder.layers.{i}."
        shapes |= {
            p + "attn.Wqkv.weight": (3 * h, h),
            p + "attn.out_proj.weight": (h, h),
            p + "norm1.weight": (h,),
            p + "norm1.bias": (h,),
            p + "mlp.fc11.weight": (ff, h),
            p + "mlp.fc12.weight": (ff, h),
            p + "mlp.fc2.weight": (h, ff),
            p + "norm2.weight": (h,),
            p + "norm2.bias": (h,),
        }
    return shapes


def canonical_name(name: str) -> str:
    """nomic's original name of a tensor under either naming (prefixes stripped)."""
    name = re.sub(r"^(model|bert|nomic_bert)\.", "", name)
    if name.startswith("layers."):
        name = "encoder." + name
    for theirs, original in _RENAMES:
        name = name.replace(theirs, original)
    return name


def load_tensors(src: Path, sizes: NomicSizes) -> dict[str, np.ndarray]:
    """The graph's tensors, float32, under nomic's names; anything else is refused."""
    expect = required_tensors(sizes)
    out: dict[str, np.ndarray] = {}
    split: dict[int, dict[str, np.ndarray]] = {}
    extra: list[str] = []
    for path in weight_files(src):
        for name, arr in read_safetensors(path).items():
            canon = canonical_name(name)
            if _IGNORED.match(canon):
                continue
            m = _SPLIT.match(canon)
            if m:
                split.setdefault(int(m.group(1)), {})[m.group(2)] = arr
                continue
            if canon not in expect:
                extra.append(name)
                continue
            if canon in out:
                raise ManifestError(f"{name!r}: {canon} is given twice")
            out[canon] = np.ascontiguousarray(arr, dtype=np.float32)
    if extra:
        raise UnsupportedModel(f"tensors the NomicBERT graph does not use: {sorted(extra)[:5]}")
    for layer, parts in sorted(split.items()):
        fused = f"encoder.layers.{layer}.attn.Wqkv.weight"
        if len(parts) != 3 or fused in out:
            raise ManifestError(f"layer {layer}: q/k/v given as {sorted(parts)} and Wqkv")
        # Wqkv's rows are q, then k, then v (transformers splits it in that order).
        out[fused] = np.ascontiguousarray(
            np.concatenate([parts[p] for p in _SPLIT_QKV], axis=0), dtype=np.float32
        )
    missing = [n for n in expect if n not in out]
    if missing:
        raise ManifestError(f"the weights lack {missing[:3]} ({len(missing)} missing)")
    for name, shape in expect.items():
        if out[name].shape != shape:
            raise ManifestError(f"{name}: shape {out[name].shape}, config implies {shape}")
    return out
