"""The bulk job's token-level columns (batch/kinds.py): sparse and multi-vector rows written as
a job writes them (a part per window, merged) and read back exactly by pyarrow and DuckDB."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch.kinds import kind_arrays, kind_fields
from batch.output import make_table, merge_parts, output_schema, read_metadata, write_part

DIMS, HEAD_DIMS, VOCAB = 8, 5, 30522


def _rows(rng: np.random.Generator, n: int):
    sparse, multi = [], []
    for i in range(n):
        k = int(rng.integers(0, 40)) if i else 0  # the first row has no active term at all
        idx = np.sort(rng.choice(VOCAB, size=k, replace=False)).astype(np.int32)
        sparse.append((idx, rng.random(k, dtype=np.float32) * 3))
        multi.append(rng.standard_normal((int(rng.integers(1, 12)), HEAD_DIMS)).astype(np.float32))
    dense = rng.standard_normal((n, DIMS)).astype(np.float32)
    return dense, sparse, multi


def test_sparse_and_multivector_columns_read_back_exactly_by_pyarrow_and_duckdb(tmp_path):
    rng = np.random.default_rng(7)
    extra = kind_fields("sparse", 0) + kind_fields("multivector", HEAD_DIMS)
    meta = {"dims": str(DIMS), "outputs": "dense,sparse,multivector"}
    schema = output_schema(DIMS, None, extra=extra)
    parts, want = [], []
    for p in range(2):  # two windows, merged as a job publishes them
        dense, sparse, multi = _rows(rng, 6)
        ids = [f"r{p}-{i}" for i in range(6)]
        arrays = kind_arrays("sparse", sparse, 0) + kind_arrays("multivector", multi, HEAD_DIMS)
        table = make_table(ids, dense, [3] * 6, [False] * 6, schema, arrays)
        write_part(tmp_path / f"part-{p}.parquet", table)
        parts.append(tmp_path / f"part-{p}.parquet")
        want += list(zip(ids, dense, sparse, multi, strict=True))
    out = tmp_path / "out.parquet"
    merge_parts(parts, out, output_schema(DIMS, meta, extra=extra))

    got = pq.read_table(out)
    assert got.schema.field("sparse_indices").type == pa.list_(pa.int32())
    assert got.schema.field("sparse_values").type == pa.list_(pa.float32())
    assert got.schema.field("multivector").type == pa.list_(pa.list_(pa.float32(), HEAD_DIMS))
    assert read_metadata(out)["outputs"] == "dense,sparse,multivector"
    db = duckdb.connect()
    rows = db.execute(
        "SELECT id, sparse_indices, sparse_values, multivector, embedding FROM read_parquet(?)",
        [str(out)],
    ).fetchall()
    described = db.execute("DESCRIBE SELECT * FROM read_parquet(?)", [str(out)]).fetchall()
    types = {row[0]: row[1] for row in described}
    assert types["sparse_indices"] == "INTEGER[]" and types["sparse_values"] == "FLOAT[]"
    # Parquet has no fixed-size list: pyarrow restores it from the Arrow schema the file
    # stores, DuckDB reads a list of lists (each inner list has d values, checked below).
    assert types["multivector"] == "FLOAT[][]"
    assert len(rows) == got.num_rows == len(want)
    for i, (rid, dense, (idx, val), multi) in enumerate(want):
        assert got.column("id")[i].as_py() == rid == rows[i][0]
        # pyarrow: the very arrays written, bit for bit
        assert np.array_equal(got.column("sparse_indices")[i].values.to_numpy(), idx)
        assert np.array_equal(got.column("sparse_values")[i].values.to_numpy(), val)
        flat = got.column("multivector")[i].values.flatten().to_numpy()
        assert np.array_equal(flat.reshape(-1, HEAD_DIMS), multi)
        # DuckDB: FLOAT is float32, so its Python floats are the float32 values exactly
        assert np.array_equal(np.array(rows[i][1], np.int32), idx)
        assert np.array_equal(np.array(rows[i][2], np.float32), val)
        assert np.array_equal(np.array(rows[i][3], np.float32).reshape(-1, HEAD_DIMS), multi)
        assert np.array_equal(np.array(rows[i][4], np.float32), dense)


def test_a_sparse_row_whose_indices_and_values_differ_in_length_is_refused():
    with pytest.raises(ValueError, match="2 indices and 1 values"):
        kind_arrays("sparse", [(np.array([1, 2]), np.array([0.5]))], 0)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"late_chunking": True}, "needs --doc-field"),
        ({"doc_field": "doc"}, "needs --doc-field"),
        ({"late_chunking": True, "doc_field": "doc", "outputs": ("tokens",)}, "dense vector only"),
        ({"late_chunking": True, "doc_field": "doc", "input": "rows.txt"}, "no fields"),
        ({"dense": False}, "nothing to write"),
        ({"dense": False, "outputs": ("sparse",), "dtype": "int8"}, "writes none"),
        ({"outputs": ("sparse", "sparse")}, "each output kind once"),
        ({"outputs": ("colbert",)}, "one of sparse, multivector, tokens"),
        ({"task": "classify", "model": "x", "outputs": ("tokens",)}, "label scores only"),
    ],
)
def test_what_late_chunking_and_the_token_outputs_combine_with(tmp_path, kw, message):
    """Usage errors before any model is loaded (the CLI's exit 2)."""
    from batch.errors import BatchUsageError
    from batch.job import JobOptions, validate

    (tmp_path / "rows.jsonl").write_text('{"text": "a", "doc": 1}\n')
    (tmp_path / "rows.txt").write_text("a\n")
    kw = {**kw, "input": str(tmp_path / kw.get("input", "rows.jsonl"))}
    with pytest.raises(BatchUsageError, match=message):
        validate(JobOptions(output=str(tmp_path / "out.parquet"), **kw))


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--late-chunking"], "--late-chunking needs --doc-field F"),
        (["--no-dense", "--dtype", "int8", "--multi-vector"], "--dtype int8 is the embedding"),
    ],
)
def test_the_cli_flags_reach_the_job(tmp_path, flags, says):
    """The flags as the job reads them: a usage error (exit 2) before any model is installed."""
    from tests.batch_support import batch_cli

    (tmp_path / "rows.jsonl").write_text('{"text": "a", "doc": 1}\n')
    done = batch_cli(
        tmp_path / "cache", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "o.parquet"), *flags
    )
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert not (tmp_path / "cache" / "models").exists()  # nothing was installed
