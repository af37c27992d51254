"""`BlockCommitter`: the Ray actors' results, arriving in any order and in pieces, become the
local job's checkpoint — a prefix of the input, one part per block, committed in order."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch.checkpoint import Checkpoint
from batch.dtypes import DTYPES, convert
from batch.errors import BatchUsageError, JobAborted
from batch.job import JobOptions
from batch.output import output_schema
from batch.ray_commit import BlockCommitter, float_vectors

DIMS = 4
META = json.dumps({"artifact_digest": "a" * 64, "prompt": "", "dims": str(DIMS)})


def meta_of(digit: str) -> str:
    return json.dumps({"artifact_digest": digit * 64, "prompt": "", "dims": str(DIMS)})


def result(lines, block, block_rows, meta=META, bad=()):
    """An actor's result rows for `lines` of `block`; lines in `bad` are row errors."""
    n = len(lines)
    vectors = np.array([[line, 0, 0, 0] for line in lines], np.float32).reshape(-1)
    return pa.table(
        {
            "line": pa.array(lines, pa.int64()),
            "id": [f"r{line}" for line in lines],
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors), DIMS),
            "n_tokens": pa.array([3] * n, pa.int32()),
            "truncated": [False] * n,
            "error_code": pa.array(
                [("empty_text" if line in bad else None) for line in lines], pa.string()
            ),
            "error_message": pa.array(
                [("no text" if line in bad else None) for line in lines], pa.string()
            ),
            "_meta": [meta] * n,
            "block": pa.array([block] * n, pa.int64()),
            "block_rows": pa.array([block_rows] * n, pa.int64()),
        }
    )


def open_job(tmp_path, resume=False, **kw):
    (tmp_path / "c.jsonl").write_text("")
    opts = JobOptions(
        input=str(tmp_path / "c.jsonl"), output=str(tmp_path / "o.parquet"), resume=resume, **kw
    )
    ckpt = Checkpoint.open(tmp_path / "o.parquet", {"job": 1}, resume)
    return opts, ckpt


def test_blocks_out_of_order_and_in_pieces_commit_as_a_prefix_in_order(tmp_path):
    opts, ckpt = open_job(tmp_path)
    commits = []
    committer = BlockCommitter(ckpt, opts, on_commit=lambda *c: commits.append(c))
    committer.add(result([5, 6], block=1, block_rows=2))  # ahead of block 0: held
    assert ckpt.state["parts"] == 0 and committer.held_blocks == 1
    committer.add(result([3, 4], block=0, block_rows=4, bad=(4,)))  # half of block 0
    assert ckpt.state["parts"] == 0
    # A piece spanning two blocks: the rest of block 0 and all of block 2.
    committer.add(
        pa.concat_tables(
            [result([1, 2], block=0, block_rows=4), result([8], block=2, block_rows=1)]
        )
    )
    assert committer.held_blocks == 0 and committer.next_block == 3
    s = ckpt.state
    assert (s["parts"], s["rows"], s["errors"], s["next_line"]) == (3, 6, 1, 9)
    ids = [pq.read_table(p).column("id").to_pylist() for p in ckpt.parts()]
    assert ids == [["r1", "r2", "r3"], ["r5", "r6"], ["r8"]]
    first = pq.read_table(ckpt.parts()[0]).column("embedding").to_pylist()
    assert [v[0] for v in first] == [1.0, 2.0, 3.0]  # each vector stays with its row
    assert [json.loads(x)["line"] for x in ckpt.errors_path.read_text().splitlines()] == [4]
    assert commits == [(3, 9, 1), (2, 6, 0), (1, 3, 0)]
    assert committer.meta["artifact_digest"] == "a" * 64


def test_rows_from_another_artifact_stop_the_job_before_they_commit(tmp_path):
    opts, ckpt = open_job(tmp_path)
    committer = BlockCommitter(ckpt, opts)
    committer.add(result([1], block=0, block_rows=1))
    other = meta_of("b")
    with pytest.raises(JobAborted, match="different models/artifacts"):
        committer.add(result([2], block=1, block_rows=1, meta=other))
    assert ckpt.state["parts"] == 1
    with pytest.raises(JobAborted, match="came back with 2 rows"):
        committer.add(result([3, 4], block=2, block_rows=1))


def test_max_errors_stops_after_the_commit_that_broke_it_and_resume_checks_the_artifact(tmp_path):
    opts, ckpt = open_job(tmp_path, max_errors=1)
    committer = BlockCommitter(ckpt, opts)
    with pytest.raises(JobAborted, match="more than --max-errors 1"):
        committer.add(result([1, 2, 3], block=0, block_rows=3, bad=(1, 2)))
    assert ckpt.state["next_line"] == 4  # committed: --resume goes on after it

    opts, ckpt = open_job(tmp_path, resume=True)
    committer = BlockCommitter(ckpt, opts)
    with pytest.raises(BatchUsageError, match="embedded with artifact aaaaaaaaaaaa"):
        committer.add(result([4], block=0, block_rows=1, meta=meta_of("c")))
    assert ckpt.state["parts"] == 1


def test_the_committed_dtype_conversion_is_the_local_one(tmp_path):
    from tests.test_batch_encoding import COLUMN, _vectors

    v = np.random.default_rng(1).standard_normal((4, 384)).astype(np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), 384).slice(1)
    assert np.array_equal(float_vectors(column), v[1:])  # a slice's offset kept
    ranges = np.vstack((v.min(0), v.max(0)))
    meta = json.dumps({"artifact_digest": "a" * 64, "prompt": "", "dims": "384"})
    rows = result([2, 3, 4], block=0, block_rows=3, meta=meta)
    rows = rows.set_column(rows.schema.get_field_index("embedding"), "embedding", column)
    for dtype in DTYPES:
        (tmp_path / dtype).mkdir()
        opts, ckpt = open_job(tmp_path / dtype, dtype=dtype)
        BlockCommitter(ckpt, opts, ranges).add(rows)
        (part,) = ckpt.parts()
        got = pq.read_table(part)
        assert got.schema == output_schema(384, None, dtype), dtype
        assert got.schema.field("embedding").type == COLUMN[dtype]
        assert np.array_equal(_vectors(got), convert(v[1:], dtype, ranges)), dtype


def test_a_late_chunking_block_commits_its_records_tokens_and_next_line_as_the_local_job(
    tmp_path,
):
    """A late-chunking window (batch/ray_late.py): its checkpoint goes on after the rows its
    last record stands for (a resume starts at the next document), counts the tokens it read
    (overlapping forward windows, not the chunks' own), and keeps a document's record whole."""
    from batch.job import LateResults
    from batch.late import DOCUMENT_TOO_LONG, document_record
    from batch.ray_late import _late_table
    from batch.rows import Row
    from batch.windows import Window

    rows = [Row(1, "a1", "x", doc="A"), Row(2, "a2", "y", doc="A")]
    record = document_record(Row(3, "t1", "z", doc="T"), "T", 8, 6, DOCUMENT_TOO_LONG, "long")
    done = LateResults(rows, [3, 2], np.ones((2, DIMS), np.float32), [record], tokens=17)
    window = Window(0, 9, rows, [], [False, False], [record])
    opts, ckpt = open_job(tmp_path)
    BlockCommitter(ckpt, opts).add(_late_table(done, window, 0, META, DIMS))
    s = ckpt.state
    assert (s["parts"], s["rows"], s["errors"], s["tokens"], s["next_line"]) == (1, 2, 1, 17, 9)
    assert pq.read_table(ckpt.parts()[0]).column("id").to_pylist() == ["a1", "a2"]
    assert [json.loads(x) for x in ckpt.errors_path.read_text().splitlines()] == [record]
