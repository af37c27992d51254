"""`synapse batch embed --ray [ADDRESS]`: the same job on Ray Data, resumable like it.

    read_datasource(RowsDatasource)          the local job's reader and row rules, striped,
                                             from the checkpoint's `next_line`
    .map_batches(EmbedActor, concurrency=N)  each actor starts a `Module` (supervised workers
                                             on its node, tokenization included)
    .iter_batches() on the driver            rows carry their errors and their read block
then `BlockCommitter` (batch/ray_commit.py) commits the blocks in input order into the local
job's checkpoint, `OUTPUT.partial/` (batch/checkpoint.py), and at the end the driver
publishes OUTPUT and OUTPUT.errors.jsonl from it exactly as the local job does. A driver
killed in any way leaves the checkpoint; `--resume` (with or without `--ray`) goes on from
it. Only the driver writes: the nodes need the input file, not the output directory.

Why a datasource of our own rather than `read_json`/`read_text`: Ray's readers neither number
lines nor survive a line that is not JSON; ours yields exactly the local job's rows (line
numbers, ids, the same error codes), so the two jobs agree row for row. With late chunking
a read block is one window of whole documents in one row, so no document is ever cut between
two actor calls (batch/ray_late.py).

Placement: an Apple-silicon node offers the custom resource `{"ane": 1}` (`node_resources`),
and an ANE-lane actor asks for it, so Core ML engines land only where a Neural Engine is.
Without an ADDRESS the Ray is our own (`host.local_ray`): loopback-bound, token on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from batch.checkpoint import Checkpoint
from batch.dtypes import dtype_metadata, needs_ranges
from batch.errors import ENGINE_CRASHED, BatchUsageError, JobAborted
from batch.job import (
    JobOptions,
    JobSummary,
    _full_disk_aborts,
    _publish,
    _raise_if_over_max_errors,
    _resume_advice,
    validate,
)
from batch.progress import JobProgress
from batch.ray_commit import BlockCommitter
from batch.ray_late import LATE_READ_SCHEMA, embed_late, read_late_blocks
from batch.rows import InputSpec, Row, count_records, read_rows
from certification.calibration import calibration_set
from host.admission import Budgets
from host.errors import ConfigInvalid
from host.local_ray import check_token_auth, start_local_ray
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
_ROW_COLUMNS = ("line", "id", "text", "error_code", "error_message")


def _row_schema() -> pa.Schema:
    return pa.schema(
        [
            ("line", pa.int64()),
            ("id", pa.string()),
            ("text", pa.string()),
            ("error_code", pa.string()),
            ("error_message", pa.string()),
            ("block", pa.int64()),
            ("block_rows", pa.int64()),
        ]
    )


class RowsDatasource(Datasource):
    """A Ray Data source over `batch.rows` from `start_line`: `stripes` read tasks, task k
    keeping the k-th of every `stripes` blocks of rows. Each task parses the whole input
    (cheap next to embedding), so every actor gets blocks from the start instead of one task
    feeding one actor; the rows and their line numbers are exactly the local job's. Every
    row names its block (numbered from 0) and the block's row count, for the committer."""

    def __init__(
        self,
        spec: InputSpec,
        stripes: int = 1,
        block_rows: int = _READ_BLOCK_ROWS,
        start_line: int = 1,
        late_budgets: Budgets | None = None,
    ) -> None:
        self.spec, self.stripes, self.block_rows = spec, max(1, stripes), block_rows
        self.start_line = start_line
        # Late chunking: blocks are windows of whole documents, one row each (batch/ray_late.py)
        self.late_budgets = late_budgets

    def estimate_inmemory_data_size(self):
        return None

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        spec, n, rows, start = self.spec, self.stripes, self.block_rows, self.start_line
        meta = BlockMetadata(
            num_rows=None, size_bytes=None, exec_stats=None, input_files=(spec.path,)
        )
        budgets = self.late_budgets
        if budgets is not None:
            return [
                ReadTask(
                    lambda k=k: read_late_blocks(spec, k, n, rows, start, budgets),
                    meta,
                    schema=LATE_READ_SCHEMA,
                )
                for k in range(n)
            ]
        return [
            ReadTask(lambda k=k: _read_blocks(spec, k, n, rows, start), meta, schema=_row_schema())
            for k in range(n)
        ]

    def get_name(self) -> str:
        return "SynapseRows"


def _read_blocks(
    spec: InputSpec,
    stripe: int = 0,
    stripes: int = 1,
    block_rows: int = _READ_BLOCK_ROWS,
    start_line: int = 1,
):
    buf: list[Row] = []
    block = 0
    for row in read_rows(spec, start_line):
        buf.append(row)
        if len(buf) >= block_rows:
            if block % stripes == stripe:
                yield _rows_table(buf, block)
            buf, block = [], block + 1
    if buf and block % stripes == stripe:
        yield _rows_table(buf, block)


def _rows_table(rows: list[Row], block: int) -> pa.Table:
    return pa.Table.from_pydict(
        {
            "line": [r.line for r in rows],
            "id": [r.id for r in rows],
            "text": [r.text for r in rows],
            "error_code": [r.error_code for r in rows],
            "error_message": [r.error_message for r in rows],
            "block": [block] * len(rows),
            "block_rows": [len(rows)] * len(rows),
        },
        schema=_row_schema(),
    )


class EmbedActor:
    """One engine per actor: a `Module` whose supervised worker runs on the actor's node."""

    def __init__(
        self,
        model,
        lane,
        normalize,
        truncate,
        module_config: bytes,
        planned_workers,
        runtime_config=None,
        prompt_name=None,
        outputs=(),
        late_doc_field=None,
    ) -> None:
        import msgspec

        from batch.embedder import LaneEmbedder
        from batch.job import late_chunking_metadata, outputs_metadata
        from batch.metadata import describe
        from certification.modules import build_module
        from host.module import ModuleConfig

        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        self._closed = False
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        config = msgspec.json.decode(module_config, type=ModuleConfig)  # JSON: any node
        config = msgspec.structs.replace(config, planned_workers=planned_workers)
        self.module = build_module(config)  # the lane choice `synapse serve` makes
        # `outputs`: token-level outputs (with "dense" for the embedding column), as the
        # local job asks them (JobOptions.embedder_args); late chunking reads unnormalized
        # token states and normalizes each chunk's pooled vector.
        self.late_doc_field = late_doc_field
        self.normalize = normalize
        self.embedder = LaneEmbedder(
            self.module,
            model,
            lane,
            normalize and late_doc_field is None,
            runtime_config,
            prompt_name=prompt_name,
            outputs=tuple(outputs),
        )
        self._run(self.embedder.start())
        self.truncate = truncate
        meta = describe([self.embedder], normalize)
        if late_doc_field is not None:
            meta.update(late_chunking_metadata(self.embedder, late_doc_field))
        else:
            meta.update(outputs_metadata(self.embedder))
        self.meta = json.dumps(meta, sort_keys=True)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def __call__(self, batch: pa.Table) -> pa.Table:
        from batch.windows import tokenize_window

        if self.late_doc_field is not None:
            cfg = self.module.config
            return embed_late(batch, self.embedder, cfg, self.normalize, self.meta, self._run)
        rows = [
            Row(*v) for v in zip(*(batch.column(c).to_pylist() for c in _ROW_COLUMNS), strict=True)
        ]
        # A batch may span blocks: each row keeps its own, by line.
        blocks = dict(
            zip(
                batch.column("line").to_pylist(),
                zip(
                    batch.column("block").to_pylist(),
                    batch.column("block_rows").to_pylist(),
                    strict=True,
                ),
                strict=True,
            )
        )
        cfg = self.module.config
        emb = self.embedder
        assert emb.tokenizer is not None  # set when the embedder started
        window = tokenize_window(
            0,
            rows,
            0,
            emb.tokenizer,
            self.truncate,
            cfg.max_worker_batch_tokens,
            cfg.max_batch_items,
            emb.prompt,
        )
        vectors = np.zeros((len(window.rows), emb.dims), np.float32)
        items: list = [None] * len(window.rows)  # token-level outputs, per row
        crashed: dict[int, str] = {}
        for group in window.batches:
            result = self._run(emb.embed([window.ids[i] for i in group]))
            for j, i in enumerate(group):
                if j in result.failed:
                    crashed[i] = result.failed[j]
                elif emb.outputs:
                    items[i] = result.vectors[j]
                    if "dense" in emb.outputs:
                        vectors[i] = items[i]["dense"]
                else:
                    vectors[i] = result.vectors[j]
        table = _result_table(window, vectors, crashed, emb.dims, self.meta, blocks)
        return _with_outputs(table, window, items, emb.outputs, json.loads(self.meta))

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
        except Exception:  # the loop may be gone at interpreter exit
            pass


def _result_table(window, vectors, crashed, dims, meta, blocks: dict) -> pa.Table:
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
    table = pa.table(
        {
            "line": pa.array(lines, pa.int64()),
            "id": pa.array(ids, pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, dims),
            "n_tokens": pa.array(n_tok, pa.int32()),
            "truncated": pa.array(cut, pa.bool_()),
            "error_code": pa.array(codes, pa.string()),
            "error_message": pa.array(messages, pa.string()),
            # Provenance on every row, so the committer can refuse a run whose nodes embedded
            # with different artifacts.
            "_meta": pa.array([meta] * n, pa.string()),
            "block": pa.array([blocks[line][0] for line in lines], pa.int64()),
            "block_rows": pa.array([blocks[line][1] for line in lines], pa.int64()),
        }
    )
    return table.sort_by("line")


def _with_outputs(table: pa.Table, window, items: list, outputs, meta: dict) -> pa.Table:
    """`table` (sorted by line) with the token-level outputs' columns; a row without them
    (an error row, a crashed one) has empty lists, and the committer drops it."""
    from batch.kinds import kind_arrays

    kinds = [k for k in outputs if k != "dense"]
    if not kinds:
        return table
    by_line = {row.line: items[i] for i, row in enumerate(window.rows)}
    per_row = [by_line.get(line) for line in table.column("line").to_pylist()]
    dims = int(meta["dims"])
    for kind in kinds:
        width = int(meta["multivector_dims"]) if kind == "multivector" else dims
        empty = (
            (np.zeros(0, np.int32), np.zeros(0, np.float32))
            if kind == "sparse"
            else np.zeros((0, width), np.float32)
        )
        got = [empty if item is None else item[kind] for item in per_row]
        names = ("sparse_indices", "sparse_values") if kind == "sparse" else (kind,)
        for name, array in zip(names, kind_arrays(kind, got, width), strict=True):
            table = table.append_column(name, array)
    return table


def run_ray_job(
    opts: JobOptions, address: str | None, workers: int | None = None, timings: dict | None = None
) -> JobSummary:
    """Run on Ray (connecting, or starting a local Ray); raise like `run_job`: a
    `BatchUsageError` before anything is done, else `JobAborted` with the checkpoint left
    for `opts.resume`.

    `timings` (bench): filled with `ray_init_s`, `first_row_s` (seconds from the call to
    the first embedded rows reaching the driver) and `result_rows` (the row count of each
    result table, in arrival order)."""
    t0 = time.time()
    spec = validate(opts)
    if spec.path == "-":
        raise BatchUsageError("--ray reads a file every node can open, not stdin")
    if "," in (opts.lane or ""):
        raise BatchUsageError(
            f"--lane {opts.lane}: two lanes in one job run locally (without --ray), where "
            "both serve one Module"
        )
    # Read tasks run in the workers' own directories: name the file as the driver sees it.
    spec = dataclasses.replace(spec, path=str(Path(spec.path).absolute()))
    output = Path(opts.output).absolute()
    local = address is None and not ray.is_initialized()
    if local:
        _usage_error_from(check_token_auth)
    with _full_disk_aborts(output.parent, "nothing was embedded: free some space and run again"):
        ckpt = Checkpoint.open(output, opts.job_key(spec), opts.resume)
    workers = workers or 1
    try:
        if local:
            _usage_error_from(
                lambda: start_local_ray(
                    num_cpus=workers + 1, resources=node_resources(), log_to_driver=False
                )
            )
        elif not ray.is_initialized():
            assert address is not None  # `local` covers the no-address case
            _connect(address)
    except BaseException:
        _drop_if_empty(ckpt)  # no Ray, nothing done: the next run needs no --resume
        raise
    if timings is not None:
        timings["ray_init_s"] = time.time() - t0
    resources = {}
    if opts.lane == "ane":
        if ray.cluster_resources().get("ane", 0) < 1:
            _drop_if_empty(ckpt)
            raise BatchUsageError(
                "no Ray node offers the 'ane' resource: Apple-silicon nodes advertise it "
                "(`ray start --resources '{\"ane\": 1}'`); use --lane llama elsewhere"
            )
        resources = {"ane": 1}
    cores = os.cpu_count() or 1
    actor_kwargs = _actor_kwargs(opts, workers, cores)
    start_line = ckpt.next_line
    s = ckpt.state
    progress = JobProgress(
        count_records(spec), s["rows"], s["tokens"], s["errors"], opts.progress_interval_s
    )
    committer: BlockCommitter | None = None
    try:
        with _interrupts_abort(ckpt):
            try:
                ranges = None
                if needs_ranges(opts.dtype):
                    # One node's ranges for every row: the actors return float32 and the
                    # driver quantizes at the commit, so nodes with their own stores cannot
                    # disagree.
                    ranges = np.array(
                        ray.get(
                            _calibrate.options(
                                num_cpus=_ACTOR_CPUS, resources=resources or None
                            ).remote(actor_kwargs)
                        ),
                        np.float32,
                    )
                committer = BlockCommitter(ckpt, opts, ranges, progress.update)
                # Closed at once on the way out, not when an exception's traceback goes:
                # that stops the dataset's execution and its actors.
                with contextlib.closing(
                    _results(spec, start_line, opts, workers, resources, actor_kwargs)
                ) as results:
                    for table in results:
                        if timings is not None:
                            timings.setdefault("first_row_s", time.time() - t0)
                            timings.setdefault("result_rows", []).append(table.num_rows)
                        committer.add(table)
                if committer.held_blocks:
                    raise JobAborted(
                        f"the run ended with {committer.held_blocks} blocks "
                        f"uncommitted (rows missing before them)"
                    )
                if committer.meta_json is None:
                    # No row in this run (an empty input, or a resume with nothing left):
                    # the lane where the actors would have run says what a full one would.
                    committer.bind(
                        ray.get(
                            _describe.options(
                                num_cpus=_ACTOR_CPUS, resources=resources or None
                            ).remote(actor_kwargs)
                        )
                    )
            except (ray.exceptions.RayError, RuntimeError) as exc:
                raise _ray_failed(exc, ckpt) from exc
    finally:
        progress.close()
    meta = committer.meta
    assert meta is not None  # bound above: from the checkpoint, or from the model's actor
    _raise_if_over_max_errors(ckpt, opts)  # a resumed job whose last block broke it
    meta.update(dtype_metadata(opts.dtype, ranges, calibration_set()))
    with _full_disk_aborts(output.parent, _resume_advice(ckpt)):
        errors_file = _publish(opts, ckpt, output, meta)
    return JobSummary(
        str(output),
        s["rows"],
        s["errors"],
        s["tokens"],
        time.time() - t0,
        meta,
        errors_file,
        start_line,
    )


def _usage_error_from(start) -> None:
    """A local Ray that would run open is a usage error, said in one line."""
    try:
        start()
    except ConfigInvalid as exc:
        raise BatchUsageError(exc.message) from None


def _connect(address: str) -> None:
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobAborted(
            f"cannot join the Ray cluster at {address}: {first} (token authentication: "
            f"RAY_AUTH_MODE=token and the cluster's token, see docs/operations.md)"
        ) from None


def _drop_if_empty(ckpt: Checkpoint) -> None:
    """A checkpoint this run opened and never committed to is no checkpoint to resume."""
    s = ckpt.state
    if s["next_line"] == 1 and s["parts"] == 0 and s["errors"] == 0:
        ckpt.remove()


@contextlib.contextmanager
def _interrupts_abort(ckpt: Checkpoint):
    """Ctrl-C and SIGTERM (Ray's own SIGTERM handler just exits) stop the job with the
    checkpoint's advice; a commit cut short is discarded on resume, like after a SIGKILL."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise JobAborted(
            f"interrupted by {signal.Signals(signum).name}; the checkpoint at {ckpt.root} "
            f"keeps every committed row: rerun the same command with --resume"
        )

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ray_failed(exc: BaseException, ckpt: Checkpoint) -> JobAborted:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    # An actor whose constructor raised (a model that cannot give what the job asks, say):
    # Ray's first line names only the actor; the traceback's last line says why.
    if isinstance(exc, ray.exceptions.RayActorError) and exc.actor_init_failed and len(lines) > 1:
        first = f"an actor could not start: {lines[-1]}"
    return JobAborted(f"the Ray job failed: {first}; {_resume_advice(ckpt)}")


def _actor_kwargs(opts: JobOptions, workers: int, cores: int) -> dict:
    return {
        "model": opts.model,
        "lane": opts.lane,
        "normalize": opts.normalize,
        "truncate": opts.truncate,
        "module_config": msgspec.json.encode(opts.module or ModuleConfig()),
        "planned_workers": max(1, min(workers, cores)),
        "runtime_config": opts.runtime_config,
        "prompt_name": opts.prompt_name,
        "outputs": tuple(opts.embedder_args().get("outputs", ())),
        "late_doc_field": opts.doc_field if opts.late_chunking else None,
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


def _one_block_per_batch(ds, rows: int):
    """Without this, a read task's rows are gathered into one block of up to
    `target_max_block_size` (128 MiB) and an actor's results come back only when that whole
    block is embedded: nothing is committed (a kill loses everything) until the input ends.
    The streaming repartition cuts the read into blocks of one batch each. Its tasks would
    ask a whole CPU, which the actors may hold all of (a deadlock); they only slice tables, so
    they ask what a read task asks. Ray Data has no public argument for that: the pinned Ray's
    logical operator is set, and checked, here."""
    ds = ds.repartition(target_num_rows_per_block=rows)
    op = ds._logical_plan.dag
    if type(op).__name__ != "StreamingRepartition" or not isinstance(op.ray_remote_args, dict):
        raise RuntimeError(f"this Ray plans repartition as {type(op).__name__}: see batch.ray_job")
    op.ray_remote_args["num_cpus"] = _IO_CPUS
    return ds


def _results(spec, start_line: int, opts, workers: int, resources: dict, actor_kwargs: dict):
    """The actors' result tables as they finish, in any order (the committer orders them).
    Closing this generator closes Ray Data's iterator, which shuts its execution down."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = False  # ordering would hold every block back
    rows = min(opts.window_rows, _ACTOR_BATCH_ROWS)
    late = opts.late_chunking
    # Late chunking reads one row per window of whole documents: a batch is one such row.
    budgets = (opts.module or ModuleConfig()).budgets if late else None
    per_batch = 1 if late else rows
    ds = ray.data.read_datasource(
        RowsDatasource(spec, workers, rows, start_line, budgets),
        num_cpus=_IO_CPUS,
        override_num_blocks=workers,
    )
    ds = _one_block_per_batch(ds, per_batch)
    ds = ds.map_batches(
        EmbedActor,
        batch_format="pyarrow",
        batch_size=per_batch,
        concurrency=workers,
        num_cpus=_ACTOR_CPUS,
        resources=resources or None,
        fn_constructor_kwargs=actor_kwargs,
    )
    batches = iter(ds.iter_batches(batch_format="pyarrow", batch_size=None))
    try:
        yield from batches
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
