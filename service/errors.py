"""Every failure as an OpenAI-style error object with its typed code (`common.errors`).

Shape: `{"error": {"message", "type", "code", "param"}}` (+ typed details such as `lane_id`,
`quarantined`, `retry_after_s`). 429 and 503 carry `Retry-After` (whole seconds, rounded up)
so well-behaved clients back off instead of hammering a recovering lane.
"""

from __future__ import annotations

import logging
import math

import msgspec
from starlette.responses import Response

from common.errors import SynapseError
from host.errors import EngineCrashed, Overloaded

log = logging.getLogger("synapse.serve")

# Details that are for operators (logs), not for HTTP clients.
_PRIVATE = {"log_tail", "exit_status", "index", "n_tokens", "max_tokens", "model", "param"}


class PayloadTooLarge(SynapseError):
    code = "request_too_large"
    http_status = 413


class MethodNotAllowed(SynapseError):
    code = "method_not_allowed"
    http_status = 405


class RequestTimeout(SynapseError):
    """The client did not finish sending its body in time."""

    code = "request_timeout"
    http_status = 408


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def error_body(exc: SynapseError) -> dict:
    details = {k: v for k, v in exc.details.items() if k not in _PRIVATE and v is not None}
    param = exc.details.get("param")
    return {
        "error": {
            "message": exc.message,
            "type": _error_type(exc.http_status),
            "code": exc.code,
            "param": param if isinstance(param, str) else None,
            **details,
        }
    }


def retry_after(exc: SynapseError) -> float | None:
    if isinstance(exc, Overloaded):
        return exc.retry_after_s
    if isinstance(exc, EngineCrashed):
        # Quarantined: the lane's own figure. A single crash: the next request restarts it.
        return exc.retry_after_s if exc.quarantined and exc.retry_after_s else 1.0
    if exc.http_status == 503:
        return 1.0
    return None


def error_response(exc: SynapseError) -> Response:
    headers = {}
    after = retry_after(exc)
    if after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(after)))
    if exc.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if exc.http_status in (408, 413):  # a body not (wholly) read: the stream is done
        headers["Connection"] = "close"
    if exc.http_status >= 500:
        log.warning("%s %s: %s", exc.http_status, exc.code, exc.message)
    return Response(
        msgspec.json.encode(error_body(exc)),
        status_code=exc.http_status,
        headers=headers,
        media_type="application/json",
    )


class Unsupported(SynapseError):
    """A feature this server refuses rather than silently ignoring."""

    code = "unsupported"
    http_status = 400
