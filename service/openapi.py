"""`GET /openapi.json`: the API described from the very structs the handlers decode and encode.

Request bodies are the handlers' msgspec request types, responses the structs in
`service.schemas`, all turned into JSON Schema by `msgspec.json.schema_components`; this
file only says which route uses which. Every route documents the error shape for each status it
can answer with. The auth schemes are always described; `security` applies them only when the
server has keys (and to `/metrics` only with `metrics_require_key`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from service import cohere_v2, schemas, tei, tokens
from service.completions import CompletionRequest
from service.config import ServeConfig
from service.embeddings import EmbeddingRequest
from service.rerank import RerankRequest, TeiRerankRequest
from service.state import ServerState

_REF = "#/components/schemas/{name}"
_ERROR = {"$ref": _REF.format(name="ErrorResponse")}
_JSON = "application/json"

# What each error status means here (the body is always ErrorResponse).
_STATUS_TEXT = {
    400: "Invalid request (malformed JSON, a bad field, an unsupported option)",
    401: "Missing or invalid API key",
    404: "Unknown model",
    408: "The request body was not complete in time",
    413: "Request body over the size limit",
    422: "The installed model artifact is invalid",
    429: "Overloaded: retry after Retry-After seconds",
    503: "A lane is down, restarting, quarantined, or the server is draining; or the model "
    "does not fit the memory budget (insufficient_memory), or is computing its int8/uint8 "
    "ranges, once (calibrating): retry after Retry-After seconds",
    504: "No result within the request timeout",
    507: "The engine ran out of memory, or a model build out of disk space",
}
_OK_TEXT = {503: "Not every lane serves (the same body, with each lane's state)"}
_INFERENCE_ERRORS = (400, 404, 408, 413, 422, 429, 503, 504, 507)


@dataclass(frozen=True)
class _Op:
    path: str
    method: str
    summary: str
    response: object  # a type for schema_components, or "text" (Prometheus exposition)
    request: type | None = None
    errors: tuple[int, ...] = ()
    protected: bool = True
    ok_status: tuple[int, ...] = (200,)
    query: tuple[str, ...] = ()  # optional string query parameters


def operations(config: ServeConfig) -> list[_Op]:
    return [
        _Op("/v1/embeddings", "post", "Embed texts or token arrays (OpenAI shape)",
            schemas.EmbeddingResponse, EmbeddingRequest, _INFERENCE_ERRORS),
        _Op("/v1/rerank", "post", "Rerank documents against a query (Jina/Cohere shape)",
            schemas.RerankResponse, RerankRequest, _INFERENCE_ERRORS),
        _Op("/rerank", "post", "Rerank texts against a query (TEI shape)",
            list[schemas.TeiRerankItem], TeiRerankRequest, _INFERENCE_ERRORS),
        _Op("/v1/completions", "post", "Short greedy generation (OpenAI completion shape)",
            schemas.CompletionResponse, CompletionRequest, _INFERENCE_ERRORS),
        _Op("/v2/embed", "post", "Embed texts (Cohere v2 shape)",
            cohere_v2.CohereEmbedResponse, cohere_v2.CohereEmbedRequest, _INFERENCE_ERRORS),
        _Op("/v2/rerank", "post", "Rerank documents against a query (Cohere v2 shape)",
            cohere_v2.CohereRerankResponse, cohere_v2.CohereRerankRequest, _INFERENCE_ERRORS),
        _Op("/embed", "post", "Embed inputs (TEI shape: a bare list of vectors)",
            list[list[float]], tei.TeiEmbedRequest, _INFERENCE_ERRORS),
        _Op("/info", "get", "One model described with TEI's fields", tei.TeiInfo,
            errors=(400, 404), query=("model",)),
        _Op("/tokenize", "post", "Tokenize text (TEI shape with `inputs`, vLLM's with `prompt`)",
            tokens.TokenizeResponse, tokens.TokenizeRequest, _INFERENCE_ERRORS),
        _Op("/detokenize", "post", "Token ids to text (vLLM shape with `tokens`, TEI's with "
            "`ids`)", tokens.DetokenizeResponse, tokens.DetokenizeRequest, _INFERENCE_ERRORS),
        _Op("/decode", "post", "Token ids to text (TEI's name for /detokenize)",
            tokens.DetokenizeResponse, tokens.DetokenizeRequest, _INFERENCE_ERRORS),
        _Op("/v1/models", "get", "Installed models and aliases", schemas.ModelList),
        _Op("/v1/models/{model}", "get", "One installed model or alias", schemas.ModelEntry,
            errors=(404,)),
        _Op("/v1/models/{model}/load", "post",
            "Load a model now (idempotent); 503 insufficient_memory when it cannot fit",
            schemas.ModelEntry, errors=(404, 422, 503, 507)),
        _Op("/v1/models/{model}/unload", "post",
            "Unload a model once its in-flight requests finish (idempotent)",
            schemas.ModelEntry, errors=(404, 503)),
        _Op("/health", "get", "Cached lane health: 200 when every lane serves, else 503",
            schemas.HealthResponse, protected=False, ok_status=(200, 503)),
        _Op("/metrics", "get", "Prometheus metrics", "text",
            protected=config.metrics_require_key),
        _Op("/openapi.json", "get", "This document", dict, protected=False),
    ]  # fmt: skip


def _error_responses(statuses: tuple[int, ...]) -> dict:
    out = {}
    for status in statuses:
        resp: dict = {"description": _STATUS_TEXT[status], "content": {_JSON: {"schema": _ERROR}}}
        if status == 429:
            resp["headers"] = {"Retry-After": {"required": True, "schema": {"type": "string"}}}
        if status == 401:
            resp["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}
        out[str(status)] = resp
    return out


def build_document(config: ServeConfig, auth_enabled: bool) -> dict:
    ops = operations(config)
    types: list[object] = [schemas.ErrorResponse]
    for op in ops:
        if op.request is not None:
            types.append(op.request)
        if op.response != "text":
            types.append(op.response)
    found, components = msgspec.json.schema_components(types, ref_template=_REF)
    # The one bound that is configuration, not type: the short-generation limit.
    max_tokens = components["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    max_tokens["maximum"] = config.module.max_generate_tokens
    schema_of = dict(zip(map(repr, types), found, strict=True))

    paths: dict[str, dict] = {}
    for op in ops:
        if op.response == "text":
            content = {"text/plain": {"schema": {"type": "string"}}}
        else:
            content = {_JSON: {"schema": schema_of[repr(op.response)]}}
        responses: dict = {
            str(s): {"description": _OK_TEXT.get(s, "OK"), "content": content}
            for s in op.ok_status
        }
        errors = op.errors + ((401,) if op.protected and auth_enabled else ())
        responses.update(_error_responses(tuple(sorted(errors))))
        operation: dict = {"summary": op.summary, "responses": responses}
        if op.request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {_JSON: {"schema": schema_of[repr(op.request)]}},
            }
        if op.path.startswith("/v1/models/{model}"):
            operation["parameters"] = [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ]
        if op.query:
            operation["parameters"] = [
                {"name": q, "in": "query", "required": False, "schema": {"type": "string"}}
                for q in op.query
            ]
        if not (op.protected and auth_enabled):
            operation["security"] = []
        paths.setdefault(op.path, {})[op.method] = operation

    doc: dict = {
        "openapi": "3.1.0",
        "info": {
            "title": "Synapse",
            "version": "1",
            "description": "Embeddings, rerank and short generation over supervised engines.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer"},
                "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }
    if auth_enabled:
        doc["security"] = [{"bearerAuth": []}, {"apiKeyHeader": []}]
    return doc


async def serve_document(request: Request, state: ServerState) -> Response:
    cached = getattr(state, "_openapi", None)
    if cached is None or cached[0] != state.keys.enabled:  # keys may appear on SIGHUP
        doc = build_document(state.config, state.keys.enabled)
        cached = state._openapi = (state.keys.enabled, msgspec.json.encode(doc))
    return Response(cached[1], media_type=_JSON)
