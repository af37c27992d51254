"""A Hugging Face NomicBERT directory (nomic-embed-text v1 / v1.5) -> GGUF (arch `nomic-bert`).

What llama.cpp's nomic-bert graph computes (models/bert.cpp in the vendored llama.cpp), and so
what a directory must be to be served by it, the same function transformers' `NomicBertModel`
computes:
- token + token-type embeddings -> LayerNorm (no position table: rotary positions in every
  layer, NEOX halves as transformers' `rotate_half`, over the whole head);
- per layer, post-norm as BERT: fused QKV without biases, full bidirectional attention, output
  projection, residual, LayerNorm; a SwiGLU MLP `down(silu(gate(x)) * up(x))`, residual,
  LayerNorm. Nothing else: no biases, no MoE layers, no partial or interleaved rotary.

A directory names its sizes in either of two key sets, and may carry both: transformers'
(`hidden_size`, `num_hidden_layers`, ...), which transformers reads, and nomic's own
(`n_embd`, `n_layer`, ...: the Hub checkpoints' original config, which llama.cpp's converter
reads). Either is read; when both are present they must agree, or the directory is refused:
the two programs would build different models from it. Weights come under either naming too:
transformers' (`layers.N.self_attn.q_proj`, `mlp.gate_proj`...) or the original checkpoint's
(`encoder.layers.N.attn.Wqkv`, `mlp.fc11` = up, `mlp.fc12` = gate, `mlp.fc2` = down, `norm1`,
`norm2`, `emb_ln`), which transformers renames on load the same way.

The trained context: nomic's config says `n_positions` 8192 with `max_trained_positions` 2048
(v1 and v1.5 were trained at 2048, as llama.cpp's converter records); the smaller one counts.
The vocabulary is BERT's WordPiece, written as the BERT converter writes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH, MODEL_TENSOR

from common.errors import ArtifactInvalid, InvalidRequest
from formats.hf_config import HfConfig
from formats.nomic_config import NomicSizes, check_config, nomic_sizes
from formats.safetensors_io import read_model_weights
from ingest.bert_to_gguf import add_bert_specials, special_ids, wordpiece_vocab
from ingest.hf_common import (
    POOLING_TYPES,
    ConvertedModel,
    Dtype,
    PoolingName,
    file_type,
    st_layout,
    st_pooling,
    tensor_dtype,
    tensor_name,
    write_gguf,
)

ARCH = MODEL_ARCH.NOMIC_BERT
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]  # "nomic-bert"


def _name(t: MODEL_TENSOR, bid: int | None = None) -> str:
    return tensor_name(ARCH, t, bid)


_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": MODEL_TENSOR.TOKEN_EMBD,
    "embeddings.token_type_embeddings.weight": MODEL_TENSOR.TOKEN_TYPES,
    "embeddings.LayerNorm.weight": MODEL_TENSOR.TOKEN_EMBD_NORM,
    "embeddings.LayerNorm.bias": MODEL_TENSOR.TOKEN_EMBD_NORM,
    "emb_ln.weight": MODEL_TENSOR.TOKEN_EMBD_NORM,
    "emb_ln.bias": MODEL_TENSOR.TOKEN_EMBD_NORM,
}
# Per layer, both namings (transformers', original) -> llama.cpp's tensor.
_LAYER = {
    "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "attn.out_proj": MODEL_TENSOR.ATTN_OUT,
    "post_attention_layernorm": MODEL_TENSOR.ATTN_OUT_NORM,
    "norm1": MODEL_TENSOR.ATTN_OUT_NORM,
    "mlp.up_proj": MODEL_TENSOR.FFN_UP,
    "mlp.fc11": MODEL_TENSOR.FFN_UP,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE,
    "mlp.fc12": MODEL_TENSOR.FFN_GATE,
    "mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
    "mlp.fc2": MODEL_TENSOR.FFN_DOWN,
    "post_mlp_layernorm": MODEL_TENSOR.LAYER_OUT_NORM,
    "norm2": MODEL_TENSOR.LAYER_OUT_NORM,
    "attn.Wqkv": MODEL_TENSOR.ATTN_QKV,
}
_SPLIT_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LAYER_KEY = re.compile(r"^(?:encoder\.)?layers\.(\d+)\.(.+)\.(weight|bias)$")
# The MLM head and buffers carry nothing the embedding uses.
_IGNORED = re.compile(
    r"^(lm_head\..*|cls\..*|pooler\..*|embeddings\.(position_ids|token_type_ids))$"
)


def _map_tensors(weights: dict[str, np.ndarray], n_layers: int) -> dict[str, np.ndarray]:
    """llama.cpp name -> array, strict about unknown, missing and duplicate tensors."""
    out: dict[str, np.ndarray] = {}
    split: dict[int, dict[str, np.ndarray]] = {}

    def put(name: str, arr: np.ndarray, key: str) -> None:
        if name in out:
            raise ArtifactInvalid(f"{key!r} maps to {name}, which another tensor already gave")
        out[name] = arr

    for key, arr in weights.items():
        k = re.sub(r"^(model|bert|nomic_bert)\.", "", key)
        if _IGNORED.match(k):
            continue
        if k in _EMBEDDINGS:
            put(f"{_name(_EMBEDDINGS[k])}.{k.rsplit('.', 1)[1]}", arr, key)
            continue
        m = _LAYER_KEY.match(k)
        if m is None:
            raise ArtifactInvalid(f"unexpected tensor {key!r}")
        bid, sub, suffix = int(m.group(1)), m.group(2), m.group(3)
        if bid >= n_layers:
            raise ArtifactInvalid(f"unexpected tensor {key!r} (the config has {n_layers} layers)")
        if sub in _SPLIT_QKV and suffix == "weight":
            split.setdefault(bid, {})[sub] = arr
            continue
        if sub not in _LAYER:
            raise ArtifactInvalid(f"unexpected tensor {key!r} (NomicBERT has no biases there)")
        put(f"{_name(_LAYER[sub], bid)}.{suffix}", arr, key)
    for bid, parts in split.items():
        if len(parts) != 3:
            raise ArtifactInvalid(f"layer {bid} has {sorted(parts)} of q/k/v projections")
        fused = np.concatenate([parts[s] for s in _SPLIT_QKV], axis=0)
        put(f"{_name(MODEL_TENSOR.ATTN_QKV, bid)}.weight", fused, f"layers.{bid}.self_attn")
    required = [f"{_name(MODEL_TENSOR.TOKEN_EMBD)}.weight"]
    required += [f"{_name(MODEL_TENSOR.TOKEN_EMBD_NORM)}.{s}" for s in ("weight", "bias")]
    per_layer = {
        MODEL_TENSOR.ATTN_QKV: ("weight",),
        MODEL_TENSOR.ATTN_OUT: ("weight",),
        MODEL_TENSOR.ATTN_OUT_NORM: ("weight", "bias"),
        MODEL_TENSOR.FFN_UP: ("weight",),
        MODEL_TENSOR.FFN_GATE: ("weight",),
        MODEL_TENSOR.FFN_DOWN: ("weight",),
        MODEL_TENSOR.LAYER_OUT_NORM: ("weight", "bias"),
    }
    required += [
        f"{_name(t, b)}.{s}" for b in range(n_layers) for t, sfx in per_layer.items() for s in sfx
    ]
    missing = [n for n in required if n not in out]
    if missing:
        raise ArtifactInvalid(f"missing tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    # One order whichever naming the checkpoint used, so the same model is the same file.
    return dict(sorted(out.items(), key=lambda kv: _tensor_order(kv[0])))


def _tensor_order(name: str) -> tuple[int, str]:
    m = re.match(r"^blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def _check_shapes(tensors: dict[str, np.ndarray], sizes: NomicSizes) -> None:
    h, ff = sizes.hidden, sizes.ffn
    want = {
        "token_embd.weight": (sizes.vocab, h),
        "blk.0.attn_qkv.weight": (3 * h, h),
        "blk.0.attn_output.weight": (h, h),
        "blk.0.ffn_up.weight": (ff, h),
        "blk.0.ffn_gate.weight": (ff, h),
        "blk.0.ffn_down.weight": (h, ff),
    }
    if "token_types.weight" in tensors:
        want["token_types.weight"] = (sizes.type_vocab, h)
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ArtifactInvalid(f"{name} has shape {tensors[name].shape}, config says {shape}")


def convert(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str,
) -> ConvertedModel:
    sizes = nomic_sizes(config)
    check_config(config, sizes)
    if pooling is None:
        pooling = st_pooling(model_dir)
        if pooling is None:
            raise InvalidRequest(f"{model_dir} declares no pooling; pass pooling=")
    elif pooling == "rank":
        raise InvalidRequest("rank pooling needs a sequence-classification model")
    tensors = _map_tensors(read_model_weights(model_dir), sizes.layers)
    _check_shapes(tensors, sizes)
    vocab = wordpiece_vocab(model_dir, sizes.vocab)
    special = special_ids(model_dir, vocab.ids, "bert")
    max_seq = st_layout(model_dir).max_seq_length

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_name(name)
        w.add_file_type(file_type(dtype))
        w.add_context_length(sizes.context)
        w.add_embedding_length(sizes.hidden)
        w.add_feed_forward_length(sizes.ffn)
        w.add_block_count(sizes.layers)
        w.add_head_count(sizes.heads)
        w.add_layer_norm_eps(sizes.norm_eps)
        w.add_rope_freq_base(sizes.rope_base)
        w.add_causal_attention(False)
        w.add_pooling_type(POOLING_TYPES[pooling])
        vocab.add_to(w)
        w.add_token_type_count(sizes.type_vocab)
        add_bert_specials(w, special, add_sep=False)
        for tname, arr in tensors.items():
            target = tensor_dtype(tname, arr, dtype, keep_f32=tname.startswith("token_types"))
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=target))

    write_gguf(out_path, ARCH_NAME, fill)
    return ConvertedModel(
        kind="embed",
        dtype=dtype,
        dims=sizes.hidden,
        pooling=pooling,
        n_ctx_train=sizes.context,
        vocab_size=sizes.vocab,
        n_layers=sizes.layers,
        n_labels=0,
        cls_id=special["cls"],
        sep_id=special["sep"],
        max_seq_length=max_seq if isinstance(max_seq, int) else None,
    )
