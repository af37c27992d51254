"""Every HTTP route, once: path, method, handler, what it answers and who may call it.

The app's routing (service/app.py), its metric labels, the paths open without a key and the
OpenAPI document (service/openapi.py) are all derived from `ROUTES`, so a route added here is
served, counted, protected and described alike — and one forgotten in any of them cannot be.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from service import (
    cohere_v2,
    completions,
    embeddings,
    lifecycle,
    openapi,
    predict,
    rerank,
    schemas,
    status,
    tei,
    token_outputs,
    tokens,
)
from service.config import ServeConfig
from service.state import ServerState

Handler = Callable[[Request, ServerState], Awaitable[Response]]
# "always": needs a key when the server has keys; "never": load balancers probe /health and
# tools read the API's description without one; "metrics": as `metrics_require_key` says.
KeyRule = Literal["always", "never", "metrics"]
INFERENCE_ERRORS = (400, 404, 408, 413, 422, 429, 503, 504, 507)


@dataclass(frozen=True)
class Route:
    path: str
    method: Literal["get", "post"]
    handler: Handler
    summary: str
    response: object  # a type for msgspec's schema_components, or "text" (Prometheus)
    request: type | None = None
    errors: tuple[int, ...] = ()
    key: KeyRule = "always"
    ok_status: tuple[int, ...] = (200,)
    query: tuple[str, ...] = ()  # optional string query parameters
    # Inference POSTs are dispatched by exact path before Starlette's router (service/app.py).
    direct: bool = False

    def protected(self, config: ServeConfig) -> bool:
        return self.key == "always" or (self.key == "metrics" and config.metrics_require_key)


async def _openapi_document(request: Request, state: ServerState) -> Response:
    cached = getattr(state, "_openapi", None)
    if cached is None or cached[0] != state.keys.enabled:  # keys may appear on SIGHUP
        doc = openapi.build_document(ROUTES, state.config, state.keys.enabled)
        cached = state._openapi = (state.keys.enabled, msgspec.json.encode(doc))
    return Response(cached[1], media_type="application/json")


ROUTES: tuple[Route, ...] = (
    Route("/v1/embeddings", "post", embeddings.create_embeddings,
          "Embed texts or token arrays (OpenAI shape)",
          schemas.EmbeddingResponse, embeddings.EmbeddingRequest, INFERENCE_ERRORS, direct=True),
    Route("/v1/rerank", "post", rerank.rerank_v1,
          "Rerank documents against a query (Jina/Cohere shape)",
          schemas.RerankResponse, rerank.RerankRequest, INFERENCE_ERRORS, direct=True),
    Route("/rerank", "post", rerank.rerank_tei, "Rerank texts against a query (TEI shape)",
          list[schemas.TeiRerankItem], rerank.TeiRerankRequest, INFERENCE_ERRORS, direct=True),
    Route("/predict", "post", predict.predict,
          "Classify texts or text pairs with a sequence classifier (TEI shape): every "
          "label's score, best first",
          predict.PredictResponse, predict.PredictRequest, INFERENCE_ERRORS, direct=True),
    Route("/v1/completions", "post", completions.create_completion,
          "Short greedy generation (OpenAI completion shape)",
          schemas.CompletionResponse, completions.CompletionRequest, INFERENCE_ERRORS,
          direct=True),
    Route("/v2/embed", "post", cohere_v2.embed, "Embed texts (Cohere v2 shape)",
          cohere_v2.CohereEmbedResponse, cohere_v2.CohereEmbedRequest, INFERENCE_ERRORS,
          direct=True),
    Route("/v2/rerank", "post", cohere_v2.rerank_v2,
          "Rerank documents against a query (Cohere v2 shape)",
          cohere_v2.CohereRerankResponse, cohere_v2.CohereRerankRequest, INFERENCE_ERRORS,
          direct=True),
    Route("/embed", "post", tei.embed, "Embed inputs (TEI shape: a bare list of vectors)",
          list[list[float]], tei.TeiEmbedRequest, INFERENCE_ERRORS, direct=True),
    Route("/embed_all", "post", token_outputs.embed_all,
          "Every token's final state per input (TEI shape); a multi-vector model's output "
          "vectors", token_outputs.EMBED_ALL_RESPONSE, token_outputs.EmbedAllRequest,
          INFERENCE_ERRORS, direct=True),
    Route("/embed_sparse", "post", token_outputs.embed_sparse,
          "A learned sparse vector per input (TEI shape: [{index, value}])",
          token_outputs.EMBED_SPARSE_RESPONSE, token_outputs.EmbedSparseRequest,
          INFERENCE_ERRORS, direct=True),
    Route("/encode", "post", token_outputs.encode,
          "Dense, sparse, multi-vector and token outputs of the same inputs from one forward "
          "pass", token_outputs.ENCODE_RESPONSE, token_outputs.EncodeRequest, INFERENCE_ERRORS,
          direct=True),
    Route("/tokenize", "post", tokens.tokenize,
          "Tokenize text (TEI shape with `inputs`, vLLM's with `prompt`)",
          tokens.TokenizeResponse, tokens.TokenizeRequest, INFERENCE_ERRORS, direct=True),
    Route("/detokenize", "post", tokens.detokenize,
          "Token ids to text (vLLM shape with `tokens`, TEI's with `ids`)",
          tokens.DetokenizeResponse, tokens.DetokenizeRequest, INFERENCE_ERRORS, direct=True),
    Route("/decode", "post", tokens.detokenize, "Token ids to text (TEI's name for /detokenize)",
          tokens.DetokenizeResponse, tokens.DetokenizeRequest, INFERENCE_ERRORS, direct=True),
    Route("/info", "get", tei.info, "One model described with TEI's fields", tei.TeiInfo,
          errors=(400, 404), query=("model",)),
    Route("/v1/models", "get", status.list_models, "Installed models and aliases",
          schemas.ModelList),
    Route("/v1/models/{model}", "get", status.get_model, "One installed model or alias",
          schemas.ModelEntry, errors=(404,)),
    Route("/v1/models/{model}/load", "post", lifecycle.load_model,
          "Load a model now (idempotent); 503 insufficient_memory when it cannot fit",
          schemas.ModelEntry, errors=(404, 422, 503, 507)),
    Route("/v1/models/{model}/unload", "post", lifecycle.unload_model,
          "Unload a model once its in-flight requests finish (idempotent)",
          schemas.ModelEntry, errors=(404, 503)),
    Route("/health", "get", status.health,
          "Cached lane health: 200 when every lane serves, else 503",
          schemas.HealthResponse, key="never", ok_status=(200, 503)),
    Route("/metrics", "get", status.metrics, "Prometheus metrics", "text", key="metrics"),
    Route("/openapi.json", "get", _openapi_document, "This document", dict, key="never"),
)  # fmt: skip

# Paths a request is counted under as they are; any other path is mapped to its template
# (a model's name never becomes a label) or to "other" (see `metric_label_of`).
_FIXED_LABELS = frozenset(r.path for r in ROUTES if "{" not in r.path)


def metric_label_of(path: str) -> str:
    """The bounded metrics label of a request path."""
    if path in _FIXED_LABELS:
        return path
    if not path.startswith("/v1/models/"):
        return "other"
    for suffix in ("/load", "/unload"):
        if path.endswith(suffix) and path.count("/") == 4:
            return "/v1/models/{model}" + suffix
    return "/v1/models/{model}"


def open_paths(config: ServeConfig) -> frozenset[str]:
    """Paths a request reaches without an API key."""
    return frozenset(r.path for r in ROUTES if not r.protected(config))
