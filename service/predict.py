"""Sequence classification in TEI's shape: `POST /predict`.

`inputs` is read as TEI reads it: a string (one text), a list of one or two strings (one text,
or one (text, text_pair) pair), or a batch: a list of such lists (`[["a"], ["b", "c"]]`).
The body is TEI's: for one input, every label's {label, score} best first; for a batch, one
such list per input. Scores are the model's activation of its head's logits (softmax for a
single-label classifier, sigmoid for a multi-label one or a single logit, none for
regression: host.classify), or the logits themselves with `raw_scores`. Labels are the
checkpoint's `id2label`.

Extensions: `model` (TEI serves one model; here, without it, the one installed sequence
classifier), `truncation_direction`. As on every route here `truncate` defaults to true. What
is per input goes in headers, as /embed does: `X-Synapse-Model`, `X-Synapse-Tokens`,
`X-Synapse-Truncated` (the indices of the inputs that were cut).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest
from host.classify import ClassifyInput
from service.state import ServerState
from service.truncation import Direction, direction, name_field

_PAIR = {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}
_ONE = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}
_INPUTS_SCHEMA = {
    "description": "A text, a pair [text, text_pair], or a batch of [text] / [text, text_pair]",
    "anyOf": [
        {"type": "string"},
        _ONE,
        _PAIR,
        {"type": "array", "items": {"anyOf": [_ONE, _PAIR]}, "minItems": 1},
    ],
}
_PREDICTION = {
    "type": "object",
    "properties": {"label": {"type": "string"}, "score": {"type": "number"}},
    "required": ["label", "score"],
}
PREDICT_RESPONSE_SCHEMA = {
    "description": "One input: its labels best first; a batch: one such list per input",
    "anyOf": [
        {"type": "array", "items": _PREDICTION},
        {"type": "array", "items": {"type": "array", "items": _PREDICTION}},
    ],
}
PredictResponse = Annotated[Any, msgspec.Meta(extra_json_schema=PREDICT_RESPONSE_SCHEMA)]


class PredictRequest(msgspec.Struct, kw_only=True):
    inputs: Annotated[Any, msgspec.Meta(extra_json_schema=_INPUTS_SCHEMA)]
    raw_scores: bool = False
    truncate: bool | None = None  # null: the default, true
    truncation_direction: Direction = "right"
    model: str | None = None  # extension: TEI serves one model


def parse_inputs(inputs: object) -> tuple[list[ClassifyInput], bool]:
    """(the inputs, whether they are a batch), as TEI's PredictInput deserializes them."""
    if isinstance(inputs, str):
        return [inputs], False
    if not isinstance(inputs, list) or not inputs:
        raise InvalidRequest(
            "inputs must be a text, a pair [text, text_pair], or a non-empty batch of them",
            param="inputs",
        )
    if isinstance(inputs[0], str):
        if len(inputs) > 2 or not all(isinstance(x, str) for x in inputs):
            raise InvalidRequest(
                f"inputs: a list of strings is one text or one pair (1 or 2 strings), got "
                f"{len(inputs)} items; a batch is a list of [text] or [text, text_pair] lists",
                param="inputs",
            )
        return [inputs[0] if len(inputs) == 1 else (inputs[0], inputs[1])], False
    batch: list[ClassifyInput] = []
    for i, item in enumerate(inputs):
        if (
            not isinstance(item, list)
            or not 1 <= len(item) <= 2
            or not all(isinstance(x, str) for x in item)
        ):
            raise InvalidRequest(
                f"inputs[{i}]: a batch item is [text] or [text, text_pair]",
                param="inputs",
                index=i,
            )
        batch.append(item[0] if len(item) == 1 else (item[0], item[1]))
    return batch, True


def default_classifier(state: ServerState) -> str:
    """The model /predict serves when a request names none: the one installed model with a
    classifier head; several (or none) must be told apart by `model`."""
    assert state.module is not None
    heads = [r.name for r in state.module.store.ls() if r.kind == "rerank"]
    if len(heads) == 1:
        return heads[0]
    which = ", ".join(sorted(heads)) if heads else "none is installed"
    raise InvalidRequest(f"name the sequence classifier in `model` ({which})", param="model")


async def predict(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, PredictRequest)
    inputs, is_batch = parse_inputs(req.inputs)
    name = state.resolve(req.model or default_classifier(state), "")
    assert state.module is not None and state.scheduler is not None
    module = state.module

    def call():
        return module.classify(
            inputs,
            name,
            truncate=True if req.truncate is None else req.truncate,
            truncation_direction=direction(req.truncation_direction),
        )

    try:
        result = await state.scheduler.unbatched("classify", call)
    except InvalidRequest as exc:
        raise name_field(exc, "inputs") from None
    ranked = [
        [{"label": label, "score": score} for label, score in row]
        for row in result.ranked(req.raw_scores)
    ]
    headers = {
        "X-Synapse-Model": result.model,
        "X-Synapse-Tokens": str(result.total_tokens),
        "X-Synapse-Truncated": ",".join(str(i) for i, cut in enumerate(result.truncated) if cut),
    }
    body = orjson.dumps(ranked if is_batch else ranked[0])
    return Response(body, media_type="application/json", headers=headers)
