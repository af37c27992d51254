"""A lane: one worker slot, its strikes and quarantine, deadlines, and cached health.

Rules, all enforced here (a worker may crash, hang or lie; callers must never see another
request's reply or wait without bound):
- One request in flight per worker: `_stream` (a lock) is held from send until the reply and
  its raw frame have DRAINED — even when the caller stopped waiting — so a later request can
  never read an abandoned request's reply.
- Inference requests also hold the device's execution permit; their silence window starts
  only once both are held. Control requests (LOAD, ADMIT_SHAPE, EVICT, UNLOAD) take no permit.
- A caller deadline raises `DeadlineExceeded` to the caller only: no kill, no strike.
- Crash, EOF, protocol fault or watchdog expiry: the worker is killed and reaped, the
  request fails with an `EngineCrashed` subclass carrying the worker's log tail, and the
  lane takes ONE strike for that worker. `strike_limit` consecutive strikes quarantine the
  lane for `quarantine_s`: requests then fail at once. After expiry the next request starts
  a fresh worker with zero strikes. Only a drained, successful inference reply clears
  strikes — LOAD, replayed LOADs, PING and setup never do. `clear_quarantine()` (unload /
  reload) and a lane restart clear them at once.
- A crashed worker (mid-request, or a process that ends while idle) is replaced at once in
  the background (never while quarantined); the fresh worker gets the lane's successful
  LOADs replayed before it serves, so a crash is invisible to callers beyond the request
  that was running.
- Health is cached: a background task PINGs an idle worker; `state()` never touches it.

The fast path: with no deadline, a live worker and a free stream (and permit), a request runs
in the caller's own task — no task, no shield, two event-loop turns per round trip. If the
caller is cancelled while its request is on the wire, a drain task takes the stream (and the
permit) over and finishes the exchange under the same watchdog, exactly as an abandoned
request of the general path does. Everything else (a deadline, a worker to start, a busy
stream, a payload large enough to send from a thread) takes the general path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import msgspec
import numpy as np

from common.errors import InvalidRequest
from host.config import HostConfig, LaneConfig
from host.connection import EOF, SILENCE, THREAD_SEND_BYTES, VIOLATION, ConnectionFault, Exchange
from host.errors import (
    DeadlineExceeded,
    EngineCrashed,
    LaneStopped,
    ProtocolViolation,
    WatchdogExpired,
    WorkerDied,
    WorkerError,
)
from host.permits import DevicePermits, Permit
from host.worker import WorkerHandle, spawn_worker
from workers.protocol import messages as m
from workers.protocol import payloads
from workers.protocol.errors import ProtocolError

log = logging.getLogger("synapse.lane")


class Health(msgspec.Struct):
    status: str  # ready | busy | starting (replacing a crash) | down | quarantined | stopped
    checked_age_s: float | None  # seconds since the last successful PING; None if never
    last_pong: dict | None = None


class LaneState(msgspec.Struct):
    lane_id: str
    pid: int | None
    strikes: int
    quarantined: bool
    retry_after_s: float | None
    restarts: int
    health: Health


@dataclass
class _Job:
    abandoned: bool = False  # the caller stopped waiting (deadline or cancellation)


class _Held:
    """The stream lock (and an execution permit) held by a request; released exactly once,
    by whichever task ends up finishing the request."""

    __slots__ = ("stream", "permit")

    def __init__(self, stream: asyncio.Lock, permit: Permit | None) -> None:
        self.stream: asyncio.Lock | None = stream
        self.permit: Permit | None = permit

    def release(self) -> None:
        if self.permit is not None:
            self.permit.release()
            self.permit = None
        if self.stream is not None:
            self.stream.release()
            self.stream = None


@dataclass
class _Cached:
    pong: m.PONG | None = None
    at: float | None = None


class Lane:
    def __init__(
        self,
        config: LaneConfig,
        host: HostConfig | None = None,
        permits: DevicePermits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        # Seconds on a monotonic scale: quarantine expiry and health age are read from it, so a
        # test can move time forward instead of sleeping through a quarantine.
        self.clock = clock
        self.host = host or HostConfig()
        self.permits = permits or DevicePermits(self.host.permits())
        self.permits.for_device(config.device)  # fail now on an unknown device
        self._stream = asyncio.Lock()
        self._worker: WorkerHandle | None = None
        self._generation = 0
        self._req_ids = 0
        self._strikes = 0
        self._quarantined_until: float | None = None
        self._loads: dict[str, m.LOAD] = {}  # model_ref -> the LOAD that produced it
        self._running = False
        self._stopping = False
        self._health = _Cached()
        self._refresher: asyncio.Task | None = None
        self._restarter: asyncio.Task | None = None
        self._jobs: set[asyncio.Task] = set()
        self.restarts = 0
        self.quarantines = 0  # times this lane entered quarantine (metrics)
        self.last_crash: EngineCrashed | None = None
        host_cfg = self.host
        # Watchdog windows by request kind (phase -> seconds), built once, not per request.
        self._ping_window = lambda phase: host_cfg.ping_window_s
        self._inference_window = lambda phase: (
            # Input preparation (phase setup) gets the long window until inference starts.
            host_cfg.setup_window_s if phase == "setup" else host_cfg.inference_window_s
        )
        self._control_window = lambda phase: host_cfg.control_window_s

    def set_device(self, device: str) -> None:
        """Which execution permit inference takes from now on (the worker's LOADED says where
        the model really runs: a llama.cpp lane offloaded to the GPU takes `gpu`)."""
        self.permits.for_device(device)  # unknown device: fail here, not mid-request
        self.config.device = device

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker now (so start-up errors surface here) and the health refresher."""
        self._running, self._stopping = True, False
        self._strikes, self._quarantined_until = 0, None
        async with self._stream:
            await self._ensure_worker()
        if self.host.ping_interval_s > 0:
            self._refresher = asyncio.create_task(self._refresh_health())

    async def stop(self) -> None:
        """SHUTDOWN, grace, SIGTERM, SIGKILL of the process group; reaped; socket removed."""
        self._stopping = True
        self._running = False
        for task in (self._refresher, self._restarter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        try:
            await asyncio.wait_for(self._stream.acquire(), self.host.shutdown_grace_s)
            locked = True
        except TimeoutError:
            locked = False  # a request is still running: it ends with the worker
        try:
            worker, self._worker = self._worker, None
            if worker is not None:
                if locked:
                    await worker.stop(self.host)
                else:
                    await worker.process.terminate(self.host.term_grace_s)
                    await worker.conn.close()
        finally:
            if locked:
                self._stream.release()
        if self._jobs:
            await asyncio.gather(*self._jobs, return_exceptions=True)

    def clear_quarantine(self) -> None:
        """Unload/reload: an operator decision that the lane deserves a fresh start."""
        self._strikes, self._quarantined_until = 0, None

    # ---- requests -------------------------------------------------------------------------

    async def request(
        self,
        message: object,
        payload: np.ndarray | memoryview | bytes | None = None,
        deadline_s: float | None = None,
    ) -> tuple[object, np.ndarray | None]:
        """Send one request; return (reply, raw payload as a numpy view or None).

        `message.req_id` is replaced by the lane's own counter. Raises `WorkerError` for the
        worker's ERR, `EngineCrashed` (and subclasses) for faults and quarantine,
        `DeadlineExceeded` when `deadline_s` passes first, `LaneStopped` after stop().
        """
        if not self._running:
            raise LaneStopped(f"lane {self.config.lane_id} is not running")
        self.raise_if_quarantined()
        raw = _as_raw(payload)
        worker = self._worker
        if (
            deadline_s is None
            and worker is not None
            and not self._stream.locked()
            and worker.usable()
            and (raw is None or len(raw) < THREAD_SEND_BYTES)
        ):
            permit = None
            if type(message) in m.INFERENCE_REQUESTS:
                permit = self.permits.for_device(self.config.device)
            if permit is None or not permit.locked():
                result = await self._request_inline(worker, message, raw, permit)
                if result is not None:
                    return result
        job = _Job()
        task = asyncio.create_task(self._run(message, raw, job))
        self._track(task)
        try:
            if deadline_s is None:  # the common case: no timer to arm
                return await asyncio.shield(task)
            async with asyncio.timeout(deadline_s):
                return await asyncio.shield(task)
        except TimeoutError:
            job.abandoned = True
            raise DeadlineExceeded(
                f"deadline of {deadline_s:g} s passed; the worker finishes and stays",
                lane_id=self.config.lane_id,
            ) from None
        except asyncio.CancelledError:
            job.abandoned = True
            raise

    async def _request_inline(
        self,
        worker: WorkerHandle,
        message: object,
        raw: memoryview | None,
        permit: Permit | None,
    ):
        """The fast path (see the module docstring): the caller's task does the exchange.
        None: the lane changed while this task waited for the stream (a woken waiter ran
        first and crashed the worker, or stop()), so the caller takes the general path."""
        await self._stream.acquire()  # free: usually returns without suspending
        holding = _Held(self._stream, None)
        held: _Held | None = holding  # None once another task owns the release
        try:
            if permit is not None:
                await permit.acquire()  # free: usually returns without suspending
                holding.permit = permit
            if (
                self._worker is not worker
                or not worker.usable()
                or not self._running
                or self._quarantined_until is not None
            ):
                return None
            req = self._stamp(message)
            try:
                ex = worker.conn.start_exchange(req, raw, self._window_for(req))
            except ProtocolError as exc:  # the caller's request broke the contract; nothing sent
                raise InvalidRequest(exc.reason) from None
            except ConnectionFault as fault:
                held = None  # released by _fault_holding, after the reaping
                raise await self._fault_holding(worker, fault, holding) from None
            # The request is on the wire: from here its reply must drain, whoever waits.
            try:
                event = await ex.wait()
            except asyncio.CancelledError:
                self._drain_later(worker, req, ex, holding)
                held = None
                raise
            except ConnectionFault as fault:
                held = None
                raise await self._fault_holding(worker, fault, holding) from None
            return self._accept(req, event)
        finally:
            if held is not None:
                held.release()

    async def _fault_holding(
        self, worker: WorkerHandle, fault: ConnectionFault, held: _Held
    ) -> EngineCrashed | LaneStopped:
        """`_fault` (kill, reap, strike) while still holding the stream, in a task of its own
        so that a cancelled caller cannot interrupt the reaping; releases `held` after."""
        task = asyncio.create_task(self._fault(worker, fault))
        task.add_done_callback(lambda _: held.release())
        self._track(task)
        return await asyncio.shield(task)

    def _drain_later(self, worker: WorkerHandle, req: object, ex: Exchange, held: _Held) -> None:
        async def drain() -> None:
            try:
                self._accept(req, await ex.wait())
            except ConnectionFault as fault:
                await self._fault(worker, fault)
            finally:
                held.release()

        self._track(asyncio.create_task(drain()))

    def _track(self, task: asyncio.Task) -> None:
        self._jobs.add(task)
        task.add_done_callback(self._job_done)

    def _job_done(self, task: asyncio.Task) -> None:
        self._jobs.discard(task)
        if not task.cancelled():
            task.exception()  # consumed: an abandoned job's error is already accounted for

    async def _run(self, message: object, raw: memoryview | None, job: _Job):
        async with self._stream:
            if job.abandoned:  # the caller gave up before we owned the stream: send nothing
                raise DeadlineExceeded("abandoned before it was sent")
            if not self._running:  # stop() came while this request waited: no new worker
                raise LaneStopped(f"lane {self.config.lane_id} stopped")
            self.raise_if_quarantined()
            worker = await self._ensure_worker()
            if type(message) in m.INFERENCE_REQUESTS:
                async with self.permits.for_device(self.config.device):
                    if job.abandoned:
                        raise DeadlineExceeded("abandoned before it was sent")
                    return await self._exchange(worker, message, raw)
            return await self._exchange(worker, message, raw)

    def _stamp(self, message: object) -> m.Request:
        self._req_ids += 1
        # Every message a caller hands the lane is a request struct (they all carry req_id).
        return msgspec.structs.replace(cast(m.Request, message), req_id=self._req_ids)

    async def _exchange(self, worker: WorkerHandle, message: object, raw: memoryview | None):
        req = self._stamp(message)
        try:
            event = await worker.conn.exchange(req, raw, self._window_for(req))
        except ProtocolError as exc:  # the caller's request broke the contract; nothing sent
            raise InvalidRequest(exc.reason) from None
        except ConnectionFault as fault:
            raise await self._fault(worker, fault) from None
        return self._accept(req, event)

    def _accept(self, req: object, event):
        """A drained terminal reply: the worker's ERR, or the reply with its payload."""
        reply = event.reply
        # Exact types: isinstance() on msgspec Structs is slow (workers/protocol/payloads.py).
        if type(reply) is m.ERR:
            raise WorkerError(reply.code, reply.msg)
        kind = type(req)
        if kind in m.INFERENCE_REQUESTS:
            self._strikes = 0  # drained, successful serving work
        elif type(req) is m.LOAD and type(reply) is m.LOADED:
            self._loads[reply.model_ref] = req
        elif type(req) is m.UNLOAD:
            self._loads.pop(req.model_ref, None)
        return reply, _reply_array(reply, event.raw)

    def _window_for(self, req: object):
        if type(req) is m.PING:
            return self._ping_window
        if type(req) in m.INFERENCE_REQUESTS:
            return self._inference_window
        return self._control_window

    # ---- workers, faults, strikes ---------------------------------------------------------

    async def _ensure_worker(self) -> WorkerHandle:
        worker = self._worker
        if worker is not None and worker.usable():
            return worker
        if worker is not None:  # died while idle: reap it, strike once
            error = await self._fault(worker, ConnectionFault(EOF, "worker died while idle"))
            log.warning("%s", error.message)
            self.raise_if_quarantined()
        self._generation += 1
        try:
            worker = await spawn_worker(self.config, self.host, self._generation)
        except EngineCrashed as exc:
            self._strike(exc)
            raise
        if self._generation > 1:
            self.restarts += 1
        self._worker = worker
        worker.process.exited.add_done_callback(lambda _: self._exited(worker))
        log.info(
            "lane %s: worker %s up (pid %d)", self.config.lane_id, worker.worker_id, worker.pid
        )
        for load in list(self._loads.values()):
            await self._exchange(worker, load, None)  # replay; a failure fails this request
        return worker

    async def _fault(
        self, worker: WorkerHandle, fault: ConnectionFault
    ) -> EngineCrashed | LaneStopped:
        """Kill and reap the worker, strike once, and build the typed error."""
        await worker.kill()
        if self._worker is worker:
            self._worker = None
        cls = {SILENCE: WatchdogExpired, VIOLATION: ProtocolViolation}.get(fault.kind, WorkerDied)
        status = worker.process.exit_status()
        if self._stopping:
            return LaneStopped(f"lane {self.config.lane_id} stopped: {fault.reason}")
        error = cls(
            f"worker {worker.worker_id} (pid {worker.pid}) failed: {fault.reason}; {status}",
            lane_id=self.config.lane_id,
            log_tail=worker.ring.tail(self.host.log_tail_bytes),
            exit_status=status,
        )
        if not worker.struck:
            worker.struck = True
            self._strike(error)
        self._schedule_restart()
        error.quarantined = self._quarantined_until is not None
        error.retry_after_s = self._retry_after()
        error.details.update(quarantined=error.quarantined, retry_after_s=error.retry_after_s)
        return error

    def _exited(self, worker: WorkerHandle) -> None:
        """A worker's process ended. Idle (nobody holds the stream), nothing else would notice
        until the next request, so replace it now; a request in flight sees the EOF itself."""
        if self._worker is worker and not self._stream.locked():
            self._schedule_restart()

    def _schedule_restart(self) -> None:
        """Replace a crashed worker now, not on the next request: health recovers by itself
        (a load balancer that stops routing to a 'down' lane would otherwise never bring it
        back) and the next caller does not pay the start-up. Never while quarantined."""
        if not self._running or self._stopping or self._quarantined_until is not None:
            return
        if self._restarter is not None and not self._restarter.done():
            return
        self._restarter = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        try:
            async with self._stream:
                if self._running and self._quarantined_until is None:
                    await self._ensure_worker()  # spawn + LOAD replay; a failure is a strike
        except Exception as exc:  # logged; the next request retries and reports
            log.warning("lane %s: restart failed: %s", self.config.lane_id, exc)

    def _strike(self, error: EngineCrashed) -> None:
        self.last_crash = error
        self._strikes += 1
        log.warning("lane %s strike %d: %s", self.config.lane_id, self._strikes, error.message)
        if self._strikes >= self.host.strike_limit:
            self._quarantined_until = self.clock() + self.host.quarantine_s
            self.quarantines += 1
            log.error("lane %s quarantined for %g s", self.config.lane_id, self.host.quarantine_s)

    def _retry_after(self) -> float | None:
        if self._quarantined_until is None:
            return None
        return max(0.0, self._quarantined_until - self.clock())

    def raise_if_quarantined(self) -> None:
        """Fail at once with `EngineCrashed(quarantined=True)` while quarantined (cheap: for
        per-request checks, also by a scheduler before it queues work)."""
        if self._quarantined_until is None:
            return
        remaining = self._quarantined_until - self.clock()
        if remaining <= 0:  # expired: the next request starts a fresh worker, zero strikes
            self._quarantined_until, self._strikes = None, 0
            return
        raise EngineCrashed(
            f"lane {self.config.lane_id} is quarantined after {self._strikes} consecutive "
            f"faults; retry in {remaining:.0f} s",
            lane_id=self.config.lane_id,
            quarantined=True,
            retry_after_s=remaining,
            log_tail=self.last_crash.log_tail if self.last_crash else "",
        )

    # ---- health ---------------------------------------------------------------------------

    async def ping(self) -> m.PONG:
        """One PING through the normal request path (used by the refresher and tools)."""
        reply, _ = await self.request(m.PING(req_id=0))
        assert isinstance(reply, m.PONG)
        self._health.pong, self._health.at = reply, self.clock()
        return reply

    async def _refresh_health(self) -> None:
        while True:
            await asyncio.sleep(self.host.ping_interval_s)
            worker = self._worker
            # PING only an idle, live worker: health must never queue behind or delay work.
            if self._stream.locked() or worker is None or not worker.usable():
                continue
            if self._quarantined_until is not None:
                continue
            with contextlib.suppress(Exception):
                await self.ping()

    def state(self) -> LaneState:
        """Cached state; never talks to the worker."""
        worker = self._worker
        retry = self._retry_after()
        quarantined = retry is not None and retry > 0
        if not self._running:
            status = "stopped"
        elif quarantined:
            status = "quarantined"
        elif (
            (worker is None or not worker.usable())
            and self._restarter is not None
            and (not self._restarter.done())
        ):
            status = "starting"
        elif worker is None or not worker.usable():
            status = "down"
        elif self._stream.locked():
            status = "busy"
        else:
            status = "ready"
        cached = self._health
        age = None if cached.at is None else self.clock() - cached.at
        pong = msgspec.structs.asdict(cached.pong) if cached.pong is not None else None
        return LaneState(
            lane_id=self.config.lane_id,
            pid=worker.pid if worker is not None and worker.usable() else None,
            strikes=self._strikes,
            quarantined=quarantined,
            retry_after_s=retry if quarantined else None,
            restarts=self.restarts,
            health=Health(status=status, checked_age_s=age, last_pong=pong),
        )

    @property
    def worker(self) -> WorkerHandle | None:
        return self._worker

    @property
    def requests_sent(self) -> int:
        """Requests this lane has tried to send to its workers, one req_id each (PINGs and
        replayed LOADs included); one that ended while it waited for the worker, such as one
        whose deadline passed, took none."""
        return self._req_ids

    @property
    def hello(self) -> m.HELLO | None:
        return self._worker.hello if self._worker is not None else None

    @property
    def last_pong(self) -> m.PONG | None:
        """The latest PONG (its `rss_mb` is the worker's resident memory); never pings."""
        return self._health.pong


def _as_raw(payload) -> memoryview | None:
    if payload is None:
        return None
    if isinstance(payload, np.ndarray):
        return (
            payloads.ids_to_wire(payload)
            if payload.dtype.kind in "iu"
            else (payloads.floats_to_wire(payload))
        )
    return memoryview(payload).cast("B")


def _reply_array(reply: object, raw: bytes | bytearray | None) -> np.ndarray | None:
    if raw is None:
        return None
    if type(reply) is m.VECTORS:
        return payloads.floats_view(raw, (reply.n, reply.dims))
    if type(reply) is m.LABEL_SCORES:
        return payloads.floats_view(raw, (reply.n, reply.n_labels))
    if type(reply) is m.ENCODED:  # mixed i32 / f32 sections: payloads.encoded_sections reads it
        return np.frombuffer(raw, np.uint8)
    return payloads.floats_view(raw, (-1,))
