"""What every reader of the owned Core ML format builds and shares: the model's config and
head (the graph builders read both), the tensors a config requires, the format's errors, and
the two reads of a source directory every ingest does (a JSON file, the sentence-transformers
layout). A leaf: `manifest` dispatches to the Qwen3 and GGUF readers, and they build on this
module rather than on `manifest`, so no reader imports one that imports it back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

from formats.st_layout import Layout, LayoutError, read_layout

HeadType = Literal["embed_mean", "embed_cls", "embed_last", "cross_encoder", "rank_last"]
EMBED_HEADS = ("embed_mean", "embed_cls", "embed_last")
# A causal LM reranker (Qwen3-Reranker, or any sentence-transformers CrossEncoder ending in
# LogitScore): one raw score, logit[true] - logit[false], at each sequence's last token.
RANK_HEADS = ("rank_last",)

# The encoder families the graph builds, by the architectures config.json names. XLM-RoBERTa
# is BERT's encoder with positions offset by the padding index, one token type and its own
# classifier head names; the builder branches on `ModelConfig.family` for exactly those.
FAMILY_BY_ARCHITECTURE = {
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
    "XLMRobertaModel": "xlm-roberta",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
    # A SPLADE checkpoint: the encoder is read, its MLM head is the sparse head beside it
    # (heads/sparse.safetensors, built into the graph from there).
    "BertForMaskedLM": "bert",
    "XLMRobertaForMaskedLM": "xlm-roberta",
    # A decoder with its own graph (builder_qwen3) and its own ingest (manifest_qwen3).
    "Qwen3Model": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
    # BERT's graph with rotary positions and a SwiGLU MLP (builder_nomic, manifest_nomic).
    "NomicBertModel": "nomic_bert",
    "NomicBertForMaskedLM": "nomic_bert",
}
DEFAULT_ARCHITECTURE = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel"}


class ManifestError(Exception):
    """The artifact is unusable; `code` is the worker error code it maps to (a wire protocol
    code, not one of the `common.errors` family's)."""

    code = "artifact_invalid"


class WeightDigestMismatch(ManifestError):
    def __init__(self, name: str, expected: str, actual: str) -> None:
        super().__init__(f"tensor {name!r}: sha256 {actual[:16]}... != manifest {expected[:16]}...")
        self.tensor = name


class UnsupportedModel(ManifestError):
    """A well-formed checkpoint this builder does not implement (refused, never guessed at)."""

    code = "unsupported"


# ---- model description ---------------------------------------------------------------------


# omit_defaults: the decoder-only fields below are left out of an encoder's manifest (and so
# of its digest), which therefore stays what it was before they existed.
class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    max_seq_length: int  # sentence-transformers' default truncation (<= max_positions)
    # Qwen3 only (None for the encoders): grouped K/V heads, a head size that is not
    # hidden / heads, and the rotary base.
    num_kv_heads: int | None = None
    attention_head_dim: int | None = None
    rope_theta: float | None = None
    # The position table's row for position 0 when it is not the family's own: a GGUF's
    # XLM-RoBERTa table was already cut past the padding rows by its converter, so it is 0
    # there. None (left out of the manifest and its digest) means the family's default.
    first_position_row: int | None = None

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    # Derived, not stored: `architecture` (in the digest) already names the family, and a
    # new field would change the digest of every BERT artifact already ingested.
    @property
    def family(self) -> str:
        return FAMILY_BY_ARCHITECTURE[self.architecture]

    @property
    def position_offset(self) -> int:
        """Rows of the position table before position 0: HF numbers XLM-RoBERTa positions
        from `pad_token_id + 1` (the rows below are never looked up), BERT's from 0."""
        if self.first_position_row is not None:
            return self.first_position_row
        return self.pad_token_id + 1 if self.family == "xlm-roberta" else 0

    @property
    def is_cross_encoder(self) -> bool:
        return self.architecture.endswith("ForSequenceClassification")


# omit_defaults: the rank-only fields are left out of every other head (and so of its
# artifact's digest, which stays what it was before they existed).
class Head(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    type: HeadType
    # mean for embed_mean; cls (the first token) for embed_cls and cross_encoder; last (the
    # appended end-of-text) for embed_last; last (the last real token) for rank_last
    pooling: Literal["mean", "cls", "last"]
    normalize: bool  # default L2 normalisation of embeddings (requests may override)
    num_labels: int  # 0 for embedders
    # rank_last only: the vocabulary ids whose logits the score compares (the LM head rows
    # the artifact's one score row was made from); false is None for a score that is the
    # true token's logit alone (LogitScore without a false token). Provenance: the graph
    # reads the row, not the ids. None too for a GGUF, whose converter kept the rows only.
    true_token_id: int | None = None
    false_token_id: int | None = None


# ---- tensors and source files -------------------------------------------------------------


def _layer_names(i: int) -> list[str]:
    p = f"encoder.layer.{i}."
    names = []
    for part in (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ):
        names += [f"{p}{part}.weight", f"{p}{part}.bias"]
    for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
        names += [f"{p}{ln}.weight", f"{p}{ln}.bias"]
    return names


def required_tensors(config: ModelConfig, head: Head) -> list[str]:
    names = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    for i in range(config.num_layers):
        names += _layer_names(i)
    if head.type == "cross_encoder":
        for layer in classifier_layers(config):
            names += [f"{layer}.weight", f"{layer}.bias"]
    return names


def classifier_layers(config: ModelConfig) -> tuple[str, str]:
    """A cross-encoder's (dense + tanh, output) layers: BERT's pooler and classifier, or
    XLM-RoBERTa's classification head. The same function (out(tanh(dense(h_first)))) under
    HF's own names, kept as HF saved them so the tensor digests are the checkpoint's."""
    if config.family == "xlm-roberta":
        return "classifier.dense", "classifier.out_proj"
    return "pooler.dense", "classifier"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path.name}: {e}") from e


def source_layout(src: Path) -> Layout:
    """The sentence-transformers facts of `src` (either layout: formats/st_layout.py)."""
    try:
        return read_layout(src)
    except LayoutError as e:  # unreadable or impossible sentence-transformers files
        raise ManifestError(f"{src}: {e}") from e
