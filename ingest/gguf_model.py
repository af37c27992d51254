"""What a GGUF file is, as a model to serve: architecture, kind, pooling, width, limits.

Rules, from the llama.cpp that llama-cpp-python 0.3.36 vendors:
- Architectures: the encoders llama.cpp embeds or reranks with (`bert`, which also carries
  XLM-RoBERTa with a `t5` vocabulary, `nomic-bert`, `nomic-bert-moe`, `jina-bert-v2`,
  `jina-bert-v3`, `modern-bert`, `neo-bert`, `eurobert`, `gemma-embedding`, `t5encoder`) and
  the decoders published as embedders (`qwen3`, `qwen2`: Qwen3-Embedding, gte-Qwen2). Any
  other architecture is refused, named.
- Pooling: `<arch>.pooling_type` when written (0 none, 1 mean, 2 cls, 3 last, 4 rank).
  llama.cpp's converter writes none for rerankers, so a classifier head (`cls.output.weight`,
  or `cls.weight` alone: a single projection) makes a reranker with rank pooling. A BERT
  cross-encoder is `[CLS]` -> pooler (`cls.weight`, tanh) -> classifier: a GGUF with the
  classifier but without the pooler cannot be served as trained, and is refused. Rerankers
  that need their own prompt template (Qwen3 rerankers, or any GGUF carrying a
  `tokenizer.chat_template.rerank`) are refused: pairs would not match their training.
- Anything the GGUF does not say (an embedder's pooling) is given by the caller, or refused:
  pooling is never guessed.
- Limits: one input is at most `ITEM_LIMIT` tokens (the worker's default encoder batch) or
  the model's trained context, whichever is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.errors import ArtifactInvalid, InvalidRequest
from formats.gguf_header import ArrayInfo, GGUFFormatError, GGUFHeader, read_gguf_header

ENCODER_ARCHITECTURES = frozenset(
    {
        "bert",
        "nomic-bert",
        "nomic-bert-moe",
        "jina-bert-v2",
        "jina-bert-v3",
        "modern-bert",
        "neo-bert",
        "eurobert",
        "gemma-embedding",
        "t5encoder",
    }
)
DECODER_EMBEDDERS = frozenset({"qwen3", "qwen2"})
EMBED_ARCHITECTURES = ENCODER_ARCHITECTURES | DECODER_EMBEDDERS
# Keys llama.cpp's loader requires that a converter can leave out, refused at ingest rather
# than at the first load: the pinned llama.cpp converter reads ModernBERT's `norm_eps` as an
# RMS epsilon only, while llama.cpp's modern-bert graph (LayerNorm) requires this one.
_REQUIRED_KEYS = {
    "modern-bert": (
        ("attention.layer_norm_epsilon",),
        "llama.cpp's converter writes a ModernBERT config's norm_eps as an RMS epsilon only",
    )
}
# llama_pooling_type values as GGUF metadata stores them.
POOLING_BY_ID = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
EMBED_POOLINGS = ("mean", "cls", "last")
# The worker's encoder batch default caps one input (workers/llama/context_plan.py).
ITEM_LIMIT = 2048
# general.file_type -> the precision name manifests use (llama_ftype).
FILE_TYPES = {
    0: "f32",
    1: "f16",
    2: "q4_0",
    3: "q4_1",
    7: "q8_0",
    8: "q5_0",
    9: "q5_1",
    10: "q2_k",
    11: "q3_k_s",
    12: "q3_k_m",
    13: "q3_k_l",
    14: "q4_k_s",
    15: "q4_k_m",
    16: "q5_k_s",
    17: "q5_k_m",
    18: "q6_k",
    32: "bf16",
}

Kind = Literal["embed", "rerank"]


@dataclass(frozen=True)
class GGUFModel:
    architecture: str
    kind: Kind
    pooling: str  # mean | cls | last | rank
    dims: int
    n_ctx_train: int
    item_limit: int
    dtype: str
    vocabulary: str  # tokenizer.ggml.model: bert (WPM), llama (SPM), gpt2 (BPE), t5 (UGM)
    n_labels: int | None = None


def read_header(path: str | Path) -> GGUFHeader:
    try:
        return read_gguf_header(path)
    except (OSError, GGUFFormatError) as e:
        raise ArtifactInvalid(f"{path} is not a readable GGUF: {e}") from e


def inspect_gguf(
    path: str | Path, kind: Kind | None = None, pooling: str | None = None
) -> GGUFModel:
    """The serving facts of the GGUF at `path`; `kind` / `pooling` say what it does not."""
    hdr = read_header(path)
    arch = hdr.architecture
    if arch not in EMBED_ARCHITECTURES:
        raise ArtifactInvalid(
            f"architecture {arch or '(none)'!r} is not one llama.cpp embeds or reranks with "
            f"here (supported: {', '.join(sorted(EMBED_ARCHITECTURES))})"
        )
    keys, why = _REQUIRED_KEYS.get(arch, ((), ""))
    for key in keys:
        if hdr.arch_get(key) is None:
            raise ArtifactInvalid(
                f"this {arch} GGUF lacks {arch}.{key}, which llama.cpp needs to load it "
                f"({why}); convert the Hugging Face directory with `synapse models ingest "
                "DIR` instead"
            )
    tensors = {t.name for t in hdr.tensors}
    has_pooler = "cls.weight" in tensors
    has_classifier = "cls.output.weight" in tensors or has_pooler
    raw = hdr.arch_get("pooling_type")
    declared = POOLING_BY_ID.get(raw) if isinstance(raw, int) else None
    is_rank = declared == "rank" or (declared in (None, "none") and has_classifier)
    if kind is None:
        kind = "rerank" if is_rank else "embed"
    if kind == "rerank":
        if not has_classifier:
            raise InvalidRequest(
                f"{arch} GGUF has no classifier head (cls.output.weight): it cannot rerank"
            )
        if arch == "bert" and "cls.output.weight" in tensors and not has_pooler:
            raise ArtifactInvalid(
                "a BERT cross-encoder GGUF without its pooler (cls.weight: the dense + tanh "
                "layer the classifier reads) cannot be served as trained; convert it again "
                "with the pooler kept"
            )
        if arch in DECODER_EMBEDDERS or "tokenizer.chat_template.rerank" in hdr.kv:
            raise InvalidRequest(
                f"{arch} reranker: it needs its own prompt template, which the worker does "
                "not reproduce; refusing rather than scoring pairs it was not trained on"
            )
        if pooling not in (None, "rank"):
            raise InvalidRequest("a reranker is served with rank pooling only")
        pooling = "rank"
        labels = hdr.arch_get("classifier.output_labels")
        n_labels = labels.length if isinstance(labels, ArrayInfo) else 1
        if n_labels != 1:
            raise InvalidRequest(f"rerank needs one classifier output, this one has {n_labels}")
    else:
        n_labels = None
        if is_rank and declared == "rank":
            raise InvalidRequest("this GGUF declares rank pooling: ingest it as a reranker")
        pooling = pooling or (declared if declared in EMBED_POOLINGS else None)
        if pooling is None:
            raise InvalidRequest(
                f"the {arch} GGUF does not say how it pools; pass pooling (mean, cls or last: "
                "the model card or its sentence-transformers 1_Pooling/config.json says which)"
            )
        if pooling not in EMBED_POOLINGS:
            raise InvalidRequest(
                f"pooling {pooling!r}: an embedder pools with {', '.join(EMBED_POOLINGS)}"
            )
    dims = hdr.arch_get("embedding_length")
    n_ctx_train = hdr.arch_get("context_length")
    if not isinstance(dims, int) or not isinstance(n_ctx_train, int) or dims < 1 or n_ctx_train < 1:
        raise ArtifactInvalid(f"{arch} GGUF lacks {arch}.embedding_length / context_length")
    file_type = hdr.kv.get("general.file_type")
    return GGUFModel(
        architecture=arch,
        kind=kind,
        pooling=pooling,
        dims=dims,
        n_ctx_train=n_ctx_train,
        item_limit=min(n_ctx_train, ITEM_LIMIT),
        dtype=FILE_TYPES.get(file_type, f"type{file_type}")
        if isinstance(file_type, int)
        else "unknown",
        vocabulary=str(hdr.kv.get("tokenizer.ggml.model", "")),
        n_labels=n_labels,
    )
