"""Spawn, watch, signal and reap one worker process.

Each worker leads its own process group (start_new_session), so a kill reaches everything it
started. Its stdout/stderr are pumped line by line into its `LogRing`; `exit_status()` turns
the return code into words for logs and errors. Every spawned process is awaited (reaped).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from host.logring import LogRing


class WorkerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, ring: LogRing) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.ring = ring
        self._pumps = [
            asyncio.create_task(self._pump(proc.stdout, "stdout")),
            asyncio.create_task(self._pump(proc.stderr, "stderr")),
        ]
        self._waiter = asyncio.create_task(proc.wait())

    @classmethod
    async def spawn(
        cls, argv: list[str], env: dict[str, str], cwd: str | None, ring: LogRing
    ) -> WorkerProcess:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
            limit=1 << 20,
        )
        return cls(proc, ring)

    async def _pump(self, stream: asyncio.StreamReader | None, name: str) -> None:
        if stream is None:
            return
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the limit: take what is buffered
                line = await stream.read(1 << 20)
            except (asyncio.CancelledError, ConnectionError):
                return
            if not line:
                return
            self.ring.append(name, line.decode("utf-8", "replace"))

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def exited(self) -> asyncio.Task:
        return self._waiter

    def signal_group(self, sig: int) -> None:
        """Signal the whole process group; a gone group is fine."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def wait(self, timeout: float | None = None) -> bool:
        """True once the process has exited (and was reaped) within `timeout`."""
        try:
            await asyncio.wait_for(asyncio.shield(self._waiter), timeout)
            return True
        except TimeoutError:
            return False

    async def kill(self) -> None:
        """SIGKILL the group, reap the leader, and let the log pumps drain to EOF."""
        self.signal_group(signal.SIGKILL)
        await self._waiter
        await self.drain_logs()

    async def drain_logs(self, timeout: float = 2.0) -> None:
        # The pipes reach EOF once every process holding them is gone (the group was killed).
        done, pending = await asyncio.wait(self._pumps, timeout=timeout)
        for task in pending:
            task.cancel()
        # asyncio closes the transport itself only when both pipes saw EOF; a straggler that
        # kept a pipe open must not leave it (and its fds) to the garbage collector.
        transport = getattr(self.proc, "_transport", None)
        if transport is not None and self.returncode is not None:
            transport.close()

    async def terminate(self, term_grace_s: float) -> None:
        """SIGTERM, a grace period, then SIGKILL. Always reaps."""
        if self.returncode is None:
            self.signal_group(signal.SIGTERM)
            if await self.wait(term_grace_s):
                self.signal_group(signal.SIGKILL)  # stragglers in the group
                await self.drain_logs()
                return
        await self.kill()

    def exit_status(self) -> str:
        code = self.returncode
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"
