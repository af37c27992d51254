"""`synapse batch embed --late-chunking --doc-field F` and `--tokens` on the default model, end to
end: each row's vector is what `Module.late_chunk` gives for its chunk of its document (the
document rules of batch/late.py, each one once), resume after an abort writes every row once,
and the token states written are what `Module.encode_outputs` returns."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from batch.errors import BatchUsageError, JobAborted
from batch.job import JobOptions, run_job
from batch.output import read_metadata
from host.admission import Budgets
from host.config import HostConfig
from host.module import Module, ModuleConfig
from tests.batch_support import WORDS

pytestmark = pytest.mark.model  # starts model workers

MAX_CHUNKS = 13  # the job's document bound in these tests (the service's is 2048)


def _long_chunks(n: int, words: int) -> list[str]:
    rng = np.random.default_rng(3)
    return [" ".join(rng.choice(WORDS, words)) + ". " for _ in range(n)]


# (doc field or None for "absent", id, text): the input, in order
LONG = _long_chunks(12, 60)  # ~720 words: more than one context window of the model
ROWS: list[tuple[str | None, str, str]] = [
    ("A", "a1", "The cat sat on the mat. "),
    ("A", "a2", "It purred softly. "),
    ("A", "a3", "Then it slept."),
    ("B", "b1", "A single chunk is a document of its own."),
    *[("L", f"L{i}", t) for i, t in enumerate(LONG)],  # longer than a window of 3 rows
    (None, "nodoc", "a row without its document field"),  # missing_field, no document
    ("C", "c1", "The first chunk of a document "),
    ("C", "c2", ""),  # empty_text: C is incomplete
    ("A", "a4", "Back to A after other documents: "),  # a new document "A"
    ("A", "a5", "it is embedded on its own."),
    *[("T", f"t{i}", f"chunk {i} ") for i in range(MAX_CHUNKS + 1)],  # over the bound
    ("D", "d1", "the ca"),
    ("D", "d2", "t"),  # inside the token "cat" that starts in d1: owns no token
    ("D", "d3", " sat on the mat"),
    ("E", "e1", "The last document, "),
    ("E", "e2", "in two chunks."),
]
EMBEDDED = [["a1", "a2", "a3"], ["b1"], [f"L{i}" for i in range(12)], ["a4", "a5"], ["e1", "e2"]]
# Documents alone in their batch (the only one of their window the job embeds): their
# windows go through the engine as late_chunk sends them. B and L share a window, so their
# windows share a batch, and llama.cpp's results move by ~1e-4 with a batch's shape.
ALONE = {"a1", "a4", "e1"}
ERRORS = [  # (line, code, rows the record stands for)
    (17, "missing_field", 1),
    (18, "document_incomplete", 1),
    (19, "empty_text", 1),
    (22, "document_too_long", MAX_CHUNKS + 1),
    (36, "invalid_request", 3),
]


def _write_input(path: Path) -> dict[str, str]:
    texts = {}
    with open(path, "w") as f:
        for doc, rid, text in ROWS:
            obj = {"id": rid, "text": text, **({"doc": doc} if doc is not None else {})}
            f.write(json.dumps(obj) + "\n")
            texts[rid] = text
    return texts


def _config(store_root: str, runtime_dir: str) -> ModuleConfig:
    return ModuleConfig(
        store_root=store_root,
        host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
        budgets=Budgets(max_inputs=MAX_CHUNKS),
    )


def _options(store_root, runtime_dir, input, output, **kw) -> JobOptions:
    kw = {"late_chunking": True, "doc_field": "doc", "window_rows": 3, **kw}
    return JobOptions(
        input=str(input), output=str(output), module=_config(store_root, runtime_dir), **kw
    )


@pytest.fixture(scope="module")
def runtime_dir():
    path = tempfile.mkdtemp(prefix="syn-", dir="/tmp")  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def late_job(store_root, runtime_dir, module_tmp):
    """The late-chunking job over ROWS, run once, uninterrupted."""
    src = module_tmp / "docs.jsonl"
    texts = _write_input(src)
    out = module_tmp / "late.parquet"
    summary = asyncio.run(run_job(_options(store_root, runtime_dir, src, out)))
    return src, out, summary, texts


def _errors(out: Path) -> list[dict]:
    path = out.with_name(out.name + ".errors.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_each_row_is_its_chunks_late_chunk_vector_and_documents_stay_whole(
    late_job, store_root, runtime_dir
):
    src, out, summary, texts = late_job
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert ids == [rid for doc in EMBEDDED for rid in doc]
    assert summary.rows == len(ids) and summary.errors == len(ERRORS)
    got = [(e["line"], e["error"]["code"], e.get("rows", 1)) for e in _errors(out)]
    assert got == ERRORS  # every input row is in the output or in exactly one record
    assert len(ids) + sum(n for *_, n in ERRORS) == len(ROWS)
    meta = read_metadata(out)
    assert meta["late_chunking"] == "true" and meta["doc_field"] == "doc"

    # A window never splits a document: the long one (12 rows, windows of 3) is one group.
    pf = pq.ParquetFile(out)
    groups = [set(pf.read_row_group(g).column("id").to_pylist()) for g in range(pf.num_row_groups)]
    for doc in EMBEDDED:
        assert sum(1 for g in groups if g & set(doc)) == 1, doc

    vectors = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    n_tokens = table.column("n_tokens").to_pylist()
    assert not any(table.column("truncated").to_pylist())
    mod = Module(ModuleConfig(store_root=store_root, host=HostConfig(runtime_dir=runtime_dir)))
    try:
        at = 0
        for doc in EMBEDDED:
            ref = await mod.late_chunk([texts[r] for r in doc])
            got = vectors[at : at + len(doc)]
            if doc[0] in ALONE:  # the same forward pass as late_chunk's: the same vectors
                assert np.array_equal(got, ref.vectors), doc
            else:  # batched with other documents' windows: llama.cpp's batch-shape noise
                cos = np.sum(got * ref.vectors, axis=1)
                assert cos.min() >= 0.9999 and np.abs(got - ref.vectors).max() < 5e-4, doc
            assert n_tokens[at : at + len(doc)] == list(ref.n_tokens)
            at += len(doc)
        tok = await mod.tokenizer()  # L is read in overlapping windows, not cut
        assert tok.encode(["".join(LONG)], truncate=True).truncated == [True]
    finally:
        await mod.close()


async def test_resume_after_an_abort_writes_every_row_once(late_job, store_root, runtime_dir):
    """An abort (more bad rows than --max-errors) after some windows, then --resume: the same
    rows, vectors and error records as the uninterrupted job; the checkpoint's job key holds
    the late-chunking options."""
    src, full, _, _ = late_job
    out = full.with_name("resumed.parquet")
    with pytest.raises(JobAborted):
        await run_job(_options(store_root, runtime_dir, src, out, max_errors=0))
    state = json.loads((out.with_name(out.name + ".partial") / "state.json").read_text())
    assert state["next_line"] == 20  # after the third window: a document's first row
    with pytest.raises(BatchUsageError, match="another job.*doc_field"):
        await run_job(_options(store_root, runtime_dir, src, out, doc_field="id", resume=True))
    summary = await run_job(_options(store_root, runtime_dir, src, out, resume=True))
    assert summary.resumed_from_line == 20
    a, b = pq.read_table(full), pq.read_table(out)
    assert a.column("id").to_pylist() == b.column("id").to_pylist()
    assert a.column("n_tokens").to_pylist() == b.column("n_tokens").to_pylist()
    np.testing.assert_allclose(
        np.stack(a.column("embedding").to_numpy(zero_copy_only=False)),
        np.stack(b.column("embedding").to_numpy(zero_copy_only=False)),
        rtol=0,
        atol=1e-6,
    )
    assert _errors(out) == _errors(full)


async def test_tokens_column_is_encode_outputs_token_states_and_duckdb_reads_it(
    store_root, runtime_dir, tmp_path
):
    texts = ["The cat sat on the mat.", "le chat dort sur le tapis rouge", "stock markets fell"]
    src = tmp_path / "t.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    out = tmp_path / "t.parquet"
    config = ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )
    opts = JobOptions(input=str(src), output=str(out), module=config, outputs=("tokens",))
    await run_job(opts)
    table = pq.read_table(out)
    assert read_metadata(out)["outputs"] == "dense,tokens"
    mod = Module(config)
    try:
        ref = await mod.encode_outputs(texts, ["dense", "tokens"])
        with pytest.raises(BatchUsageError, match="no sparse head"):
            await run_job(
                JobOptions(
                    input=str(src),
                    output=str(tmp_path / "s.parquet"),
                    module=config,
                    outputs=("sparse",),
                    dense=False,
                )
            )
    finally:
        await mod.close()
    dims = ref.dense.shape[1]
    rows = duckdb.execute("SELECT embedding, tokens FROM read_parquet(?)", [str(out)]).fetchall()
    for i in range(len(texts)):
        states = np.array(rows[i][1], np.float32).reshape(-1, dims)
        # A job packs its decodes otherwise than one request: llama.cpp's rounding moves.
        np.testing.assert_allclose(np.array(rows[i][0], np.float32), ref.dense[i], atol=1e-4)
        cos = (states * ref.tokens[i]).sum(1) / (
            np.linalg.norm(states, axis=1) * np.linalg.norm(ref.tokens[i], axis=1)
        )
        assert states.shape == ref.tokens[i].shape and cos.min() >= 0.9999
        flat = table.column("tokens")[i].values.flatten().to_numpy().reshape(-1, dims)
        assert np.array_equal(flat, states)
    assert table.column("n_tokens").to_pylist() == list(ref.n_tokens)


async def test_a_document_whose_window_crashes_the_engine_twice_is_one_error_record(
    store_root, runtime_dir, tmp_path, monkeypatch
):
    """Validation off and n_ubatch 64: the one document over 64 tokens trips a REAL GGML_ASSERT
    each time its window runs; it gets one engine_crashed record for its rows, the others
    are embedded."""
    monkeypatch.setenv("SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE", "1")
    rows = [
        ("A", "a1", "The cat sat. "),
        ("A", "a2", "It purred."),
        ("P", "p1", "the river bank " * 40),
        ("P", "p2", "end."),
        ("B", "b1", "Another one."),
    ]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t, "doc": d}) + "\n" for d, i, t in rows))
    lanes: list = []
    summary = await run_job(
        _options(
            store_root,
            runtime_dir,
            src,
            tmp_path / "p.parquet",
            window_rows=1,
            workers=1,
            lane="llama",
            runtime_config={"n_ubatch": 64, "n_batch": 64},
        ),
        on_ready=lanes.extend,
    )
    assert pq.read_table(tmp_path / "p.parquet").column("id").to_pylist() == ["a1", "a2", "b1"]
    [error] = _errors(tmp_path / "p.parquet")
    assert (error["line"], error["doc"], error["rows"]) == (3, "P", 2)
    assert error["error"]["code"] == "engine_crashed"
    assert "a window of document 'P' crashed the engine twice" in error["error"]["message"]
    assert summary.errors == 1 and lanes[0].crashes == 2  # the window, then once again
