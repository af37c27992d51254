"""What a GGUF is served as (embed, rerank or generate), with which pooling, and whether
llama.cpp runs it causally: decided from the file's header and the runtime config alone,
before llama.cpp loads a byte of weights, so a model we cannot serve is refused typed."""

from __future__ import annotations

from pathlib import Path

from formats.gguf_header import ArrayInfo, GGUFHeader
from workers.engine import EngineError
from workers.llama import llm_head
from workers.llama.config import Kind, RuntimeConfig

# llama.cpp's enum llama_pooling_type, which is also what a GGUF's `pooling_type` key holds
# (a test holds these to llama-cpp-python's constants).
POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
POOLING_NAMES = {v: k for k, v in POOLING_TYPES.items()}

# Architectures whose load_hparams force bidirectional attention whatever the file says
# (models/gemma-embedding.cpp, dream.cpp, llada.cpp, llada-moe.cpp, rnd1.cpp in the llama.cpp
# llama-cpp-python 0.3.36 vendors); upstream's EmbeddingGemma GGUFs carry no causal key.
_ALWAYS_BIDIRECTIONAL = frozenset({"gemma-embedding", "dream", "llada", "llada-moe", "rnd1"})


# Decoders whose rerankers we serve as LLM rerankers (the host renders the checkpoint's chat
# template; the worker reads the two LM-head rows at the last token, see llm_head.py).
LLM_RERANK_ARCHITECTURES = frozenset({"qwen3", "gemma3"})


def is_causal(hdr: GGUFHeader) -> bool:
    """Whether llama.cpp runs the model causally: its `attention.causal` key (true when
    absent, as llama.cpp defaults), unless the architecture forces bidirectional attention."""
    if hdr.architecture in _ALWAYS_BIDIRECTIONAL:
        return False
    return bool(hdr.arch_get("attention.causal", True))


def default_ref(path: str) -> str:
    """The model_ref of a LOAD that names none: the file stem, or the parent directory's name
    for the store's generic `model.gguf`."""
    p = Path(path)
    return p.parent.name if p.stem == "model" and p.parent.name else p.stem


def n_cls_out(hdr: GGUFHeader) -> int:
    """Outputs of the model's classifier head (1 when the GGUF names no labels)."""
    labels = hdr.arch_get("classifier.output_labels")
    if isinstance(labels, ArrayInfo):
        return labels.length
    return 1


def decide_kind(hdr: GGUFHeader, cfg: RuntimeConfig) -> tuple[Kind, str]:
    """(kind, pooling name) from the GGUF and the config; refuses what we cannot serve."""
    arch = hdr.architecture
    gguf_pool = hdr.arch_get("pooling_type")
    gguf_pooling = POOLING_NAMES.get(gguf_pool) if isinstance(gguf_pool, int) else None
    # llama.cpp's converter writes no pooling type for rerankers: a classifier head is one.
    has_head = any(t.name in ("cls.weight", "cls.output.weight") for t in hdr.tensors)
    is_rank = gguf_pooling == "rank" or (
        cfg.kind == "rerank" and gguf_pooling in (None, "none") and has_head
    )
    if is_rank and arch in LLM_RERANK_ARCHITECTURES:
        if llm_head.is_sequence_classifier(hdr):
            return _decoder_classifier(hdr, cfg)
        return _llm_reranker(hdr, cfg)
    if is_rank and "tokenizer.chat_template.rerank" in hdr.kv:
        raise EngineError(
            "unsupported", "reranker with a prompt template; pairs would not match its training"
        )
    causal = is_causal(hdr)
    if cfg.kind is not None:
        kind = cfg.kind
    elif is_rank:
        kind = "rerank"
    elif cfg.embedding or (
        cfg.embedding is None and (gguf_pooling not in (None, "none") or not causal)
    ):
        kind = "embed"
    else:
        kind = "generate"
    if cfg.embedding is not None and cfg.embedding != (kind != "generate"):
        raise EngineError("config_invalid", f"embedding={cfg.embedding} contradicts kind {kind}")
    if kind == "rerank":
        if not is_rank:
            raise EngineError("config_invalid", "rerank needs a GGUF with rank pooling")
        if cfg.pooling not in (None, "rank"):
            raise EngineError("config_invalid", "a reranker must use rank pooling")
        return kind, "rank"
    if kind == "embed":
        pooling = cfg.pooling or gguf_pooling or ("last" if causal else "mean")
        if pooling in ("none", "rank"):
            raise EngineError("config_invalid", f"pooling {pooling} cannot produce one vector")
        return kind, pooling
    if not causal:
        raise EngineError("config_invalid", f"{arch} is an encoder; it cannot generate")
    if cfg.pooling not in (None, "none"):
        raise EngineError("config_invalid", "pooling applies to embedding models only")
    return kind, "none"


def has_decoder_head(hdr: GGUFHeader) -> bool:
    """A decoder with rank pooling that we serve through a head on its last token's state
    (llm_head.py): an LLM reranker or a sequence classifier."""
    raw = hdr.arch_get("pooling_type")
    return hdr.architecture in LLM_RERANK_ARCHITECTURES and raw == POOLING_TYPES["rank"]


def _check_last_token(cfg: RuntimeConfig, what: str) -> None:
    if cfg.kind not in (None, "rerank"):
        raise EngineError("config_invalid", f"{what} cannot be served as {cfg.kind}")
    if cfg.pooling not in (None, "rank", "last"):
        raise EngineError("config_invalid", f"{what} scores the last token")
    if cfg.embedding is False:
        raise EngineError("config_invalid", "embedding=False contradicts kind rerank")


def _decoder_classifier(hdr: GGUFHeader, cfg: RuntimeConfig) -> tuple[Kind, str]:
    """A decoder sequence classifier (llm_head.py): LAST pooling, its N rows applied in numpy
    (llama.cpp's RANK pooling would softmax them)."""
    n = n_cls_out(hdr)
    if not llm_head.has_rows(hdr, n):
        raise EngineError(
            "unsupported",
            f"{hdr.architecture} sequence classifier without its head {llm_head.CLS_OUT} "
            f"({n} rows of the hidden width, one per classifier.output_labels entry)",
        )
    _check_last_token(cfg, "a decoder sequence classifier")
    return "rerank", "last"


def _llm_reranker(hdr: GGUFHeader, cfg: RuntimeConfig) -> tuple[Kind, str]:
    """An LLM reranker decodes with LAST pooling (the final hidden state at each sequence's
    last token) and scores it with the two classifier rows; pairs come composed by the host
    (RERANK_SEQUENCES) through the checkpoint's chat template."""
    if not llm_head.has_two_rows(hdr):
        raise EngineError(
            "unsupported",
            f"{hdr.architecture} reranker without the two-row head {llm_head.CLS_OUT} "
            "(the true and false tokens' LM-head rows; for Gemma 3, two labels the LM head "
            "holds) cannot be scored",
        )
    _check_last_token(cfg, "an LLM reranker")
    return "rerank", "last"
