"""Tokenizing the texts of many requests in one tokenizer call.

Why: at small inputs the host's event loop is on the serving path's critical path. At
concurrency 32 the engine waits while the loop answers one batch's callers and takes in their
next requests, and tokenizing them one request at a time was a third of that work: every
call starts with the tokenizer's tables cold (the engine's batch has just streamed its weights
through the caches), 49 µs per 16-token text in the server against 28 µs warm. The texts that
arrive while a batch is being gathered are tokenized together when the batch is formed: one
call, tables warm after the first text, spread by the tokenizer over its own threads on the
cores the waiting engine leaves idle.

Rule: each request gets exactly what `Tokenizer.encode(its texts, its truncate, its options)`
would give it alone: the same ids (texts are encoded independently), and the same
`InvalidRequest` when a text is over the limit and the request asked not to truncate. A
request's error never reaches the requests tokenized with it. Requests with different
options (prompt, truncation direction, limit) are tokenized in one call per set of options:
almost every request uses the model's defaults, so that is still one call.

Bound: the loop tokenizes at most `max_bytes` of text in one go (what one request may have
tokenized on the loop before); a larger request is tokenized in a thread by the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple

from host.tokenization import Encoded, Tokenizer


class Options(NamedTuple):
    """What `Tokenizer.encode` takes beside the texts and `truncate`."""

    prompt: str = ""
    direction: str = "right"
    max_tokens: int | None = None

    def encode(self, tokenizer: Tokenizer, texts: Sequence[str | bytes], truncate: bool):
        if self == DEFAULT:  # the call every request made before there were options
            return tokenizer.encode(texts, truncate)
        return tokenizer.encode(
            texts, truncate, self.max_tokens, prompt=self.prompt, direction=self.direction
        )


DEFAULT = Options()


class _Arrival:
    __slots__ = ("texts", "truncate", "size", "future", "options")

    def __init__(
        self,
        texts: Sequence[str | bytes],
        truncate: bool,
        size: int,
        future: asyncio.Future,
        options: Options,
    ) -> None:
        self.texts, self.truncate, self.size, self.future = texts, truncate, size, future
        self.options = options


class Coalescer:
    """The requests of one model waiting to be tokenized; `flush()` answers all of them."""

    def __init__(self, tokenizer: Tokenizer, max_bytes: int) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.arrivals: list[_Arrival] = []
        self.items = 0  # texts waiting
        self._bytes = 0

    def __len__(self) -> int:
        return len(self.arrivals)

    def withdraw(self, future: asyncio.Future) -> None:
        """Take out a request whose wait ended before it was tokenized (deadline, hang-up):
        what is waiting counts only live requests, as the batch queue does."""
        for i, a in enumerate(self.arrivals):
            if a.future is future:
                del self.arrivals[i]
                self.items -= len(a.texts)
                self._bytes -= a.size
                return

    def add(
        self, texts: Sequence[str | bytes], truncate: bool, size: int, options: Options = DEFAULT
    ) -> asyncio.Future:
        """Queue a request's texts (`size` bytes in all); the future gets its `Encoded`."""
        if self._bytes + size > self.max_bytes:
            self.flush()  # keep one flush within the loop's bound
        future = asyncio.get_running_loop().create_future()
        self.arrivals.append(_Arrival(texts, truncate, size, future, options))
        self.items += len(texts)
        self._bytes += size
        return future

    def flush(self) -> None:
        """Tokenize every waiting request's texts in one call and answer each. Never raises."""
        arrivals = [a for a in self.arrivals if not a.future.done()]  # skip cancelled callers
        self.arrivals, self.items, self._bytes = [], 0, 0
        groups: dict[Options, list[_Arrival]] = {}
        for a in arrivals:
            groups.setdefault(a.options, []).append(a)
        for options, group in groups.items():
            self._flush_group(options, group)

    def _flush_group(self, options: Options, arrivals: list[_Arrival]) -> None:
        try:
            texts = [t for a in arrivals for t in a.texts]
            encoded = options.encode(self.tokenizer, texts, True)
        except Exception:  # some text broke the tokenizer: find whose it is
            for a in arrivals:
                self._alone(a)
            return
        start = 0
        for a in arrivals:
            end = start + len(a.texts)
            part = Encoded(
                encoded.ids[start:end], encoded.n_tokens[start:end], encoded.truncated[start:end]
            )
            start = end
            if not a.truncate and any(part.truncated):
                self._alone(a)  # its 400, with its own index and counts (rare)
            else:
                a.future.set_result(part)

    def fail(self, exc: BaseException) -> None:
        """Answer every waiting request with `exc`."""
        arrivals, self.arrivals, self.items, self._bytes = self.arrivals, [], 0, 0
        for a in arrivals:
            if not a.future.done():
                a.future.set_exception(exc)

    def _alone(self, a: _Arrival) -> None:
        """Tokenize one request by itself: its result, or its own error."""
        try:
            a.future.set_result(a.options.encode(self.tokenizer, a.texts, a.truncate))
        except Exception as exc:  # this request's own error, typed or not
            a.future.set_exception(exc)
