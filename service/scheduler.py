"""Dynamic batching of embedding requests from concurrent callers.

Each request is tokenized module-side, admitted against the module's token budget, and queued
per (model, normalize). Requests that arrive while a batch is being gathered are tokenized
together when it is formed (service/coalesce.py); at other times, once per loop turn. One
batcher task per queue takes every request waiting when a batch slot is free (packing whole
requests up to `max_batch_items` / `max_batch_tokens`), calls `Module.embed_token_ids` once,
and splits the vectors back per request. Requests that arrive while the lane computes form
the next batch, so load itself grows the batches. With `batches_in_flight` = 2 (default 1)
that next batch is sent at once and waits at the lane.

Waiting is adaptive: when a batch has just been answered, its callers send their next
requests a few milliseconds apart. If recent batches held more requests than are queued now,
the batcher waits up to `max_wait_ms` for them (else one early arrival would run alone and the
rest would wait a whole batch behind it). A lone caller never waits: its batches hold one.

Two lanes: for a model the module routes between lanes (`serving_lanes` names more than
one), a queue keeps `batches_in_flight` batches per lane in flight, and each batch goes to
the lane `pick_lane` names as it is sent (the one expected to finish it first); every caller
learns which lane computed its rows (`Embedded.lane`).

Backpressure: the queue is bounded in items (`max_queue_items`); over it, or over the module's
in-flight token budget, a request fails at once with `Overloaded` (429 + Retry-After). A
quarantined lane fails at once with its `EngineCrashed`. Any failure of a batch (a worker
crash mid-batch included) fails every request in it with that typed error — never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec
import numpy as np

from common.errors import InvalidRequest, SynapseError
from host.admission import Admission
from host.errors import ConfigInvalid, DeadlineExceeded, LaneStopped, Overloaded, WorkerError
from host.lane import Lane
from host.tokenization import Encoded, Tokenizer
from ingest.store import DEFAULT_EMBED
from service.coalesce import DEFAULT, Coalescer, Options

log = logging.getLogger("synapse.scheduler")

T = TypeVar("T")

# Inputs larger than this are tokenized in a thread so one big request cannot stall the loop;
# the loop tokenizes at most this much text at once when it tokenizes requests together.
_THREAD_TOKENIZE_BYTES = 64 * 1024


class ModelKind(Protocol):
    @property
    def kind(self) -> str:
        """ "embed", "rerank" or "generate"."""
        ...


class EmbeddingModels(Protocol):
    """What the scheduler reads and does of the models it batches for (host.module.Module is
    one): their tokenizers, prompts and admission budgets, embedding of token ids, and the
    supervisor whose quarantine refuses work before it is queued."""

    admission: Admission

    def record(self, name: str) -> ModelKind:
        """What model `name` is; its `kind` says whether it embeds."""
        ...

    def prompt(
        self, model: str | None = None, prompt_name: str | None = None, prompt: str | None = None
    ) -> str:
        """The text prepended to every input for these arguments."""
        ...

    async def tokenizer(self, model: str | None = None) -> Tokenizer:
        """The model's tokenizer, loading the model if needed (`ModelNotFound` if unknown)."""
        ...

    async def embed_token_ids(
        self,
        ids: list[np.ndarray],
        model: str | None = None,
        normalize: bool = True,
        lane: str | None = None,
    ) -> np.ndarray:
        """One row per input of `ids`, already admitted (a coalesced batch), on `lane`."""
        ...

    def pick_lane(self, name: str, items: int, *, longest: int = 0) -> str | None:
        """The lane a batch of `items` inputs, the longest `longest` tokens, should go to now
        (None: the module decides)."""
        ...

    def serving_lanes(self, name: str) -> tuple[str, ...]:
        """The lanes that serve `name` (more than one: batches are routed between them)."""
        ...

    def supervisor(self, name: str) -> Lane | None:
        """The lane serving `name` (None when not loaded)."""
        ...


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Ids per coalesced batch (a larger request still goes alone). About one llama.cpp decode
    # per encode stream: a bigger batch runs as successive decodes anyway, so it adds no
    # throughput, but every request in it would wait for the whole batch. (TEI's name, which
    # /info reports; the module's per-worker request size is `max_worker_batch_tokens`.)
    max_batch_tokens: int = 512
    max_batch_items: int = 256
    max_wait_ms: float = 4.0  # upper bound of the adaptive wait for a non-full batch
    # Batches per model sent before the previous one is answered: the next one waits at the
    # lane, so the worker starts it the moment the first is done instead of idling while the
    # first one's callers get their answers and send again. Not the default: on 2 cores,
    # 16-token inputs at concurrency 32, 2 x 256-token batches measured 0.97-0.98x of
    # 1 x 512 on AVX2 kernels and 0.93x on AVX-512 ones (bench.serve --scheduler, interleaved
    # runs): the host's work then competes with the engine for the cores, and smaller decodes
    # cost the worker more per input (batches of 16 ran 8-12% slower per input than 32
    # in-process on AVX-512, where streaming the weights weighs more).
    batches_in_flight: int = 1
    max_queue_items: int = 4096  # queued inputs per model; over it -> 429
    request_timeout_s: float = 300.0  # a queued or running request's total wait -> 504
    max_pending: int = 64  # rerank / completion requests in flight, each; over it -> 429

    def __post_init__(self) -> None:
        for name in (
            "max_batch_tokens",
            "max_batch_items",
            "max_queue_items",
            "max_pending",
            "batches_in_flight",
        ):
            if getattr(self, name) < 1:
                raise ConfigInvalid(f"scheduler.{name} must be >= 1")
        # Written so that NaN fails too (every comparison with NaN is false).
        if not (0 <= self.max_wait_ms < math.inf and 0 < self.request_timeout_s < math.inf):
            raise ConfigInvalid(
                "scheduler: max_wait_ms must be finite and >= 0, request_timeout_s finite and > 0"
            )


@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray  # float32 (n, dims), one row per input
    n_tokens: list[int]
    truncated: list[bool]
    model: str
    prompt: str = ""  # the text prepended to every input
    lane: str = ""  # the lane that computed the vectors

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


@dataclass(frozen=True)
class BatchStats:
    model: str
    items: int
    tokens: int
    requests: int
    seconds: float


class _Pending:
    """One request's inputs, waiting in a queue; its future gets the vectors."""

    __slots__ = ("ids", "tokens", "future", "queued")

    def __init__(self, ids: list[np.ndarray], tokens: int, future: asyncio.Future) -> None:
        self.ids, self.tokens, self.future = ids, tokens, future
        self.queued = False  # in its queue's deque (and counted in its totals)


class _Queue:
    """One model's queue and its batcher task."""

    def __init__(self, sched: Scheduler, model: str, normalize: bool) -> None:
        self.sched, self.model, self.normalize = sched, model, normalize
        self.items: deque[_Pending] = deque()
        self.queued_items = 0
        self.queued_tokens = 0
        self.expected = 1.0  # requests per recent batch (moving average)
        self.wake = asyncio.Event()
        # Per lane: a routed model keeps each of its lanes as busy as one lane is kept.
        lanes = max(1, len(sched.module.serving_lanes(model)))
        self.in_flight = asyncio.Semaphore(sched.config.batches_in_flight * lanes)
        self.running: dict[asyncio.Task, list[_Pending]] = {}  # batch tasks and their batches
        self.coalescer: Coalescer | None = None  # texts waiting to be tokenized
        # Between taking a batch slot and forming the batch, arrivals wait for the batch to be
        # formed and are tokenized with it; at other times, once per loop turn.
        self.gathering = False
        self._flush_soon: asyncio.Handle | None = None
        self.task = asyncio.create_task(self._run(), name=f"batcher:{model}")

    def tokenize(
        self,
        tokenizer: Tokenizer,
        texts: Sequence[str | bytes],
        truncate: bool,
        size: int,
        options: Options = DEFAULT,
    ) -> asyncio.Future:
        """The future `Encoded` of a request's texts, tokenized with the other arrivals."""
        self._check_room(len(texts))
        if self.coalescer is None or self.coalescer.tokenizer is not tokenizer:
            if self.coalescer is not None:  # the model was replaced: each keeps its tokenizer
                self.coalescer.flush()
            self.coalescer = Coalescer(tokenizer, _THREAD_TOKENIZE_BYTES)
        future = self.coalescer.add(texts, truncate, size, options)
        if self.gathering:
            self.wake.set()
        elif self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self._flush)
        return future

    def untokenized(self, future: asyncio.Future) -> None:
        """A caller's wait for `tokenize` ended without its result: if its texts still wait
        (deadline, hang-up), they leave, so a dead request never counts toward the bound or
        the batch (as `withdraw` does for the queue)."""
        if self.coalescer is not None:
            self.coalescer.withdraw(future)

    def _flush(self) -> None:
        self._flush_soon = None
        if self.coalescer is not None:
            self.coalescer.flush()

    def _check_room(self, n: int) -> None:
        """Over the queue bound, refuse at once (texts still being tokenized count too)."""
        cfg = self.sched.config
        waiting = self.queued_items + (self.coalescer.items if self.coalescer else 0)
        if waiting + n > cfg.max_queue_items:
            self.sched.rejected += 1
            raise Overloaded(
                f"{waiting} inputs queued for {self.model!r}; {n} more would exceed "
                f"{cfg.max_queue_items}",
                retry_after_s=self.sched.retry_after(self.queued_tokens),
            )

    def put(self, pending: _Pending) -> None:
        n = len(pending.ids)
        self._check_room(n)
        self.items.append(pending)
        pending.queued = True
        self.queued_items += n
        self.queued_tokens += pending.tokens
        self.wake.set()

    def withdraw(self, pending: _Pending) -> None:
        """Take out a request that ended before the batcher took it (deadline, cancelled
        caller): what is queued counts only live requests, so a dead one never causes a 429."""
        if pending.queued:
            self.items.remove(pending)
            self._uncount(pending)

    def _take(self) -> list[_Pending]:
        cfg = self.sched.config
        batch: list[_Pending] = []
        items = tokens = 0
        while self.items:
            head = self.items[0]
            if head.future.done():  # its caller timed out or went away: skip, don't compute
                self._pop()
                continue
            n = len(head.ids)
            over = items + n > cfg.max_batch_items or tokens + head.tokens > cfg.max_batch_tokens
            if batch and over:
                break
            batch.append(self._pop())
            items += n
            tokens += head.tokens
        return batch

    def _pop(self) -> _Pending:
        p = self.items.popleft()
        self._uncount(p)
        return p

    def _uncount(self, p: _Pending) -> None:
        p.queued = False
        self.queued_items -= len(p.ids)
        self.queued_tokens -= p.tokens

    def _full(self) -> bool:
        cfg = self.sched.config
        return (
            self.queued_items >= cfg.max_batch_items or self.queued_tokens >= cfg.max_batch_tokens
        )

    def _expect_more(self) -> bool:
        arriving = len(self.coalescer) if self.coalescer else 0
        return not self._full() and len(self.items) + arriving < self.expected - 0.5

    async def _run(self) -> None:
        wait_s = self.sched.config.max_wait_ms / 1000
        while True:
            # A batch slot first: until one is free, arrivals stay queued (and grow the batch).
            await self.in_flight.acquire()
            try:
                batch = await self._next_batch(wait_s)
            except BaseException:
                self.in_flight.release()
                raise
            if not batch:
                self.in_flight.release()
                continue
            self.expected = 0.7 * self.expected + 0.3 * len(batch)
            task = asyncio.create_task(self._execute_then_release(batch))
            self.running[task] = batch
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)

    async def _next_batch(self, wait_s: float) -> list[_Pending]:
        self.gathering = True
        try:
            await self.wake.wait()
            # One loop turn lets requests parsed in the same tick join this batch.
            await asyncio.sleep(0)
            if wait_s > 0 and self._expect_more():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        while self._expect_more():
                            self.wake.clear()
                            await self.wake.wait()
        finally:
            self.gathering = False
        if self.coalescer is not None and len(self.coalescer):
            self.coalescer.flush()
            # One loop turn: the tokenized callers are admitted and queued before the take.
            await asyncio.sleep(0)
        batch = self._take()
        if self.items:  # more than one batch waiting: run again without a new put
            self.wake.set()
        else:
            self.wake.clear()
        return batch

    async def _execute_then_release(self, batch: list[_Pending]) -> None:
        try:
            await self._execute(batch)
        finally:
            self.in_flight.release()

    async def _execute(self, batch: list[_Pending]) -> None:
        ids = [x for p in batch for x in p.ids]
        start = time.monotonic()
        module = self.sched.module
        lane = module.pick_lane(self.model, len(ids), longest=max(len(x) for x in ids))
        try:
            vectors = await module.embed_token_ids(ids, self.model, self.normalize, lane=lane)
        except WorkerError as exc:
            if len(batch) > 1:
                # The worker refused some input (it validates again): run each request alone
                # so one caller's input cannot fail its neighbours.
                for p in batch:
                    await self._execute([p])
                return
            _fail(batch, exc)
            return
        except SynapseError as exc:
            _fail(batch, exc)
            return
        except Exception as exc:  # a bug must still answer every caller, typed
            log.exception("batch for %s failed", self.model)
            _fail(batch, SynapseError(f"internal error: {type(exc).__name__}: {exc}"))
            return
        elapsed = time.monotonic() - start
        tokens = sum(p.tokens for p in batch)
        self.sched.observe(BatchStats(self.model, len(ids), tokens, len(batch), elapsed))
        row = 0
        for p in batch:
            n = len(p.ids)
            if not p.future.done():
                p.future.set_result((vectors[row : row + n], lane or ""))
            row += n


class _Deadline:
    """One timer for a request's whole wait (`request_timeout_s`): it fails the future the
    request awaits at the time, first its tokenization, then its place in a batch. The
    deadline fails the future itself, and a cancelled caller cancels it: either way the
    batcher then skips it (not yet taken) or drops its rows (running). One timer handle per
    request, not an asyncio.timeout scope: this runs for every request while the engine
    waits for the next batch."""

    __slots__ = ("future", "expired", "timeout_s", "timer")

    def __init__(self, timeout_s: float) -> None:
        self.future: asyncio.Future | None = None
        self.expired = False
        self.timeout_s = timeout_s
        self.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def watch(self, future: asyncio.Future) -> asyncio.Future:
        self.future = future
        if self.expired:  # it passed between two futures: fail the new one at once
            self._expire()
        return future

    def cancel(self) -> None:
        self.timer.cancel()

    def _expire(self) -> None:
        self.expired = True
        if self.future is not None and not self.future.done():
            self.future.set_exception(DeadlineExceeded(f"no result within {self.timeout_s:g} s"))


def _fail(batch: list[_Pending], exc: BaseException) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(exc)


class Scheduler:
    """Coalesces concurrent embedding requests into EMBED_BATCH-sized batches per model."""

    def __init__(
        self,
        module: EmbeddingModels,
        config: SchedulerConfig | None = None,
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> None:
        self.module = module
        self.config = config or SchedulerConfig()
        self.on_batch = on_batch
        self.rejected = 0
        self._queues: dict[tuple[str, bool], _Queue] = {}
        self._kinds: dict[str, str] = {}
        self._pending: dict[str, int] = {}
        self._tokens_per_s = 0.0  # smoothed throughput, for Retry-After estimates
        self._closed = False

    # ---- public ---------------------------------------------------------------------------

    async def embed_texts(
        self,
        texts: Sequence[str | bytes],
        model: str | None = None,
        normalize: bool = True,
        truncate: bool = True,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        direction: str = "right",
        max_tokens: int | None = None,
    ) -> Embedded:
        """`prompt_name`/`prompt` as `Module.embed` takes them (none: the model's default
        prompt); `direction` and `max_tokens` as `Tokenizer.encode` takes them."""
        name = await self._embed_model(model)
        try:
            self.module.admission.check_inputs(list(texts))
        except InvalidRequest as exc:
            exc.details.setdefault("param", "input")  # name the field for HTTP callers
            raise
        options = Options(self.module.prompt(name, prompt_name, prompt), direction, max_tokens)
        tokenizer = await self.module.tokenizer(name)
        size = sum(len(t) for t in texts)
        self._raise_if_closed()
        deadline = _Deadline(self.config.request_timeout_s)
        try:
            encoded: Encoded
            if size > _THREAD_TOKENIZE_BYTES:
                encoded = await asyncio.to_thread(options.encode, tokenizer, texts, truncate)
            else:
                queue = self._queue(name, normalize)
                tokenized = queue.tokenize(tokenizer, texts, truncate, size, options)
                try:
                    encoded = await deadline.watch(tokenized)
                except BaseException:
                    queue.untokenized(tokenized)
                    raise
            vectors, lane = await self._submit(
                name, normalize, encoded.ids, encoded.total_tokens, deadline
            )
        except InvalidRequest as exc:
            if "n_tokens" in exc.details:  # over the limit with truncate off: name the field
                exc.details.setdefault("param", "input")
            raise
        finally:
            deadline.cancel()
        return Embedded(vectors, encoded.n_tokens, encoded.truncated, name, options.prompt, lane)

    async def embed_ids(
        self,
        ids: Sequence[Sequence[int]],
        model: str | None = None,
        normalize: bool = True,
    ) -> Embedded:
        """Token arrays in the model's own vocabulary: validated here, embedded as given."""
        name = await self._embed_model(model)
        limits = self.module.admission.budgets
        if not ids:
            raise InvalidRequest("input must not be empty", param="input")
        if len(ids) > limits.max_inputs:
            raise InvalidRequest(
                f"{len(ids)} inputs; at most {limits.max_inputs} per request", param="input"
            )
        tokenizer = await self.module.tokenizer(name)
        vocab, hard = tokenizer.vocab_size, tokenizer.hard_limit
        arrays = []
        for i, seq in enumerate(ids):
            if not 1 <= len(seq) <= hard:
                raise InvalidRequest(
                    f"input {i} has {len(seq)} tokens; token arrays need 1..{hard} tokens "
                    f"for {name!r}",
                    param="input",
                )
            try:
                arr = np.asarray(seq, dtype=np.int64)
            except OverflowError:  # beyond int64 (JSON integers are unbounded): no token id
                arr = None
            if arr is None or ((arr < 0) | (arr >= vocab)).any():
                bad = next(t for t in seq if not 0 <= t < vocab)
                raise InvalidRequest(
                    f"input {i}: token id {bad} is outside {name!r}'s vocabulary (0..{vocab - 1})",
                    param="input",
                )
            arrays.append(arr.astype(np.int32))
        counts = [len(a) for a in arrays]
        vectors, lane = await self._submit(name, normalize, arrays, sum(counts))
        return Embedded(vectors, counts, [False] * len(arrays), name, lane=lane)

    @contextlib.contextmanager
    def slot(self, kind: str) -> Iterator[None]:
        """Bound the in-flight requests of an unbatched kind (rerank, completion): 429 over."""
        n = self._pending.get(kind, 0)
        if n >= self.config.max_pending:
            self.rejected += 1
            raise Overloaded(
                f"{n} {kind} requests in flight; at most {self.config.max_pending}",
                retry_after_s=1.0,
            )
        self._pending[kind] = n + 1
        try:
            yield
        finally:
            self._pending[kind] -= 1

    async def unbatched(self, kind: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call()` (a rerank or completion) in a `slot` of its kind, within
        `request_timeout_s` like a batched request: past it, `DeadlineExceeded` (504) and the
        lane drains the reply nobody waits for."""
        timeout_s = self.config.request_timeout_s
        with self.slot(kind):
            try:
                async with asyncio.timeout(timeout_s):
                    return await call()
            except TimeoutError:
                raise DeadlineExceeded(f"no result within {timeout_s:g} s") from None

    def queue_depth(self) -> dict[str, int]:
        """Queued inputs per model (not yet in a batch)."""
        depth: dict[str, int] = {}
        for (model, _), q in self._queues.items():
            depth[model] = depth.get(model, 0) + q.queued_items
        return depth

    def awaiting_tokenization(self) -> dict[str, int]:
        """Inputs per model that arrived and wait to be tokenized with the next batch (not
        yet in `queue_depth`; `max_queue_items` counts them too)."""
        waiting: dict[str, int] = {}
        for (model, _), q in self._queues.items():
            if q.coalescer is not None:
                waiting[model] = waiting.get(model, 0) + q.coalescer.items
        return waiting

    def running_batches(self) -> dict[str, int]:
        """Batches per model sent to the module and not yet answered (at most
        `batches_in_flight` each)."""
        running: dict[str, int] = {}
        for (model, _), q in self._queues.items():
            running[model] = running.get(model, 0) + len(q.running)
        return running

    def retry_after(self, queued_tokens: int) -> float:
        """Seconds until the queue has likely drained: a hint for Retry-After."""
        if self._tokens_per_s <= 0:
            return 1.0
        return min(60.0, max(1.0, queued_tokens / self._tokens_per_s))

    def observe(self, stats: BatchStats) -> None:
        if stats.seconds > 0:
            rate = stats.tokens / stats.seconds
            self._tokens_per_s = (
                rate if self._tokens_per_s == 0 else (0.8 * self._tokens_per_s + 0.2 * rate)
            )
        if self.on_batch is not None:
            self.on_batch(stats)

    async def close(self) -> None:
        """Stop the batchers; anything still queued fails with `LaneStopped`."""
        self._closed = True
        queues, self._queues = list(self._queues.values()), {}
        # Every caller of a running batch is answered here: a task cancelled before its first
        # step never runs its handlers, and one cancelled in the one-by-one retry answers
        # only the request it was computing.
        batches = [batch for q in queues for batch in q.running.values()]
        for q in queues:
            q.task.cancel()
            for task in q.running:
                task.cancel()
        for q in queues:
            for task in [q.task, *q.running]:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        stopped = LaneStopped("the server is shutting down")
        for batch in [*batches, *(list(q.items) for q in queues)]:
            _fail(batch, stopped)
        for q in queues:
            if q.coalescer is not None:
                q.coalescer.fail(stopped)

    # ---- internals ------------------------------------------------------------------------

    async def _embed_model(self, model: str | None) -> str:
        name = model or DEFAULT_EMBED
        kind = self._kinds.get(name)
        if kind is None:
            await self.module.tokenizer(name)  # loads the model; ModelNotFound if unknown
            kind = self._kinds[name] = self.module.record(name).kind
        if kind != "embed":
            raise InvalidRequest(
                f"model {name!r} is a {kind} model, not an embedding model",
                param="model",
                model=name,
            )
        return name

    async def _submit(
        self,
        model: str,
        normalize: bool,
        ids: list[np.ndarray],
        tokens: int,
        deadline: _Deadline | None = None,
    ) -> tuple[np.ndarray, str]:
        """Queue `ids` and wait for their rows and the lane that computed them, within
        `deadline` (the request's, started before it was tokenized; else one of its own)."""
        self._raise_if_closed()
        self._raise_if_quarantined(model)
        own = deadline is None
        with self.module.admission.reserve(tokens):
            pending = _Pending(ids, tokens, asyncio.get_running_loop().create_future())
            queue = self._queue(model, normalize)
            queue.put(pending)
            if deadline is None:
                deadline = _Deadline(self.config.request_timeout_s)
            try:
                return await deadline.watch(pending.future)
            finally:
                if own:
                    deadline.cancel()
                queue.withdraw(pending)

    def _queue(self, model: str, normalize: bool) -> _Queue:
        key = (model, normalize)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue(self, model, normalize)
        return queue

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise LaneStopped("the server is shutting down")

    def _raise_if_quarantined(self, model: str) -> None:
        # Fail fast: don't queue work for a lane that will refuse it for minutes. A routed
        # model's batches avoid a quarantined lane while another one serves.
        if len(self.module.serving_lanes(model)) > 1:
            return
        lane = self.module.supervisor(model)
        if lane is not None:
            lane.raise_if_quarantined()
