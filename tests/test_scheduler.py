"""The batching scheduler: coalescing, per-request splitting, validation, backpressure,
deadlines, close and the tokenization of requests arriving together, over the REAL
fault-injection worker (tests/faulty_support.py: a real worker process behind a real Lane,
MiniLM's real tokenizer, no model built), whose rows say which input each one is. Two tests
run over a REAL Module with a real llama.cpp worker: real vectors split back per request, and
a real SIGKILL mid-batch with quarantine and recovery."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time

import numpy as np
import pytest

from common.errors import InvalidRequest, ModelNotFound
from host.admission import Budgets
from host.config import HostConfig
from host.errors import DeadlineExceeded, EngineCrashed, LaneStopped, Overloaded, WorkerError
from host.module import Module, ModuleConfig
from host.tokenization import Tokenizer
from ingest.model_packages import minilm_dir
from service.scheduler import BatchStats, Scheduler, SchedulerConfig
from tests.clock_support import Clock
from tests.faulty_support import GENERATOR, MODEL, FaultyModels, freeze, frozen, thaw

LONG = "word " * 400  # truncated to 256 tokens
# One batch at a time (the default), said explicitly where a test queues behind a busy lane.
ONE_AT_A_TIME = SchedulerConfig(batches_in_flight=1)


@contextlib.asynccontextmanager
async def running(store_root: str, sched: SchedulerConfig | None = None, **host):
    """A REAL Module serving MiniLM on llama.cpp, and a scheduler over it."""
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    cfg = ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime, ping_interval_s=0, **host)
    )
    batches: list[BatchStats] = []
    mod = Module(cfg)
    scheduler = Scheduler(mod, sched, batches.append)
    try:
        await mod.load(MODEL)
        yield mod, scheduler, batches
    finally:
        await scheduler.close()
        await mod.close()
        shutil.rmtree(runtime, ignore_errors=True)


@contextlib.asynccontextmanager
async def faulty(sched: SchedulerConfig | None = None, budgets=None, n_vocab=None, on_batch=None):
    """A scheduler over MiniLM's tokenizer and the faulty worker; `on_batch` is called with
    the list of batches so far after each one."""
    batches: list[BatchStats] = []

    def observe(stats: BatchStats) -> None:
        batches.append(stats)
        if on_batch is not None:
            on_batch(batches)

    async with FaultyModels(budgets=budgets, n_vocab=n_vocab) as models:
        scheduler = Scheduler(models, sched, observe)
        try:
            yield models, scheduler, batches
        finally:
            await scheduler.close()


async def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _busy(lane) -> bool:
    return lane.state().health.status == "busy"


def _rows(results) -> np.ndarray:
    """The faulty worker's rows of these results, item ids left out."""
    return np.concatenate([r.vectors[:, :3] for r in results])


@pytest.mark.model
async def test_concurrent_requests_coalesce_and_each_gets_its_own_rows(store_root):
    texts = [f"request {i}: the quick brown fox {i % 5}" for i in range(24)]
    async with running(store_root) as (mod, sched, batches):
        reference = await mod.embed(texts)
        expected = reference.vectors
        results = await asyncio.wait_for(
            asyncio.gather(
                *(sched.embed_texts([t]) for t in texts),
                sched.embed_texts(texts[:3]),  # a multi-input request among single ones
            ),
            120,
        )
    got = np.concatenate([r.vectors for r in results[:-1]])
    assert np.abs(got - expected).max() < 5e-4
    assert np.abs(results[-1].vectors - expected[:3]).max() < 5e-4
    assert len(batches) < len(results), [b.requests for b in batches]
    assert sum(b.items for b in batches) == len(texts) + 3
    assert max(b.requests for b in batches) > 1
    assert sum(r.total_tokens for r in results[:-1]) == reference.usage.total_tokens


async def test_a_second_batch_waits_at_the_lane_and_a_third_in_the_queue():
    # Two in flight: requests arriving while a batch computes form the next batch, sent at
    # once to wait at the lane; only when both slots are taken do they queue.
    two = SchedulerConfig(batches_in_flight=2)
    async with faulty(two) as (models, sched, batches):
        with frozen(models):  # the first batch computes until the block ends
            first = asyncio.create_task(sched.embed_texts([LONG] * 8))
            await _until(lambda: _busy(models.lane))
            second = [asyncio.create_task(sched.embed_texts([f"second {i}"])) for i in range(3)]
            await _until(
                lambda: sched.running_batches()[MODEL] == 2 and sched.queue_depth()[MODEL] == 0
            )
            third = asyncio.create_task(sched.embed_texts(["third"]))
            await _until(lambda: sched.queue_depth()[MODEL] == 1)
            assert sched.running_batches()[MODEL] == 2 and not first.done()
        results = await asyncio.wait_for(asyncio.gather(first, *second, third), 60)
    assert [b.requests for b in batches] == [1, 3, 1]
    texts = [LONG] * 8 + [f"second {i}" for i in range(3)] + ["third"]
    np.testing.assert_array_equal(_rows(results), models.rows(texts))
    assert [r.vectors[:, 3].tolist() for r in results[1:4]] == [[0], [1], [2]]  # one batch


async def test_a_batch_takes_whole_requests_up_to_its_item_and_token_bounds():
    cfg = SchedulerConfig(max_batch_items=4, max_batch_tokens=512, batches_in_flight=1)
    async with faulty(cfg) as (models, sched, batches):
        with frozen(models):
            blocker = asyncio.create_task(sched.embed_texts(["x"]))  # 3 tokens
            await _until(lambda: _busy(models.lane))
            pairs = [asyncio.create_task(sched.embed_texts([f"s {i}", f"t {i}"])) for i in range(3)]
            longs = [asyncio.create_task(sched.embed_texts([LONG])) for _ in range(3)]  # 256 each
            await _until(lambda: sched.queue_depth()[MODEL] == 9)
        await asyncio.wait_for(asyncio.gather(blocker, *pairs, *longs), 60)
    # Two pairs fill 4 items; a pair and one long input (the next would pass 512 tokens);
    # two long inputs are exactly 512.
    assert [(b.requests, b.items, b.tokens) for b in batches] == [
        (1, 1, 3),
        (2, 4, 16),
        (2, 3, 264),
        (2, 2, 512),
    ]


async def test_token_arrays_are_validated_then_embedded_as_given():
    async with faulty() as (models, sched, _):
        tok = await models.tokenizer(MODEL)
        ids = tok.encode(["a sentence about cats"], truncate=True).ids[0]
        by_ids = await sched.embed_ids([ids.tolist()])
        by_text = await sched.embed_texts(["a sentence about cats"])
        np.testing.assert_array_equal(by_ids.vectors, by_text.vectors)
        assert by_ids.vectors[0, :3].tolist() == [ids.sum(), len(ids), ids[0]]
        assert by_ids.total_tokens == len(ids) == by_text.total_tokens
        for bad, match in [
            ([], "must not be empty"),
            ([[]], "1..512"),
            ([[101] * 513], "1..512"),
            ([[101, tok.vocab_size, 102]], "vocabulary"),
            ([[-5]], "vocabulary"),
            ([[101, 10**25]], "vocabulary"),  # JSON integers are unbounded: no OverflowError
            ([[-(10**30)]], "vocabulary"),
        ]:
            with pytest.raises(InvalidRequest, match=match):
                await sched.embed_ids(bad)
        with pytest.raises(InvalidRequest, match="not an embedding model"):
            await sched.embed_texts(["x"], model=GENERATOR)
        with pytest.raises(ModelNotFound):
            await sched.embed_texts(["x"], model="no-such-model")


async def test_bounded_queue_and_token_budget_refuse_at_once():
    cfg = SchedulerConfig(max_queue_items=8, max_batch_items=8, max_pending=1, batches_in_flight=1)
    async with faulty(cfg, Budgets(max_inputs=8)) as (models, sched, _):
        with frozen(models):
            running_batch = asyncio.create_task(sched.embed_texts([LONG] * 8))
            await _until(lambda: _busy(models.lane) and sched.queue_depth()[MODEL] == 0)
            queued = asyncio.create_task(sched.embed_texts([LONG] * 8))
            await _until(lambda: sched.queue_depth()[MODEL] == 8)
            with pytest.raises(Overloaded) as info:
                await asyncio.wait_for(sched.embed_texts(["one more"]), 10)
            # At once: refused while the batch it would have waited behind is still running.
            assert not running_batch.done() and not queued.done()
            assert info.value.retry_after_s >= 1
            assert sched.rejected == 1
            with sched.slot("rerank"), pytest.raises(Overloaded):  # unbatched kinds too
                with sched.slot("rerank"):
                    pass
        await asyncio.wait_for(asyncio.gather(running_batch, queued), 60)
        assert models.admission.inflight_tokens == 0

        models.admission.budgets.max_inflight_tokens = 300
        with frozen(models):
            first = asyncio.create_task(sched.embed_texts([LONG]))  # 256 tokens in flight
            await _until(lambda: models.admission.inflight_tokens == 256)
            with pytest.raises(Overloaded):  # 64 tokens; 44 are left
                await asyncio.wait_for(sched.embed_texts(["word " * 30] * 2), 10)
        await asyncio.wait_for(first, 60)


async def test_deadline_and_close_answer_every_waiter():
    # The blocker's deadline must outlast its own tokenizing and dispatch on a loaded machine
    # (at 0.2 s it could expire in the queue, and the lane never became busy), and pass while
    # the worker is frozen; the request behind it has a short one.
    cfg = SchedulerConfig(request_timeout_s=2.0, batches_in_flight=1)
    async with faulty(cfg) as (models, sched, batches):
        with frozen(models):
            blocker = asyncio.create_task(sched.embed_texts([LONG] * 16))
            await _until(lambda: _busy(models.lane))
            sched.config.request_timeout_s = 0.2
            with pytest.raises(DeadlineExceeded):  # queued, then timed out
                await asyncio.wait_for(sched.embed_texts(["waits behind the blocker"]), 10)
            with pytest.raises(DeadlineExceeded):
                await asyncio.wait_for(blocker, 10)  # its own deadline passed meanwhile
        sched.config.request_timeout_s = 300
        await asyncio.wait_for(sched.embed_texts(["after"]), 60)
        # The blocker's batch, then `after` alone: the timed-out request was never computed.
        assert [b.items for b in batches] == [16, 1]

        with frozen(models):
            blocker = asyncio.create_task(sched.embed_texts([LONG] * 16))
            await _until(lambda: _busy(models.lane))
            waiter = asyncio.create_task(sched.embed_texts(["queued at shutdown"]))
            await _until(lambda: sched.queue_depth().get(MODEL) == 1)
            await sched.close()
            with pytest.raises(LaneStopped):
                await asyncio.wait_for(waiter, 10)
            with pytest.raises(LaneStopped):
                await asyncio.wait_for(blocker, 10)
            with pytest.raises(LaneStopped):
                await sched.embed_texts(["after close"])


async def test_a_request_that_ends_while_queued_leaves_the_queue_at_once():
    # A deadline or a cancelled caller: its inputs stop counting against the queue bound then,
    # not when the batcher gets to it, so it cannot turn a live request into a 429.
    cfg = SchedulerConfig(max_queue_items=48, max_batch_items=48, batches_in_flight=1)
    async with faulty(cfg, Budgets(max_inputs=48)) as (models, sched, batches):
        with frozen(models):
            blocker = asyncio.create_task(sched.embed_texts([LONG] * 48))
            await _until(lambda: _busy(models.lane) and sched.queue_depth()[MODEL] == 0)
            cancelled = asyncio.create_task(sched.embed_texts([f"gone {i}" for i in range(16)]))
            await _until(lambda: sched.queue_depth()[MODEL] == 16)
            cancelled.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cancelled
            assert sched.queue_depth()[MODEL] == 0

            sched.config.request_timeout_s = 0.2
            with pytest.raises(DeadlineExceeded):
                await asyncio.wait_for(sched.embed_texts([f"late {i}" for i in range(16)]), 10)
            assert sched.queue_depth()[MODEL] == 0 and not blocker.done()
            sched.config.request_timeout_s = 300
            live = asyncio.create_task(sched.embed_texts([f"live {i}" for i in range(16)]))
            await _until(lambda: sched.queue_depth()[MODEL] == 16)
        live_result = await asyncio.wait_for(live, 60)
        await asyncio.wait_for(blocker, 60)
    np.testing.assert_array_equal(
        _rows([live_result]), models.rows([f"live {i}" for i in range(16)])
    )
    assert [b.items for b in batches] == [48, 16]  # the blocker and `live`; the dead never ran


async def test_rerank_and_completion_waits_are_bounded_by_the_request_timeout():
    sched = Scheduler(None, SchedulerConfig(request_timeout_s=0.05, max_pending=1))  # type: ignore[arg-type]
    never = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await sched.unbatched("rerank", never.wait)
    assert await sched.unbatched("rerank", lambda: asyncio.sleep(0, "answered")) == "answered"
    with sched.slot("rerank"):  # the one slot (max_pending=1) came back both times
        pass


@pytest.mark.model
async def test_sigkill_mid_batch_fails_the_whole_batch_typed_and_the_lane_recovers(store_root):
    async with running(store_root, ONE_AT_A_TIME, strike_limit=1, quarantine_s=2.0) as (
        mod,
        sched,
        _,
    ):
        first = asyncio.create_task(sched.embed_texts([LONG] * 4))
        await _until(lambda: _busy(mod.supervisor(MODEL, "llama")))
        rest = [asyncio.create_task(sched.embed_texts([f"text {i}"])) for i in range(8)]
        await _until(lambda: sched.queue_depth()[MODEL] == 8)
        lane = mod.supervisor(MODEL, "llama")
        lane.clock = clock = Clock()  # the quarantine expires when the test says so
        pid = lane.state().pid
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(first, *rest, return_exceptions=True), 60)
        assert time.monotonic() - start < 30
        assert isinstance(outcomes[0], EngineCrashed) and outcomes[0].code == "engine_crashed"
        # strike_limit=1: the crash quarantined the lane, so the queued batch fails at once too.
        for out in outcomes[1:]:
            assert isinstance(out, EngineCrashed) and out.quarantined, out

        with pytest.raises(EngineCrashed) as info:
            await sched.embed_texts(["refused without queueing"])
        # No time passed on the lane's clock: the whole quarantine is still ahead.
        assert info.value.quarantined and info.value.retry_after_s == 2.0
        assert sched.queue_depth()[MODEL] == 0

        clock.advance(info.value.retry_after_s)
        result = await asyncio.wait_for(sched.embed_texts(["after quarantine"]), 60)
        assert result.vectors.shape == (1, 384)
        state = mod.supervisor(MODEL, "llama").state()
        assert state.pid != pid and state.restarts >= 1 and not state.quarantined


# The worker of these tests knows the first 10000 of MiniLM's 30522 ids: an input with a
# higher id passes the host's checks (the scheduler's public path) and the worker refuses it.
WORKER_VOCAB = 10_000
REFUSED = [[101, 20_000, 102]]


async def test_input_the_worker_refuses_does_not_fail_its_batch_neighbours():
    """Host validation comes first; should some input still reach the worker and be refused,
    only its own caller gets the error — the batch is retried request by request."""
    async with faulty(ONE_AT_A_TIME, n_vocab=WORKER_VOCAB) as (models, sched, batches):
        pid = models.lane.state().pid
        with frozen(models):
            blocker = asyncio.create_task(sched.embed_texts([LONG] * 4))  # so the rest queue up
            await _until(lambda: _busy(models.lane))
            good = [asyncio.create_task(sched.embed_texts([f"good {i}"])) for i in range(3)]
            bad = asyncio.create_task(sched.embed_ids(REFUSED))
            await _until(lambda: sched.queue_depth()[MODEL] == 4)
        results = await asyncio.wait_for(
            asyncio.gather(blocker, *good, bad, return_exceptions=True), 60
        )
        state = models.lane.state()
    assert isinstance(results[-1], WorkerError) and results[-1].code == "invalid_request"
    for r in results[:-1]:
        assert not isinstance(r, BaseException), r
    texts = [LONG] * 4 + [f"good {i}" for i in range(3)]
    np.testing.assert_array_equal(_rows(results[:-1]), models.rows(texts))
    # The blocker, then each request of the refused batch alone: it never "succeeded".
    assert [b.requests for b in batches] == [1, 1, 1, 1]
    assert state.pid == pid and state.strikes == 0  # a refusal is not a fault


async def test_close_during_the_one_by_one_retry_answers_every_caller_of_the_batch():
    cfg = SchedulerConfig(batches_in_flight=1, max_batch_tokens=8192)  # all four in one batch

    def stop_after_the_first_retry(batches: list[BatchStats]) -> None:
        if len(batches) == 2:  # the blocker, then the retry's first request: the second
            freeze(models.lane.state().pid)  # one computes until the test says

    async with faulty(cfg, n_vocab=WORKER_VOCAB, on_batch=stop_after_the_first_retry) as (
        models,
        sched,
        batches,
    ):
        with frozen(models) as pid:
            blocker = asyncio.create_task(sched.embed_texts([LONG] * 4))  # so the rest queue up
            await _until(lambda: _busy(models.lane))
            good = [asyncio.create_task(sched.embed_texts([LONG] * 4)) for _ in range(3)]
            await _until(lambda: sched.queue_depth()[MODEL] == 12)  # queued in this order
            bad = asyncio.create_task(sched.embed_ids(REFUSED))  # refused by the worker: a retry
            await _until(lambda: sched.queue_depth()[MODEL] == 13)
        try:  # running again; the second batch stops it
            await asyncio.wait_for(blocker, 60)
            await _until(lambda: len(batches) == 2)  # the retry answered its first request
            await sched.close()  # ... and is cancelled while it computes the second
            outcomes = await asyncio.wait_for(  # not request_timeout_s (300 s) later
                asyncio.gather(*good, bad, return_exceptions=True), 10
            )
        finally:
            thaw(pid)
    assert not isinstance(outcomes[0], BaseException)
    for out in outcomes[1:]:
        assert isinstance(out, LaneStopped), out


async def test_requests_arriving_together_are_tokenized_in_one_call():
    texts = [f"together {i}: a short text" for i in range(6)]
    async with faulty() as (models, sched, batches):
        tok = await models.tokenizer(MODEL)
        calls: list[int] = []
        real = tok.encode

        def counting(texts, truncate, max_tokens=None):  # the real tokenizer, calls counted
            calls.append(len(texts))
            return real(texts, truncate, max_tokens)

        tok.encode = counting
        try:
            results = await asyncio.wait_for(
                asyncio.gather(
                    *(sched.embed_texts([t]) for t in texts),
                    sched.embed_texts(["fits", LONG], truncate=False),  # its own 400, nobody else's
                    return_exceptions=True,
                ),
                60,
            )
        finally:
            del tok.encode
    assert calls == [8, 2]  # all eight texts at once, then the refused request alone
    refused = results[-1]
    assert isinstance(refused, InvalidRequest) and refused.details["index"] == 1
    assert [r.n_tokens for r in results[:-1]] == [[n] for n in tok.encode(texts, True).n_tokens]
    np.testing.assert_array_equal(_rows(results[:-1]), models.rows(texts))
    assert sum(b.requests for b in batches) == 6


async def test_close_answers_a_request_still_waiting_to_be_tokenized():
    # A long adaptive wait: after a batch of 8, one lone arrival waits for more to join it.
    cfg = SchedulerConfig(max_wait_ms=60_000)
    async with faulty(cfg) as (models, sched, batches):
        await asyncio.wait_for(
            asyncio.gather(*(sched.embed_texts([f"warm {i}"]) for i in range(8))), 60
        )
        lone = asyncio.create_task(sched.embed_texts(["lone"]))
        await _until(lambda: sched.awaiting_tokenization().get(MODEL) == 1)
        await sched.close()
        outcome = await asyncio.wait_for(asyncio.gather(lone, return_exceptions=True), 10)
    assert isinstance(outcome[0], LaneStopped), outcome


async def test_a_replaced_tokenizer_never_tokenizes_the_requests_of_the_old_one():
    async with faulty() as (models, sched, batches):
        old = await models.tokenizer(MODEL)
        new = Tokenizer.from_file(  # MiniLM's again, with a limit that tells them apart
            minilm_dir() / "tokenizer.json", max_tokens=8, hard_limit=old.hard_limit
        )
        # The queue's own entry point: no public path hands one queue two tokenizers in turn.
        queue = sched._queue(MODEL, True)
        futures = [queue.tokenize(t, [LONG], True, len(LONG)) for t in (old, new, old)]
        got = await asyncio.wait_for(asyncio.gather(*futures), 10)
    assert [g.n_tokens for g in got] == [[256], [8], [256]]


async def test_the_request_deadline_covers_the_wait_to_be_tokenized():
    # After a batch of 8, a lone arrival waits (up to a minute here) for more to join it; its
    # deadline runs from the moment it arrived, not from when it is tokenized and queued.
    cfg = SchedulerConfig(max_wait_ms=60_000)
    async with faulty(cfg) as (models, sched, batches):
        await asyncio.wait_for(
            asyncio.gather(*(sched.embed_texts([f"warm {i}"]) for i in range(8))), 60
        )
        sched.config.request_timeout_s = 0.2
        outcome = await asyncio.wait_for(  # well before the adaptive wait of a minute ends
            asyncio.gather(sched.embed_texts(["lone"]), return_exceptions=True), 10
        )
    assert isinstance(outcome[0], DeadlineExceeded), outcome
    assert len(batches) == 1  # the warm-up's: the lone request was never computed


async def test_a_caller_gone_while_waiting_to_be_tokenized_does_not_count_toward_the_bound():
    cfg = SchedulerConfig(max_wait_ms=60_000, max_queue_items=3)
    async with faulty(cfg) as (models, sched, batches):
        for r in range(3):  # batches of 3: a lone arrival then waits for company
            await asyncio.wait_for(
                asyncio.gather(*(sched.embed_texts([f"warm {r} {i}"]) for i in range(3))), 60
            )
        gone = asyncio.create_task(sched.embed_texts(["gone"]))
        await _until(lambda: sched.awaiting_tokenization().get(MODEL) == 1)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert sched.awaiting_tokenization()[MODEL] == 0
        # Three live texts fit the bound of 3; the dead one must not make the third a 429.
        results = await asyncio.wait_for(
            asyncio.gather(
                *(sched.embed_texts([f"live {i}"]) for i in range(3)), return_exceptions=True
            ),
            60,
        )
    for r in results:
        assert not isinstance(r, BaseException), r
