"""The supervisor against REAL faults: real worker processes, sockets, signals and aborts.

Every fault test asserts: the typed error and its fields, that the call returned within a
bound, that the faulty process is gone and reaped, the lane's strikes/quarantine state, the
log tail where relevant, and that the next request succeeds on a fresh worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from common.errors import InvalidRequest
from host import HostConfig, Lane, LaneConfig
from host.errors import (
    ConfigInvalid,
    DeadlineExceeded,
    EngineCrashed,
    LaneStopped,
    ProtocolViolation,
    WatchdogExpired,
    WorkerDied,
    WorkerError,
)
from host.permits import DevicePermits
from tests.clock_support import Clock
from workers.protocol import messages as m

WORKER = ["python", "-m", "workers.faulty"]


def config(runtime_dir: str, **kw) -> HostConfig:
    base = dict(
        runtime_dir=runtime_dir,
        hello_timeout_s=20.0,
        inference_window_s=1.0,
        setup_window_s=3.0,
        control_window_s=2.0,
        ping_window_s=2.0,
        quarantine_s=60.0,
        ping_interval_s=0,
        shutdown_grace_s=2.0,
        term_grace_s=1.0,
    )
    return HostConfig(**(base | kw))


@contextlib.asynccontextmanager
async def running_lane(runtime_dir, fault: str | None = None, clock=None, **kw):
    argv = WORKER + (["--fault", fault] if fault else [])
    lane = Lane(
        LaneConfig(lane_id="t", argv=argv),
        config(runtime_dir, **kw),
        **({"clock": clock} if clock else {}),
    )
    await lane.start()
    try:
        yield lane
    finally:
        await lane.stop()


def fails_without_waiting(coro, error: type):
    """`coro` raises `error` on its first step, before it ever suspends: it waited for no
    worker, permit or timer (a wall-clock bound says the same, and fails on a loaded machine)."""
    with pytest.raises(error) as info:
        try:
            coro.send(None)
        except StopIteration:
            pytest.fail("returned instead of raising")
        coro.close()
        pytest.fail(f"suspended instead of raising {error.__name__}")
    return info


async def until(predicate, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def embed_req(
    model_ref: str = "ok", lengths=(3, 2), first_id=0
) -> tuple[m.EMBED_BATCH, np.ndarray]:
    items = [m.EmbedItem(id=first_id + i, n_tokens=n) for i, n in enumerate(lengths)]
    ids = np.arange(1, sum(lengths) + 1, dtype=np.int32) + first_id
    return m.EMBED_BATCH(req_id=0, model_ref=model_ref, items=items), ids


async def honest(lane: Lane, first_id: int = 0) -> np.ndarray:
    req, ids = embed_req("ok", first_id=first_id)
    reply, vectors = await lane.request(req, ids)
    assert isinstance(reply, m.VECTORS)
    assert vectors[:, 3].tolist() == [first_id, first_id + 1]  # our own items, not another's
    assert vectors[0, 0] == ids[:3].sum()
    return vectors


def assert_reaped(pid: int) -> None:
    if psutil.pid_exists(pid):
        status = psutil.Process(pid).status()
        raise AssertionError(f"pid {pid} still exists ({status})")


async def timed(coro, bound: float):
    start = time.monotonic()
    try:
        async with asyncio.timeout(bound):
            return await coro, time.monotonic() - start
    except BaseException as exc:
        exc.elapsed = time.monotonic() - start  # type: ignore[attr-defined]
        raise


async def expect_fault(lane: Lane, model_ref: str, error: type, bound: float):
    if lane.worker is None:  # workers restart lazily; a PING starts one (and clears nothing)
        await lane.request(m.PING(req_id=0))
    pid = lane.worker.pid
    req, ids = embed_req(f"fault:{model_ref}")
    start = time.monotonic()
    with pytest.raises(error) as info:
        async with asyncio.timeout(bound):
            await lane.request(req, ids)
    elapsed = time.monotonic() - start
    assert elapsed < bound
    assert_reaped(pid)
    assert info.value.code == "engine_crashed"
    assert info.value.lane_id == "t"
    return info.value, elapsed, pid


async def recovers_on_fresh_worker(lane: Lane, old_pid: int) -> None:
    await honest(lane)
    assert lane.worker.pid != old_pid
    assert lane.state().strikes == 0  # drained serving work clears the strike


# ---- the happy path -------------------------------------------------------------------------


async def test_embed_roundtrip_and_ping(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        await honest(lane)
        reply, _ = await lane.request(m.PING(req_id=0))
        assert isinstance(reply, m.PONG) and reply.rss_mb > 1
        state = lane.state()
        assert state.pid == lane.worker.pid and state.strikes == 0 and not state.quarantined
        assert state.health.status == "ready"


# ---- faults: the process dies or hangs ------------------------------------------------------


async def test_hang_without_progress_is_killed_by_the_watchdog(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        err, elapsed, pid = await expect_fault(lane, "hang", WatchdogExpired, bound=8)
        assert 0.9 <= elapsed  # the 1 s inference window, not earlier
        assert "no valid progress" in err.message
        assert lane.state().strikes == 1 and not err.quarantined
        await recovers_on_fresh_worker(lane, pid)


async def test_sigstopped_worker_is_killed_by_the_watchdog(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        err, _, pid = await expect_fault(lane, "sigstop", WatchdogExpired, bound=8)
        assert err.exit_status == "killed by SIGKILL"
        await recovers_on_fresh_worker(lane, pid)


async def test_setup_phase_gets_the_long_window(short_runtime_dir):
    async with running_lane(short_runtime_dir, inference_window_s=0.5, setup_window_s=2.0) as lane:
        _, elapsed, pid = await expect_fault(lane, "hang_setup", WatchdogExpired, bound=8)
        assert elapsed >= 1.9  # the setup window applied, not the 0.5 s inference window
        await recovers_on_fresh_worker(lane, pid)


async def test_slow_worker_with_valid_progress_is_not_killed(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        pid = lane.worker.pid
        req, ids = embed_req("fault:slow:8:0.3")  # 2.4 s total, 0.3 s between progress
        (reply, vectors), elapsed = await timed(lane.request(req, ids), bound=10)
        assert elapsed > 2.0 > lane.host.inference_window_s
        assert vectors[:, 3].tolist() == [0, 1]
        assert lane.worker.pid == pid and lane.state().strikes == 0


@pytest.mark.parametrize(
    "fault, exit_status, last_words",
    [
        ("sigkill", "killed by SIGKILL", "about to SIGKILL myself"),
        ("abort", "killed by SIGABRT", "about to os.abort()"),
        ("bug", "exited with code 70", "ValueError: injected engine bug"),  # its traceback
    ],
)
async def test_worker_dies_mid_request(short_runtime_dir, fault, exit_status, last_words):
    async with running_lane(short_runtime_dir) as lane:
        err, _, pid = await expect_fault(lane, fault, WorkerDied, bound=5)
        assert err.exit_status == exit_status
        assert last_words in err.log_tail
        assert len(err.log_tail.encode()) <= 8192
        await recovers_on_fresh_worker(lane, pid)


# ---- faults: the wire is broken -------------------------------------------------------------


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("garbage", "undecodable control frame"),
        ("oversize", "exceeds max_frame"),
        ("progress_regress", "strictly increase"),
        ("phase_regress", "backwards"),
        ("progress_between", "header implies 32"),
        ("short_raw", "raw frame of 28 bytes, header implies 32"),
        ("wrong_req_id", "expected"),
    ],
)
async def test_protocol_violations_kill_and_strike(short_runtime_dir, fault, reason):
    async with running_lane(short_runtime_dir) as lane:
        err, _, pid = await expect_fault(lane, fault, ProtocolViolation, bound=5)
        assert reason in err.message
        assert lane.state().strikes == 1
        await recovers_on_fresh_worker(lane, pid)


# ---- faults at start-up ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault, error, text",
    [
        ("wrong_nonce", ProtocolViolation, "nonce"),
        ("v2", ProtocolViolation, "protocol version 2"),
        ("early_progress", ProtocolViolation, "expected HELLO, got PROGRESS"),
        ("crash_on_start", WorkerDied, "exited before connecting"),
        ("no_hello", WatchdogExpired, "no valid progress"),
        ("hello_extra_frame", ProtocolViolation, "unsolicited PONG"),  # typed, and a strike
    ],
)
async def test_startup_faults(short_runtime_dir, fault, error, text):
    lane = Lane(
        LaneConfig(lane_id="t", argv=[*WORKER, "--fault", fault]),
        config(short_runtime_dir, hello_timeout_s=3.0),
    )
    start = time.monotonic()
    with pytest.raises(error) as info:
        await lane.start()
    assert time.monotonic() - start < 10
    assert text in info.value.message
    assert lane.state().strikes == 1
    if fault == "crash_on_start":
        assert "crashing before connecting" in info.value.log_tail
    for p in psutil.Process().children(recursive=True):
        assert "workers.faulty" not in " ".join(p.cmdline()), "child not reaped"
    assert not list(Path(short_runtime_dir).rglob("*.sock"))
    await lane.stop()


async def test_exit_right_after_hello_crash_loops_into_quarantine(short_runtime_dir):
    async with running_lane(short_runtime_dir, fault="exit_after_hello") as lane:
        errors = []
        for _ in range(3):
            req, ids = embed_req()
            with pytest.raises(EngineCrashed) as info:
                async with asyncio.timeout(10):
                    await lane.request(req, ids)
            errors.append(info.value)
        assert any("exiting right after HELLO" in e.log_tail for e in errors)
        assert errors[-1].quarantined and lane.state().quarantined


# ---- deadlines ------------------------------------------------------------------------------


async def test_deadline_neither_kills_nor_strikes_and_reply_never_leaks(short_runtime_dir):
    async with running_lane(short_runtime_dir, inference_window_s=5.0) as lane:
        pid = lane.worker.pid
        late, late_ids = embed_req("fault:late:1.0", first_id=100)
        with pytest.raises(DeadlineExceeded) as info:
            await lane.request(late, late_ids, deadline_s=0.2)
        assert info.value.code == "deadline_exceeded"
        # The next caller waits for the abandoned reply to drain, then gets its OWN reply.
        _, elapsed = await timed(honest(lane, first_id=7), bound=5)
        assert elapsed > 0.5
        assert lane.worker.pid == pid and lane.state().strikes == 0


async def test_deadline_while_queued_sends_nothing(short_runtime_dir):
    async with running_lane(short_runtime_dir, inference_window_s=5.0) as lane:
        slow, slow_ids = embed_req("fault:slow:3:0.2")
        first = asyncio.create_task(lane.request(slow, slow_ids))
        await until(lambda: lane.state().health.status == "busy")  # the first holds the worker
        sent_before = lane.requests_sent
        with pytest.raises(DeadlineExceeded):
            await lane.request(*embed_req("fault:sigkill"), deadline_s=0.1)
        await first
        await asyncio.sleep(0.1)
        assert lane.requests_sent == sent_before  # the queued request never reached the worker
        await honest(lane)


async def _on_the_wire(lane: Lane, req, ids) -> asyncio.Task:
    """Start a request with no deadline (the lane's fast path: it runs in the caller's own
    task) and return once it has been sent."""
    sent = lane.requests_sent
    task = asyncio.create_task(lane.request(req, ids))
    await asyncio.sleep(0)  # one turn: the fast path sends without suspending
    assert lane.requests_sent == sent + 1 and lane.state().health.status == "busy"
    return task


async def test_cancelled_caller_on_the_fast_path_drains_and_the_next_reply_is_its_own(
    short_runtime_dir,
):
    async with running_lane(short_runtime_dir, inference_window_s=5.0) as lane:
        pid = lane.worker.pid
        task = await _on_the_wire(lane, *embed_req("fault:late:0.6", first_id=100))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lane.state().health.status == "busy"  # the drain holds the worker until the reply
        _, elapsed = await timed(honest(lane, first_id=7), bound=5)
        assert elapsed > 0.3  # it waited for the abandoned reply to drain
        assert lane.worker.pid == pid and lane.state().strikes == 0


async def test_cancelled_caller_whose_worker_goes_silent_still_kills_and_strikes(
    short_runtime_dir,
):
    async with running_lane(short_runtime_dir, inference_window_s=0.5) as lane:
        pid = lane.worker.pid
        task = await _on_the_wire(lane, *embed_req("fault:hang"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: lane.state().strikes == 1, 10)  # the drain's fault: killed, reaped
        assert_reaped(pid)  # the drain's watchdog killed it, as the caller's would have
        assert isinstance(lane.last_crash, WatchdogExpired)
        await recovers_on_fresh_worker(lane, pid)


# ---- strikes and quarantine -----------------------------------------------------------------


async def test_two_consecutive_crashes_quarantine_and_requests_fail_fast(short_runtime_dir):
    async with running_lane(short_runtime_dir, quarantine_s=60.0) as lane:
        first, *_ = await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        assert not first.quarantined
        await honest(lane)  # fresh worker; strike cleared ...
        await expect_fault(lane, "sigkill", WorkerDied, bound=5)  # ... so this is strike 1
        second, *_ = await expect_fault(lane, "abort", WorkerDied, bound=5)
        assert second.quarantined and second.retry_after_s > 50
        req, ids = embed_req()
        info = fails_without_waiting(lane.request(req, ids), EngineCrashed)
        assert info.value.quarantined and 50 < info.value.retry_after_s <= 60
        assert info.value.to_dict()["quarantined"] is True
        state = lane.state()
        assert state.quarantined and state.pid is None and state.health.status == "quarantined"


async def test_load_and_ping_do_not_clear_strikes(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        load = m.LOAD(req_id=0, artifact_path="-", artifact_digest="-", format="echo")
        await lane.request(load)
        await lane.request(m.PING(req_id=0))
        assert lane.state().strikes == 1
        err, *_ = await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        assert err.quarantined


async def test_quarantine_expiry_restarts_with_zero_strikes(short_runtime_dir):
    clock = Clock()
    async with running_lane(short_runtime_dir, quarantine_s=60.0, clock=clock) as lane:
        await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        clock.advance(59.9)
        with pytest.raises(EngineCrashed) as info:
            await honest(lane)
        assert info.value.quarantined and info.value.retry_after_s == pytest.approx(0.1)
        clock.advance(0.1)
        restarts = lane.restarts
        await honest(lane)
        assert lane.state().strikes == 0 and lane.restarts == restarts + 1
        assert not lane.state().quarantined


async def test_clear_quarantine_on_reload(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        assert lane.state().quarantined
        lane.clear_quarantine()
        await honest(lane)


async def test_worker_error_is_typed_and_not_a_strike(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        pid = lane.worker.pid
        req, ids = embed_req("fault:error:invalid_request")
        with pytest.raises(WorkerError) as info:
            await lane.request(req, ids)
        assert info.value.code == "invalid_request" and info.value.http_status == 400
        assert lane.worker.pid == pid and lane.state().strikes == 0
        await honest(lane)


async def test_loads_are_replayed_on_a_fresh_worker(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        load = m.LOAD(
            req_id=0,
            artifact_path="-",
            artifact_digest="-",
            format="echo",
            runtime_config={"model_ref": "m1"},
        )
        reply, _ = await lane.request(load)
        assert reply.model_ref == "m1"
        await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        pong, _ = await lane.request(m.PING(req_id=0))
        assert pong.models_loaded == ["m1"]
        await lane.request(m.UNLOAD(req_id=0, model_ref="m1"))
        await expect_fault(lane, "abort", WorkerDied, bound=5)
        lane.clear_quarantine()
        pong, _ = await lane.request(m.PING(req_id=0))
        assert pong.models_loaded == []


async def test_control_window_applies_to_load(short_runtime_dir):
    async with running_lane(short_runtime_dir, control_window_s=1.0) as lane:
        pid = lane.worker.pid
        load = m.LOAD(
            req_id=0,
            artifact_path="-",
            artifact_digest="-",
            format="echo",
            runtime_config={"fault": "hang"},
        )
        with pytest.raises(WatchdogExpired):
            async with asyncio.timeout(6):
                await lane.request(load)
        assert_reaped(pid)


# ---- execution permits ----------------------------------------------------------------------


async def test_watchdog_starts_only_once_the_permit_is_held(short_runtime_dir):
    permits = DevicePermits({"cpu": 1})
    host = config(short_runtime_dir, inference_window_s=1.0)
    a = Lane(LaneConfig(lane_id="a", argv=WORKER), host, permits)
    b = Lane(LaneConfig(lane_id="b", argv=WORKER), host, permits)
    await asyncio.gather(a.start(), b.start())
    try:
        slow, ids = embed_req("fault:slow:6:0.3")  # holds the only CPU permit for 1.8 s
        task = asyncio.create_task(a.request(slow, ids))
        await asyncio.sleep(0.1)
        _, elapsed = await timed(honest(b), bound=10)
        assert elapsed > 1.2  # b waited for the permit longer than its own window ...
        await task
        assert b.state().strikes == 0  # ... without its watchdog firing
    finally:
        await asyncio.gather(a.stop(), b.stop())


# ---- health, logs, shutdown -----------------------------------------------------------------


async def test_health_is_cached_and_never_pings_on_the_health_path(short_runtime_dir):
    clock = Clock()
    async with running_lane(short_runtime_dir, ping_interval_s=0.2, clock=clock) as lane:
        await until(lambda: lane.last_pong is not None)  # the refresher's PING came back
        assert lane.state().health.checked_age_s == 0.0
        os.kill(lane.worker.pid, signal.SIGSTOP)  # a worker that could never answer a PING
        try:
            clock.advance(5.0)
            # `state` is a plain function: it cannot wait for the worker, and what it reports
            # is the cached PONG, as old as the clock says.
            state = lane.state()
            assert state.health.last_pong is not None and state.health.checked_age_s == 5.0
        finally:
            os.kill(lane.worker.pid, signal.SIGCONT)


async def test_log_ring_is_size_capped(short_runtime_dir):
    async with running_lane(short_runtime_dir, log_ring_bytes=32 * 1024) as lane:
        req, ids = embed_req("fault:spam:400000")
        await lane.request(req, ids)
        await until(lambda: "END-OF-SPAM" in lane.worker.ring.tail(8192))  # the pump caught up
        ring = lane.worker.ring
        assert ring.size <= 32 * 1024 and ring.dropped_bytes > 300_000
        assert "END-OF-SPAM" in ring.tail(8192)


async def test_stop_shuts_down_cleanly_and_reaps(short_runtime_dir):
    lane = Lane(LaneConfig(lane_id="t", argv=WORKER), config(short_runtime_dir))
    await lane.start()
    worker = lane.worker
    await lane.stop()
    assert worker.process.exit_status() == "exited with code 0"  # it honoured SHUTDOWN
    assert_reaped(worker.pid)
    assert not list(Path(short_runtime_dir).rglob("*.sock"))
    with pytest.raises(LaneStopped):
        await honest(lane)


async def test_stop_with_a_request_in_flight(short_runtime_dir):
    lane = Lane(
        LaneConfig(lane_id="t", argv=WORKER),
        config(short_runtime_dir, inference_window_s=30, shutdown_grace_s=0.3),
    )
    await lane.start()
    pid = lane.worker.pid
    req, ids = embed_req("fault:hang")
    task = asyncio.create_task(lane.request(req, ids))
    await until(lambda: lane.state().health.status == "busy")  # in flight
    _, elapsed = await timed(lane.stop(), bound=5)
    with pytest.raises(LaneStopped):
        await task
    assert_reaped(pid)


async def test_shell_wrapped_worker_in_the_process_group_is_accepted(short_runtime_dir):
    # A foreign worker command may fork the real worker; it stays in the spawned group.
    argv = ["sh", "-c", f'"{os.sys.executable}" -m workers.faulty "$@"; exit $?', "sh"]
    lane = Lane(LaneConfig(lane_id="t", argv=argv), config(short_runtime_dir))
    await lane.start()
    try:
        assert lane.hello.pid != lane.worker.pid  # the peer is the shell's child
        await honest(lane)
    finally:
        await lane.stop()


async def test_socket_path_too_long_is_a_clear_error():
    lane = Lane(LaneConfig(lane_id="t", argv=WORKER), config("/tmp/" + "x" * 110))
    with pytest.raises(ConfigInvalid, match="allows"):
        await lane.start()


async def test_a_crashed_worker_is_replaced_without_waiting_for_a_request(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:
        load = m.LOAD(
            req_id=0,
            artifact_path="-",
            artifact_digest="-",
            format="echo",
            runtime_config={"model_ref": "m1"},
        )
        await lane.request(load)
        _, _, pid = await expect_fault(lane, "sigkill", WorkerDied, bound=5)
        async with asyncio.timeout(20):  # health recovers by itself: no request is sent
            while lane.state().health.status != "ready":
                assert lane.state().health.status in ("starting", "down", "busy")
                await asyncio.sleep(0.05)
        state = lane.state()
        assert state.pid not in (None, pid) and state.strikes == 1 and state.restarts == 1
        pong, _ = await lane.request(m.PING(req_id=0))
        assert pong.models_loaded == ["m1"]  # LOAD replayed on the replacement


# ---- the lane's own requests and its lifecycle ------------------------------------------------


async def test_a_frame_over_the_agreed_max_frame_fails_alone_and_nothing_is_sent(
    short_runtime_dir,
):
    async with running_lane(short_runtime_dir, max_frame=1 << 20) as lane:
        pid = lane.worker.pid
        n = (1 << 18) + 1  # 4 bytes over the limit
        big = m.EMBED_BATCH(req_id=0, model_ref="ok", items=[m.EmbedItem(id=0, n_tokens=n)])
        for _ in range(3):  # each would have been a crash and a strike: a quarantine by now
            with pytest.raises(InvalidRequest, match="exceeds max_frame"):
                await lane.request(big, np.zeros(n, np.int32))
        huge = m.GENERATE(req_id=0, model_ref="ok", max_tokens=1)
        with pytest.raises(InvalidRequest):  # over u32 too: refused before the session moves
            await lane.request(huge, np.empty(2**30 + 1, np.int32))
        await honest(lane)
        state = lane.state()
        assert (state.pid, state.strikes, state.health.status) == (pid, 0, "ready")


async def test_a_request_queued_behind_stop_gets_lane_stopped_and_no_new_worker(
    short_runtime_dir,
):
    lane = Lane(
        LaneConfig(lane_id="t", argv=WORKER),
        config(short_runtime_dir, inference_window_s=30, shutdown_grace_s=0.3),
    )
    await lane.start()
    first = lane.worker.pid
    hung = asyncio.create_task(lane.request(*embed_req("fault:hang")))
    await until(lambda: lane.state().health.status == "busy", 10)
    queued = asyncio.create_task(lane.request(*embed_req()))
    async with asyncio.timeout(10):
        # No public reading counts the requests waiting for a worker: its job task does.
        while not lane._jobs:  # its job task exists ...
            await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # ... and waits for the stream
    await timed(lane.stop(), bound=10)
    for task in (hung, queued):
        with pytest.raises(LaneStopped):
            await task
    assert lane.worker is None
    assert_reaped(first)
    for p in psutil.Process().children(recursive=True):
        assert "workers.faulty" not in " ".join(p.cmdline()), "a worker outlived stop()"


async def test_a_worker_that_dies_while_idle_is_replaced_at_once(short_runtime_dir):
    async with running_lane(short_runtime_dir) as lane:  # no health refresher (interval 0)
        pid = lane.worker.pid
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(20):  # no request is sent: the exit alone restarts it
            while lane.state().pid in (None, pid):
                await asyncio.sleep(0.02)
        state = lane.state()
        assert state.health.status == "ready" and state.restarts == 1 and state.strikes == 1
        assert_reaped(pid)
        await honest(lane)


async def test_a_fast_path_request_never_reaches_a_worker_a_queued_one_crashed(
    short_runtime_dir,
):
    # One task sends A then B back to back; C, queued behind A, is woken first when A
    # releases the stream and kills the worker. B must run on the replacement, not fail with
    # C's crash.
    async with running_lane(short_runtime_dir) as lane:

        async def a_then_b():
            await lane.request(*embed_req("fault:slow"))
            return await lane.request(*embed_req())

        sequence = asyncio.create_task(a_then_b())
        await until(lambda: lane.state().health.status == "busy", 10)
        crasher = asyncio.create_task(lane.request(*embed_req("fault:sigkill")))
        reply, vectors = await asyncio.wait_for(sequence, 20)
        assert isinstance(reply, m.VECTORS) and vectors.shape[0] == 2
        with pytest.raises(WorkerDied):
            await crasher


async def test_a_worker_command_that_cannot_start_is_config_invalid(short_runtime_dir):
    lane = Lane(LaneConfig(lane_id="t", argv=["/nonexistent/worker"]), config(short_runtime_dir))
    with pytest.raises(ConfigInvalid, match="cannot start"):
        await lane.start()
    assert lane.state().strikes == 0
    await lane.stop()
