"""`batch embed --ray` on the session's local Ray: the same output as the local job."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import time

import numpy as np
import pytest

from batch.errors import BatchUsageError, JobAborted
from batch.job import JobOptions, run_job
from batch.output import read_metadata
from batch.ray_job import run_ray_job
from host.config import HostConfig
from host.module import ModuleConfig
from tests.batch_support import WORDS, read_output, write_jsonl
from tests.ray_support import wait_gone

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker


def options(store_root, runtime_dir, input, output, **kw) -> JobOptions:
    module = ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )
    return JobOptions(input=str(input), output=str(output), module=module, **kw)


def test_the_ray_job_writes_what_the_local_job_writes(
    ray_session, store_root, tmp_path, monkeypatch, short_runtime_dir
):
    runtime_dir = short_runtime_dir
    bad = ["not json", json.dumps({"id": "e", "text": ""})]
    write_jsonl(tmp_path / "c.jsonl", 200, seed=7, extra=bad)
    local = asyncio.run(
        run_job(
            options(
                store_root,
                runtime_dir,
                tmp_path / "c.jsonl",
                tmp_path / "local.parquet",
                window_rows=32,
            )
        )
    )
    timings: dict = {}
    # A relative input, from a directory Ray's workers do not run in: the job names the file
    # as the driver sees it.
    monkeypatch.chdir(tmp_path)
    remote = run_ray_job(
        options(store_root, runtime_dir, "c.jsonl", tmp_path / "ray.parquet", window_rows=32),
        address=None,
        workers=2,
        timings=timings,
    )  # 2 actors, 7 blocks
    assert (
        (remote.rows, remote.errors, remote.tokens)
        == (local.rows, local.errors, local.tokens)
        == (200, 2, local.tokens)
    )
    (lt, lids), (rt, rids) = (
        read_output(tmp_path / "local.parquet"),
        read_output(tmp_path / "ray.parquet"),
    )
    assert rids == lids
    lv = np.stack(lt.column("embedding").to_numpy(zero_copy_only=False))
    rv = np.stack(rt.column("embedding").to_numpy(zero_copy_only=False))
    assert np.sum(lv * rv, axis=1).min() >= 0.99999
    assert rt.schema == lt.schema
    assert read_metadata(tmp_path / "ray.parquet") == read_metadata(tmp_path / "local.parquet")
    assert (tmp_path / "ray.parquet.errors.jsonl").read_text() == (
        tmp_path / "local.parquet.errors.jsonl"
    ).read_text()
    assert not (tmp_path / "ray.parquet.partial").exists()  # the checkpoint, published
    assert 0 < timings["first_row_s"]
    # Results stream back a batch at a time (so windows commit as the run goes), never a read
    # task's whole share of the input (104 rows here) at its end. A stripe's short last block
    # may ride with the next one: under two batches.
    assert max(timings["result_rows"]) < 64 and sum(timings["result_rows"]) == 202
    assert not wait_gone(runtime_dir, timeout_s=30), "an actor's worker outlived the job"


def test_the_ane_lane_needs_a_node_that_offers_the_ane(ray_session, store_root, tmp_path):
    write_jsonl(tmp_path / "c.jsonl", 2)
    with pytest.raises(BatchUsageError, match="no Ray node offers the 'ane' resource"):
        run_ray_job(
            options(store_root, "/tmp", tmp_path / "c.jsonl", tmp_path / "o.parquet", lane="ane"),
            address=None,
        )


def test_an_empty_input_writes_an_empty_output_like_the_local_job(
    ray_session, store_root, tmp_path, short_runtime_dir
):
    # No row reaches an actor, so the provenance metadata is described by a task that loads
    # the lane where the actors would have run; the local job writes the same empty file.
    (tmp_path / "c.jsonl").write_text("\n\n")  # blank lines are not records
    local = asyncio.run(
        run_job(
            options(store_root, short_runtime_dir, tmp_path / "c.jsonl", tmp_path / "local.parquet")
        )
    )
    remote = run_ray_job(
        options(store_root, short_runtime_dir, tmp_path / "c.jsonl", tmp_path / "ray.parquet"),
        address=None,
        workers=1,
    )
    assert (remote.rows, remote.errors) == (local.rows, local.errors) == (0, 0)
    (rt, rids), (lt, _) = (
        read_output(tmp_path / "ray.parquet"),
        read_output(tmp_path / "local.parquet"),
    )
    assert rids == [] and rt.schema == lt.schema
    assert read_metadata(tmp_path / "ray.parquet") == read_metadata(tmp_path / "local.parquet")
    assert not (tmp_path / "ray.parquet.errors.jsonl").exists()
    assert not wait_gone(short_runtime_dir, timeout_s=30), "the describing worker outlived it"


def test_sigint_stops_the_ray_job_with_its_checkpoint_and_resume_finishes_it(
    ray_session, store_root, tmp_path, short_runtime_dir
):
    ids = write_jsonl(tmp_path / "c.jsonl", 200, seed=5)
    out = tmp_path / "o.parquet"
    state_file = tmp_path / "o.parquet.partial" / "state.json"

    def interrupt_after_two_commits():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if json.loads(state_file.read_text())["parts"] >= 2:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, to the driver's main thread

    killer = threading.Thread(target=interrupt_after_two_commits)
    killer.start()
    try:
        with pytest.raises(JobAborted, match=r"interrupted by SIGINT.*--resume"):
            run_ray_job(
                options(store_root, short_runtime_dir, tmp_path / "c.jsonl", out, window_rows=10),
                address=None,
                workers=1,
            )
    finally:
        killer.join()
    assert not out.exists()
    committed = json.loads(state_file.read_text())
    assert 20 <= committed["rows"] < 200
    summary = run_ray_job(
        options(
            store_root, short_runtime_dir, tmp_path / "c.jsonl", out, window_rows=10, resume=True
        ),
        address=None,
        workers=1,
    )
    assert summary.resumed_from_line == committed["next_line"] > 1
    assert summary.rows == 200 and read_output(out)[1] == ids  # none lost, none twice
    assert not wait_gone(short_runtime_dir, timeout_s=30), "an actor's worker outlived it"


def test_token_level_outputs_on_ray_are_the_local_jobs(ray_session, store_root, tmp_path):
    """`--tokens --no-dense` (the sparse and multi-vector columns take the same path): the
    same columns, schema and metadata as the local job."""
    runtime_dir = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    write_jsonl(tmp_path / "c.jsonl", 12, seed=3, extra=[json.dumps({"id": "e", "text": ""})])
    kw = {"window_rows": 8, "outputs": ("tokens",), "dense": False}
    src = tmp_path / "c.jsonl"
    try:
        asyncio.run(run_job(options(store_root, runtime_dir, src, tmp_path / "l.parquet", **kw)))
        remote = run_ray_job(
            options(store_root, runtime_dir, src, tmp_path / "r.parquet", **kw), None, workers=1
        )
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
    (lt, lids), (rt, rids) = (
        read_output(tmp_path / "l.parquet"),
        read_output(tmp_path / "r.parquet"),
    )
    assert rids == lids and remote.rows == 12 and remote.errors == 1
    assert rt.schema == lt.schema and "embedding" not in rt.schema.names
    assert read_metadata(tmp_path / "r.parquet") == read_metadata(tmp_path / "l.parquet")
    assert read_metadata(tmp_path / "r.parquet")["outputs"] == "tokens"
    assert rt.column("n_tokens").to_pylist() == lt.column("n_tokens").to_pylist()
    for i in range(rt.num_rows):
        a = lt.column("tokens")[i].values.flatten().to_numpy()
        b = rt.column("tokens")[i].values.flatten().to_numpy()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def _late_rows() -> list[dict]:
    """Documents of 3, 1 and 12 chunks (the last over a 4-row window and over the model's
    context: read in overlapping windows), a row with no document, a document with a bad
    row, then two more documents."""
    rng = np.random.default_rng(11)
    long = [" ".join(rng.choice(WORDS, 60)) + ". " for _ in range(12)]
    docs = [
        ("A", ["The cat sat on the mat. ", "It purred softly. ", "Then it slept."]),
        ("B", ["A single chunk is a document of its own."]),
        ("L", long),
        (None, ["a row without its document field"]),  # missing_field
        ("C", ["The first chunk of a document ", ""]),  # empty_text: document_incomplete
        ("D", ["stock markets fell ", "sharply near the old river bank"]),
        ("E", ["The last document, ", "in two chunks."]),
    ]
    return [
        {"id": f"{doc or 'x'}{i}", "text": t, **({"doc": doc} if doc else {})}
        for doc, texts in docs
        for i, t in enumerate(texts)
    ]


def test_late_chunking_on_ray_writes_what_the_local_job_writes(
    ray_session, store_root, tmp_path, short_runtime_dir
):
    """Windows of 4 rows: Ray Data would cut L (12 rows) between blocks; the read ships each
    window of whole documents as one row, so the actor pools L from one reading, as the local
    job does: the same rows in order, vectors, error records (a document's stands for its
    rows) and metadata."""
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _late_rows()))
    kw = {"late_chunking": True, "doc_field": "doc", "window_rows": 4}
    local = asyncio.run(
        run_job(options(store_root, short_runtime_dir, src, tmp_path / "l.parquet", **kw))
    )
    out = tmp_path / "r.parquet"
    remote = run_ray_job(options(store_root, short_runtime_dir, src, out, **kw), None, workers=1)
    assert (remote.rows, remote.errors, remote.tokens) == (local.rows, local.errors, local.tokens)
    assert (local.rows, local.errors) == (20, 3)
    (lt, lids), (rt, rids) = read_output(tmp_path / "l.parquet"), read_output(out)
    assert rids == lids and "L11" in rids and "C0" not in rids
    assert rt.schema == lt.schema
    assert rt.column("n_tokens").to_pylist() == lt.column("n_tokens").to_pylist()
    np.testing.assert_allclose(
        np.stack(rt.column("embedding").to_numpy(zero_copy_only=False)),
        np.stack(lt.column("embedding").to_numpy(zero_copy_only=False)),
        rtol=0,
        atol=1e-6,
    )
    assert read_metadata(out) == read_metadata(tmp_path / "l.parquet")
    assert read_metadata(out)["late_chunking"] == "true"
    assert (tmp_path / "r.parquet.errors.jsonl").read_text() == (
        tmp_path / "l.parquet.errors.jsonl"
    ).read_text()
    assert not wait_gone(short_runtime_dir, timeout_s=30), "an actor's worker outlived it"
