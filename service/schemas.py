"""Response bodies as msgspec structs: the handlers encode these, and `/openapi.json` is
generated from them (with the request structs the handlers decode). One definition each, so the
document cannot drift from what the server sends.

Optional fields default to None and are omitted when None (`omit_defaults`), so the document
marks them not-required; a field that is always sent, even as null, has no default. No struct
forbids extra fields: a client must accept additions.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# ---- errors ------------------------------------------------------------------------------------


class ErrorDetail(_Body):
    message: str
    type: str  # invalid_request_error | authentication_error | rate_limit_error | server_error
    code: str  # the typed code from host.errors (invalid_request, engine_crashed, ...)
    param: str | None  # the offending field, when there is one (always present, maybe null)
    lane_id: str | None = None
    quarantined: bool | None = None
    retry_after_s: float | None = None
    limit_bytes: int | None = None
    # insufficient_memory: what the model needs, and the budget / machine it did not fit.
    needed_mb: float | None = None
    budget_mb: float | None = None
    resident_mb: float | None = None
    available_mb: float | None = None


class ErrorResponse(_Body):
    error: ErrorDetail


# ---- embeddings --------------------------------------------------------------------------------


class EmbeddingData(_Body):
    object: Literal["embedding"]
    index: int
    # JSON Schema's "number" takes integers too: the quantized formats fit list[float].
    embedding: Annotated[
        list[float] | str,
        msgspec.Meta(
            description=(
                "float: numbers; base64: little-endian float32 bytes, base64; int8 / binary: "
                "integers -128..127; uint8 / ubinary: integers 0..255 (binary and ubinary: "
                "ceil(dims/8) packed bytes)"
            )
        ),
    ]
    # Extensions OpenAI clients ignore: what was embedded, and whether the input was cut.
    n_tokens: int
    truncated: bool


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int
    # Extension: the lane that computed the answer ("ane", "llama"); a model served by two
    # lanes routes each request to one (also in the `x-synapse-lane` response header).
    lane: str | None = None


class EmbeddingResponse(_Body):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---- rerank ------------------------------------------------------------------------------------


class RerankedDocument(_Body):
    text: str


class RerankResult(_Body):
    index: int
    relevance_score: float
    n_tokens: int  # extension: the tokens scored for this document (its pair's)
    truncated: bool  # extension: the document (or the query in its pair) was cut to fit
    document: RerankedDocument | None = None


class BilledUnits(_Body):
    input_tokens: int


class RerankMeta(_Body):
    method: Literal["cross-encoder", "bi-encoder-cosine", "multi-vector-maxsim"]
    billed_units: BilledUnits
    warning: str | None = None


class RerankResponse(_Body):
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage
    meta: RerankMeta


class TeiRerankItem(_Body):
    index: int
    score: float
    n_tokens: int  # extension, as RerankResult's
    truncated: bool
    text: str | None = None


# ---- completions -------------------------------------------------------------------------------


class CompletionChoice(_Body):
    text: str
    index: int
    finish_reason: str
    logprobs: None  # always null: logprobs are not supported


class CompletionUsage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


# ---- status (service/status.py builds these as dicts; the live fuzz test holds them to
# these shapes) ---------------------------------------------------------------------------------


class LaneHealth(_Body):
    lane_id: str
    status: str  # ready | busy | starting | down | quarantined | stopped
    pid: int | None
    strikes: int
    quarantined: bool
    retry_after_s: float | None
    restarts: int
    checked_age_s: float | None


class HealthResponse(_Body):
    status: Literal["ok", "degraded", "draining", "starting"]
    lanes: dict[str, LaneHealth]


class ModelWorker(_Body):
    lane: str  # llama | ane
    device: str | None  # where it computes: cpu, metal, ane...
    pid: int | None
    status: str  # as in /health
    rss_mb: float | None  # the worker's resident memory from its latest PONG


class ModelProvenance(_Body):
    origin: str  # huggingface | ollama | lmstudio
    repo: str  # Hub repository id, Ollama NAME:TAG, LM Studio PUBLISHER/REPO/FILE
    revision: str = ""  # the Hub commit the revision resolved to; Ollama's manifest sha256
    requested: str | None = None  # the branch or tag asked for, when not a commit
    endpoint: str | None = None  # the Hub it came from, when not huggingface.co
    files: dict[str, str] = {}  # file -> sha256 of what was read


class ModelEntry(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: str
    dims: int | None
    max_tokens: int  # the default cut
    max_tokens_limit: int  # the most a request may ask for
    pooling: str | None  # mean | cls | last | rank (null: a generator)
    prompts: dict[str, str]  # name -> text, prepended by prompt_name / input_type
    default_prompt_name: str | None  # applied when a request names none
    matryoshka_dims: list[int]  # widths `dimensions` may cut the vectors to (widest first)
    loaded: bool
    loaded_lanes: list[str]  # the lanes it is loaded on now
    workers: list[ModelWorker]
    resident_mb: float | None  # its workers' RSS summed (null: not loaded)
    estimated_mb: float  # what its next load is budgeted at
    estimate_source: Literal["estimate", "measured"]  # artifact + overhead, or a load's RSS
    in_flight: int  # calls inside the model now
    last_used: float | None  # unix seconds of its latest use (null: not used yet)
    keep_alive_s: float | None  # idle seconds before it is unloaded (null: never)
    expires_at: float | None  # unix seconds it will be unloaded if still idle (null: none)
    # Where its files came from (null: a local directory or file).
    provenance: ModelProvenance | None = None
    alias_for: str | None = None  # set on aliases: the installed model this name serves


class ModelMemory(_Body):
    resident_mb: float  # every worker's RSS, plus the estimates of loads under way
    max_resident_mb: float | None  # the budget (null: none)
    machine_available_mb: float | None  # what the OS says is available now
    min_free_mb: float  # a load must leave this much of it free
    unloads: dict[str, int]  # models unloaded so far, by reason: keep_alive, budget, request
    refusals: int  # loads refused with insufficient_memory


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelEntry]
    memory: ModelMemory
