"""The OpenAPI document (service/openapi.py) as built from the handlers' own structs; the
live fuzzing of it against a real server is tests/test_serve_fuzz.py."""

from __future__ import annotations

import msgspec

from service.completions import CompletionRequest
from service.config import ServeConfig
from service.embeddings import EmbeddingRequest
from service.openapi import build_document
from service.routes import ROUTES as TABLE

ROUTES = {
    ("/v1/embeddings", "post"),
    ("/v1/rerank", "post"),
    ("/rerank", "post"),
    ("/predict", "post"),
    ("/v1/completions", "post"),
    ("/v2/embed", "post"),
    ("/v2/rerank", "post"),
    ("/embed", "post"),
    ("/embed_all", "post"),
    ("/embed_sparse", "post"),
    ("/encode", "post"),
    ("/info", "get"),
    ("/tokenize", "post"),
    ("/detokenize", "post"),
    ("/decode", "post"),
    ("/v1/models", "get"),
    ("/v1/models/{model}", "get"),
    ("/v1/models/{model}/load", "post"),
    ("/v1/models/{model}/unload", "post"),
    ("/health", "get"),
    ("/metrics", "get"),
    ("/openapi.json", "get"),
}


def _ref(schema: dict) -> str:
    return schema["$ref"].rsplit("/", 1)[1]


def test_every_route_is_described_with_its_own_structs():
    doc = build_document(TABLE, ServeConfig(), auth_enabled=False)
    assert doc["openapi"].startswith("3.1")
    assert {(p, m) for p, ops in doc["paths"].items() for m in ops} == ROUTES
    assert {(op.path, op.method) for op in TABLE} == ROUTES
    schemas = doc["components"]["schemas"]
    embed = doc["paths"]["/v1/embeddings"]["post"]
    body = embed["requestBody"]["content"]["application/json"]["schema"]
    assert _ref(body) == "EmbeddingRequest"
    ok = embed["responses"]["200"]["content"]["application/json"]["schema"]
    assert _ref(ok) == "EmbeddingResponse"
    # The same schema msgspec derives from the struct the handler decodes: no second copy.
    (direct,), comps = msgspec.json.schema_components(
        [EmbeddingRequest], ref_template="#/components/schemas/{name}"
    )
    assert schemas["EmbeddingRequest"] == comps["EmbeddingRequest"]
    assert schemas["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"][0]["minimum"] == 1
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "code", "param"]


def test_every_error_status_carries_the_error_shape():
    doc = build_document(TABLE, ServeConfig(), auth_enabled=True)
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")) and not (path == "/health" and status == "503"):
                    schema = resp["content"]["application/json"]["schema"]
                    assert _ref(schema) == "ErrorResponse", (path, status)
    limits = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "408", "413", "429", "503", "504"} <= set(limits)
    assert limits["429"]["headers"]["Retry-After"]["required"]
    assert limits["401"]["headers"]["WWW-Authenticate"]["required"]


def test_auth_scheme_follows_the_configuration():
    schemes = {"bearerAuth", "apiKeyHeader"}
    open_doc = build_document(TABLE, ServeConfig(), auth_enabled=False)
    assert set(open_doc["components"]["securitySchemes"]) == schemes
    assert "security" not in open_doc
    assert "401" not in open_doc["paths"]["/v1/embeddings"]["post"]["responses"]

    keyed = build_document(TABLE, ServeConfig(metrics_require_key=False), auth_enabled=True)
    assert keyed["security"] == [{"bearerAuth": []}, {"apiKeyHeader": []}]
    for path in ("/health", "/openapi.json", "/metrics"):
        assert keyed["paths"][path]["get"]["security"] == []
    strict = build_document(TABLE, ServeConfig(metrics_require_key=True), auth_enabled=True)
    assert "security" not in strict["paths"]["/metrics"]["get"]
    assert "401" in strict["paths"]["/metrics"]["get"]["responses"]


def test_configured_generation_limit_is_stated():
    cfg = msgspec.convert({"module": {"max_generate_tokens": 7}}, ServeConfig)
    doc = build_document(TABLE, cfg, auth_enabled=False)
    max_tokens = doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]
    assert max_tokens["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 7}
    # ... and building it never mutates the struct's own schema for the next document.
    (_,), comps = msgspec.json.schema_components([CompletionRequest])
    assert "maximum" not in comps["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]


def test_lifecycle_routes_and_residency_fields_are_described():
    doc = build_document(TABLE, ServeConfig(), auth_enabled=True)
    schemas = doc["components"]["schemas"]
    for action in ("load", "unload"):
        op = doc["paths"][f"/v1/models/{{model}}/{action}"]["post"]
        assert op["parameters"][0] == {
            "name": "model",
            "in": "path",
            "required": True,
            "schema": {"type": "string"},
        }
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert _ref(ok) == "ModelEntry"
        assert {"401", "404", "503"} <= set(op["responses"])
        assert "security" not in op  # protected like every API route
    assert (
        "insufficient_memory"
        in doc["paths"]["/v1/embeddings"]["post"]["responses"]["503"]["description"]
    )
    entry = schemas["ModelEntry"]
    residency = {
        "loaded_lanes",
        "workers",
        "resident_mb",
        "estimated_mb",
        "estimate_source",
        "in_flight",
        "last_used",
        "keep_alive_s",
        "expires_at",
    }
    assert residency <= set(entry["required"])
    assert {"id", "object", "created", "owned_by"} <= set(entry["required"])
    assert "memory" in schemas["ModelList"]["required"]
    assert {"needed_mb", "budget_mb", "available_mb"} <= set(schemas["ErrorDetail"]["properties"])


def test_the_app_serves_exactly_the_route_table():
    from service.app import create_app

    app = create_app(ServeConfig())  # not started: routing is built at creation
    served = {(r.path, m.lower()) for r in app.starlette.routes for m in r.methods if m != "HEAD"}
    assert served == {(r.path, r.method) for r in TABLE} == ROUTES


def test_metric_labels_and_open_paths_come_from_the_table():
    from service.routes import metric_label_of, open_paths

    assert metric_label_of("/v1/embeddings") == "/v1/embeddings"
    assert metric_label_of("/v1/models/my-secret-model") == "/v1/models/{model}"
    assert metric_label_of("/v1/models/x/unload") == "/v1/models/{model}/unload"
    assert metric_label_of("/nope") == "other"
    assert open_paths(ServeConfig(metrics_require_key=False)) == {
        "/health",
        "/openapi.json",
        "/metrics",
    }
    assert open_paths(ServeConfig(metrics_require_key=True)) == {"/health", "/openapi.json"}
