"""Rerank in two shapes: Jina/Cohere (`POST /v1/rerank`) and TEI (`POST /rerank`).

Both call `Module.rerank`. A cross-encoder's raw logit becomes a [0, 1] relevance with the
sigmoid (what sentence-transformers' CrossEncoder does for one label; TEI's `raw_scores`
skips it). With no cross-encoder installed the module ranks by the embedding model's cosine,
and the response says so: `meta.method` (Jina/Cohere) or the `X-Synapse-Rerank-Method`
header (TEI's body is a bare list).
"""

from __future__ import annotations

import math

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from host.module import DEFAULT_EMBED, RerankResult
from host.serve.body import decode, read_body
from host.serve.state import ServerState

BI_ENCODER_NOTE = (
    "no cross-encoder is installed: scores are the embedding model's cosine similarity "
    "(bi-encoder), in [-1, 1]"
)


class Document(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str | Document]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    truncate: bool = True  # extension: over-long pairs are cut, not refused


class TeiRerankRequest(msgspec.Struct, kw_only=True):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = True
    model: str | None = None  # extension: TEI serves one model


def _score(result: RerankResult, raw: float, raw_scores: bool) -> float:
    if result.method == "cross-encoder" and not raw_scores:
        return 1.0 / (1.0 + math.exp(-raw))
    return raw


def _json(payload: object, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json", headers=headers)


async def _rerank(state: ServerState, model, query, docs, top_n, truncate) -> RerankResult:
    name = state.resolve(model, DEFAULT_EMBED)
    assert state.module is not None and state.scheduler is not None
    with state.scheduler.slot("rerank"):
        return await state.module.rerank(query, docs, name, top_n=top_n, truncate=truncate)


async def rerank_v1(request: Request, state: ServerState) -> Response:
    req = decode(await read_body(request, state.config.max_body_bytes), RerankRequest)
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    result = await _rerank(state, req.model, req.query, docs, req.top_n, req.truncate)
    results = []
    for index, raw in result.results:
        item: dict = {"index": index, "relevance_score": _score(result, raw, False)}
        if req.return_documents:
            item["document"] = {"text": docs[index]}
        results.append(item)
    meta: dict = {
        "method": result.method,
        "billed_units": {"input_tokens": result.usage.total_tokens},
    }
    if result.method == "bi-encoder-cosine":
        meta["warning"] = BI_ENCODER_NOTE
    usage = {"prompt_tokens": result.usage.prompt_tokens, "total_tokens": result.usage.total_tokens}
    return _json({"model": result.model, "results": results, "usage": usage, "meta": meta})


async def rerank_tei(request: Request, state: ServerState) -> Response:
    req = decode(await read_body(request, state.config.max_body_bytes), TeiRerankRequest)
    result = await _rerank(state, req.model, req.query, req.texts, None, req.truncate)
    out = []
    for index, raw in result.results:
        item: dict = {"index": index, "score": _score(result, raw, req.raw_scores)}
        if req.return_text:
            item["text"] = req.texts[index]
        out.append(item)
    headers = {"X-Synapse-Rerank-Method": result.method, "X-Synapse-Model": result.model}
    return _json(out, headers)
