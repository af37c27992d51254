"""Rerank in two shapes: Jina/Cohere (`POST /v1/rerank`) and TEI (`POST /rerank`).

Both call `Module.rerank`. A cross-encoder's raw logit becomes a [0, 1] relevance with the
sigmoid (what sentence-transformers' CrossEncoder does for one label; TEI's `raw_scores`
skips it). An LLM reranker's raw score is `logit[yes] - logit[no]` at the last token, so its
sigmoid is the model's P(yes) (of the two); `instruction` sets its chat template's
instruction (default: the model's own), and is refused for any other model. With no
cross-encoder installed the module ranks by the embedding model's cosine, and the response
says so: `meta.method` (Jina/Cohere) or the `X-Synapse-Rerank-Method`
header (TEI's body is a bare list). Both take `truncate` and `truncation_direction`
(service/truncation.py), and every result says its `n_tokens` and whether it was `truncated`.
Cohere's v2 shape (service/cohere_v2.py) shares `_rerank` and `relevance`.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest
from host.module import RerankResult as Ranked
from service.metrics import LANE_HEADER
from service.schemas import (
    BilledUnits,
    EmbeddingUsage,
    RerankedDocument,
    RerankMeta,
    RerankResponse,
    RerankResult,
    TeiRerankItem,
)
from service.state import ServerState
from service.truncation import Direction, direction, name_field

BI_ENCODER_NOTE = (
    "no cross-encoder is installed: scores are the embedding model's cosine similarity "
    "(bi-encoder), in [-1, 1]"
)


# What /openapi.json says of the `instruction` field every rerank shape takes.
INSTRUCTION_DOC = (
    "LLM rerankers only (e.g. Qwen3-Reranker): the instruction rendered into the model's chat "
    "template (its system message, as sentence-transformers' CrossEncoder prompt); default: "
    "the model's own. The score is logit(yes) - logit(no) at the template's last token; "
    "relevance_score is its sigmoid (raw_scores: the difference itself). Other models refuse it."
)
Instruction = Annotated[str, msgspec.Meta(description=INSTRUCTION_DOC)]


class Document(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: Annotated[list[str | Document], msgspec.Meta(min_length=1)]
    model: str | None = None
    top_n: Annotated[int, msgspec.Meta(ge=1)] | None = None
    return_documents: bool = True
    truncate: bool = True  # extension: over-long pairs are cut, not refused
    truncation_direction: Direction = "right"  # extension
    # extension: an LLM reranker's instruction (its chat template's system message)
    instruction: Instruction | None = None


class TeiRerankRequest(msgspec.Struct, kw_only=True):
    query: str
    texts: Annotated[list[str], msgspec.Meta(min_length=1)]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = True
    truncation_direction: Direction = "right"
    model: str | None = None  # extension: TEI serves one model
    instruction: Instruction | None = None  # extension: an LLM reranker's instruction


def relevance(result: Ranked, raw: float, raw_scores: bool) -> float:
    if result.method == "cross-encoder" and not raw_scores:
        # The logistic sigmoid, in the form whose exp() cannot overflow for any logit.
        if raw >= 0:
            return 1.0 / (1.0 + math.exp(-raw))
        e = math.exp(raw)
        return e / (1.0 + e)
    return raw


def _json(payload: object, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json", headers=headers)


async def _rerank(
    state: ServerState,
    req,
    docs: list[str],
    top_n: int | None,
    param: str,
    max_doc_tokens: int | None = None,
    hint: str | None = None,
) -> Ranked:
    """`Module.rerank` for a decoded request (`query`, `model`, `truncate`,
    `truncation_direction`); an over-the-limit error names the request's `param` field."""
    name = state.resolve(req.model, state.config.default_model)
    assert state.module is not None and state.scheduler is not None
    module = state.module

    def call():
        return module.rerank(
            req.query,
            docs,
            name,
            top_n=top_n,
            truncate=req.truncate,
            truncation_direction=direction(req.truncation_direction),
            max_doc_tokens=max_doc_tokens,
            instruction=req.instruction,
        )

    try:
        return await state.scheduler.unbatched("rerank", call)
    except InvalidRequest as exc:
        # No document index: the query alone is over the limit.
        about_query = exc.details.get("param") == "query" or "index" not in exc.details
        field = "query" if about_query else param
        raise name_field(exc, field, hint) from None


async def rerank_v1(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, RerankRequest)
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    result = await _rerank(state, req, docs, req.top_n, "documents")
    results = [
        RerankResult(
            index=index,
            relevance_score=relevance(result, raw, False),
            document=RerankedDocument(text=docs[index]) if req.return_documents else None,
            n_tokens=result.n_tokens[index],
            truncated=result.truncated[index],
        )
        for index, raw in result.results
    ]
    meta = RerankMeta(
        method=result.method,
        billed_units=BilledUnits(input_tokens=result.usage.total_tokens),
        warning=BI_ENCODER_NOTE if result.method == "bi-encoder-cosine" else None,
    )
    usage = EmbeddingUsage(
        prompt_tokens=result.usage.prompt_tokens,
        total_tokens=result.usage.total_tokens,
        lane=result.lane or None,
    )
    state.metrics.observe_lane(result.model, result.lane, len(docs))
    headers = {LANE_HEADER: result.lane} if result.lane else None
    return _json(
        RerankResponse(model=result.model, results=results, usage=usage, meta=meta), headers
    )


async def rerank_tei(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, TeiRerankRequest)
    result = await _rerank(state, req, req.texts, None, "texts")
    out = [
        TeiRerankItem(
            index=index,
            score=relevance(result, raw, req.raw_scores),
            text=req.texts[index] if req.return_text else None,
            n_tokens=result.n_tokens[index],
            truncated=result.truncated[index],
        )
        for index, raw in result.results
    ]
    headers = {"X-Synapse-Rerank-Method": result.method, "X-Synapse-Model": result.model}
    if result.lane:
        headers[LANE_HEADER] = result.lane
    state.metrics.observe_lane(result.model, result.lane, len(req.texts))
    return _json(out, headers)
