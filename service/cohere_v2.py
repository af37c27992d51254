"""Cohere's v2 API: `POST /v2/embed` and `POST /v2/rerank`, in the shapes `cohere.ClientV2`
sends and reads (its v1 `Client.rerank` is served by `/v1/rerank`, service/rerank.py).

Embed: `texts` only (no `images`/`inputs`: 400). `input_type` chooses the model's prompt, as
sentence-transformers models name them: `search_query` -> "query", `search_document` ->
"document", else "passage", `classification` / `clustering` -> the prompt of that name; a
model without that prompt (or a request without `input_type`) gets the model's default prompt,
if it has one. `truncate` is Cohere's: `END` (the default) cuts the end of an input over the
limit, `START` its beginning, `NONE` makes it a 400 naming the input. `max_tokens` lowers the
limit for this request (never above the model's own). `output_dimension` is `dimensions` of
/v1/embeddings: Matryoshka models only. `embedding_types` go through `embeddings_by_type`.

Rerank: as `/v1/rerank`, plus `max_tokens_per_doc` (every document capped at that many tokens
before the pair limit applies) and the extensions `truncate` / `truncation_direction`.
Relevance scores of a cross-encoder are in [0, 1]; with no cross-encoder installed they are
the embedding model's cosine, and `meta.warnings` says so.

Extension fields Cohere's SDK keeps as extras: `model` (what ran), per input `n_tokens` and
`truncated` (parallel to `texts`, or on each rerank result), `prompt_name` (the prompt applied).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest, SynapseError
from ingest.store import DEFAULT_EMBED
from service import rerank
from service.embeddings import apply_dimensions, is_matryoshka
from service.encoding import encode_embeddings, quantization_ranges
from service.errors import Unsupported
from service.state import ServerState
from service.truncation import name_field

InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
# Cohere's embedding types, all served: int8/uint8 with the model's calibration ranges and
# (u)binary packed bits, as sentence-transformers' quantize_embeddings (service.encoding).
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
# Which of a model's prompts an input type means: the first one the model has.
PROMPTS_FOR = {
    "search_query": ("query",),
    "search_document": ("document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
_CUT = {"END": "right", "START": "left"}
_HINT = "pass truncate END or START"


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# ---- requests ----------------------------------------------------------------------------------


class CohereEmbedRequest(msgspec.Struct, kw_only=True):
    texts: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    model: str | None = None
    input_type: InputType | None = None
    embedding_types: Annotated[list[EmbeddingType], msgspec.Meta(min_length=1)] | None = None
    output_dimension: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    priority: int | None = None  # accepted: a model's requests share one queue here
    images: Any = None  # refused: text only
    inputs: Any = None  # refused: text only


class RelevantSpans(msgspec.Struct, kw_only=True):
    mode: Literal["enabled", "disabled"]
    threshold: float | None = None
    max_spans: int | None = None


class CohereRerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: Annotated[list[str], msgspec.Meta(min_length=1)]
    model: str | None = None
    top_n: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_tokens_per_doc: Annotated[int, msgspec.Meta(ge=1)] | None = None
    relevant_spans: RelevantSpans | None = None  # "enabled" is refused: no span model here
    priority: int | None = None
    truncate: bool = True  # extension
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"  # extension
    instruction: rerank.Instruction | None = None  # extension: an LLM reranker's instruction


# ---- responses ---------------------------------------------------------------------------------


class CohereApiVersion(_Body):
    version: str


class CohereBilledUnits(_Body):
    input_tokens: int | None = None
    search_units: int | None = None


class CohereTokens(_Body):
    input_tokens: int


class CohereMeta(_Body):
    api_version: CohereApiVersion
    billed_units: CohereBilledUnits
    tokens: CohereTokens
    warnings: list[str] | None = None


class CohereEmbeddings(_Body):
    float_: list[list[float]] | None = msgspec.field(default=None, name="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereEmbedResponse(_Body):
    id: str
    response_type: Literal["embeddings_by_type"]
    embeddings: CohereEmbeddings
    texts: list[str]
    meta: CohereMeta
    model: str  # extension: the installed model that ran
    n_tokens: list[int]  # extension, per text: what was embedded (the prompt included)
    truncated: list[bool]  # extension, per text: cut to fit
    prompt_name: str | None = None  # extension: the model's prompt that was applied


class CohereRerankResult(_Body):
    index: int
    relevance_score: float
    n_tokens: int  # extension: the tokens scored for this document
    truncated: bool  # extension: the document (or the query in its pair) was cut


class CohereRerankResponse(_Body):
    id: str
    results: list[CohereRerankResult]
    meta: CohereMeta
    model: str  # extension
    method: Literal["cross-encoder", "bi-encoder-cosine", "multi-vector-maxsim"]  # extension


# ---- embed -------------------------------------------------------------------------------------


def prompt_for(input_type: str | None, prompts: dict[str, str]) -> str | None:
    """The name of the model's prompt `input_type` means; None: the model's default."""
    for name in PROMPTS_FOR.get(input_type or "", ()):
        if name in prompts:
            return name
    return None


async def embeddings_by_type(
    state: ServerState, model: str, vectors: np.ndarray, types: list[str]
) -> CohereEmbeddings:
    """`vectors` in every requested embedding type (the request's `embedding_types`); int8 and
    uint8 use the model's ranges at the served width (a Matryoshka cut included)."""
    assert state.module is not None
    types = list(dict.fromkeys(types))
    ranges = await quantization_ranges(
        state.module, model, vectors.shape[1], types, param="embedding_types"
    )
    encoded = encode_embeddings(vectors, types, ranges)
    out = CohereEmbeddings()
    for t, rows in encoded.items():
        setattr(out, "float_" if t == "float" else t, rows)
    return out


def _meta(tokens: int, warning: str | None = None, **billed: int) -> CohereMeta:
    return CohereMeta(
        api_version=CohereApiVersion(version="2"),
        billed_units=CohereBilledUnits(**billed),
        tokens=CohereTokens(input_tokens=tokens),
        warnings=[warning] if warning else None,
    )


def _json(body: object) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


async def embed(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, CohereEmbedRequest)
    if req.images is not None or req.inputs is not None:
        raise Unsupported(
            "this server embeds text only: send `texts`",
            param="images" if req.images is not None else "inputs",
        )
    if req.texts is None:
        raise InvalidRequest("texts is required", param="texts")
    if req.input_type == "image":
        raise Unsupported(
            "input_type 'image' needs images; this server embeds text only", param="input_type"
        )
    model = state.resolve(req.model, DEFAULT_EMBED)
    assert state.module is not None and state.scheduler is not None
    prompt_name = prompt_for(req.input_type, state.module.record(model).manifest.prompts)
    max_tokens = await _limit(state, model, req.max_tokens)
    try:
        result = await state.scheduler.embed_texts(
            req.texts,
            model,
            True,
            req.truncate != "NONE",
            prompt_name=prompt_name,
            direction=_CUT.get(req.truncate, "right"),
            max_tokens=max_tokens,
        )
    except SynapseError as exc:
        if exc.details.get("param") == "input":  # the scheduler names OpenAI's field
            exc.details["param"] = "texts"
        raise name_field(exc, "texts", _HINT) from None
    vectors = result.vectors
    if req.output_dimension is not None:
        try:
            vectors = apply_dimensions(
                vectors, req.output_dimension, model, is_matryoshka(state, model)
            )
        except InvalidRequest as exc:
            raise InvalidRequest(
                exc.message.replace("dimensions", "output_dimension"), param="output_dimension"
            ) from None
    applied = (
        prompt_name
        if prompt_name is not None
        else (state.module.record(model).manifest.default_prompt_name if result.prompt else None)
    )
    body = CohereEmbedResponse(
        id=str(uuid.uuid4()),
        response_type="embeddings_by_type",
        embeddings=await embeddings_by_type(
            state, model, vectors, list(req.embedding_types or ["float"])
        ),
        texts=req.texts,
        meta=_meta(result.total_tokens, input_tokens=result.total_tokens),
        model=result.model,
        n_tokens=result.n_tokens,
        truncated=result.truncated,
        prompt_name=applied,
    )
    return _json(body)


async def _limit(state: ServerState, model: str, max_tokens: int | None) -> int | None:
    """The request's token limit: `max_tokens` lowers the model's own, never raises it."""
    if max_tokens is None:
        return None
    assert state.module is not None
    tokenizer = await state.module.tokenizer(model)
    floor = tokenizer.n_special_pair + 2
    if max_tokens < floor:
        raise InvalidRequest(
            f"max_tokens must be at least {floor} for {model!r} (its special tokens and text)",
            param="max_tokens",
        )
    return min(max_tokens, tokenizer.max_tokens)


# ---- rerank ------------------------------------------------------------------------------------


async def rerank_v2(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, CohereRerankRequest)
    if req.relevant_spans is not None and req.relevant_spans.mode == "enabled":
        raise Unsupported("relevant spans are not served", param="relevant_spans")
    result = await rerank._rerank(
        state, req, req.documents, req.top_n, "documents", req.max_tokens_per_doc
    )
    results = [
        CohereRerankResult(
            index=index,
            relevance_score=rerank.relevance(result, raw, False),
            n_tokens=result.n_tokens[index],
            truncated=result.truncated[index],
        )
        for index, raw in result.results
    ]
    warning = rerank.BI_ENCODER_NOTE if result.method == "bi-encoder-cosine" else None
    meta = _meta(result.usage.total_tokens, warning, search_units=1)
    return _json(
        CohereRerankResponse(
            id=str(uuid.uuid4()),
            results=results,
            meta=meta,
            model=result.model,
            method=result.method,  # type: ignore[arg-type]
        )
    )
