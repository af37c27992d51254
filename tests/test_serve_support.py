"""Helpers for the serve tests: a REAL `python -m service` subprocess on a free loopback port.

No tests here. The default models are ingested once per session into a temp store (ingest is
idempotent, so a second module asking for the same store pays nothing).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
_READY = re.compile(r"synapse serve: listening on (http://\S+)")


def server_config(store_root: str, **overrides) -> dict:
    """A serve config over the session's store; ServerProcess adds its own runtime dir."""
    host = {"ping_interval_s": 0.5, **overrides.pop("host", {})}
    module = {"store_root": store_root, "host": host, **overrides.pop("module", {})}
    return {"port": 0, "install_defaults": False, "module": module, **overrides}


SERVE = [sys.executable, "-m", "service"]


class ServerProcess:
    """`python -m service --config FILE --port 0`; ready when it prints its address.

    `command` replaces `python -m service` (e.g. to run it with a module blocked), `args`
    are appended, `env` is added to the environment. Every stdout line is kept in `lines`.
    """

    def __init__(
        self,
        config: dict,
        start_timeout_s: float = 180.0,
        command: list[str] | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix="syn-srv-", dir="/tmp")  # short: socket paths
        # Worker sockets go under our own dir unless the config names one: stop() removes it.
        # A copy: the caller's dict must not keep a path that dies with this server.
        module = config.get("module", {})
        host = {"runtime_dir": str(Path(self.dir) / "rt"), **module.get("host", {})}
        config = {**config, "module": {**module, "host": host}}
        self.config_path = Path(self.dir) / "serve.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = Path(self.dir) / "server.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.lines: list[str] = []
        self._line_seen = threading.Condition()
        env = {
            **os.environ,
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "passive",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [*(command or SERVE), "--config", str(self.config_path), *(args or [])],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self.url = self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                self._log.write(raw)
                self._log.flush()
                with self._line_seen:
                    self.lines.append(line)
                    self._line_seen.notify_all()
                m = _READY.search(line)
                if m and not found:
                    found.append(m.group(1))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if found:
                return found[0]
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def wait_for_line(self, needle: str, timeout_s: float = 30.0, after: int = 0) -> str:
        """The first stdout line from index `after` on that contains `needle` (waits)."""
        deadline = time.monotonic() + timeout_s
        with self._line_seen:
            while True:
                for line in self.lines[after:]:
                    if needle in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line with {needle!r} in {timeout_s} s")
                self._line_seen.wait(left)

    def log(self) -> str:
        if self.proc.poll() is not None:
            self._reader.join(5)  # the last lines of a stopped server are in the file
        return self.log_path.read_text(errors="replace")[-8000:]

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def worker_pid(self, model: str = "minilm-l6-v2") -> int | None:
        return self.health()["lanes"][model]["pid"]

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        try:
            self.terminate()
        finally:
            self._log.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from a Prometheus exposition, or None."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample == name and got == want:
            return float(value)
    return None
