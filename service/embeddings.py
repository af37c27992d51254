"""`POST /v1/embeddings` in OpenAI's shape, through the batching scheduler.

`input` is a string, a list of strings, one token array, or a list of token arrays (ids in
the model's own vocabulary, embedded as given: no special tokens added). `encoding_format`
`base64` is little-endian float32, as OpenAI sends it. `dimensions` truncates and renormalizes
only for Matryoshka-trained models (ingested with `--matryoshka-dims`, or listed in the config's
`matryoshka_models`); asking for the model's full width is always fine; anything else is a 400
rather than a silently degraded vector.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from host.errors import InvalidRequest
from host.module import DEFAULT_EMBED
from service.schemas import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from service.state import ServerState

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# `input` decodes as Any (msgspec allows one array type per union) and `parse_input` checks it;
# this is what it accepts, for the OpenAPI document.
_INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        _TOKENS,
        {"type": "array", "items": _TOKENS, "minItems": 1},
    ]
}


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Annotated[Any, msgspec.Meta(extra_json_schema=_INPUT_SCHEMA)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: Any = None  # accepted and ignored, as the issue asks


def parse_input(value: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, None) or (None, token arrays); anything else is a 400 naming `input`."""
    if isinstance(value, str):
        return [value], None
    if not isinstance(value, list):
        raise _bad_input()
    if not value:
        raise InvalidRequest("input must not be empty", param="input")
    if all(isinstance(x, str) for x in value):
        return value, None
    if all(_is_token(x) for x in value):
        return None, [value]
    if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in value):
        return None, value
    raise _bad_input()


def _is_token(x: object) -> bool:
    return type(x) is int  # not bool, not float


def _bad_input() -> InvalidRequest:
    return InvalidRequest(
        "input must be a string, a list of strings, a token array (list of integers) or a "
        "list of token arrays",
        param="input",
    )


def apply_dimensions(
    vectors: np.ndarray, dimensions: int | None, model: str, matryoshka: bool
) -> np.ndarray:
    if dimensions is None:
        return vectors
    dims = vectors.shape[1]
    if not 1 <= dimensions <= dims:
        raise InvalidRequest(
            f"dimensions must be between 1 and {dims} for {model!r}", param="dimensions"
        )
    if dimensions == dims:
        return vectors
    if not matryoshka:
        raise InvalidRequest(
            f"model {model!r} is not Matryoshka-trained, so truncated embeddings would lose "
            f"quality silently; omit dimensions or use {dims}",
            param="dimensions",
        )
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)


def is_matryoshka(state: ServerState, model: str) -> bool:
    """Ingested with Matryoshka widths, or listed in the config's `matryoshka_models` (which
    covers a model ingested without them)."""
    if model in state.config.matryoshka_models:
        return True
    assert state.module is not None
    return bool(state.module.record(model).manifest.matryoshka_dims)


def _encode_vector(row: np.ndarray, fmt: str) -> msgspec.Raw | str:
    if fmt == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    # JSON numbers at float32's own shortest round-trip precision (orjson writes a float32
    # array that way): each parses back to exactly the float32 the model computed, in about
    # 10 characters where float64's repr of the same value takes 17-19 (4.7 instead of 8.0 KB
    # per 384-d vector), and it costs the serving loop a third less. Non-finite -> null, as
    # before.
    return msgspec.Raw(orjson.dumps(np.ascontiguousarray(row, np.float32), option=_NUMPY))


async def create_embeddings(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, EmbeddingRequest)
    texts, token_arrays = parse_input(req.input)
    model = state.resolve(req.model, DEFAULT_EMBED)
    sched = state.scheduler
    assert sched is not None
    if texts is not None:
        result = await sched.embed_texts(texts, model)
    else:
        result = await sched.embed_ids(token_arrays or [], model)
    matryoshka = req.dimensions is not None and is_matryoshka(state, model)
    vectors = apply_dimensions(result.vectors, req.dimensions, model, matryoshka)
    fmt = req.encoding_format
    tokens = result.total_tokens
    body = EmbeddingResponse(
        object="list",
        data=[
            EmbeddingData(object="embedding", index=i, embedding=_encode_vector(row, fmt))
            for i, row in enumerate(vectors)
        ],
        model=result.model,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return Response(msgspec.json.encode(body), media_type="application/json")
