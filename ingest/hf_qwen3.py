"""A Hugging Face Qwen3 directory (Qwen3-Embedding: a causal decoder whose last token is the
embedding) -> GGUF of llama.cpp's `qwen3` architecture.

What llama.cpp's `qwen3` graph computes (models/qwen3.cpp in the llama.cpp llama-cpp-python
0.3.36 vendors) and so what we write:
- RMSNorm everywhere (`layer_norm_rms_eps`), per-head q/k RMSNorm, NEOX rope over the whole
  head (`rope.dimension_count` = head_dim: the graph asserts it), SwiGLU FFN, grouped-query
  attention (`head_count_kv`), head_dim written as key/value length because Qwen3's head_dim
  is not hidden / heads (0.6B: 1024 / 16 heads, head_dim 128);
- no biases on q/k/v/o, no sliding window, no rope scaling: a config asking for any of them
  would load and compute something else, so it is refused;
- the LM head is not needed to embed (`lm_head.*` ignored; llama.cpp ties it when absent).
Pooling is the directory's (sentence-transformers `lasttoken` -> `last`).
A Qwen3 LLM reranker (`convert_reranker`, see ingest.llm_rerank) is written as llama.cpp's
converter writes one: rank pooling, `classifier.output_labels` [true, false],
`cls.output.weight` holding those two rows of the LM head (the tied token embedding when the
checkpoint has no `lm_head`), kept in f32 whatever the file's dtype since the score is their
difference, and the checkpoint's Jinja template as `tokenizer.chat_template`. A
Qwen3ForSequenceClassification is written the same way with its `score` head as
`cls.output.weight` (`_convert_classifier`). The tokenizer stays
the directory's tokenizer.json, whose post-processor appends `<|endoftext|>`: the token the
model was trained to pool. The GGUF's vocabulary is byte-level BPE with the `qwen2`
pre-tokenizer, as llama.cpp's converter writes Qwen3's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import msgspec
import numpy as np

from common.errors import ArtifactInvalid, InvalidRequest
from formats.gguf_header import SEQ_CLS_PAD_KEY
from formats.hf_config import SIZE_KEYS, HfConfig
from formats.safetensors_io import read_model_weights
from ingest.hf_common import (
    POOLING_TYPES,
    ConvertedModel,
    Dtype,
    PoolingName,
    embed_pooling,
    file_type,
    load_json,
    map_names,
    require,
    st_layout,
    tensor_dtype,
    write_gguf,
)
from ingest.hf_vocab import byte_bpe_vocab
from ingest.llm_rerank import LlmRerankSpec, pair_template

ARCH = gguf.MODEL_ARCH.QWEN3
_EMBED_ARCHS = {"Qwen3Model", "Qwen3ForCausalLM"}
SEQ_CLS_ARCH = "Qwen3ForSequenceClassification"


def _rope_theta(config: HfConfig) -> float:
    kind, theta = config.rope()
    if kind != "default":
        raise ArtifactInvalid(
            f"rope scaling {kind!r} is not computed by llama.cpp's qwen3 "
            "graph as transformers computes it"
        )
    return theta


def _check_config(config: HfConfig, reranker: bool = False) -> None:
    archs = config.architectures or ["Qwen3Model"]
    if reranker and archs != ["Qwen3ForCausalLM"]:
        raise ArtifactInvalid(f"a Qwen3 LLM reranker is a Qwen3ForCausalLM, not {archs}")
    if len(archs) != 1 or archs[0] not in (*_EMBED_ARCHS, SEQ_CLS_ARCH):
        raise ArtifactInvalid(f"unsupported architecture {archs} for model_type 'qwen3'")
    for key in SIZE_KEYS:
        config.positive_int(key)
    act = config.string("hidden_act")
    if act != "silu":
        raise ArtifactInvalid(f"unsupported hidden_act {act!r} (llama.cpp's qwen3 graph is SwiGLU)")
    if config.flag("attention_bias"):
        raise ArtifactInvalid("attention_bias: llama.cpp's qwen3 graph has no q/k/v/o biases")
    if config.flag("use_sliding_window"):
        raise ArtifactInvalid(
            "use_sliding_window: llama.cpp's qwen3 graph attends to the whole sequence"
        )
    if config.positive_int("num_attention_heads") % config.kv_heads():
        raise ArtifactInvalid("num_attention_heads is not a multiple of num_key_value_heads")


def _ignored(key: str) -> bool:
    return key in ("score.weight", "score.bias") or (
        key.startswith("lm_head.") or key.endswith("rotary_emb.inv_freq")
    )


def convert(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str,
) -> ConvertedModel:
    _check_config(config)
    if config.architectures == [SEQ_CLS_ARCH]:
        return _convert_classifier(model_dir, config, out_path, dtype, pooling, name)
    pooling = embed_pooling(model_dir, pooling)
    if pooling != "last":
        # A causal decoder's early tokens never see the later ones: mean or first-token
        # pooling is not what Qwen3 embedders are trained with.
        raise InvalidRequest(f"Qwen3 embedders pool the last token, not {pooling!r}")
    return _convert(model_dir, config, out_path, dtype, pooling, name, None)


def _convert_classifier(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str,
) -> ConvertedModel:
    """A Qwen3ForSequenceClassification (transformers' GenericForSequenceClassification:
    `score.weight`, N labels, no bias, read at the rightmost non-pad token), written as a
    reranker GGUF whose `cls.output.weight` is that score head, marked by the pad id
    (workers.llama.llm_head.SEQ_CLS_PAD). llama.cpp's converter refuses the architecture (its
    TEXT_MODEL_MAP has no entry for it), so this is the one way in. One label: a reranker,
    whose pairs sentence-transformers renders through the tokenizer's chat template when it
    has one (kept as the manifest's pair template); N labels: a classifier."""
    if pooling not in (None, "rank", "last"):
        raise InvalidRequest("a sequence classifier scores its last token; it takes no pooling")
    weights = read_model_weights(model_dir)
    n_labels = len(config.labels())
    h = config.positive_int("hidden_size")
    score = weights.get("score.weight")
    if score is None:
        raise ArtifactInvalid(f"{SEQ_CLS_ARCH} without score.weight: its head is missing")
    if "score.bias" in weights:
        raise ArtifactInvalid("score.bias: transformers' score head has no bias")
    if tuple(score.shape) != (n_labels, h):
        raise ArtifactInvalid(
            f"score.weight has shape {tuple(score.shape)}, the config says ({n_labels}, {h})"
        )
    pad = config.get("pad_token_id")
    n_vocab = config.positive_int("vocab_size")
    if pad is not None and (
        not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < n_vocab
    ):
        raise ArtifactInvalid(f"config.json: pad_token_id {pad!r} is not a token id")
    layout = st_layout(model_dir)
    template = (
        pair_template(
            model_dir,
            instructions=layout.prompts,
            default_instruction_name=layout.default_prompt_name,
        )
        if n_labels == 1
        else None
    )
    head = _Head(np.asarray(score, np.float32), config.labels(), -1 if pad is None else pad)
    info = _convert(model_dir, config, out_path, dtype, "last", name, template, head, weights)
    return msgspec.structs.replace(info, n_labels=n_labels)


def convert_reranker(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    name: str,
    spec: LlmRerankSpec,
) -> ConvertedModel:
    _check_config(config, reranker=True)
    return _convert(model_dir, config, out_path, dtype, "rank", name, spec)


@dataclass(frozen=True)
class _Head:
    """The rows written as `cls.output.weight` (f32 whatever the file's dtype: the score is a
    dot product with them, or their difference), named by `labels`; `pad_id` marks a
    sequence classifier (-1: no pad id), None an LLM reranker."""

    rows: np.ndarray
    labels: list[str]
    pad_id: int | None = None


def _llm_head(weights: dict, config: HfConfig, spec: LlmRerankSpec) -> _Head:
    """The LM head's rows of the two scored tokens, or the token embedding's when the config
    ties them (transformers' Qwen3Config defaults tie_word_embeddings to false)."""
    assert spec.true_id is not None and spec.false_id is not None
    assert spec.true_token is not None and spec.false_token is not None
    embed = (
        "model.embed_tokens.weight"
        if "model.embed_tokens.weight" in weights
        else "embed_tokens.weight"
    )
    key = embed if config.flag("tie_word_embeddings") else "lm_head.weight"
    if key not in weights:
        raise ArtifactInvalid(f"no {key}: the reranker's score reads two rows of the LM head")
    head = weights[key]
    if head.shape[0] <= max(spec.true_id, spec.false_id):
        raise ArtifactInvalid(f"the LM head has {head.shape[0]} rows, fewer than the vocabulary")
    rows = np.stack([head[spec.true_id], head[spec.false_id]]).astype(np.float32)
    return _Head(rows, [spec.true_token, spec.false_token])


def _convert(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName,
    name: str,
    spec: LlmRerankSpec | None,
    head: _Head | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> ConvertedModel:
    theta = _rope_theta(config)
    h, n_layers = config.positive_int("hidden_size"), config.positive_int("num_hidden_layers")
    n_head, n_kv = config.positive_int("num_attention_heads"), config.kv_heads()
    head_dim = config.head_dim()
    ff, n_vocab = config.positive_int("intermediate_size"), config.positive_int("vocab_size")
    if weights is None:  # a classifier's were read already, for its score head
        weights = read_model_weights(model_dir)
    if spec is not None and head is None:
        head = _llm_head(weights, config, spec)
    tensors = map_names(weights, ARCH, n_layers, _ignored)
    shapes = {"token_embd.weight": (n_vocab, h), "output_norm.weight": (h,)}
    for b in range(n_layers):
        shapes |= {
            f"blk.{b}.attn_norm.weight": (h,),
            f"blk.{b}.attn_q.weight": (n_head * head_dim, h),
            f"blk.{b}.attn_k.weight": (n_kv * head_dim, h),
            f"blk.{b}.attn_v.weight": (n_kv * head_dim, h),
            f"blk.{b}.attn_output.weight": (h, n_head * head_dim),
            f"blk.{b}.attn_q_norm.weight": (head_dim,),
            f"blk.{b}.attn_k_norm.weight": (head_dim,),
            f"blk.{b}.ffn_norm.weight": (h,),
            f"blk.{b}.ffn_gate.weight": (ff, h),
            f"blk.{b}.ffn_up.weight": (ff, h),
            f"blk.{b}.ffn_down.weight": (h, ff),
        }
    require(tensors, shapes)
    extra = sorted(set(tensors) - set(shapes) - {"output.weight"})
    if extra:
        raise ArtifactInvalid(f"tensors llama.cpp's qwen3 graph does not use: {extra[:5]}")
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ArtifactInvalid(f"{model_dir} has no tokenizer.json")
    vocab = byte_bpe_vocab(load_json(tok_path), n_vocab, pre="qwen2")
    eos = _eos_id(model_dir, vocab.ids)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_name(name)
        w.add_file_type(file_type(dtype))
        w.add_context_length(config.positive_int("max_position_embeddings"))
        w.add_embedding_length(h)
        w.add_feed_forward_length(ff)
        w.add_block_count(n_layers)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(theta)
        w.add_layer_norm_rms_eps(config.number("rms_norm_eps"))
        # A head on the last token is rank-pooled, as llama.cpp's converter writes Qwen3
        # rerankers (model_kind reads it so; the worker decodes it with LAST pooling).
        w.add_pooling_type(POOLING_TYPES["rank" if head is not None else pooling])
        vocab.add_to(w)
        w.add_eos_token_id(eos)
        w.add_pad_token_id(eos)
        w.add_add_bos_token(False)
        if head is None:
            w.add_add_eos_token(True)  # Qwen3-Embedding appends <|endoftext|> and pools it
        else:
            # The tokenizer composes each sequence (the template ends an LLM reranker's
            # prompt); llama.cpp appends nothing.
            w.add_add_eos_token(False)
            w.add_classifier_output_labels(head.labels)
            if spec is not None:
                w.add_chat_template(spec.chat_template)
            if head.pad_id is not None:
                w.add_int32(SEQ_CLS_PAD_KEY, head.pad_id)
            w.add_tensor("cls.output.weight", head.rows)
        for tname, arr in tensors.items():
            if tname == "output.weight":
                continue  # the LM head does not embed
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=tensor_dtype(tname, arr, dtype)))

    write_gguf(out_path, gguf.MODEL_ARCH_NAMES[ARCH], fill)
    max_seq = st_layout(model_dir).max_seq_length
    return ConvertedModel(
        kind="embed" if head is None else "rerank",
        dtype=dtype,
        dims=h,
        pooling=pooling,
        n_ctx_train=config.positive_int("max_position_embeddings"),
        vocab_size=n_vocab,
        n_layers=n_layers,
        n_labels=0,
        cls_id=None,
        sep_id=None,
        max_seq_length=max_seq,
        architecture="qwen3",
        llm_rerank=spec,
    )


def _eos_id(model_dir: Path, ids: dict[str, int]) -> int:
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = load_json(cfg_path) if cfg_path.is_file() else {}
    text = cfg.get("eos_token", "<|endoftext|>")
    if isinstance(text, dict):  # AddedToken serialised as an object
        text = text.get("content")
    if text not in ids:
        raise ArtifactInvalid(f"tokenizer.json has no end-of-text token {text!r}")
    return ids[text]
