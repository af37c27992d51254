"""batch.job in-process: formats, a worker SIGKILL mid-batch, a row that really crashes the
engine (a GGML_ASSERT), and resuming against a changed job."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from batch.errors import BatchUsageError
from batch.job import JobOptions, run_job
from batch.output import read_metadata
from host.config import HostConfig
from host.module import Module, ModuleConfig
from tests.batch_support import read_output, texts, write_jsonl

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker


def module_config(store_root, runtime_dir) -> ModuleConfig:
    return ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )


def options(store_root, runtime_dir, input, output, **kw) -> JobOptions:
    return JobOptions(
        input=str(input), output=str(output), module=module_config(store_root, runtime_dir), **kw
    )


async def test_txt_csv_and_parquet_inputs_give_the_same_vectors_as_module_embed(
    store_root, short_runtime_dir, tmp_path
):
    corpus = texts(40, seed=3, lengths=(4, 30, 300))  # some over the 256-token limit
    (tmp_path / "c.txt").write_text("\n".join(corpus) + "\n")
    table = pa.table({"key": [f"k{i}" for i in range(40)], "body": corpus})
    pcsv.write_csv(table, tmp_path / "c.csv")
    pq.write_table(table, tmp_path / "c.parquet")
    got = {}
    for name, fields in [
        ("c.txt", {}),
        ("c.csv", {"text_field": "body", "id_field": "key"}),
        ("c.parquet", {"text_field": "body", "id_field": "key"}),
    ]:
        summary = await run_job(
            options(
                store_root,
                short_runtime_dir,
                tmp_path / name,
                tmp_path / f"{name}.parquet",
                workers=2,
                window_rows=16,
                **fields,
            )
        )
        assert summary.rows == 40 and summary.errors == 0
        got[name] = read_output(tmp_path / f"{name}.parquet")
    assert got["c.txt"][1] == [str(i) for i in range(1, 41)]
    assert got["c.csv"][1] == got["c.parquet"][1] == [f"k{i}" for i in range(40)]
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        ref = await mod.embed(corpus)
    for name, (tbl, _) in got.items():
        vectors = np.stack(tbl.column("embedding").to_numpy(zero_copy_only=False))
        cos = np.sum(vectors * ref.vectors, axis=1)
        assert cos.min() >= 0.9999, (name, float(cos.min()))
        assert tbl.column("truncated").to_pylist() == ref.truncated
        assert any(ref.truncated)
    assert read_metadata(tmp_path / "c.csv.parquet")["dims"] == "384"


async def test_a_worker_sigkilled_mid_batch_is_retried_and_no_row_is_lost(
    store_root, short_runtime_dir, tmp_path
):
    ids = write_jsonl(tmp_path / "c.jsonl", 150, seed=4)
    killed: list[int] = []
    lanes = []

    async def kill_one_in_flight():
        while not lanes:
            await asyncio.sleep(0.01)
        emb = lanes[0]
        lane = emb.supervisor
        while lane.state().health.status != "busy":  # a batch is on the wire
            await asyncio.sleep(0.002)
        pid = lane.state().pid
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = asyncio.create_task(kill_one_in_flight())
    summary = await run_job(
        options(
            store_root,
            short_runtime_dir,
            tmp_path / "c.jsonl",
            tmp_path / "o.parquet",
            workers=1,
            window_rows=50,
        ),
        on_ready=lanes.extend,
    )
    await killer
    assert killed and lanes[0].crashes >= 1
    assert summary.rows == 150 and summary.errors == 0
    assert read_output(tmp_path / "o.parquet")[1] == ids


async def test_a_row_that_crashes_the_engine_twice_is_a_row_error(
    store_root, short_runtime_dir, tmp_path, monkeypatch
):
    """Validation off and n_ubatch 64: the one row over 64 tokens trips a REAL GGML_ASSERT in
    llama.cpp each time it runs; the job records it as engine_crashed and keeps the rest."""
    monkeypatch.setenv("SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE", "1")
    short = texts(30, seed=5, lengths=(3, 8, 15))
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(short)]
    rows.insert(12, {"id": "poison", "text": "the river bank " * 40})
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lanes = []
    summary = await run_job(
        options(
            store_root,
            short_runtime_dir,
            tmp_path / "c.jsonl",
            tmp_path / "o.parquet",
            workers=1,
            runtime_config={"n_ubatch": 64, "n_batch": 64},
        ),
        on_ready=lanes.extend,
    )
    assert summary.rows == 30 and summary.errors == 1
    assert read_output(tmp_path / "o.parquet")[1] == [f"r{i}" for i in range(30)]
    [error] = [json.loads(x) for x in open(summary.errors_file)]
    assert error["line"] == 13 and error["id"] == "poison"
    assert error["error"]["code"] == "engine_crashed"
    assert "crashed the engine twice" in error["error"]["message"]
    assert lanes[0].crashes == 4  # batch, batch again, then the row alone twice


async def test_resume_refuses_a_checkpoint_of_another_job(store_root, short_runtime_dir, tmp_path):
    write_jsonl(tmp_path / "c.jsonl", 10)
    out = tmp_path / "o.parquet"
    partial = tmp_path / "o.parquet.partial"
    partial.mkdir()
    (partial / "state.json").write_text(
        json.dumps(
            {
                "job": {"input": {"path": "/elsewhere.jsonl"}},
                "next_line": 5,
                "parts": 0,
                "rows": 4,
                "tokens": 0,
                "errors": 0,
                "errors_bytes": 0,
                "artifact_digest": None,
            }
        )
    )
    with pytest.raises(BatchUsageError, match="belongs to another job.*input"):
        await run_job(
            options(store_root, short_runtime_dir, tmp_path / "c.jsonl", out, resume=True)
        )
    with pytest.raises(BatchUsageError, match="pass --resume"):
        await run_job(options(store_root, short_runtime_dir, tmp_path / "c.jsonl", out))
