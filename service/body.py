"""Reading request bodies under a size limit and decoding them into typed structs.

Over the limit is a 413. A body that announces its size is refused before it is read; one
that does not (chunked) is counted as it streams. Either way the rest is read and dropped up
to `_DRAIN_LIMIT`, because a server that answers and closes while the client is still sending
makes the client see a reset instead of the 413.

A body not complete within `timeout_s` is a 408: a client that stalls mid-body must not hold
a task and a connection forever. A body already known to be over the limit stays a 413 even
if draining it runs out of time (the 413 says what the client must change); either way the
connection closes after the answer.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.types import Receive, Scope

from common.errors import InvalidRequest
from service.errors import PayloadTooLarge, RequestTimeout

T = TypeVar("T")

_DRAIN_LIMIT = 64 << 20
_OVER_LIMIT = "synapse.body_over_limit"  # scope flag: the body is known to be too large


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        if request.scope.get(_OVER_LIMIT):  # timed out while draining a refused body
            raise _too_large(limit) from None
        raise RequestTimeout(f"the request body was not complete within {timeout_s:g} s") from None


async def _read_body(request: Request, limit: int) -> bytes:
    # On the raw ASGI messages, not Starlette's `Request.stream()`/`headers`: their wrappers
    # cost a one-message body ~2 us more (micro-benchmark), on the serving loop's ~130 us per
    # small request, and almost every body here is one message.
    receive = request.receive
    declared = _content_length(request.scope)
    if declared is not None and declared > limit:
        request.scope[_OVER_LIMIT] = True
        await _drain(receive, declared)
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequest("client disconnected while sending the body")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            request.scope[_OVER_LIMIT] = True
            if more:
                await _drain(receive, size)
            raise _too_large(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _content_length(scope: Scope) -> int | None:
    """The declared body size; None when absent or not a plain number (then the body is
    counted as it streams)."""
    for name, value in scope["headers"]:
        if name == b"content-length":  # ASGI servers send header names lower-cased
            return int(value) if value.isdigit() else None
    return None


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is over the limit of {limit} bytes", limit_bytes=limit)


async def _drain(receive: Receive, seen: int) -> None:
    """Read and drop the rest of a refused body, up to `_DRAIN_LIMIT` bytes in all."""
    total = seen
    while total <= _DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        total += len(message.get("body", b""))


async def read_json(request: Request, type_: type[T], limit: int, timeout_s: float) -> T:
    """The body under its size and time limits, decoded into `type_`."""
    return decode(await read_body(request, limit, timeout_s), type_)


def decode(body: bytes, type_: type[T]) -> T:
    """JSON -> struct; every failure is a 400 naming the offending field."""
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        try:
            return msgspec.json.decode(body, type=type_)
        except UnicodeDecodeError:
            # The project's one sanitization rule (host/sanitize.py): invalid UTF-8 in text
            # becomes U+FFFD. Anywhere else in the JSON it stays a 400 on the second try.
            return msgspec.json.decode(body.decode("utf-8", "replace").encode(), type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in text else None
        raise InvalidRequest(f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's answer to nesting deeper than Python's stack allows
        raise InvalidRequest("request body is nested too deeply") from None
