"""The owned manifest of a Qwen3 embedder (Qwen3-Embedding: a causal decoder pooled at the
`<|endoftext|>` its tokenizer appends) or reranker (Qwen3-Reranker: a Qwen3ForCausalLM whose
raw score is logit[yes] - logit[no] at the last token, as sentence-transformers' CrossEncoder
with LogitScore computes it), read from a Hugging Face / sentence-transformers directory.
`manifest.build_body` hands `model_type: qwen3` directories here; everything else about the
artifact (digests, files, verification) is the owned format's, unchanged.

What the Qwen3 graph (`builder_qwen3`) computes, and so what is accepted: RMSNorm everywhere
(per-head q/k norms too), NEOX rotary embeddings over the whole head at `rope_theta`,
grouped-query attention (`num_key_value_heads`), SwiGLU MLP, no biases, causal attention over
the whole sequence, the last token. A config asking for anything else (biases, a sliding
window, rope scaling, another activation, a classifier, another pooling, a Dense module after
pooling) would be served silently wrong, so it is refused by name.

Embedder or reranker: a Qwen3ForCausalLM directory is a reranker when its sentence-transformers
files say so (a CrossEncoder ending in LogitScore), when it says it is a Qwen3-Reranker (README
heading or name, as llama.cpp's converter decides), or when the caller names its true and
false tokens (`formats.owned.rank_head`); otherwise an embedder, whose artifact (and digest) is
what it was before rerankers existed.

Weights keep HF's names minus the `model.` prefix Qwen3ForCausalLM adds. An embedder leaves the
LM head out (its digest would otherwise pin a tensor the graph never reads); a reranker keeps
only the difference of its two rows (`score.weight`), taken from `lm_head.weight` or, for tied
embeddings, from the embedding table, as transformers computes the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from formats.hf_config import HfConfig
from formats.owned.model import (
    RANK_HEADS,
    Head,
    ManifestError,
    ModelConfig,
    UnsupportedModel,
    read_json,
    source_layout,
)
from formats.owned.rank_head import (
    SCORE_WEIGHT,
    RankTokens,
    rank_head,
    rank_tokens,
    score_row,
    vocabulary,
)
from formats.safetensors_io import read_safetensors, weight_files

ARCHITECTURES = ("Qwen3Model", "Qwen3ForCausalLM")

# The longest row the graph is built for. Position and segment ids are compared in fp16
# inside the graph (the masks and the last-token pick run on the Neural Engine), and fp16
# holds every integer exactly only up to 2048; the host's own per-input limit for Qwen3 is the
# same 2048 (the llama.cpp lane's encoder batch), so nothing servable is lost.
MAX_GRAPH_POSITIONS = 2048


def _rope_theta(cfg: HfConfig) -> float:
    kind, theta = cfg.rope()
    if kind != "default":
        raise UnsupportedModel(
            f"rope scaling {kind!r}: the graph's rotary tables are the unscaled ones"
        )
    return theta


def _eos_id(src: Path) -> int:
    """The id of the token the model pools: the tokenizer's end-of-text token."""
    cfg_path = src / "tokenizer_config.json"
    cfg = read_json(cfg_path) if cfg_path.is_file() else {}
    text = cfg.get("eos_token", "<|endoftext|>")
    if isinstance(text, dict):  # AddedToken serialised as an object
        text = text.get("content")
    ids = vocabulary(src)
    if text not in ids:
        raise ManifestError(f"tokenizer.json has no end-of-text token {text!r}")
    return int(ids[text])


def config_from_hf(src: Path, cfg: HfConfig) -> ModelConfig:
    archs = cfg.architectures or ["Qwen3Model"]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise UnsupportedModel(
            f"architectures {archs}: Qwen3 embedders and rerankers only "
            f"({', '.join(ARCHITECTURES)}); Qwen3 classifiers are not built"
        )
    act = cfg.string("hidden_act")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act={act!r}: the MLP is SwiGLU (silu)")
    if cfg.flag("attention_bias"):
        raise UnsupportedModel("attention_bias: the graph's q/k/v/o projections have no biases")
    if cfg.flag("use_sliding_window"):
        raise UnsupportedModel("use_sliding_window: the graph attends to the whole sequence")
    hidden = cfg.positive_int("hidden_size")
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.kv_heads()
    if heads % kv_heads:
        raise UnsupportedModel(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = cfg.head_dim()
    if head_dim % 2:
        raise ManifestError(
            f"config.json: head_dim {head_dim!r} is not a positive even integer "
            "(rotary embeddings rotate half of it)"
        )
    eps = cfg.number("rms_norm_eps")
    max_pos = min(cfg.positive_int("max_position_embeddings"), MAX_GRAPH_POSITIONS)
    max_seq = source_layout(src).max_seq_length or max_pos
    return ModelConfig(
        architecture=archs[0],
        vocab_size=cfg.positive_int("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.positive_int("num_hidden_layers"),
        num_heads=heads,
        intermediate_size=cfg.positive_int("intermediate_size"),
        max_positions=max_pos,
        type_vocab_size=0,  # a decoder has no token types: the graph takes none
        layer_norm_eps=eps,  # RMSNorm's epsilon
        hidden_act="silu",
        # Padding positions carry the end-of-text id: any valid id serves (never pooled,
        # never attended to by a real token).
        pad_token_id=_eos_id(src),
        max_seq_length=min(max_seq, max_pos),
        num_kv_heads=kv_heads,
        attention_head_dim=head_dim,
        rope_theta=_rope_theta(cfg),
    )


def head_from_hf(src: Path, rank: RankTokens | None = None) -> Head:
    layout = source_layout(src)
    if rank is not None:
        if layout.pooling_modes or layout.dense_dirs:
            # A reranker reads the LM head's logits at the last token; a Pooling or Dense
            # module says the directory is an embedder.
            raise UnsupportedModel(
                "a reranker (true/false tokens named) whose sentence-transformers modules "
                "pool or project: not built"
            )
        return rank_head(rank)
    if layout.dense_dirs:
        raise UnsupportedModel(f"{len(layout.dense_dirs)} Dense module(s) after pooling: not built")
    if layout.pooling_modes != ("lasttoken",):
        # A causal decoder's early tokens never see the later ones: only the last token
        # (the appended end-of-text) has read the whole input.
        raise UnsupportedModel(
            f"pooling {list(layout.pooling_modes)}: Qwen3 embedders pool "
            "the last token (sentence-transformers 'lasttoken')"
        )
    return Head(type="embed_last", pooling="last", normalize=layout.normalize, num_labels=0)


def required_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph reads, with the shape the config implies."""
    h, ff, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (config.vocab_size, h),
        "norm.weight": (h,),
    }
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        }
    return shapes


LM_HEAD = "lm_head.weight"


def _ignored(name: str) -> bool:
    return name.startswith("lm_head.") or name.endswith("rotary_emb.inv_freq")


def load_tensors(
    src: Path, config: ModelConfig, head: Head | None = None, tied: bool = False
) -> dict[str, np.ndarray]:
    """The graph's tensors, float32, canonical names; anything else a Qwen3 checkpoint holds
    besides the LM head is refused (a tensor the graph ignores would change what it means).
    A reranker's `score.weight` is made from the LM head's two rows (the embedding table's
    when `tied`, as transformers ties them)."""
    expect = required_tensors(config)
    rank = head is not None and head.type in RANK_HEADS
    out: dict[str, np.ndarray] = {}
    extra: list[str] = []
    lm_head: np.ndarray | None = None
    for path in weight_files(src):
        for name, arr in read_safetensors(path).items():
            canon = name.removeprefix("model.")
            if rank and not tied and name == LM_HEAD:
                lm_head = arr
                continue
            if _ignored(canon):
                continue
            if canon not in expect:
                extra.append(name)
                continue
            out[canon] = np.ascontiguousarray(arr, dtype=np.float32)
    if extra:
        raise UnsupportedModel(f"tensors the Qwen3 graph does not use: {sorted(extra)[:5]}")
    missing = [n for n in expect if n not in out]
    if missing:
        raise ManifestError(f"the weights lack {missing[:3]} ({len(missing)} missing)")
    for name, shape in expect.items():
        if out[name].shape != shape:
            raise ManifestError(f"{name}: shape {out[name].shape}, config implies {shape}")
    if rank:
        assert head is not None and head.true_token_id is not None
        table = out["embed_tokens.weight"] if tied else lm_head
        if table is None:
            raise ManifestError(
                f"a reranker without tied embeddings needs {LM_HEAD}: the weights have none"
            )
        if table.shape != (config.vocab_size, config.hidden_size):
            raise ManifestError(
                f"{LM_HEAD}: shape {table.shape}, config implies "
                f"{(config.vocab_size, config.hidden_size)}"
            )
        false = None if head.false_token_id is None else table[head.false_token_id]
        out[SCORE_WEIGHT] = score_row(table[head.true_token_id], false)
    return out


def config_head_tensors(
    src: Path,
    cfg: HfConfig,
    true_token: str | int | None = None,
    false_token: str | int | None = None,
) -> tuple[ModelConfig, Head, dict[str, np.ndarray]]:
    """`true_token` / `false_token` (token strings or ids) make the directory a reranker
    scored with those two tokens; without them it is one only when it says so itself."""
    config = config_from_hf(src, cfg)
    name = cfg.get("_name_or_path")
    rank = rank_tokens(
        src,
        name if isinstance(name, str) else "",
        config.vocab_size,
        true_token,
        false_token,
    )
    if rank is not None and config.architecture != "Qwen3ForCausalLM":
        raise UnsupportedModel(
            f"a {config.architecture} reranker: the score reads the LM head "
            "(Qwen3ForCausalLM checkpoints only)"
        )
    head = head_from_hf(src, rank)
    return config, head, load_tensors(src, config, head, cfg.flag("tie_word_embeddings"))
