"""bench.soak end to end, briefly: a real `synapse serve` whose three models the memory budget
cycles, and a real fault (SIGKILL of a worker while it serves) that the report must count.

The figures of so short a run mean nothing; what is checked is that the report has its shape
and that its error and restart counts come from what really happened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.model  # starts a server and its model workers

REPO = Path(__file__).resolve().parent.parent
ENTRY = {
    "minute", "seconds", "requests", "throughput", "p50_ms", "p99_ms", "host_rss_mb",
    "worker_rss_mb", "errors", "restarts", "unloads",
}  # fmt: skip
TARGETS = ["throughput_last_vs_first_minute", "host_rss_growth", "no_errors", "no_restarts"]


def _busy_worker(url: str, timeout_s: float) -> int:
    """The pid of a worker that is serving a request now."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=10) as client:
        while time.monotonic() < deadline:
            for lane in client.get("/health").json()["lanes"].values():
                if lane["status"] == "busy" and lane["pid"]:
                    return lane["pid"]
            time.sleep(0.02)
    raise AssertionError("no worker was seen busy")


def test_short_soak_reports_each_window_and_counts_a_killed_worker(synapse_cache_dir):
    argv = [
        sys.executable, "-m", "bench.soak", "--minutes", "0.1", "--window-seconds", "3",
        "--warmup-seconds", "0", "--concurrency", "8",
    ]  # fmt: skip
    env = {**os.environ, "SYNAPSE_CACHE_DIR": str(synapse_cache_dir)}
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")))
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("bench.soak: synapse serve at") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        url = next(ln for ln in lines if ln.startswith("bench.soak:")).split()[4]
        pid = _busy_worker(url, 60)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join()
    assert proc.returncode == 0, "".join(lines)
    assert not psutil.pid_exists(pid)
    report = json.loads(out)
    print(json.dumps(report, indent=1))  # shown when an assertion below fails

    # 0.1 minutes in 3-second windows: two windows, each loading and unloading every model once.
    assert report["window_seconds"] == 3 and report["phase_seconds"] == 1
    assert len(report["minutes"]) == 2
    for i, entry in enumerate(report["minutes"]):
        assert set(entry) == ENTRY and entry["minute"] == i + 1
        assert entry["requests"] > 0 and entry["throughput"] > 0 and entry["p99_ms"] > 0
        assert entry["host_rss_mb"] > 0 and entry["worker_rss_mb"] > 0
    # The budget cycled the models. Not necessarily in every window of a run this short: the
    # server budgets a loaded model at its last PONG's RSS, and a worker's RSS right after
    # LOAD (before its compute buffers are touched) can let all three fit until the next PING.
    assert sum(e["unloads"] for e in report["minutes"]) >= 1
    assert sum(e["unloads"] for e in report["minutes"]) == report["unloads"]["budget"]

    # The killed worker was replaced, and /metrics said so. The requests it was serving (if it
    # was not between two batches at that instant) failed: each error the client counted is one
    # the server answered with its typed error for a crashed worker, by its own count.
    assert report["restarts"] >= 1
    codes = report["server_errors_by_code"]
    # No insufficient_memory: the budget holds two models, and a model's bytes count once
    # even while its first PING runs (tests/test_residency.py proves that rule).
    crash = {"engine_crashed", "lane_stopped", "deadline_exceeded"}
    assert set(codes) <= crash, codes
    assert report["errors"] == sum(report["errors_by_status"].values()) == sum(codes.values())
    assert set(report["errors_by_status"]) <= {"503", "504"}
    targets = {t["name"]: t for t in report["targets"]}
    assert list(targets) == TARGETS
    assert targets["no_restarts"]["met"] is False
    assert targets["no_restarts"]["value"] == report["restarts"]
    assert targets["no_errors"]["met"] is (report["errors"] == 0)
