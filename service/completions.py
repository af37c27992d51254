"""`POST /v1/completions`: short greedy generation in OpenAI's completion shape.

Decoding is greedy and non-streaming; knobs that would change that (sampling temperature,
`n`, `stream`, `logprobs`, `stop`, ...) are refused with a clear 400 rather than silently
ignored. `grammar` (a GBNF string) is an extension field; a grammar the engine cannot honour
is the worker's typed `invalid_request`, never an unconstrained answer.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest
from host.errors import WorkerError
from ingest.store import DEFAULT_GENERATE
from service.errors import Unsupported
from service.schemas import CompletionChoice, CompletionResponse, CompletionUsage
from service.state import ServerState

# `prompt` decodes as Any and `_prompt` checks it; this is what it accepts (for the document).
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
    ]
}


class CompletionRequest(msgspec.Struct, kw_only=True):
    prompt: Annotated[Any, msgspec.Meta(extra_json_schema=_PROMPT_SCHEMA)]
    model: str | None = None
    # The upper bound is the server's `max_generate_tokens`; /openapi.json states it.
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    grammar: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stop: Any = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None  # greedy decoding is deterministic already
    user: Any = None


def _refuse_unsupported(req: CompletionRequest) -> None:
    checks = [
        ("stream", bool(req.stream), "streaming is not supported; omit stream"),
        ("n", req.n not in (None, 1), "only n=1 is supported"),
        ("best_of", req.best_of not in (None, 1), "only best_of=1 is supported"),
        ("echo", bool(req.echo), "echo is not supported"),
        ("logprobs", req.logprobs is not None, "logprobs are not supported"),
        ("suffix", req.suffix is not None, "suffix (insertion) is not supported"),
        ("stop", req.stop not in (None, [], ""), "stop sequences are not supported"),
        (
            "temperature",
            req.temperature not in (None, 0),
            "decoding is greedy: temperature must be 0 or omitted",
        ),
        ("top_p", req.top_p not in (None, 1), "decoding is greedy: top_p must be 1 or omitted"),
        ("presence_penalty", req.presence_penalty not in (None, 0), "penalties are not supported"),
        (
            "frequency_penalty",
            req.frequency_penalty not in (None, 0),
            "penalties are not supported",
        ),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
    ]
    for param, bad, message in checks:
        if bad:
            raise Unsupported(message, param=param)


def _prompt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    raise InvalidRequest(
        "prompt must be a string (or a list of exactly one string)", param="prompt"
    )


async def create_completion(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, CompletionRequest)
    _refuse_unsupported(req)
    prompt = _prompt(req.prompt)
    limit = state.config.module.max_generate_tokens
    default = state.config.default_completion_tokens
    assert default is not None  # resolved when the config was loaded
    max_tokens = default if req.max_tokens is None else req.max_tokens
    if not 1 <= max_tokens <= limit:
        raise InvalidRequest(
            f"max_tokens must be between 1 and {limit} (short generation)", param="max_tokens"
        )
    model = state.resolve(req.model, DEFAULT_GENERATE)
    assert state.module is not None and state.scheduler is not None
    module = state.module
    try:
        result = await state.scheduler.unbatched(
            "completion", lambda: module.generate(prompt, max_tokens, req.grammar, model)
        )
    except WorkerError as exc:
        if req.grammar is not None and exc.message.startswith("grammar"):
            exc.details["param"] = "grammar"  # point the client at the field to fix
        raise
    body = CompletionResponse(
        id=f"cmpl-{secrets.token_hex(12)}",
        object="text_completion",
        created=int(time.time()),
        model=result.model,
        choices=[
            CompletionChoice(
                text=result.text, index=0, finish_reason=result.finish_reason, logprobs=None
            )
        ],
        usage=CompletionUsage(
            prompt_tokens=result.n_prompt,
            completion_tokens=result.n_gen,
            total_tokens=result.n_prompt + result.n_gen,
        ),
    )
    return Response(msgspec.json.encode(body), media_type="application/json")
