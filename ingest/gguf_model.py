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
  classifier but without the pooler cannot be served as trained, and is refused. A Qwen3
  reranker GGUF (rank pooling, two labels, `cls.output.weight`: what llama.cpp's converter
  makes of Qwen3-Reranker) is an LLM reranker whose pairs the host renders through the
  template it keeps (ingest.llm_rerank); one without a template we can render is refused,
  and so is any other reranker carrying a `tokenizer.chat_template.rerank`: its pairs would
  not match its training. A decoder sequence classifier's GGUF (our converter's, marked by
  `SEQ_CLS_PAD_KEY`) is refused: its problem type and pair template are its directory's.
- A LoRA adapter GGUF (`general.type` adapter) is refused: it is no model.
- Anything the GGUF does not say (an embedder's pooling) is given by the caller, or refused:
  pooling is never guessed.
- Limits: one input is at most `ITEM_LIMIT` tokens (the worker's default encoder batch) or
  the model's trained context, whichever is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.errors import ArtifactInvalid, InvalidRequest
from formats.gguf_header import SEQ_CLS_PAD_KEY, GGUFFormatError, GGUFHeader, read_gguf_header
from ingest.llm_rerank import LLM_RERANK_FAMILIES, LlmRerankSpec, spec_from_gguf

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
    labels: list[str] = field(default_factory=list)  # classifier.output_labels, by id
    llm_rerank: LlmRerankSpec | None = None


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
    if hdr.kv.get("general.type") == "adapter":
        # llama.cpp's converter writes jina-embeddings-v3's task adapters as LoRA GGUFs
        # beside the base model; an adapter alone is no model.
        task = hdr.kv.get("adapter.lora.task_name")
        raise ArtifactInvalid(
            f"{path} is a LoRA adapter{f' (task {task})' if task else ''}, not a model; to "
            "serve a task, ingest the Hugging Face directory with --default-prompt TASK (the "
            "task's adapter is merged at ingest)"
        )
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
        if SEQ_CLS_PAD_KEY in hdr.kv:
            # Our converter's file of a decoder sequence classifier: its problem type and
            # pair template are config.json's and the tokenizer's, not the GGUF's.
            raise InvalidRequest(
                f"a {arch} sequence classifier GGUF (written by `synapse models ingest DIR`): "
                "ingest its Hugging Face directory, which says its problem type and how its "
                "pairs are composed"
            )
        if arch in LLM_RERANK_FAMILIES.values() and declared == "rank":
            return _llm_reranker(path, hdr, pooling)
        if arch in DECODER_EMBEDDERS or "tokenizer.chat_template.rerank" in hdr.kv:
            raise InvalidRequest(
                f"{arch} reranker: it needs its own prompt template, which the worker does "
                "not reproduce; refusing rather than scoring pairs it was not trained on"
            )
        if pooling not in (None, "rank"):
            raise InvalidRequest("a reranker is served with rank pooling only")
        pooling = "rank"
        label_names = _output_labels(path, hdr)
        # A head of N labels is a sequence classifier: served by /predict, refused by rerank.
        n_labels = len(label_names) or 1
    else:
        n_labels, label_names = None, []
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
        labels=label_names,
    )


def _output_labels(path: str | Path, hdr: GGUFHeader) -> list[str]:
    """The classifier's label names (`classifier.output_labels`), [] when it names none."""
    key = f"{hdr.architecture}.classifier.output_labels"
    if key not in hdr.kv:
        return []
    try:
        labels = read_gguf_header(path, want_arrays=frozenset({key})).kv[key]
    except (OSError, GGUFFormatError) as e:
        raise ArtifactInvalid(f"{path} is not a readable GGUF: {e}") from e
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise ArtifactInvalid(f"{path}: {key} is not a list of strings")
    return labels


def _llm_reranker(path: str | Path, hdr: GGUFHeader, pooling: str | None) -> GGUFModel:
    """A decoder reranker llama.cpp's converter made: two classifier rows and the template."""
    if pooling not in (None, "rank"):
        raise InvalidRequest("an LLM reranker scores its last token; it takes no pooling")
    arch = hdr.architecture
    cls_out = next((t for t in hdr.tensors if t.name == "cls.output.weight"), None)
    width = hdr.arch_get("embedding_length")
    if cls_out is None or cls_out.shape != (width, 2):
        raise ArtifactInvalid(
            f"{arch} reranker GGUF without a two-row cls.output.weight (the true and false "
            "tokens' LM-head rows) cannot be scored"
        )
    try:
        full = read_gguf_header(
            path,
            want_arrays=frozenset({f"{arch}.classifier.output_labels", "tokenizer.ggml.tokens"}),
        )
    except (OSError, GGUFFormatError) as e:
        raise ArtifactInvalid(f"{path} is not a readable GGUF: {e}") from e
    tokens = full.kv.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ArtifactInvalid(f"{path}: no tokenizer.ggml.tokens")
    spec = spec_from_gguf(full, tokens)
    n_ctx_train = hdr.arch_get("context_length")
    if not isinstance(width, int) or not isinstance(n_ctx_train, int) or n_ctx_train < 1:
        raise ArtifactInvalid(f"{arch} GGUF lacks {arch}.embedding_length / context_length")
    file_type = hdr.kv.get("general.file_type")
    return GGUFModel(
        architecture=arch,
        kind="rerank",
        pooling="rank",
        dims=width,
        n_ctx_train=n_ctx_train,
        item_limit=min(n_ctx_train, ITEM_LIMIT),
        dtype=FILE_TYPES.get(file_type, f"type{file_type}")
        if isinstance(file_type, int)
        else "unknown",
        vocabulary=str(hdr.kv.get("tokenizer.ggml.model", "")),
        n_labels=None,
        llm_rerank=spec,
    )
