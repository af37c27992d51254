"""What every embed and rerank route shares about cutting inputs to the model's limit.

`truncate` (default true) cuts an input over the limit; false makes it a 400 that names the
input's index and token count. `truncation_direction` says which end goes: "right" (the
default) drops the end, "left" the beginning (the rule, and why a prompt survives a left cut,
is in host/tokenization.py). TEI's own clients write the direction capitalized ("Left"), so
both spellings are accepted.
"""

from __future__ import annotations

from typing import Literal

from common.errors import InvalidRequest, SynapseError

Direction = Literal["right", "left", "Right", "Left"]


def direction(value: str) -> str:
    """The tokenizer's spelling ("right" or "left") of a request's `truncation_direction`."""
    return value.lower()


def name_field(exc: SynapseError, param: str, hint: str | None = None) -> SynapseError:
    """An over-the-limit error (it carries `n_tokens`) pointed at the request's own field,
    with the route's own way to ask for a cut when that is not `truncate=true`."""
    if not isinstance(exc, InvalidRequest) or "n_tokens" not in exc.details:
        return exc
    message = exc.message
    if hint is not None:
        message = message.replace("pass truncate=true", hint)
    return InvalidRequest(message, **{**exc.details, "param": param})
