"""Helpers of the bulk-job tests: corpora, the CLI as a user runs it, the output read back."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

WORDS = (
    "the cat sat on a mat while stock markets fell sharply and le chat dort sur le "
    "tapis rouge near the old river bank"
).split()


def texts(n: int, seed: int = 0, lengths=(3, 12, 40, 120)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice(lengths))) for _ in range(n)]


def write_jsonl(path: Path, n: int, seed: int = 0, extra: list[str] = ()) -> list[str]:
    """`n` good rows with ids doc0..doc{n-1}, then the `extra` raw lines."""
    with open(path, "w") as f:
        for i, text in enumerate(texts(n, seed)):
            f.write(json.dumps({"id": f"doc{i}", "text": text}) + "\n")
        for line in extra:
            f.write(line + "\n")
    return [f"doc{i}" for i in range(n)]


def cli_env(cache_dir, runtime_dir: str | None = None, extra: dict | None = None) -> dict:
    env = {**os.environ, "SYNAPSE_CACHE_DIR": str(cache_dir), **(extra or {})}
    if runtime_dir is not None:
        env["XDG_RUNTIME_DIR"] = runtime_dir  # our workers' sockets, found by psutil
    return env


def batch_cli(
    cache_dir,
    *args: str,
    input: str | None = None,
    runtime_dir: str | None = None,
    timeout: float = 300,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "batch", "embed", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        env=cli_env(cache_dir, runtime_dir, env),
    )


def start_batch_cli(
    cache_dir, *args: str, runtime_dir: str | None = None, env: dict | None = None
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "batch", "embed", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(cache_dir, runtime_dir, env),
    )


def wait_for_commits(
    output: Path, parts: int, proc: subprocess.Popen, timeout_s: float = 120
) -> dict:
    """Block until the job's checkpoint records `parts` committed windows."""
    state = output.with_name(output.name + ".partial") / "state.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            data = json.loads(state.read_text())
            if data["parts"] >= parts:
                return data
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no {parts} commits within {timeout_s} s")


def read_output(path: Path):
    table = pq.read_table(path)
    return table, table.column("id").to_pylist()
