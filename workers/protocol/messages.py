"""Every control message of wire protocol v3, as msgspec structs.

The JSON object's ``type`` field carries the message name exactly as docs/protocol.md
writes it (``"HELLO"``, ``"EMBED_BATCH"``, ...). Unknown fields are ignored on decode so that a
foreign worker written from that document, or a newer peer, interoperates; optional fields default.

One decoder per direction: a side can only ever receive the messages the other side may send,
so anything else is a decode error, which the session turns into a protocol violation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

PROTOCOL_VERSION = 3
DEFAULT_MAX_FRAME = 64 * 1024 * 1024

U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # msgspec bounds stop at int64
Count = Annotated[int, msgspec.Meta(ge=0)]

Phase = Literal["setup", "inference", "control"]
Pooling = Literal["none", "mean", "cls", "last", "rank"]

# ERR codes a worker may answer with: a closed set, so the host maps each to a typed error.
WORKER_ERROR_CODES = frozenset(
    {
        "artifact_invalid",
        "oom",
        "config_invalid",
        "invalid_request",
        "model_not_loaded",
        "unsupported",
        "shape_unsupported",
        "compile_failed",
    }
)


# Every subclass repeats frozen=True: msgspec inherits it at runtime, but a type checker reads
# dataclass_transform keywords per class and would otherwise take the subclass as mutable.
class _Msg(msgspec.Struct, tag_field="type", frozen=True):
    """Base for every control frame; the subclass name is the wire ``type``. Every field is
    written, defaults included: a foreign peer built from docs/protocol.md may require them."""


# ---- handshake ---------------------------------------------------------------------------


class EngineInfo(msgspec.Struct, frozen=True):
    engine: str
    version: str
    build_flags: str = ""


class HELLO(_Msg, tag="HELLO", frozen=True):
    # `v` stays a plain int so that a v2 worker decodes and is rejected by the session with a
    # clear reason ("version 2, expected 3") rather than an opaque schema error.
    v: int
    nonce: str
    engine: EngineInfo
    pid: U32
    max_frame: U32 = DEFAULT_MAX_FRAME
    manifest_digest: str | None = None
    kernel_revision: str | None = None
    packed: bool | None = None


class HELLO_ACK(_Msg, tag="HELLO_ACK", frozen=True):
    v: int
    accept: bool
    max_frame: U32


# ---- requests (host -> worker) --------------------------------------------------------------


class LOAD(_Msg, tag="LOAD", frozen=True):
    req_id: U64
    artifact_path: str
    artifact_digest: str
    format: str
    runtime_config: dict[str, Any] = {}


class EmbedItem(msgspec.Struct, frozen=True):
    id: U64
    n_tokens: Count


class EMBED_BATCH(_Msg, tag="EMBED_BATCH", frozen=True):
    req_id: U64
    model_ref: str
    items: list[EmbedItem]
    pooling: str = "mean"
    normalize: bool = True


class RerankCandidate(msgspec.Struct, frozen=True):
    n_tokens: Count


class RERANK(_Msg, tag="RERANK", frozen=True):
    req_id: U64
    model_ref: str
    query_n_tokens: Count
    candidates: list[RerankCandidate]


class RerankSequence(msgspec.Struct, frozen=True):
    n_tokens: Count
    n_first: Count


class RERANK_SEQUENCES(_Msg, tag="RERANK_SEQUENCES", frozen=True):
    req_id: U64
    model_ref: str
    sequences: list[RerankSequence]


class CLASSIFY(_Msg, tag="CLASSIFY", frozen=True):
    """Sequences the host composed (a text, or a pair through the tokenizer's pair template);
    `n_first` counts segment A's tokens, specials included (all of them for a single text)."""

    req_id: U64
    model_ref: str
    sequences: list[RerankSequence]


# What ENCODE may ask for: one pooled vector an item ("dense"), the final state of every token
# ("tokens"), a learned sparse vector ("sparse") and a head's per-token vectors ("multivector").
OutputKind = Literal["dense", "tokens", "sparse", "multivector"]
OUTPUT_KINDS: tuple[OutputKind, ...] = ("dense", "tokens", "sparse", "multivector")
Side = Literal["query", "document"]
SIDES: tuple[Side, ...] = ("query", "document")


class ENCODE(_Msg, tag="ENCODE", frozen=True):
    """Several outputs of the same items from one forward pass. `side` picks a head's query
    or document route (prefixes, expansion, an inference-free query route)."""

    req_id: U64
    model_ref: str
    items: list[EmbedItem]
    outputs: list[OutputKind]
    side: Side = "document"
    normalize: bool = True


class GENERATE(_Msg, tag="GENERATE", frozen=True):
    req_id: U64
    model_ref: str
    max_tokens: Count
    grammar: str | None = None


class ADMIT_SHAPE(_Msg, tag="ADMIT_SHAPE", frozen=True):
    req_id: U64
    model_ref: str
    rows: Count
    seq_len: Count
    packed: bool = False
    # Extension (optional): segments per packed row; absent, the engine picks its own.
    max_segments: Count | None = None


class EVICT(_Msg, tag="EVICT", frozen=True):
    req_id: U64
    model_ref: str
    shape_id: str | None = None


class UNLOAD(_Msg, tag="UNLOAD", frozen=True):
    req_id: U64
    model_ref: str


class PING(_Msg, tag="PING", frozen=True):
    req_id: U64


class SHUTDOWN(_Msg, tag="SHUTDOWN", frozen=True):
    pass


# ---- replies (worker -> host) --------------------------------------------------------------


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """An ENCODE output the loaded model will refuse on this worker: on `side` only (None:
    on every side), and why (the reason its ERR would give)."""

    output: OutputKind
    side: Side | None = None
    reason: str


class LOADED(_Msg, tag="LOADED", frozen=True):
    req_id: U64
    model_ref: str
    dims: Count
    cold_load_ms: float = 0.0
    # Extension (optional): the device the model actually runs on ("cpu", "metal", "cuda"...),
    # so the host takes the right execution permit and certificates name it.
    device: str | None = None
    # Extension (optional): the ENCODE outputs this worker refuses for the model whatever the
    # items (llama.cpp: a query side whose expansion must be hidden from itself; Core ML: no
    # graph with token outputs), so a host serving the model on two lanes sends each request
    # to a lane that serves it.
    refuses: list[Refusal] = []
    # Extension (optional): the most tokens one item may have on this worker for the model
    # (Core ML: its longest admitted shape), so a host serving the model on two lanes sends a
    # longer item to a lane that takes it. None: the model's own limit.
    max_item_tokens: Count | None = None


class VECTORS(_Msg, tag="VECTORS", frozen=True):
    req_id: U64
    dims: Count
    n: Count


class SCORES(_Msg, tag="SCORES", frozen=True):
    req_id: U64


class LABEL_SCORES(_Msg, tag="LABEL_SCORES", frozen=True):
    """Label scores per item: `n` rows of `n_labels` raw f32 logits follow, row-major."""

    req_id: U64
    n: Count
    n_labels: Count


class OutputSection(msgspec.Struct, frozen=True):
    """One requested output in ENCODED's raw frame. `dims`: a vector's width (the vocabulary
    size for sparse). `counts`: rows per item for ragged outputs (tokens, multivector) and
    non-zero entries per item for sparse; empty for dense (one row an item)."""

    kind: OutputKind
    dims: Count
    counts: list[Count] = []


class ENCODED(_Msg, tag="ENCODED", frozen=True):
    """`sections` in the request's `outputs` order; the raw frame holds them back to back:
    dense n x dims f32, tokens / multivector sum(counts) x dims f32, sparse sum(counts) i32
    indices then sum(counts) f32 values."""

    req_id: U64
    n: Count
    sections: list[OutputSection]


class TEXT(_Msg, tag="TEXT", frozen=True):
    req_id: U64
    text: str
    n_prompt: Count
    n_gen: Count
    finish_reason: str


class SHAPE_ADMITTED(_Msg, tag="SHAPE_ADMITTED", frozen=True):
    req_id: U64
    shape_id: str
    cache_hit: bool
    compile_ms: float = 0.0
    # Extensions (optional): the other admission stages, in ms (0 when skipped).
    build_ms: float = 0.0
    load_ms: float = 0.0
    warmup_ms: float = 0.0


class EVICTED(_Msg, tag="EVICTED", frozen=True):
    req_id: U64
    shape_ids: list[str] = []
    freed_bytes: Count = 0


class UNLOADED(_Msg, tag="UNLOADED", frozen=True):
    req_id: U64


class PONG(_Msg, tag="PONG", frozen=True):
    req_id: U64
    rss_mb: float
    models_loaded: list[str] = []
    placement_share: float | None = None
    # Extension: where placement_share comes from, "compute_plan" or "estimate".
    placement_source: str | None = None
    # Extensions (Core ML lanes): this worker's compile-cache hits / misses since it started
    # and the cache's total bytes after its last admission (service/metrics.py reads them).
    cache_hits: int | None = None
    cache_misses: int | None = None
    cache_bytes: int | None = None


class PROGRESS(_Msg, tag="PROGRESS", frozen=True):
    req_id: U64
    completed: U64
    phase: Phase


class ERR(_Msg, tag="ERR", frozen=True):
    req_id: U64
    code: str
    msg: str = ""


HostToWorker = Union[
    HELLO_ACK,
    LOAD,
    EMBED_BATCH,
    RERANK,
    RERANK_SEQUENCES,
    CLASSIFY,
    ENCODE,
    GENERATE,
    ADMIT_SHAPE,
    EVICT,
    UNLOAD,
    PING,
    SHUTDOWN,
]
WorkerToHost = Union[
    HELLO,
    LOADED,
    VECTORS,
    SCORES,
    LABEL_SCORES,
    ENCODED,
    TEXT,
    SHAPE_ADMITTED,
    EVICTED,
    UNLOADED,
    PONG,
    PROGRESS,
    ERR,
]

Request = Union[
    LOAD,
    EMBED_BATCH,
    RERANK,
    RERANK_SEQUENCES,
    CLASSIFY,
    ENCODE,
    GENERATE,
    ADMIT_SHAPE,
    EVICT,
    UNLOAD,
    PING,
]

# Which reply ends which request, and which phase its PROGRESS runs in after setup.
REPLY_FOR: dict[type, type] = {
    LOAD: LOADED,
    EMBED_BATCH: VECTORS,
    RERANK: SCORES,
    RERANK_SEQUENCES: SCORES,
    CLASSIFY: LABEL_SCORES,
    ENCODE: ENCODED,
    GENERATE: TEXT,
    ADMIT_SHAPE: SHAPE_ADMITTED,
    EVICT: EVICTED,
    UNLOAD: UNLOADED,
    PING: PONG,
}
INFERENCE_REQUESTS: frozenset[type] = frozenset(
    {EMBED_BATCH, RERANK, RERANK_SEQUENCES, CLASSIFY, ENCODE, GENERATE}
)
CONTROL_REQUESTS: frozenset[type] = frozenset({LOAD, ADMIT_SHAPE, EVICT, UNLOAD})

_encoder = msgspec.json.Encoder()
_host_decoder = msgspec.json.Decoder(WorkerToHost)  # what the HOST receives
_worker_decoder = msgspec.json.Decoder(HostToWorker)  # what the WORKER receives


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_from_worker(data: bytes | memoryview) -> WorkerToHost:
    """Decode a control frame the host received. Raises msgspec.DecodeError/ValidationError."""
    return _host_decoder.decode(data)


def decode_from_host(data: bytes | memoryview) -> HostToWorker:
    """Decode a control frame the worker received. Raises msgspec.DecodeError/ValidationError."""
    return _worker_decoder.decode(data)


def message_name(msg: object) -> str:
    return type(msg).__name__
