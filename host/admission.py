"""Admission: byte and token budgets that cap every request before it reaches a worker.

Rule: a request whose own size breaks a per-request cap is the caller's error
(`InvalidRequest`, 400); a request that would push the in-flight total over the module's
budget is `Overloaded` (429) at once — the module never builds an unbounded queue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import msgspec

from common.errors import InvalidRequest
from host.errors import ConfigInvalid, Overloaded


class Budgets(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_inputs: int = 2048  # texts per embed request, documents per rerank request
    max_input_bytes: int = 1 << 20  # one text, UTF-8 (truncation handles long ones)
    max_request_bytes: int = 16 << 20  # all texts of one request together
    max_inflight_tokens: int = 1 << 18  # tokens admitted and not yet answered, module-wide

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if getattr(self, name) < 1:
                raise ConfigInvalid(f"budgets.{name} must be >= 1")


class Admission:
    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets
        self.inflight_tokens = 0
        self.rejected = 0

    def check_inputs(self, texts: list, what: str = "input") -> None:
        b = self.budgets
        if not texts:
            raise InvalidRequest(f"{what} must not be empty")
        if len(texts) > b.max_inputs:
            raise InvalidRequest(f"{len(texts)} {what}s; at most {b.max_inputs} per request")
        total = 0
        for i, text in enumerate(texts):
            if not isinstance(text, str | bytes):
                raise InvalidRequest(f"{what} {i} is {type(text).__name__}, expected a string")
            size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "replace"))
            if size > b.max_input_bytes:
                raise InvalidRequest(f"{what} {i} is {size} bytes; at most {b.max_input_bytes}")
            total += size
        if total > b.max_request_bytes:
            raise InvalidRequest(f"request is {total} bytes; at most {b.max_request_bytes}")

    @contextlib.contextmanager
    def reserve(self, tokens: int) -> Iterator[None]:
        budget = self.budgets.max_inflight_tokens
        if tokens > budget:
            raise InvalidRequest(f"request has {tokens} tokens; at most {budget} per request")
        if self.inflight_tokens + tokens > budget:
            self.rejected += 1
            raise Overloaded(
                f"{self.inflight_tokens} tokens in flight; {tokens} more would exceed {budget}",
                retry_after_s=1.0,
            )
        self.inflight_tokens += tokens
        try:
            yield
        finally:
            self.inflight_tokens -= tokens
