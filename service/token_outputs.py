"""Outputs on every token's state, over HTTP.

- `POST /embed_all` (TEI's shape): for each input, the final hidden state of every token
  (special tokens included), unnormalized: a list of lists of vectors. For a multi-vector
  model it returns the model's output vectors instead (ColBERT-style), the document side
  unless the request names the query side (`prompt_name: "query"` or `input_type: "query"`).
- `POST /embed_sparse` (TEI's shape): for each input its learned sparse vector as
  `[{"index", "value"}]`, indices ascending, zeros left out.
- `POST /encode` (ours): any of `dense`, `sparse`, `multivector`, `tokens` of the same inputs
  from ONE forward pass of the model: `{"model", "data": [{"index", <each output asked>}],
  "usage"}` with `sparse` as `{"indices", "values"}`.

Every route takes `inputs` (a text or a list of texts), `truncate` (default true),
`truncation_direction`, `prompt_name` / `prompt` and the extension `model`; headers say what
is per input as `/embed` does (`X-Synapse-Model`, `X-Synapse-Tokens`, `X-Synapse-Truncated`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest
from host.token_outputs import TokenOutputs
from service.metrics import LANE_HEADER
from service.state import ServerState
from service.truncation import Direction, direction, name_field

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_TEXTS = {
    "description": "A text or a non-empty list of texts",
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}],
}
Side = Literal["query", "document"]


class _TokenRequest(msgspec.Struct, kw_only=True):
    inputs: Annotated[Any, msgspec.Meta(extra_json_schema=_TEXTS)]
    truncate: bool | None = None  # null: the default, true
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    prompt: str | None = None  # extension: the text to prepend ("": none)
    input_type: Side | None = None  # which side of a multi-vector or sparse model's routes
    model: str | None = None  # extension: TEI serves one model


class EmbedAllRequest(_TokenRequest, kw_only=True):
    pass


class EmbedSparseRequest(_TokenRequest, kw_only=True):
    pass


class EncodeRequest(_TokenRequest, kw_only=True):
    outputs: list[Literal["dense", "sparse", "multivector", "tokens"]] = msgspec.field(
        default_factory=lambda: ["dense"]
    )
    normalize: bool = True  # the dense vector's


EMBED_ALL_RESPONSE = Annotated[
    Any, msgspec.Meta(extra_json_schema={"description": "Per input, per token, a vector"})
]
EMBED_SPARSE_RESPONSE = Annotated[
    Any,
    msgspec.Meta(extra_json_schema={"description": "Per input, its [{index, value}] entries"}),
]
ENCODE_RESPONSE = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={
            "description": "{model, data: [{index, dense?, sparse?: {indices, values}, "
            "multivector?, tokens?}], usage}"
        }
    ),
]


def _texts(inputs: object) -> list[str]:
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, list) and inputs and all(isinstance(x, str) for x in inputs):
        return list(inputs)
    raise InvalidRequest("inputs must be a text or a non-empty list of texts", param="inputs")


def _side(req: _TokenRequest) -> Side:
    """The query side when the request names it (input_type, or the prompt named "query")."""
    if req.input_type is not None:
        return req.input_type
    return "query" if req.prompt_name == "query" else "document"


async def _run(
    state: ServerState, req: _TokenRequest, outputs: list[str], normalize: bool = True
) -> TokenOutputs:
    texts = _texts(req.inputs)
    name = state.resolve(req.model, state.config.default_model)
    assert state.module is not None and state.scheduler is not None
    module = state.module

    def call():
        return module.encode_outputs(
            texts,
            outputs,
            name,
            normalize=normalize,
            truncate=True if req.truncate is None else req.truncate,
            side=_side(req),
            prompt_name=req.prompt_name,
            prompt=req.prompt,
            truncation_direction=direction(req.truncation_direction),
        )

    try:
        result = await state.scheduler.unbatched("encode", call)
    except InvalidRequest as exc:
        raise name_field(exc, "inputs") from None
    state.metrics.observe_lane(result.model, result.lane, len(texts))  # a routed model's lane
    return result


def _headers(result: TokenOutputs) -> dict[str, str]:
    return {
        "X-Synapse-Model": result.model,
        "X-Synapse-Tokens": str(sum(result.n_tokens)),
        "X-Synapse-Truncated": ",".join(str(i) for i, cut in enumerate(result.truncated) if cut),
    } | ({LANE_HEADER: result.lane} if result.lane else {})


def _json(body: object, result: TokenOutputs) -> Response:
    return Response(
        orjson.dumps(body, option=_NUMPY), media_type="application/json", headers=_headers(result)
    )


def _has_head(state: ServerState, name: str, kind: str) -> bool:
    assert state.module is not None
    return kind in state.module.record(name).manifest.heads


async def embed_all(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, EmbedAllRequest)
    name = state.resolve(req.model, state.config.default_model)
    kind = "multivector" if _has_head(state, name, "multivector") else "tokens"
    result = await _run(state, req, [kind])
    rows = result.multivector if kind == "multivector" else result.tokens
    return _json(rows, result)


async def embed_sparse(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, EmbedSparseRequest)
    result = await _run(state, req, ["sparse"])
    assert result.sparse is not None
    body = [
        [{"index": int(i), "value": float(v)} for i, v in zip(idx, val, strict=True)]
        for idx, val in result.sparse
    ]
    return _json(body, result)


async def encode(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, EncodeRequest)
    result = await _run(state, req, list(req.outputs), req.normalize)
    data: list[dict] = []
    for i in range(len(result.n_tokens)):
        item: dict = {"index": i}
        if result.dense is not None:
            item["dense"] = result.dense[i]
        if result.sparse is not None:
            idx, val = result.sparse[i]
            item["sparse"] = {"indices": idx, "values": val}
        if result.multivector is not None:
            item["multivector"] = result.multivector[i]
        if result.tokens is not None:
            item["tokens"] = result.tokens[i]
        data.append(item)
    usage = {"prompt_tokens": sum(result.n_tokens), "total_tokens": sum(result.n_tokens)}
    return _json({"model": result.model, "data": data, "usage": usage}, result)
