"""Tokenizing many requests in one call (service/coalesce.py), with the real MiniLM tokenizer:
each request gets exactly what tokenizing it alone gives, errors included."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidRequest
from host.tokenization import Tokenizer
from ingest.model_packages import minilm_dir
from service.coalesce import Coalescer

LONG = "token " * 300  # over MiniLM's 256-token limit


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(minilm_dir())


class _Counting:
    """The real tokenizer, with its calls counted."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.calls = tok, []

    def encode(self, texts, truncate):
        self.calls.append(len(texts))
        return self.tok.encode(texts, truncate)


def _alone(tok: Tokenizer, texts: list[str], truncate: bool):
    try:
        return tok.encode(texts, truncate)
    except InvalidRequest as exc:
        return exc


def _same(got, want) -> bool:
    if isinstance(want, InvalidRequest):
        return isinstance(got, InvalidRequest) and (got.message, got.details) == (
            want.message,
            want.details,
        )
    return (
        not isinstance(got, BaseException)
        and got.n_tokens == want.n_tokens
        and got.truncated == want.truncated
        and len(got.ids) == len(want.ids)
        and all(
            np.array_equal(a, b) and a.dtype == b.dtype
            for a, b in zip(got.ids, want.ids, strict=True)
        )
    )


async def _flushed(coalescer: Coalescer, requests: list[tuple[list[str], bool]]) -> list:
    futures = [coalescer.add(texts, trunc, sum(map(len, texts))) for texts, trunc in requests]
    coalescer.flush()
    return [f.exception() or f.result() for f in futures]


_text = st.one_of(st.text(max_size=40), st.just(LONG), st.just(LONG + " and more"))


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.lists(_text, min_size=1, max_size=4), st.booleans()), min_size=1, max_size=6
    )
)
def test_each_request_gets_what_tokenizing_it_alone_gives(tok, requests):
    counting = _Counting(tok)
    got = asyncio.run(_flushed(Coalescer(counting, 1 << 20), requests))
    assert counting.calls[0] == sum(len(texts) for texts, _ in requests)  # one call for all
    for (texts, truncate), result in zip(requests, got, strict=True):
        assert _same(result, _alone(tok, texts, truncate)), (texts, truncate, result)


def test_a_refused_request_does_not_fail_the_requests_tokenized_with_it(tok):
    got = asyncio.run(
        _flushed(
            Coalescer(tok, 1 << 20),
            [
                (["fine"], False),
                (["short", LONG], False),
                ([LONG], True),
                (["also fine"], False),
            ],
        )
    )
    assert isinstance(got[1], InvalidRequest) and got[1].details["index"] == 1
    assert "over the limit of 256" in got[1].message
    assert got[2].truncated == [True] and got[2].n_tokens == [256]
    assert [g.n_tokens for g in (got[0], got[3])] == [[3], [4]]


def test_the_loop_tokenizes_at_most_max_bytes_at_once(tok):
    async def go():
        counting = _Counting(tok)
        coalescer = Coalescer(counting, max_bytes=10)
        first = coalescer.add(["abcdef"], True, 6)
        second = coalescer.add(["ghijkl"], True, 6)  # 12 > 10: the first is tokenized now
        assert first.done() and not second.done() and counting.calls == [1]
        coalescer.flush()
        assert second.done() and counting.calls == [1, 1]

    asyncio.run(go())


def test_withdrawn_and_cancelled_callers_are_not_tokenized_and_fail_answers_the_rest(tok):
    async def go():
        counting = _Counting(tok)
        coalescer = Coalescer(counting, 1 << 20)
        gone, kept = coalescer.add(["gone"], True, 4), coalescer.add(["kept"], True, 4)
        left = coalescer.add(["left"], True, 4)
        gone.cancel()
        left.cancel()
        coalescer.withdraw(left)  # what its caller does when its wait ends
        assert (len(coalescer), coalescer.items) == (2, 2)
        coalescer.flush()  # `gone`, cancelled but not withdrawn, is skipped all the same
        assert counting.calls == [1] and kept.result().n_tokens == [3]
        waiting = [coalescer.add([f"w{i}"], True, 2) for i in range(3)]
        assert (len(coalescer), coalescer.items) == (3, 3)
        stop = RuntimeError("stopping")
        coalescer.fail(stop)
        assert all(f.exception() is stop for f in waiting) and len(coalescer) == 0

    asyncio.run(go())


def test_a_text_that_breaks_the_tokenizer_fails_only_its_own_request(tok):
    async def go():
        counting = _Counting(tok)
        coalescer = Coalescer(counting, 1 << 20)
        fine, broken = coalescer.add(["fine"], True, 4), coalescer.add([12345], True, 5)
        coalescer.flush()  # does not raise
        assert counting.calls == [2, 1, 1]  # together, then each alone to find whose it is
        assert fine.result().n_tokens == [3]
        assert broken.exception() is not None

    asyncio.run(go())
