"""`POST /tokenize` and `POST /detokenize` (also `POST /decode`), in TEI's and vLLM's shapes.

One route answers both shapes, told apart by the field that carries the text:

- TEI: `{"inputs": "text" | ["text", ...], "add_special_tokens": true, "prompt_name": ...}`
  -> one list of tokens per input, each `{"id", "text", "special", "start", "stop"}`: the
  token's slice of the text as tokenized (a special token added by the model's template has
  its vocabulary string and null offsets).
- vLLM: `{"prompt": "text", "add_special_tokens": true, "return_token_strs": false}`
  -> `{"count", "max_model_len", "tokens", "token_strs"}`.

Text is what the embedding routes would feed the model: sanitized by the one rule
(host/sanitize.py; offsets index the sanitized text, whose length that rule keeps but for
joined surrogate pairs), with the model's prompt first (`prompt_name`, else the model's
default prompt; the extension `prompt` field of the embedding routes is vLLM's text here, so a
literal prompt is not taken), and never cut: the counts say whether an input fits
(`max_model_len` is the limit inputs are cut at). The same admission limits as embedding
apply (inputs per request, bytes per text and per request).

Detokenize: vLLM's `{"tokens": [ids]}` -> `{"prompt": "text"}`; TEI's `{"ids": [ids] |
[[ids], ...]}` -> one string per sequence. `skip_special_tokens` defaults to TEI's true for
`ids` and vLLM's false for `tokens`. An id outside the vocabulary is a 400.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest
from service.state import ServerState

# Larger inputs are tokenized in a thread, as embedding does: one request cannot stall the loop.
_THREAD_BYTES = 64 * 1024
# Both decode as Any (msgspec allows one array type per union); these are what `_texts` and
# `_id_batch` accept, for the OpenAPI document. Null: the other shape's field is used.
_NULL = {"type": "null"}
_TEXTS = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        _NULL,
    ]
}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_ID_BATCH = {"anyOf": [_IDS, {"type": "array", "items": _IDS, "minItems": 1}, _NULL]}
_ONE_OF = (
    "Exactly one of `inputs` (TEI shape: a string or a list of strings) and `prompt` (vLLM "
    "shape: one string)"
)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    inputs: Annotated[Any, msgspec.Meta(extra_json_schema=_TEXTS, description=_ONE_OF)] = None
    prompt: Annotated[str, msgspec.Meta(description=_ONE_OF)] | None = None
    model: str | None = None
    add_special_tokens: bool = True
    prompt_name: str | None = None
    return_token_strs: bool = False  # vLLM shape


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None  # vLLM shape
    ids: Annotated[Any, msgspec.Meta(extra_json_schema=_ID_BATCH)] = None  # TEI shape
    model: str | None = None
    skip_special_tokens: bool | None = None


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class TeiToken(_Body):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class VllmTokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class VllmDetokenizeResponse(_Body):
    prompt: str


TokenizeResponse = list[list[TeiToken]] | VllmTokenizeResponse
DetokenizeResponse = list[str] | VllmDetokenizeResponse


def _json(body: object) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def _texts(req: TokenizeRequest) -> tuple[list[str], bool]:
    """(texts, TEI shape?)"""
    if (req.inputs is None) == (req.prompt is None):
        raise InvalidRequest(_ONE_OF, param="inputs")
    if req.prompt is not None:
        return [req.prompt], False
    if isinstance(req.inputs, str):
        return [req.inputs], True
    if isinstance(req.inputs, list) and req.inputs and all(isinstance(x, str) for x in req.inputs):
        return req.inputs, True
    raise InvalidRequest("inputs must be a string or a non-empty list of strings", param="inputs")


async def tokenize(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, TokenizeRequest)
    texts, tei = _texts(req)
    model = state.resolve(req.model, state.config.default_model)
    module = state.module
    assert module is not None
    try:
        module.admission.check_inputs(texts)
    except InvalidRequest as exc:
        exc.details.setdefault("param", "inputs" if tei else "prompt")
        raise
    prompt = module.prompt(model, req.prompt_name)  # a generation model has none
    tokenizer = await module.tokenizer(model)
    if sum(len(t) for t in texts) > _THREAD_BYTES:
        out = await asyncio.to_thread(tokenizer.tokenize, texts, req.add_special_tokens, prompt)
    else:
        out = tokenizer.tokenize(texts, req.add_special_tokens, prompt)
    if not tei:
        (one,) = out
        return _json(
            VllmTokenizeResponse(
                count=len(one.ids),
                max_model_len=tokenizer.max_tokens,
                tokens=one.ids,
                token_strs=one.tokens if req.return_token_strs else None,
            )
        )
    return _json(
        [
            [
                TeiToken(id=i, text=tok, special=True, start=None, stop=None)
                if span is None
                else TeiToken(
                    id=i, text=t.text[span[0] : span[1]], special=False, start=span[0], stop=span[1]
                )
                for i, tok, span in zip(t.ids, t.tokens, t.offsets, strict=True)
            ]
            for t in out
        ]
    )


async def detokenize(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, DetokenizeRequest)
    if (req.tokens is None) == (req.ids is None):
        raise InvalidRequest(
            "exactly one of `tokens` (vLLM shape) and `ids` (TEI shape)", param="tokens"
        )
    sequences = [req.tokens] if req.tokens is not None else _id_batch(req.ids)
    model = state.resolve(req.model, state.config.default_model)
    module = state.module
    assert module is not None
    limit = module.admission.budgets.max_inputs
    if len(sequences) > limit:
        raise InvalidRequest(
            f"{len(sequences)} sequences; at most {limit} per request", param="ids"
        )
    tokenizer = await module.tokenizer(model)
    vocab = tokenizer.vocab_size
    for i, seq in enumerate(sequences):
        bad = next((t for t in seq if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"sequence {i}: token id {bad} is outside {model!r}'s vocabulary (0..{vocab - 1})",
                param="tokens" if req.tokens is not None else "ids",
            )
    skip = req.skip_special_tokens
    if req.tokens is not None:
        return _json(
            VllmDetokenizeResponse(
                prompt=tokenizer.decode(req.tokens, skip_special_tokens=bool(skip))
            )
        )
    skip = True if skip is None else skip
    return _json([tokenizer.decode(seq, skip_special_tokens=skip) for seq in sequences])


def _id_batch(ids: Any) -> list[list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(type(t) is int and t >= 0 for t in x)

    if is_ids(ids):
        return [ids]
    if isinstance(ids, list) and ids and all(is_ids(x) for x in ids):
        return ids
    raise InvalidRequest("ids must be a list of token ids or a non-empty list of them", param="ids")
