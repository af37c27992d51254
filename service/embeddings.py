"""`POST /v1/embeddings` in OpenAI's shape, through the batching scheduler.

`input` is a string, a list of strings, one token array, or a list of token arrays (ids in
the model's own vocabulary, embedded as given: no special tokens added). `encoding_format`
`base64` is little-endian float32, as OpenAI sends it; the extension values `int8`, `uint8`,
`binary` and `ubinary` are sentence-transformers' quantizations (service/encoding.py), of the
vectors after any `dimensions` cut. `dimensions` truncates and renormalizes
only for Matryoshka-trained models (ingested with `--matryoshka-dims`, or listed in the config's
`matryoshka_models`); asking for the model's full width is always fine; anything else is a 400
rather than a silently degraded vector.

Extensions (OpenAI clients send them in `extra_body` and ignore what they do not know):
`prompt_name` / `prompt` (else the model's default prompt; not with token arrays),
`normalize`, `truncate` and `truncation_direction` (service/truncation.py), and on every item
answered `n_tokens` and `truncated`. The lane that computed the vectors is `usage.lane` and the
`x-synapse-lane` header (a model served by two lanes routes each batch to one).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest
from ingest.store import DEFAULT_EMBED
from service.encoding import encode_embeddings, quantization_ranges
from service.metrics import LANE_HEADER
from service.scheduler import Embedded
from service.schemas import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from service.state import ServerState
from service.truncation import Direction, direction

_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_NAME = (
    "The model's prompt to prepend to every input (GET /info lists them); omitted: the "
    "model's default prompt, if it has one"
)
_PROMPT = 'The text to prepend to every input, instead of a named prompt ("": none)'
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


_FORMATS = (
    "float: JSON numbers; base64: little-endian float32 bytes; extensions, as "
    "sentence-transformers' quantize_embeddings: int8 / uint8 (each dimension's range over the "
    "model's calibration set in 256 buckets, as -128..127 / 0..255), binary / ubinary (one bit "
    "a dimension, 1 where > 0, packed 8 to a byte, as -128..127 / 0..255; ceil(dims/8) "
    "numbers). Quantized after any `dimensions` cut."
)


_LATE = (
    "Jina's late chunking: `input` is ONE document's chunks, in order (concatenated as given); "
    "each chunk's vector pools the states of its own tokens from a pass over the whole "
    "document (mean-pooled models only)"
)


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Annotated[Any, msgspec.Meta(extra_json_schema=_INPUT_SCHEMA)]
    model: str | None = None
    encoding_format: Annotated[
        Literal["float", "base64", "int8", "uint8", "binary", "ubinary"],
        msgspec.Meta(description=_FORMATS),
    ] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: Any = None  # accepted and ignored: OpenAI clients send it, we track no end users
    # Extensions (OpenAI clients send them through `extra_body`):
    normalize: bool = True
    truncate: bool = True  # false: an input over the limit is a 400 naming it
    truncation_direction: Direction = "right"
    prompt_name: Annotated[str, msgspec.Meta(description=_PROMPT_NAME)] | None = None
    prompt: Annotated[str, msgspec.Meta(description=_PROMPT)] | None = None
    late_chunking: Annotated[bool, msgspec.Meta(description=_LATE)] = False


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


def refuse_prompt_for_ids(prompt_name: str | None, prompt: str | None) -> None:
    """Token arrays are embedded as given: a prompt asked for cannot be prepended to them."""
    if prompt_name is not None or prompt:
        raise InvalidRequest(
            "token arrays are embedded as given; a prompt cannot be prepended to them: send "
            "text, or tokenize the prompt into the arrays",
            param="prompt_name" if prompt_name is not None else "prompt",
        )


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


async def create_embeddings(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, EmbeddingRequest)
    texts, token_arrays = parse_input(req.input)
    model = state.resolve(req.model, DEFAULT_EMBED)
    sched = state.scheduler
    assert sched is not None
    usage_tokens = None
    if req.late_chunking:
        if texts is None:
            raise InvalidRequest(
                "late_chunking takes the document's chunks as texts", param="input"
            )
        result, usage_tokens = await _late_chunked(state, texts, model, req)
    elif texts is not None:
        result = await sched.embed_texts(
            texts,
            model,
            req.normalize,
            req.truncate,
            prompt_name=req.prompt_name,
            prompt=req.prompt,
            direction=direction(req.truncation_direction),
        )
    else:
        refuse_prompt_for_ids(req.prompt_name, req.prompt)
        result = await sched.embed_ids(token_arrays or [], model, req.normalize)
    matryoshka = req.dimensions is not None and is_matryoshka(state, model)
    vectors = apply_dimensions(result.vectors, req.dimensions, model, matryoshka)
    fmt = req.encoding_format
    assert state.module is not None
    ranges = await quantization_ranges(
        state.module, model, vectors.shape[1], (fmt,), normalize=req.normalize
    )
    rows = encode_embeddings(vectors, (fmt,), ranges)[fmt]
    tokens = result.total_tokens if usage_tokens is None else usage_tokens
    body = EmbeddingResponse(
        object="list",
        data=[
            EmbeddingData(
                object="embedding",
                index=i,
                embedding=row,
                n_tokens=result.n_tokens[i],
                truncated=result.truncated[i],
            )
            for i, row in enumerate(rows)
        ],
        model=result.model,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens, lane=result.lane or None),
    )
    state.metrics.observe_lane(result.model, result.lane, len(rows))
    headers = {LANE_HEADER: result.lane} if result.lane else None
    return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)


async def _late_chunked(
    state: ServerState, chunks: list[str], model: str, req: EmbeddingRequest
) -> tuple[Embedded, int]:
    """The chunks' vectors (n_tokens: each chunk's own tokens) and the tokens read in all."""
    module, sched = state.module, state.scheduler
    assert module is not None and sched is not None

    def call():
        return module.late_chunk(
            chunks, model, req.normalize, prompt_name=req.prompt_name, prompt=req.prompt
        )

    got = await sched.unbatched("embed", call)
    result = Embedded(
        got.vectors, list(got.n_tokens), list(got.truncated), got.model, got.prompt, got.lane
    )
    return result, got.usage.total_tokens
