"""`synapse batch embed` as a user runs it: real subprocesses, real workers, real signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.batch_support import (
    batch_cli,
    read_output,
    start_batch_cli,
    wait_for_commits,
    write_jsonl,
)
from tests.ray_support import wait_gone

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker


@pytest.fixture
def runtime_dir():
    # Our workers' sockets live here, so psutil can find exactly our worker processes.
    path = tempfile.mkdtemp(prefix="synb-", dir="/tmp")
    yield path
    left = wait_gone(path, timeout_s=10)
    shutil.rmtree(path, ignore_errors=True)
    assert not left, "a worker outlived its job"


def test_bad_rows_are_recorded_and_the_output_reads_in_pyarrow_and_duckdb(
    synapse_cache_dir, store_root, tmp_path, runtime_dir
):
    bad = [
        "not json",
        json.dumps({"id": "empty", "text": ""}),
        json.dumps({"id": "no-text"}),
        json.dumps({"id": "num", "text": 3}),
        json.dumps({"id": "long", "text": "word " * 400}),
    ]
    ids = write_jsonl(tmp_path / "c.jsonl", 120, extra=bad)
    out = tmp_path / "out.parquet"
    proc = batch_cli(
        synapse_cache_dir,
        str(tmp_path / "c.jsonl"),
        "-o",
        str(out),
        "--no-truncate",
        "--json",
        "--window-rows",
        "50",
        runtime_dir=runtime_dir,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["rows"] == 120 and summary["errors"] == 5
    table, got_ids = read_output(out)
    assert got_ids == ids  # input order, every good row once
    assert str(table.schema.field("embedding").type) == "fixed_size_list<element: float>[384]"
    meta = pq.read_schema(out).metadata
    assert meta[b"synapse.model"] == b"minilm-l6-v2" and meta[b"synapse.lane"] == b"llama"
    assert meta[b"synapse.normalize"] == b"true" and len(meta[b"synapse.artifact_digest"]) == 64
    assert pq.ParquetFile(out).num_row_groups == 3  # one per committed window
    count, dims, tokens = duckdb.sql(
        f"select count(*), max(len(embedding)), sum(n_tokens) from '{out}'"
    ).fetchall()[0]
    assert (count, dims, tokens) == (120, 384, summary["tokens"])
    errors = [
        json.loads(x) for x in (tmp_path / "out.parquet.errors.jsonl").read_text().splitlines()
    ]
    assert [(e["line"], e["id"], e["error"]["code"]) for e in errors] == [
        (121, "121", "invalid_json"),
        (122, "empty", "empty_text"),
        (123, "no-text", "missing_field"),
        (124, "num", "not_a_string"),
        (125, "long", "too_long"),
    ]
    assert not (tmp_path / "out.parquet.partial").exists()
    vectors = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)


def test_sigkill_of_the_job_then_resume_writes_every_row_once(
    synapse_cache_dir, tmp_path, runtime_dir
):
    ids = write_jsonl(tmp_path / "c.jsonl", 240, seed=1)
    out = tmp_path / "out.parquet"
    args = [str(tmp_path / "c.jsonl"), "-o", str(out), "--window-rows", "20", "--json"]
    proc = start_batch_cli(synapse_cache_dir, *args, runtime_dir=runtime_dir)
    state = wait_for_commits(out, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()  # published only when complete
    assert not wait_gone(runtime_dir, timeout_s=20), "workers outlived the killed job"
    assert state["rows"] >= 60

    again = batch_cli(synapse_cache_dir, *args, runtime_dir=runtime_dir)
    assert again.returncode == 2 and "--resume" in again.stderr  # never silently restarts
    resumed = batch_cli(synapse_cache_dir, *args, "--resume", runtime_dir=runtime_dir)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["resumed_from_line"] > 1 and summary["rows"] == 240
    _, got = read_output(out)
    assert got == ids  # exact: none lost, none twice, in order


def test_ctrl_c_leaves_a_checkpoint_and_exits_1(synapse_cache_dir, tmp_path, runtime_dir):
    write_jsonl(tmp_path / "c.jsonl", 200, seed=2)
    out = tmp_path / "out.parquet"
    args = [str(tmp_path / "c.jsonl"), "-o", str(out), "--window-rows", "20"]
    proc = start_batch_cli(synapse_cache_dir, *args, runtime_dir=runtime_dir)
    wait_for_commits(out, 2, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "interrupted by SIGINT" in stderr and "--resume" in stderr
    state = json.loads((tmp_path / "out.parquet.partial" / "state.json").read_text())
    assert state["rows"] >= 40 and state["next_line"] == state["rows"] + 1
    assert not out.exists()


def test_stdin_and_max_errors(synapse_cache_dir, tmp_path, runtime_dir):
    lines = [json.dumps({"id": f"s{i}", "text": f"line number {i}"}) for i in range(30)]
    out = tmp_path / "s.parquet"
    proc = batch_cli(
        synapse_cache_dir,
        "-",
        "-o",
        str(out),
        input="\n".join(lines) + "\n",
        runtime_dir=runtime_dir,
    )
    assert proc.returncode == 0, proc.stderr
    assert read_output(out)[1] == [f"s{i}" for i in range(30)]
    assert "wrote 30 rows" in proc.stdout and "no row failed" in proc.stdout

    bad = lines[:5] + ["{broken"] * 4
    proc = batch_cli(
        synapse_cache_dir,
        "-",
        "-o",
        str(tmp_path / "m.parquet"),
        "--max-errors",
        "3",
        input="\n".join(bad),
        runtime_dir=runtime_dir,
    )
    assert proc.returncode == 1
    assert "4 rows failed, more than --max-errors 3" in proc.stderr
    assert not (tmp_path / "m.parquet").exists()

    # The limit broke on the last window: that window is committed, so --resume has nothing
    # left to embed, and must still refuse to publish.
    proc = batch_cli(
        synapse_cache_dir,
        "-",
        "-o",
        str(tmp_path / "m.parquet"),
        "--max-errors",
        "3",
        "--resume",
        input="\n".join(bad),
        runtime_dir=runtime_dir,
    )
    assert proc.returncode == 1, proc.stdout
    assert "more than --max-errors 3" in proc.stderr and not (tmp_path / "m.parquet").exists()


def test_usage_errors_exit_2_before_any_worker(synapse_cache_dir, tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "c.xml").write_text("<x/>")
    good = str(tmp_path / "c.jsonl")
    if os.geteuid() == 0:
        unwritable = "/sys"  # root ignores permission bits; sysfs refuses new files even so
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        unwritable = str(tmp_path / "ro")
    cases = [
        ([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.parquet")], "does not exist"),
        ([str(tmp_path / "c.xml"), "-o", str(tmp_path / "o.parquet")], "unknown rows format"),
        ([good, "-o", f"{unwritable}/o.parquet"], "cannot write in the output directory"),
        ([good, "-o", str(tmp_path / "nodir" / "o.parquet")], "does not exist"),
        ([good, "-o", str(tmp_path / "o.csv")], "is a .parquet file"),
        ([good, "-o", str(tmp_path / "adir.parquet")], "is a directory"),  # before any work
        ([good, "-o", str(tmp_path / "o.parquet"), "--workers", "0"], "expected an integer"),
        ([good], "required: -o"),
    ]
    (tmp_path / "adir.parquet").mkdir()
    for args, message in cases:
        proc = batch_cli(synapse_cache_dir, *args, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
