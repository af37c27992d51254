"""`synapse batch embed --dtype`: the Parquet column type of each dtype, its values against
sentence-transformers' `quantize_embeddings` of the float32 job's vectors, the metadata that
says how the rows were quantized, locally and on Ray."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch.dtypes import DTYPES, convert, embedding_array, embedding_type
from batch.errors import BatchUsageError
from batch.job import JobOptions, run_job, validate
from batch.output import make_table, output_schema, read_metadata
from batch.rows import InputSpec
from certification.calibration import calibration_set
from cli.main import build_parser
from host.config import HostConfig
from host.module import ModuleConfig
from ingest.quantization import calibration_ranges, record_ranges
from ingest.store import ArtifactStore
from tests.batch_support import write_jsonl
from tests.encoding_support import private_store, st_quantize

MODEL = "minilm-l6-v2"
COLUMN = {
    "float32": pa.list_(pa.float32(), 384),
    "float16": pa.list_(pa.float16(), 384),
    "int8": pa.list_(pa.int8(), 384),
    "uint8": pa.list_(pa.uint8(), 384),
    "binary": pa.list_(pa.int8(), 48),
    "ubinary": pa.binary(48),
}


def _vectors(table: pa.Table) -> np.ndarray:
    column = table.column("embedding").combine_chunks()
    if pa.types.is_fixed_size_binary(column.type):
        return np.frombuffer(b"".join(column.to_pylist()), np.uint8).reshape(len(column), -1)
    return column.flatten().to_numpy().reshape(len(column), -1)


# ---- without a model ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_has_its_column_type_through_parquet(dtype, tmp_path):
    assert embedding_type(384, dtype) == COLUMN[dtype]
    rng = np.random.default_rng(0)
    v = rng.standard_normal((5, 384)).astype(np.float32)
    ranges = np.vstack((v.min(0), v.max(0)))
    values = convert(v, dtype, ranges)
    schema = output_schema(384, {"dims": "384", "dtype": dtype}, dtype)
    table = make_table([f"r{i}" for i in range(5)], values, [3] * 5, [False] * 5, schema)
    pq.write_table(table, tmp_path / "t.parquet")
    back = pq.read_table(tmp_path / "t.parquet")
    assert back.schema.field("embedding").type == COLUMN[dtype]
    assert np.array_equal(_vectors(back), values)
    assert read_metadata(tmp_path / "t.parquet")["dtype"] == dtype


def test_a_float_vector_never_lands_in_an_integer_column():
    v = np.ones((2, 384), np.float32)
    with pytest.raises(TypeError):
        embedding_array(v, COLUMN["int8"])
    assert embedding_array(v, COLUMN["float16"]).type == COLUMN["float16"]  # a float narrows


def test_the_cli_offers_every_dtype_and_the_job_checks_its_own(tmp_path):
    def parse(*extra):
        return build_parser().parse_args(["batch", "embed", "in.jsonl", "-o", "o.parquet", *extra])

    assert parse().dtype == "float32"
    assert [parse("--dtype", d).dtype for d in DTYPES] == list(DTYPES)
    with pytest.raises(SystemExit):
        parse("--dtype", "int4")

    write_jsonl(tmp_path / "c.jsonl", 2)
    base = {"input": str(tmp_path / "c.jsonl"), "output": str(tmp_path / "o.parquet")}
    with pytest.raises(BatchUsageError, match="one of float32"):
        validate(JobOptions(**base, dtype="int4"))
    with pytest.raises(BatchUsageError, match="normalized"):
        validate(JobOptions(**base, dtype="int8", normalize=False))
    validate(JobOptions(**base, dtype="binary", normalize=False))  # signs need no ranges
    # A float32 job's checkpoint key is what it was before --dtype: old checkpoints resume.
    spec = InputSpec(base["input"], "text", "id")
    assert "dtype" not in JobOptions(**base).job_key(spec)
    assert JobOptions(**base, dtype="int8").job_key(spec)["dtype"] == "int8"


# ---- with the default model --------------------------------------------------------------------


def _options(root, runtime, input, output, **kw) -> JobOptions:
    module = ModuleConfig(store_root=root, host=HostConfig(runtime_dir=runtime, ping_interval_s=0))
    return JobOptions(input=str(input), output=str(output), module=module, **kw)


@pytest.fixture(scope="module")
def float_job(store_root, module_tmp):
    """A private store's default model and the float32 job over 40 rows; the model's int8
    ranges recorded from those very vectors (a real calibration embeds the whole corpus: the
    encoding tests do that; here the job must only read what the manifest holds)."""
    import shutil
    import tempfile

    root = private_store(store_root, module_tmp / "models", [MODEL])
    write_jsonl(module_tmp / "c.jsonl", 40, seed=5)
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    try:
        asyncio.run(
            run_job(
                _options(
                    root,
                    runtime,
                    module_tmp / "c.jsonl",
                    module_tmp / "float32.parquet",
                    window_rows=16,
                )
            )
        )
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    vectors = _vectors(pq.read_table(module_tmp / "float32.parquet"))
    ranges = calibration_ranges(vectors, 384)
    store = ArtifactStore(root)
    kept = record_ranges(
        store, MODEL, store.get(MODEL).digest, {384: ranges}, calibration_set(), "llama", "t"
    )
    assert np.array_equal(kept[384], ranges)
    return {"root": root, "dir": module_tmp, "vectors": vectors, "ranges": ranges}


@pytest.mark.model
async def test_each_dtype_writes_quantize_embeddings_of_the_float_job(float_job, short_runtime_dir):
    root, d, want, ranges = (float_job[k] for k in ("root", "dir", "vectors", "ranges"))
    float_meta = read_metadata(d / "float32.parquet")
    assert float_meta["dtype"] == "float32" and "quantization_ranges" not in float_meta
    for dtype in DTYPES[1:]:
        out = d / f"{dtype}.parquet"
        summary = await run_job(
            _options(root, short_runtime_dir, d / "c.jsonl", out, window_rows=16, dtype=dtype)
        )
        assert summary.rows == 40 and summary.metadata["dtype"] == dtype
        table = pq.read_table(out)
        assert table.schema.field("embedding").type == COLUMN[dtype]
        assert table.column("id").to_pylist() == [f"doc{i}" for i in range(40)]
        got = _vectors(table)
        if dtype == "float16":
            assert np.array_equal(got, want.astype(np.float16))
        else:
            expected = st_quantize(want, dtype, ranges=ranges if dtype.endswith("int8") else None)
            assert got.dtype == expected.dtype and np.array_equal(got, expected), dtype
        meta = read_metadata(out)
        assert {k: v for k, v in meta.items() if k not in ("dtype", "quantization_ranges")} == {
            k: v for k, v in float_meta.items() if k != "dtype"
        }
        assert meta["dims"] == "384"  # the model's width, also for 48 packed bytes
        if dtype.endswith("int8"):
            recorded = json.loads(meta["quantization_ranges"])
            assert recorded["calibration"] == calibration_set()
            assert np.array_equal(np.array([recorded["min"], recorded["max"]], np.float32), ranges)
        else:
            assert "quantization_ranges" not in meta


@pytest.mark.model
def test_the_ray_job_quantizes_with_the_models_ranges(
    ray_session, float_job, tmp_path, short_runtime_dir
):
    from batch.ray_job import run_ray_job

    root, d, want, ranges = (float_job[k] for k in ("root", "dir", "vectors", "ranges"))
    remote = run_ray_job(
        _options(
            root,
            short_runtime_dir,
            d / "c.jsonl",
            tmp_path / "r.parquet",
            window_rows=16,
            dtype="int8",
        ),
        address=None,
        workers=1,
    )
    assert remote.rows == 40
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.schema.field("embedding").type == COLUMN["int8"]
    meta = read_metadata(tmp_path / "r.parquet")
    assert meta["dtype"] == "int8"
    recorded = json.loads(meta["quantization_ranges"])
    assert np.array_equal(np.array([recorded["min"], recorded["max"]], np.float32), ranges)
    # Ray batches the rows its own way, so a float may differ in its last bit from the local
    # job's, and a value on a bucket edge may fall one bucket over; nothing more.
    diff = np.abs(_vectors(table).astype(int) - st_quantize(want, "int8", ranges=ranges))
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99
