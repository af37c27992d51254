"""The owned manifest of a model that exists only as a GGUF file: config and head from its
metadata, weights from its f16/f32 (or bf16) tensors under the Hugging Face names the graph
builders read, so the artifact is the one a HF directory of the same model gives.

Families, by `general.architecture`:
- `bert`: BERT and XLM-RoBERTa embedders and cross-encoders. XLM-RoBERTa is told apart by its
  Unigram vocabulary (`tokenizer.ggml.model = "t5"`); its GGUF position table was already cut
  past the `pad_token_id + 1` rows HF numbers positions after (our converter and llama.cpp's
  both cut them), so position 0 is row 0 (`ModelConfig.first_position_row`). A cross-encoder is
  rank pooling with `cls` (dense + tanh) and `cls.output` (the classifier), mapped back to
  BERT's pooler + classifier or XLM-RoBERTa's classification head.
- `qwen3`: Qwen3 embedders (last-token pooled), as `formats.owned.manifest_qwen3` accepts them
  from a directory; rope scaling, a sliding window, biases or any tensor the graph does not
  read are refused by name. A Qwen3 reranker as llama.cpp's converter writes it (rank pooling,
  `cls.output.weight`: the LM head's `yes` and `no` rows, labels [yes, no]) keeps the
  difference of those rows as its score row, as from a directory; the token ids themselves
  are gone from such a file, so the head names none.
Any other architecture is refused, named.

What a GGUF does not state comes from the model's record (the host passes it): the pooling when
the file has no `pooling_type`, and the default truncation. A GGUF does not say whether the
model's vectors are L2-normalised; requests choose that, and the recorded default is the
host's own (normalised). GELU: the `bert` architecture carries no activation name; BERT and
XLM-RoBERTa are trained with exact (erf) GELU, which the graph computes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf.constants import Keys

from formats.gguf_header import GGUFHeader
from formats.owned import manifest_qwen3
from formats.owned.gguf_weights import check_float, read_header, read_tensor
from formats.owned.model import (
    Head,
    ManifestError,
    ModelConfig,
    UnsupportedModel,
    classifier_layers,
    required_tensors,
)
from formats.owned.rank_head import SCORE_WEIGHT, rank_head, score_row

ARCHITECTURES = ("bert", "qwen3")
# llama_pooling_type as GGUF metadata stores it.
_POOLING_BY_ID = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


class UnsupportedArchitecture(UnsupportedModel):
    def __init__(self, arch: str) -> None:
        super().__init__(
            f"GGUF architecture {arch or '(none)'!r}: the Core ML lane builds "
            f"{', '.join(ARCHITECTURES)} GGUFs only"
        )
        self.architecture = arch


Loaded = tuple[ModelConfig, Head, dict[str, np.ndarray]]


def config_head_tensors(
    path: str | Path, *, pooling: str | None = None, max_seq_length: int | None = None
) -> Loaded:
    """(config, head, float32 tensors under HF names) of the GGUF at `path`. `pooling`
    (mean | cls | last | rank) overrides the file's `pooling_type`; `max_seq_length` is the
    default truncation (capped at the model's positions)."""
    path = Path(path)
    hdr = read_header(path)
    arch = hdr.architecture
    if arch == "bert":
        return _bert(path, hdr, pooling, max_seq_length)
    if arch == "qwen3":
        return _qwen3(path, hdr, pooling, max_seq_length)
    raise UnsupportedArchitecture(arch)


# ---- metadata --------------------------------------------------------------------------------


def _key(hdr: GGUFHeader, template: str) -> str:
    return template.format(arch=hdr.architecture)


def _int(hdr: GGUFHeader, template: str, default: int | None = None) -> int:
    key = _key(hdr, template)
    value = hdr.kv.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ManifestError(f"GGUF metadata {key} missing or not a positive integer")
    return value


def _float(hdr: GGUFHeader, template: str) -> float:
    key = _key(hdr, template)
    value = hdr.kv.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ManifestError(f"GGUF metadata {key} missing or not a positive number")
    return float(value)


def _pooling(hdr: GGUFHeader, given: str | None) -> str:
    if given is not None:
        return given
    raw = hdr.kv.get(_key(hdr, Keys.LLM.POOLING_TYPE))
    declared = _POOLING_BY_ID.get(raw) if isinstance(raw, int) else None
    if declared is None or declared == "none":
        raise ManifestError(
            f"the {hdr.architecture} GGUF does not say how it pools, and no pooling was given"
        )
    return declared


def _max_seq(given: int | None, max_pos: int) -> int:
    if given is None:
        return max_pos
    if not isinstance(given, int) or isinstance(given, bool) or given < 1:
        raise ManifestError(f"max_seq_length {given!r} is not a positive integer")
    return min(given, max_pos)


def _shape(path: Path, hdr: GGUFHeader, name: str) -> tuple[int, ...]:
    for t in hdr.tensors:
        if t.name == name:
            return tuple(reversed(t.shape))
    raise ManifestError(f"{path.name} has no tensor {name!r}")


# ---- tensors ---------------------------------------------------------------------------------


def _load(
    path: Path,
    hdr: GGUFHeader,
    names: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    ignored: Callable[[str], bool],
) -> dict[str, np.ndarray]:
    """The tensors `names` maps (GGUF name -> HF name), checked against `shapes` (HF names).
    A tensor neither mapped nor `ignored` is refused: the graph would not compute it."""
    extra = [t.name for t in hdr.tensors if t.name not in names and not ignored(t.name)]
    if extra:
        raise UnsupportedModel(
            f"{path.name}: tensors the {hdr.architecture} graph does not "
            f"compute: {sorted(extra)[:5]}"
        )
    present = {t.name: t for t in hdr.tensors if t.name in names}
    missing = [n for n in names if n not in present]
    if missing:
        raise ManifestError(f"{path.name} lacks {missing[:3]} ({len(missing)} missing)")
    for info in present.values():  # every tensor's type before any is read
        check_float(info)
    out: dict[str, np.ndarray] = {}
    for gguf_name, hf_name in names.items():
        arr = read_tensor(path, hdr, present[gguf_name])
        if arr.shape != shapes[hf_name]:
            raise ManifestError(
                f"{path.name}: {gguf_name} has shape {arr.shape}, the metadata "
                f"implies {shapes[hf_name]}"
            )
        out[hf_name] = arr
    return out


# ---- BERT and XLM-RoBERTa --------------------------------------------------------------------


_BERT_EMBEDDINGS = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
_BERT_LAYER = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# The vocabulary names the family: XLM-RoBERTa's is SentencePiece Unigram, BERT's WordPiece.
_BERT_FAMILY = {"bert": "bert", "t5": "xlm-roberta"}


def _bert(
    path: Path, hdr: GGUFHeader, given_pooling: str | None, max_seq_length: int | None
) -> Loaded:
    vocab = hdr.kv.get(Keys.Tokenizer.MODEL)
    family = _BERT_FAMILY.get(vocab) if isinstance(vocab, str) else None
    if family is None:
        raise UnsupportedModel(
            f"a bert GGUF with a {vocab!r} vocabulary: BERT (WordPiece, "
            "'bert') or XLM-RoBERTa (Unigram, 't5') only"
        )
    if hdr.kv.get(_key(hdr, Keys.Attention.CAUSAL)):
        raise UnsupportedModel("causal attention: the BERT graph attends both ways")
    pooling = _pooling(hdr, given_pooling)
    h = _int(hdr, Keys.LLM.EMBEDDING_LENGTH)
    heads = _int(hdr, Keys.Attention.HEAD_COUNT)
    if h % heads:
        raise UnsupportedModel("embedding_length is not a multiple of head_count")
    ctx = _int(hdr, Keys.LLM.CONTEXT_LENGTH)
    vocab_rows = _shape(path, hdr, "token_embd.weight")[0]
    pos_rows = _shape(path, hdr, "position_embd.weight")[0]
    types = _shape(path, hdr, "token_types.weight")[0]
    if pos_rows < ctx:
        raise ManifestError(f"position_embd has {pos_rows} rows for a context of {ctx}")
    if not 1 <= types <= 2:
        # The graph adds token types arithmetically (type 0 + tt * (type 1 - type 0)).
        raise UnsupportedModel(f"{types} token types: 1 or 2 supported")
    pad = hdr.kv.get(Keys.Tokenizer.PAD_ID, 1 if family == "xlm-roberta" else 0)
    if not isinstance(pad, int) or not 0 <= pad < vocab_rows:
        raise ManifestError(f"padding token id {pad!r} is not in the vocabulary")
    rerank = pooling == "rank"
    if rerank:
        arch = (
            "XLMRobertaForSequenceClassification"
            if family == "xlm-roberta"
            else "BertForSequenceClassification"
        )
        labels = _shape(path, hdr, "cls.output.weight")[0]
        head = Head(type="cross_encoder", pooling="cls", normalize=False, num_labels=labels)
    elif pooling == "mean" or pooling == "cls":
        arch = "XLMRobertaModel" if family == "xlm-roberta" else "BertModel"
        head = (
            Head(type="embed_mean", pooling="mean", normalize=True, num_labels=0)
            if pooling == "mean"
            else Head(type="embed_cls", pooling="cls", normalize=True, num_labels=0)
        )
    else:
        raise UnsupportedModel(
            f"pooling {pooling!r}: BERT-family embedders pool by mean or cls "
            "(rank for cross-encoders)"
        )
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab_rows,
        hidden_size=h,
        num_layers=_int(hdr, Keys.LLM.BLOCK_COUNT),
        num_heads=heads,
        intermediate_size=_int(hdr, Keys.LLM.FEED_FORWARD_LENGTH),
        max_positions=ctx,
        type_vocab_size=types,
        layer_norm_eps=_float(hdr, Keys.Attention.LAYERNORM_EPS),
        hidden_act="gelu",
        pad_token_id=pad,
        max_seq_length=_max_seq(max_seq_length, ctx),
        first_position_row=0 if family == "xlm-roberta" else None,
    )
    names = dict(_BERT_EMBEDDINGS)
    for i in range(config.num_layers):
        for gguf_part, hf_part in _BERT_LAYER.items():
            for suffix in ("weight", "bias"):
                names[f"blk.{i}.{gguf_part}.{suffix}"] = f"encoder.layer.{i}.{hf_part}.{suffix}"
    head_names = ("cls", "cls.output")
    if rerank:
        for gguf_layer, hf_layer in zip(head_names, classifier_layers(config), strict=True):
            for suffix in ("weight", "bias"):
                names[f"{gguf_layer}.{suffix}"] = f"{hf_layer}.{suffix}"
    assert sorted(names.values()) == sorted(required_tensors(config, head))
    tensors = _load(
        path,
        hdr,
        names,
        _bert_shapes(config, head, pos_rows),
        # An embedder's classifier tensors are not applied (mean or cls pooling
        # reads none of them, in llama.cpp as here).
        lambda n: not rerank and n.split(".")[0] == "cls",
    )
    pos = "embeddings.position_embeddings.weight"
    tensors[pos] = np.ascontiguousarray(tensors[pos][:ctx])  # rows past the context: unused
    return config, head, tensors


def _bert_shapes(config: ModelConfig, head: Head, pos_rows: int) -> dict[str, tuple[int, ...]]:
    h, ff = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config.vocab_size, h),
        "embeddings.position_embeddings.weight": (pos_rows, h),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    widths = {"intermediate.dense": (ff, h), "output.dense": (h, ff)}
    for i in range(config.num_layers):
        for part in _BERT_LAYER.values():
            w = widths.get(part, (h,) if part.endswith("LayerNorm") else (h, h))
            shapes[f"encoder.layer.{i}.{part}.weight"] = w
            shapes[f"encoder.layer.{i}.{part}.bias"] = (w[0],)
    dense, out = classifier_layers(config)
    shapes |= {
        f"{dense}.weight": (h, h),
        f"{dense}.bias": (h,),
        f"{out}.weight": (head.num_labels, h),
        f"{out}.bias": (head.num_labels,),
    }
    return shapes


# ---- Qwen3 -----------------------------------------------------------------------------------


_QWEN3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _qwen3(
    path: Path, hdr: GGUFHeader, given_pooling: str | None, max_seq_length: int | None
) -> Loaded:
    pooling = _pooling(hdr, given_pooling)
    rerank = pooling == "rank"
    if pooling != "last" and not rerank:
        # A causal decoder's early tokens never see the later ones: only the last token
        # (the appended end-of-text) has read the whole input.
        raise UnsupportedModel(
            f"pooling {pooling!r}: Qwen3 embedders pool the last token (rerankers: rank)"
        )
    scaling = hdr.kv.get(_key(hdr, Keys.Rope.SCALING_TYPE))
    if scaling not in (None, "none"):
        raise UnsupportedModel(
            f"rope scaling {scaling!r}: the graph's rotary tables are the unscaled ones"
        )
    if _key(hdr, Keys.Attention.SLIDING_WINDOW) in hdr.kv:
        raise UnsupportedModel("a sliding window: the graph attends to the whole sequence")
    h = _int(hdr, Keys.LLM.EMBEDDING_LENGTH)
    heads = _int(hdr, Keys.Attention.HEAD_COUNT)
    kv_heads = _int(hdr, Keys.Attention.HEAD_COUNT_KV, heads)
    if heads % kv_heads:
        raise UnsupportedModel(f"head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    head_dim = _int(hdr, Keys.Attention.KEY_LENGTH, h // heads)
    if head_dim % 2:
        raise ManifestError(f"key_length {head_dim} is odd (rotary embeddings rotate half)")
    for template in (Keys.Attention.VALUE_LENGTH, Keys.Rope.DIMENSION_COUNT):
        if _int(hdr, template, head_dim) != head_dim:
            # The graph's attention and rotary embeddings span the whole head.
            raise UnsupportedModel(f"{_key(hdr, template)} differs from key_length {head_dim}")
    eos = hdr.kv.get(Keys.Tokenizer.EOS_ID)
    vocab_rows = _shape(path, hdr, "token_embd.weight")[0]
    if not isinstance(eos, int) or not 0 <= eos < vocab_rows:
        raise ManifestError(
            f"end-of-text token id {eos!r} (the token the model pools) is not in the vocabulary"
        )
    max_pos = min(_int(hdr, Keys.LLM.CONTEXT_LENGTH), manifest_qwen3.MAX_GRAPH_POSITIONS)
    config = ModelConfig(
        # A reranker reads its LM head's rows: the causal LM, as from a directory.
        architecture="Qwen3ForCausalLM" if rerank else "Qwen3Model",
        vocab_size=vocab_rows,
        hidden_size=h,
        num_layers=_int(hdr, Keys.LLM.BLOCK_COUNT),
        num_heads=heads,
        intermediate_size=_int(hdr, Keys.LLM.FEED_FORWARD_LENGTH),
        max_positions=max_pos,
        type_vocab_size=0,  # a decoder has no token types
        layer_norm_eps=_float(hdr, Keys.Attention.LAYERNORM_RMS_EPS),
        hidden_act="silu",
        # Padding positions carry the end-of-text id: any valid id serves (never pooled,
        # never attended to by a real token).
        pad_token_id=eos,
        max_seq_length=_max_seq(max_seq_length, max_pos),
        num_kv_heads=kv_heads,
        attention_head_dim=head_dim,
        rope_theta=_float(hdr, Keys.Rope.FREQ_BASE),
    )
    head = (
        rank_head(None)
        if rerank
        else Head(type="embed_last", pooling="last", normalize=True, num_labels=0)
    )
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
    for i in range(config.num_layers):
        for gguf_part, hf_part in _QWEN3_LAYER.items():
            names[f"blk.{i}.{gguf_part}.weight"] = f"layers.{i}.{hf_part}.weight"
    shapes = manifest_qwen3.required_tensors(config)
    assert sorted(names.values()) == sorted(shapes)
    if rerank:
        names[_CLS_OUT] = _CLS_OUT
        shapes[_CLS_OUT] = (2, h)
        _check_answer_labels(path, hdr)
    # The LM head does not embed (as from a directory), nor does a reranker read it past
    # the two rows its converter kept.
    tensors = _load(path, hdr, names, shapes, lambda n: n == "output.weight")
    if rerank:
        rows = tensors.pop(_CLS_OUT)
        tensors[SCORE_WEIGHT] = score_row(rows[0], rows[1])
    return config, head, tensors


# llama.cpp's converter writes a Qwen3 reranker's LM-head rows for `yes` and `no`, in that
# order, as the rank classifier (conversion/qwen.py), and names them as labels.
_CLS_OUT = "cls.output.weight"
_ANSWER_LABELS = ["yes", "no"]


def _check_answer_labels(path: Path, hdr: GGUFHeader) -> None:
    """The two rows must be (true, false): labels [yes, no], or none stated (the converter's
    order). Anything else would score with the rows swapped or with other tokens' logits."""
    key = _key(hdr, Keys.Classifier.OUTPUT_LABELS)
    if key not in hdr.kv:
        return
    labels = read_header(path, frozenset({key})).kv.get(key)  # the scan skips arrays
    if labels != _ANSWER_LABELS:
        raise UnsupportedModel(
            f"{key} {labels!r}: a Qwen3 reranker GGUF's rows are [yes, no] (the true answer first)"
        )
