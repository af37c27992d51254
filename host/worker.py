"""One live worker: its process, its connection, its log ring — and how it is started.

Start-up order (each step closes a way a stranger or a stale child could take the socket):
listener first (0700 dir, 0600 socket, stale file gone),
then spawn with `--socket --nonce` and `SYNAPSE_WORKER_ID`, then accept under the HELLO
timeout while watching for the child's exit, check the peer's credentials, and complete the
handshake (exact v3, nonce). Any failure kills and reaps the child before raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
import time

from host.config import HostConfig, LaneConfig
from host.connection import SILENCE, VIOLATION, ConnectionFault, WorkerConnection
from host.errors import ConfigInvalid, ProtocolViolation, WatchdogExpired, WorkerDied
from host.listener import create_listener, peer_credentials, peer_is_child, socket_path
from host.logring import LogRing
from host.process import WorkerProcess
from workers.protocol import messages as m
from workers.protocol.session import HostSession


class WorkerHandle:
    def __init__(
        self,
        worker_id: str,
        process: WorkerProcess,
        conn: WorkerConnection,
        hello: m.HELLO,
    ) -> None:
        self.worker_id = worker_id
        self.process = process
        self.conn = conn
        self.hello = hello
        self.started_at = time.monotonic()
        self.struck = False  # one strike per worker death at most

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def ring(self) -> LogRing:
        return self.process.ring

    def usable(self) -> bool:
        return self.process.returncode is None and self.conn.ended is None

    async def kill(self) -> None:
        await self.process.kill()
        await self.conn.close()

    async def stop(self, config: HostConfig) -> None:
        """SHUTDOWN (if the stream is idle), grace, SIGTERM, grace, SIGKILL; always reaped."""
        if self.usable():
            with contextlib.suppress(Exception):
                await self.conn.send_shutdown()
            await self.process.wait(config.shutdown_grace_s)
        await self.process.terminate(config.term_grace_s)
        await self.conn.close()


def worker_env(lane: LaneConfig, worker_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")  # idle OpenMP threads must not spin
    # On GGML_ASSERT, ggml attaches gdb for a backtrace: seconds of delay and a flood of
    # frames that pushes the assert line itself out of the 8 KiB log tail.
    env.setdefault("GGML_NO_BACKTRACE", "1")
    env.update(lane.env)
    env["SYNAPSE_WORKER_ID"] = worker_id
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def resolve_argv(argv: list[str]) -> list[str]:
    # "python" in a lane's argv means this interpreter, so workers share the host's venv.
    if argv and argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return list(argv)


async def spawn_worker(
    lane: LaneConfig, config: HostConfig, generation: int, ring_capacity: int | None = None
) -> WorkerHandle:
    worker_id = f"{lane.lane_id}-{generation}"
    # A random suffix: two hosts (Ray replicas, parallel jobs) or two Modules in one process
    # may run lanes of the same id over one runtime dir; they must never share a socket path.
    path = socket_path(config.resolved_runtime_dir(), f"{worker_id}.{secrets.token_hex(4)}")
    listener = create_listener(path)
    nonce = secrets.token_hex(16)
    ring = LogRing(worker_id, ring_capacity or config.log_ring_bytes)
    process: WorkerProcess | None = None
    sock = None
    try:
        argv = [*resolve_argv(lane.argv), "--socket", str(path), "--nonce", nonce]
        try:
            process = await WorkerProcess.spawn(argv, worker_env(lane, worker_id), lane.cwd, ring)
        except OSError as exc:  # no such program, not executable, bad cwd: the lane's config
            raise ConfigInvalid(f"lane {lane.lane_id}: cannot start {argv[0]!r}: {exc}") from None
        deadline = time.monotonic() + config.hello_timeout_s
        sock = await _accept(listener, process, config.hello_timeout_s)
        peer_pid = _check_peer(sock, process.pid)
        conn = await WorkerConnection.open(sock, HostSession(nonce, config.max_frame))
        try:
            remaining = max(0.001, deadline - time.monotonic())
            hello = await conn.handshake(remaining)
        except BaseException:
            await conn.close()
            raise
        if peer_pid is not None and hello.pid != peer_pid:
            await conn.close()
            raise ConnectionFault(VIOLATION, f"HELLO pid {hello.pid} is not the peer {peer_pid}")
        return WorkerHandle(worker_id, process, conn, hello)
    except ConnectionFault as fault:
        if sock is not None:
            sock.close()
        assert process is not None
        await process.kill()
        raise _startup_error(fault, process, lane, config.log_tail_bytes) from None
    except BaseException:
        if sock is not None:
            sock.close()
        if process is not None:
            await process.kill()
        raise
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # connected (or failed): the file is no longer needed


async def _accept(listener, process: WorkerProcess, timeout: float):
    loop = asyncio.get_running_loop()
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    done, _ = await asyncio.wait(
        {accept, process.exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
    )
    if accept in done:
        sock, _addr = accept.result()
        return sock
    accept.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await accept
    if process.exited in done:
        raise ConnectionFault("eof", "worker exited before connecting")
    raise ConnectionFault(SILENCE, f"worker did not connect within {timeout:g} s")


def _check_peer(sock, child_pid: int) -> int | None:
    """The peer's pid once it is proven ours; None where the OS does not tell."""
    creds = peer_credentials(sock)
    if creds is None:
        return None
    pid, uid = creds
    if uid != os.getuid():
        sock.close()
        raise ConnectionFault(VIOLATION, f"peer uid {uid} is not ours")
    if not peer_is_child(pid, child_pid):
        sock.close()
        raise ConnectionFault(VIOLATION, f"peer pid {pid} is not the spawned worker {child_pid}")
    return pid


def _startup_error(
    fault: ConnectionFault, process: WorkerProcess, lane: LaneConfig, tail_bytes: int
):
    cls = {SILENCE: WatchdogExpired, VIOLATION: ProtocolViolation}.get(fault.kind, WorkerDied)
    return cls(
        f"worker of lane {lane.lane_id} failed to start: {fault.reason} ({process.exit_status()})",
        lane_id=lane.lane_id,
        log_tail=process.ring.tail(tail_bytes),
        exit_status=process.exit_status(),
    )
