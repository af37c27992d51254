"""`synapse batch embed --ray [ADDRESS]`: the same job on Ray Data.

    read_datasource(RowsDatasource)          the local job's reader and row rules, striped
    .map_batches(EmbedActor, concurrency=N)  each actor starts a `Module` (supervised workers
                                             on its node, tokenization included)
    .write_parquet(OUTPUT.ray/)              on the nodes; rows carry their errors
then the driver merges the files into OUTPUT (same columns and metadata as the local job) and
the error rows into OUTPUT.errors.jsonl, both published atomically.

Why a datasource of our own rather than `read_json`/`read_text`: Ray's readers neither number
lines nor survive a line that is not JSON; ours yields exactly the local job's rows (line
numbers, ids, the same error codes), so the two jobs agree row for row.

Placement: an Apple-silicon node offers the custom resource `{"ane": 1}` (`node_resources`),
and an ANE-lane actor asks for it, so Core ML engines land only where a Neural Engine is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from batch.dtypes import convert, dtype_metadata, embedding_array, embedding_type, needs_ranges
from batch.errors import ENGINE_CRASHED, BatchUsageError, JobAborted
from batch.job import JobOptions, JobSummary, validate
from batch.output import merge_parts, output_schema, publish_copy
from batch.rows import InputSpec, Row, read_rows
from certification.calibration import calibration_set
from host.module import ModuleConfig
from host.node_resources import node_resources

# Ray reports usage statistics to its authors by default; ours never phones home (an
# operator may still opt in by setting the variable).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Engines own the cores; reading rows and writing Parquet are I/O and ask for little CPU, so
# they are never starved by the actors (Ray's CPU accounting is logical).
_IO_CPUS = 0.1
_ACTOR_CPUS = 0.9
# Rows per read block and per actor call: small enough that batches spread evenly over the
# actors and the first rows come out early, large enough for length-aware batching.
_READ_BLOCK_ROWS = 1024
_ACTOR_BATCH_ROWS = 1024



def _row_schema() -> pa.Schema:
    return pa.schema([("line", pa.int64()), ("id", pa.string()), ("text", pa.string()),
                      ("error_code", pa.string()), ("error_message", pa.string())])


class RowsDatasource(Datasource):
    """A Ray Data source over `batch.rows`: `stripes` read tasks, task k keeping the k-th of
    every `stripes` blocks of rows. Each task parses the whole input (cheap next to
    embedding), so every actor gets blocks from the start instead of one task feeding one
    actor; the rows and their line numbers are exactly the local job's."""

    def __init__(self, spec: InputSpec, stripes: int = 1,
                 block_rows: int = _READ_BLOCK_ROWS) -> None:
        self.spec, self.stripes, self.block_rows = spec, max(1, stripes), block_rows

    def estimate_inmemory_data_size(self):
        return None

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        spec, n, rows = self.spec, self.stripes, self.block_rows
        meta = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None,
                             input_files=(spec.path,))
        return [ReadTask(lambda k=k: _read_blocks(spec, k, n, rows), meta,
                         schema=_row_schema()) for k in range(n)]

    def get_name(self) -> str:
        return "SynapseRows"


def _read_blocks(spec: InputSpec, stripe: int = 0, stripes: int = 1,
                 block_rows: int = _READ_BLOCK_ROWS):
    buf: list[Row] = []
    block = 0
    for row in read_rows(spec):
        buf.append(row)
        if len(buf) >= block_rows:
            if block % stripes == stripe:
                yield _rows_table(buf)
            buf, block = [], block + 1
    if buf and block % stripes == stripe:
        yield _rows_table(buf)


def _rows_table(rows: list[Row]) -> pa.Table:
    return pa.Table.from_pydict(
        {"line": [r.line for r in rows], "id": [r.id for r in rows],
         "text": [r.text for r in rows], "error_code": [r.error_code for r in rows],
         "error_message": [r.error_message for r in rows]},
        schema=_row_schema(),
    )


class EmbedActor:
    """One engine per actor: a `Module` whose supervised worker runs on the actor's node."""

    def __init__(self, model, lane, normalize, truncate, module_config: bytes,
                 planned_workers, runtime_config=None, prompt_name=None) -> None:
        import msgspec

        from batch.embedder import LaneEmbedder
        from batch.metadata import describe
        from host.module import Module, ModuleConfig

        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        self._closed = False
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        config = msgspec.json.decode(module_config, type=ModuleConfig)  # JSON: any node
        config = msgspec.structs.replace(config, planned_workers=planned_workers)
        self.module = Module(config)
        self.embedder = LaneEmbedder(self.module, model, lane, normalize, runtime_config,
                                     prompt_name=prompt_name)
        self._run(self.embedder.start())
        self.truncate = truncate
        self.meta = json.dumps(describe(self.embedder, normalize), sort_keys=True)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def __call__(self, batch: pa.Table) -> pa.Table:
        from batch.windows import tokenize_window

        rows = [Row(*v) for v in zip(*(batch.column(c).to_pylist() for c in
                                       ("line", "id", "text", "error_code", "error_message")),
                                     strict=True)]
        cfg = self.module.config
        emb = self.embedder
        assert emb.tokenizer is not None  # set when the embedder started
        window = tokenize_window(0, rows, 0, emb.tokenizer, self.truncate,
                                 cfg.max_batch_tokens, cfg.max_batch_items, emb.prompt)
        vectors = np.zeros((len(window.rows), emb.dims), np.float32)
        crashed: dict[int, str] = {}
        for group in window.batches:
            result = self._run(emb.embed([window.ids[i] for i in group]))
            for j, i in enumerate(group):
                if j in result.failed:
                    crashed[i] = result.failed[j]
                else:
                    vectors[i] = result.vectors[j]
        return _result_table(window, vectors, crashed, emb.dims, self.meta)

    def calibration_ranges(self) -> list:
        """The model's int8/uint8 ranges at its full width (certification.calibration)."""
        from certification.calibration import Calibrations

        emb = self.embedder
        book = Calibrations(self.module)
        return self._run(book.ranges(emb.model, emb.dims, emb.lane)).tolist()

    def close(self) -> None:
        """Every worker stopped and reaped, and the actor's loop ended; once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.module.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the loop may be gone at interpreter exit
            pass


def _result_table(window, vectors, crashed, dims, meta) -> pa.Table:
    ok_rows = window.rows
    lines, ids, codes, messages, n_tok, cut, keep = [], [], [], [], [], [], []
    for i, row in enumerate(ok_rows):
        lines.append(row.line)
        ids.append(row.id)
        code = ENGINE_CRASHED if i in crashed else None
        codes.append(code)
        messages.append(crashed.get(i))
        n_tok.append(len(window.ids[i]))
        cut.append(window.truncated[i])
        keep.append(i)
    for err in window.errors:
        lines.append(err["line"])
        ids.append(err["id"])
        codes.append(err["error"]["code"])
        messages.append(err["error"]["message"])
        n_tok.append(0)
        cut.append(False)
    all_vectors = np.zeros((len(lines), dims), np.float32)
    all_vectors[: len(keep)] = vectors
    flat = pa.array(all_vectors.reshape(-1))
    n = len(lines)
    table = pa.table({
        "line": pa.array(lines, pa.int64()), "id": pa.array(ids, pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(flat, dims),
        "n_tokens": pa.array(n_tok, pa.int32()), "truncated": pa.array(cut, pa.bool_()),
        "error_code": pa.array(codes, pa.string()),
        "error_message": pa.array(messages, pa.string()),
        # Provenance on every row (dictionary-encoded in Parquet: a few bytes a file), so
        # the merge can refuse a run whose nodes embedded with different artifacts.
        "_meta": pa.array([meta] * n, pa.string()),
        "_done_at": pa.array([time.time()] * n, pa.float64()),
    })
    return table.sort_by("line")


def run_ray_job(opts: JobOptions, address: str | None, workers: int | None = None,
                timings: dict | None = None) -> JobSummary:
    """Run on Ray (connecting, or starting a local Ray); raise like `run_job`.

    `timings` (bench): filled with `ray_init_s` and `first_row_s` (seconds from the call to
    the first embedded batch)."""
    t0 = time.time()
    spec = validate(opts)
    if spec.path == "-":
        raise BatchUsageError("--ray reads a file every node can open, not stdin")
    # Read tasks run in the workers' own directories: name the file as the driver sees it.
    spec = dataclasses.replace(spec, path=str(Path(spec.path).absolute()))
    output = Path(opts.output).absolute()
    scratch = output.with_name(output.name + ".ray")
    if not output.parent.is_dir():
        raise BatchUsageError(f"output directory {output.parent} does not exist")
    try:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
    except OSError as exc:
        raise BatchUsageError(
            f"cannot write in the output directory {output.parent}: {exc.strerror or exc}"
        ) from None
    workers = workers or 1
    if not ray.is_initialized():
        if address is None:
            ray.init(num_cpus=workers + 1, resources=node_resources(),
                     include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    if timings is not None:
        timings["ray_init_s"] = time.time() - t0
    resources = {}
    if opts.lane == "ane":
        if ray.cluster_resources().get("ane", 0) < 1:
            shutil.rmtree(scratch, ignore_errors=True)
            raise BatchUsageError(
                "no Ray node offers the 'ane' resource: Apple-silicon nodes advertise it "
                "(`ray start --resources '{\"ane\": 1}'`); use --lane llama elsewhere"
            )
        resources = {"ane": 1}
    cores = os.cpu_count() or 1
    actor_kwargs = _actor_kwargs(opts, workers, cores)

    def describe() -> str:  # no row at all: the lane where the actors would have run
        try:
            return ray.get(_describe.options(num_cpus=_ACTOR_CPUS, resources=resources or None)
                           .remote(actor_kwargs))
        except ray.exceptions.RayError as exc:
            raise _ray_failed(exc) from exc

    try:
        try:
            ranges = None
            if needs_ranges(opts.dtype):
                # One node's ranges for every row: the actors write float32 and the driver
                # quantizes at the merge, so nodes with their own stores cannot disagree.
                ranges = np.array(ray.get(
                    _calibrate.options(num_cpus=_ACTOR_CPUS, resources=resources or None)
                    .remote(actor_kwargs)), np.float32)
            _execute(spec, opts, scratch, workers, resources, actor_kwargs)
        except (ray.exceptions.RayError, RuntimeError) as exc:
            raise _ray_failed(exc) from exc
        summary = _merge(opts, scratch, output, t0, timings, describe, ranges)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summary


def _ray_failed(exc: BaseException) -> JobAborted:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return JobAborted(f"the Ray job failed: {first}")


def _actor_kwargs(opts: JobOptions, workers: int, cores: int) -> dict:
    return {
        "model": opts.model, "lane": opts.lane, "normalize": opts.normalize,
        "truncate": opts.truncate,
        "module_config": msgspec.json.encode(opts.module or ModuleConfig()),
        "planned_workers": max(1, min(workers, cores)),
        "runtime_config": opts.runtime_config,
        "prompt_name": opts.prompt_name,
    }


@ray.remote
def _calibrate(actor_kwargs: dict) -> list:
    """The model's int8/uint8 ranges as one actor's node has (or computes and records) them."""
    actor = EmbedActor(**actor_kwargs)
    try:
        return actor.calibration_ranges()
    finally:
        actor.close()


@ray.remote
def _describe(actor_kwargs: dict) -> str:
    """The provenance an actor writes on its rows, for an input that has none: one actor's
    lane is started, described and stopped, so an empty output says what a full one would."""
    actor = EmbedActor(**actor_kwargs)
    try:
        return actor.meta
    finally:
        actor.close()


def _execute(spec, opts, scratch: Path, workers: int, resources: dict,
             actor_kwargs: dict) -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # rows come out in input order
    rows = min(opts.window_rows, _ACTOR_BATCH_ROWS)
    ds = ray.data.read_datasource(RowsDatasource(spec, workers, rows), num_cpus=_IO_CPUS,
                                  override_num_blocks=workers)
    ds = ds.map_batches(
        EmbedActor,
        batch_format="pyarrow",
        batch_size=rows,
        concurrency=workers,
        num_cpus=_ACTOR_CPUS,
        resources=resources or None,
        fn_constructor_kwargs=actor_kwargs,
    )
    # At most one actor batch a file: files then sort by their first line into input order.
    ds.write_parquet(str(scratch), max_rows_per_file=rows,
                     ray_remote_args={"num_cpus": _IO_CPUS})


def _merge(opts: JobOptions, scratch: Path, output: Path, t0: float,
           timings: dict | None, describe: Callable[[], str],
           ranges: np.ndarray | None = None) -> JobSummary:
    """The files into OUTPUT and the error rows into OUTPUT.errors.jsonl; `describe()` gives
    the provenance when no row at all was written (an empty input)."""
    files = sorted(scratch.rglob("*.parquet"), key=_first_line)
    metas = set()
    errors_tmp = scratch / "errors.jsonl"
    parts_dir = scratch / "merged"
    parts_dir.mkdir()
    parts: list[Path] = []
    rows = errors = tokens = 0
    first_done = None
    with open(errors_tmp, "w") as err_out:
        for f in files:
            table = pq.read_table(f).sort_by("line")
            if table.num_rows == 0:
                continue
            metas.update(table.column("_meta").unique().to_pylist())
            done = min(table.column("_done_at").to_pylist())
            first_done = done if first_done is None else min(first_done, done)
            bad = table.filter(pa.compute.is_valid(table.column("error_code")))
            good = table.filter(pa.compute.is_null(table.column("error_code")))
            for rec in bad.select(["line", "id", "error_code", "error_message"]).to_pylist():
                err_out.write(json.dumps({"line": rec["line"], "id": rec["id"],
                                          "error": {"code": rec["error_code"],
                                                    "message": rec["error_message"]}},
                                         ensure_ascii=False) + "\n")
            errors += bad.num_rows
            if good.num_rows:
                part = parts_dir / f"{len(parts):06d}.parquet"
                good = _as_dtype(good.select(["id", "embedding", "n_tokens", "truncated"]),
                                 opts.dtype, ranges)
                pq.write_table(good, part)
                parts.append(part)
                rows += good.num_rows
                tokens += int(pa.compute.sum(good.column("n_tokens")).as_py() or 0)
    if len(metas) > 1:
        raise JobAborted(f"the nodes embedded with different models/artifacts: {sorted(metas)}")
    if timings is not None and first_done is not None:
        timings["first_row_s"] = first_done - t0
    errors_dest = opts.errors_output().absolute()
    if errors:
        publish_copy(errors_tmp, errors_dest)
    else:
        errors_dest.unlink(missing_ok=True)
    if errors > opts.max_errors:
        raise JobAborted(f"{errors} rows failed, more than --max-errors {opts.max_errors}; "
                         f"see {errors_dest}")
    meta = json.loads(metas.pop() if metas else describe())
    meta.update(dtype_metadata(opts.dtype, ranges, calibration_set()))
    merge_parts(parts, output, output_schema(int(meta["dims"]), meta, opts.dtype))
    return JobSummary(str(output), rows, errors, tokens, time.time() - t0, meta,
                      str(errors_dest) if errors else None)


def _as_dtype(table: pa.Table, dtype: str, ranges: np.ndarray | None) -> pa.Table:
    """The float32 `embedding` column in the job's `--dtype` (batch/dtypes.py)."""
    if dtype == "float32":
        return table
    column = table.column("embedding").combine_chunks()
    dims = column.type.list_size
    vectors = column.flatten().to_numpy().reshape(-1, dims)
    values = embedding_array(convert(vectors, dtype, ranges), embedding_type(dims, dtype))
    return table.set_column(table.schema.get_field_index("embedding"), "embedding", values)


def _first_line(path: Path) -> int:
    pf = pq.ParquetFile(path)
    if pf.metadata.num_rows == 0:
        return -1
    return pf.read_row_group(0, columns=["line"]).column("line")[0].as_py()
