"""`GET /openapi.json`: the API described from the very structs the handlers decode and encode.

Request bodies are the handlers' msgspec request types, responses the structs in
`service.schemas`, all turned into JSON Schema by `msgspec.json.schema_components`; the
route table (service/routes.py) says which route uses which. Every route documents the error
shape for each status it can answer with. The auth schemes are always described; `security`
applies them only when the server has keys (and to `/metrics` only with
`metrics_require_key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from service import schemas
from service.config import ServeConfig


class Route(Protocol):
    """What the document reads of a route (service.routes.Route, which imports this module
    for its document handler: this module names no type of it)."""

    @property
    def path(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def summary(self) -> str: ...
    @property
    def response(self) -> object: ...
    @property
    def request(self) -> type | None: ...
    @property
    def errors(self) -> tuple[int, ...]: ...
    @property
    def ok_status(self) -> tuple[int, ...]: ...
    @property
    def query(self) -> tuple[str, ...]: ...

    def protected(self, config: ServeConfig) -> bool: ...


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


def build_document(ops: Sequence[Route], config: ServeConfig, auth_enabled: bool) -> dict:
    """The OpenAPI 3.1 document of `ops` (service.routes.ROUTES) as this server runs them."""
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
            str(s): {"description": _OK_TEXT.get(s, "OK"), "content": content} for s in op.ok_status
        }
        protected = op.protected(config)
        errors = op.errors + ((401,) if protected and auth_enabled else ())
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
        if not (protected and auth_enabled):
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
