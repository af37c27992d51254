"""`synapse batch embed --ray` as a user runs it, its driver SIGKILLed mid-run and resumed:
no row lost, none twice, in input order — the local job's own test, on Ray. The driver
starts its own local Ray (in a private RAY_TMPDIR, so psutil finds exactly its processes);
killing the driver takes that Ray with it, and the checkpoint it left is the local job's
layout: the resume on Ray and, from a copy, the local job without Ray both finish it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.batch_support import batch_cli, cli_env, read_output, wait_for_commits, write_jsonl
from tests.ray_support import wait_gone

pytestmark = pytest.mark.model  # starts Ray and model workers

# 30 windows of 20 rows: the driver commits one about every 0.2 s here, so the kill after the
# third lands seconds before the end even when the test process is descheduled for a while.
ROWS = 600


@pytest.fixture
def private_dirs():
    """Our engine workers' runtime dir and the driver's Ray temp dir (short: Ray's Unix
    sockets live there)."""
    runtime_dir = tempfile.mkdtemp(prefix="synr-", dir="/tmp")
    ray_tmp = tempfile.mkdtemp(prefix="rr-", dir="/tmp")
    yield runtime_dir, ray_tmp
    left = wait_gone(runtime_dir, timeout_s=10) + wait_gone(ray_tmp, timeout_s=10)
    for proc in left:  # never leave a stray process to the next test
        proc.kill()
    shutil.rmtree(runtime_dir, ignore_errors=True)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"processes outlived the test: {[p.pid for p in left]}"


def test_sigkill_of_the_ray_driver_then_resume_writes_every_row_once(
    synapse_cache_dir, tmp_path, private_dirs
):
    runtime_dir, ray_tmp = private_dirs
    # RAY_agent_register_timeout_ms: a loaded 2-core machine brings Ray's agents up slowly.
    ray_env = {"RAY_TMPDIR": ray_tmp, "RAY_agent_register_timeout_ms": "120000"}
    ids = write_jsonl(tmp_path / "c.jsonl", ROWS, seed=4)
    out = tmp_path / "out.parquet"
    args = [str(tmp_path / "c.jsonl"), "-o", str(out), "--window-rows", "20", "--json", "--ray"]
    # The driver's output to files: Ray Data's progress could fill a pipe and stall it.
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "batch", "embed", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=cli_env(synapse_cache_dir, runtime_dir, ray_env),
        )
        try:
            state = wait_for_commits(out, 3, proc, timeout_s=300)
        except AssertionError:
            proc.kill()
            proc.wait()
            raise AssertionError((tmp_path / "driver.log").read_text()[-3000:]) from None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()  # published only when complete
    assert not wait_gone(ray_tmp, timeout_s=30), "the driver's local Ray outlived it"
    assert not wait_gone(runtime_dir, timeout_s=30), "engine workers outlived the driver"
    # Read after the kill: what the checkpoint holds is what the resume starts from.
    after = json.loads((tmp_path / "out.parquet.partial" / "state.json").read_text())
    assert 60 <= state["rows"] <= after["rows"] < ROWS, "the kill did not land mid-run"

    # A copy of the checkpoint for the local job: the layout is one.
    shutil.copytree(tmp_path / "out.parquet.partial", tmp_path / "local.parquet.partial")

    again = batch_cli(synapse_cache_dir, *args, runtime_dir=runtime_dir, env=ray_env)
    assert again.returncode == 2 and "--resume" in again.stderr  # never silently restarts
    resumed = batch_cli(
        synapse_cache_dir, *args, "--resume", runtime_dir=runtime_dir, env=ray_env, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_line"] > 1 and summary["rows"] == ROWS
    _, got = read_output(out)
    assert got == ids  # exact: none lost, none twice, in order
    assert not (tmp_path / "out.parquet.partial").exists()

    local = batch_cli(
        synapse_cache_dir,
        str(tmp_path / "c.jsonl"),
        "-o",
        str(tmp_path / "local.parquet"),
        "--window-rows",
        "20",
        "--json",
        "--resume",
        runtime_dir=runtime_dir,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    assert json.loads(local.stdout)["rows"] == ROWS
    local_table, local_ids = read_output(tmp_path / "local.parquet")
    ray_table, _ = read_output(out)
    assert local_ids == ids and local_table.schema == ray_table.schema
