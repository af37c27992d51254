"""`run_job`: the local bulk embedding job — streaming, checkpointed, resumable.

Pipeline (memory bounded by a few windows, whatever the corpus size):
    reader thread: rows -> windows (tokenized, length-batched)   at most `ahead` windows
    lane runners (one per `--workers` Module): batches -> vectors, crashes survived
    committer: windows in input order -> part file + errors + state.json (the checkpoint)
At the end the parts are merged into OUTPUT and the errors into OUTPUT.errors.jsonl, each
published atomically, and the checkpoint is removed. Ctrl-C, SIGTERM or a SIGKILL leave the
checkpoint; `resume=True` continues at its `next_line`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import msgspec
import numpy as np

from batch.checkpoint import Checkpoint
from batch.dtypes import DTYPES, convert, dtype_metadata, needs_ranges
from batch.embedder import LaneEmbedder
from batch.errors import ENGINE_CRASHED, BatchUsageError, JobAborted
from batch.metadata import describe
from batch.output import (
    classify_schema,
    make_classify_table,
    make_table,
    merge_parts,
    output_schema,
    publish_copy,
)
from batch.progress import JobProgress
from batch.rows import InputSpec, count_records
from batch.windows import Window, error_record, windows
from certification.calibration import Calibrations, calibration_set
from certification.modules import build_module
from common.errors import StorageFull, SynapseError
from host.classify import activate, activation_for
from host.errors import ConfigInvalid
from host.module import ModuleConfig, check_lane_list
from ingest.durable import full_disk_as
from ingest.store import DEFAULT_EMBED

log = logging.getLogger("synapse.batch")


@dataclass
class JobOptions:
    input: str
    output: str
    model: str | None = None
    lane: str | None = None
    text_field: str = "text"
    id_field: str = "id"
    workers: int = 1
    resume: bool = False
    max_errors: int = 1000
    normalize: bool = True
    truncate: bool = True
    window_rows: int = 4096
    prompt_name: str | None = None  # None: the model's default prompt, if it has one
    dtype: str = "float32"  # the embedding column's type (batch/dtypes.py)
    ahead: int = 2  # windows read and tokenized ahead of the committer
    module: ModuleConfig | None = None  # store, host windows; planned_workers is set here
    runtime_config: dict | None = None  # LOAD extras for the lane (tests shrink n_ubatch)
    progress_interval_s: float = 5.0
    # "embed" (vectors) or "classify" (a sequence classifier's label scores, batch/output.py)
    task: str = "embed"
    raw_scores: bool = False  # classify: the head's logits, not the model's activation

    def errors_output(self) -> Path:
        return Path(self.output).with_name(Path(self.output).name + ".errors.jsonl")

    def job_key(self, spec: InputSpec) -> dict:
        """What must match for `--resume` to continue a checkpoint."""
        return {
            "input": spec.identity(),
            "format": spec.format,
            "text_field": self.text_field,
            "id_field": self.id_field,
            "model": self.model,
            "lane": self.lane,
            "normalize": self.normalize,
            "truncate": self.truncate,
            "prompt_name": self.prompt_name,
            # Only when not the default: a checkpoint from before --dtype has no key and
            # was embedded as float32, so it still resumes.
            **({"dtype": self.dtype} if self.dtype != "float32" else {}),
            **({"task": self.task, "raw_scores": self.raw_scores} if self.task != "embed" else {}),
        }


@dataclass
class JobSummary:
    output: str
    rows: int
    errors: int
    tokens: int
    seconds: float
    metadata: dict[str, str]
    errors_file: str | None = None
    resumed_from_line: int = 1
    worker_pids: list[int] = field(default_factory=list)
    lane_rows: dict[str, int] = field(default_factory=dict)  # rows each lane embedded, this run


def job_lanes(opts: JobOptions) -> list[str] | None:
    """The lanes `--lane` names (None: the Module's own choice, which may be two lanes).
    Two lanes serve one job only when their vectors agree, as they serve one model."""
    if opts.lane is None:
        return None
    lanes = [part.strip() for part in opts.lane.split(",")]
    try:
        check_lane_list(opts.model or DEFAULT_EMBED, lanes)
    except ConfigInvalid as exc:
        raise BatchUsageError(f"--lane {opts.lane}: {exc.message}") from None
    if len(lanes) > 1 and opts.runtime_config:
        raise BatchUsageError("runtime settings apply to one lane: name one --lane")
    return lanes


def validate(opts: JobOptions) -> InputSpec:
    if opts.workers < 1:
        raise BatchUsageError("--workers must be >= 1")
    if opts.max_errors < 0:
        raise BatchUsageError("--max-errors must be >= 0")
    if opts.dtype not in DTYPES:
        raise BatchUsageError(f"--dtype {opts.dtype}: one of {', '.join(DTYPES)}")
    if needs_ranges(opts.dtype) and not opts.normalize:
        raise BatchUsageError(
            f"--dtype {opts.dtype} quantizes over the model's calibration ranges, which are "
            f"those of normalized vectors: drop --no-normalize (binary/ubinary keep only signs "
            f"and work either way)"
        )
    if opts.window_rows < 1:
        raise BatchUsageError("window_rows must be >= 1")
    if opts.task not in ("embed", "classify"):
        raise BatchUsageError(f"task {opts.task!r}: embed or classify")
    if opts.task == "classify":
        if opts.model is None:
            raise BatchUsageError("batch classify needs --model: a sequence classifier")
        if opts.lane not in (None, "llama"):
            raise BatchUsageError("batch classify runs on the llama lane (--lane llama)")
    job_lanes(opts)
    spec = InputSpec(opts.input, opts.text_field, opts.id_field)
    spec.check()
    if Path(opts.output).suffix.lower() != ".parquet":
        raise BatchUsageError(f"output {opts.output}: the output is a .parquet file")
    if Path(opts.output).is_dir():
        raise BatchUsageError(f"output {opts.output} is a directory; name a .parquet file")
    return spec


async def run_job(opts: JobOptions, on_ready=None) -> JobSummary:
    """Run the job; raise `BatchUsageError` (nothing done) or `JobAborted` (checkpoint left).

    `on_ready(embedders)` is called once every lane is up (tests find worker pids there).
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    spec = validate(opts)
    output = Path(opts.output).absolute()
    with _full_disk_aborts(output.parent, "nothing was embedded: free some space and run again"):
        ckpt = Checkpoint.open(output, opts.job_key(spec), opts.resume)
    base = opts.module or ModuleConfig()
    config = msgspec.structs.replace(base, planned_workers=opts.workers)
    lanes = job_lanes(opts)
    if lanes is not None and len(lanes) > 1:  # served together as a model so configured is
        model_lanes = {**config.model_lanes, opts.model or DEFAULT_EMBED: lanes}
        config = msgspec.structs.replace(config, model_lanes=model_lanes)
    # Built as `synapse serve` builds its Module: a certified Core ML lane serves a job that
    # names no --lane, as it serves the same model over HTTP.
    modules = [build_module(config) for _ in range(opts.workers)]
    lane_rows: dict[str, int] = {}
    try:
        embedders = [
            LaneEmbedder(
                mod,
                opts.model,
                lanes[0] if lanes is not None and len(lanes) == 1 else None,
                opts.normalize,
                opts.runtime_config,
                prompt_name=opts.prompt_name,
                task=opts.task,
            )
            for mod in modules
        ]
        await asyncio.gather(*(e.start() for e in embedders))
        embedders += await _second_lanes(embedders, lanes, opts)
        meta = describe(embedders, opts.normalize)
        if opts.task == "classify":
            meta.update(_classify_metadata(embedders[0], opts.raw_scores))
        ranges = None
        if needs_ranges(opts.dtype):  # the model's own, recorded on its first int8 use
            first = embedders[0]
            ranges = await Calibrations(first.module).ranges(first.model, first.dims, first.lane)
        meta.update(dtype_metadata(opts.dtype, ranges, calibration_set()))
        with _full_disk_aborts(ckpt.root, _resume_advice(ckpt)):
            ckpt.bind_artifact(meta["artifact_digest"], meta["prompt"])
        if on_ready is not None:
            on_ready(embedders)
        start_line = ckpt.next_line
        progress = JobProgress(
            count_records(spec),
            ckpt.state["rows"],
            ckpt.state["tokens"],
            ckpt.state["errors"],
            opts.progress_interval_s,
        )
        try:
            await _pipeline(opts, spec, ckpt, embedders, meta, progress, ranges)
        finally:
            progress.close()
        for emb in embedders:
            lane_rows[emb.lane] = lane_rows.get(emb.lane, 0) + emb.rows
    finally:
        await asyncio.gather(*(m.close() for m in modules), return_exceptions=True)
    _raise_if_over_max_errors(ckpt, opts)  # a resumed job whose last window broke it
    s = ckpt.state
    with _full_disk_aborts(output.parent, _resume_advice(ckpt)):
        errors_file = _publish(opts, ckpt, output, meta)
    return JobSummary(
        str(output),
        s["rows"],
        s["errors"],
        s["tokens"],
        loop.time() - t0,
        meta,
        errors_file,
        start_line,
        lane_rows=lane_rows,
    )


async def _second_lanes(
    embedders: list[LaneEmbedder], lanes: list[str] | None, opts: JobOptions
) -> list[LaneEmbedder]:
    """For a model its Modules serve on two lanes, an embedder for each further lane of each
    Module: every lane takes batches from one queue, so the job keeps them all busy. With
    `--lane ane,llama`, a model that cannot be served so (its lanes disagree) stops the job
    before anything is embedded."""
    more = []
    for emb in embedders:
        serving = emb.module.serving_lanes(emb.model) if emb.requested_lane is None else ()
        if lanes is not None and len(lanes) > 1 and list(serving) != lanes:
            reason = emb.module.chosen_lanes()[emb.model].reason
            raise BatchUsageError(f"--lane {opts.lane}: the lanes cannot serve together: {reason}")
        for lane in serving:
            if lane != emb.lane:
                more.append(
                    LaneEmbedder(
                        emb.module, emb.model, lane, opts.normalize, prompt_name=opts.prompt_name
                    )
                )
    await asyncio.gather(*(e.start() for e in more))
    return more


def _publish(opts: JobOptions, ckpt: Checkpoint, output: Path, meta: dict) -> str | None:
    errors_dest = opts.errors_output().absolute()
    errors_file = None
    if ckpt.state["errors"]:
        publish_copy(ckpt.errors_path, errors_dest)
        errors_file = str(errors_dest)
    else:
        errors_dest.unlink(missing_ok=True)  # a stale one from an earlier run
    merge_parts(ckpt.parts(), output, _schema(opts, meta, with_metadata=True))
    ckpt.remove()
    return errors_file


async def _pipeline(opts, spec, ckpt: Checkpoint, embedders, meta, progress, ranges=None) -> None:
    loop = asyncio.get_running_loop()
    cfg = embedders[0].module.config
    ready: asyncio.Queue = asyncio.Queue(maxsize=opts.ahead)  # windows, in order, or the end
    work: asyncio.Queue = asyncio.Queue()  # (window, batch) for the lane runners
    schema = _schema(opts, meta, with_metadata=False)
    stop_reader = threading.Event()

    def read() -> None:  # a daemon thread: a blocked stdin read never holds the exit
        try:
            source = windows(
                spec,
                ckpt.next_line,
                opts.window_rows,
                embedders[0].tokenizer,
                opts.truncate,
                cfg.max_worker_batch_tokens,
                cfg.max_batch_items,
                ckpt.state["parts"],
                embedders[0].prompt,
            )
            for window in source:
                if stop_reader.is_set():
                    return
                asyncio.run_coroutine_threadsafe(ready.put(window), loop).result()
            item: object = None
        except BaseException as exc:  # handed to the event loop to raise
            item = exc
        if not stop_reader.is_set():
            asyncio.run_coroutine_threadsafe(ready.put(item), loop).result()

    pending: dict[int, _Progress] = {}

    async def runner(emb: LaneEmbedder) -> None:
        while True:
            window, batch = await work.get()
            result = await emb.embed([window.ids[i] for i in batch])
            state = pending[window.index]
            for j, i in enumerate(batch):
                if j in result.failed:
                    state.crashed[i] = result.failed[j]
                else:
                    state.vectors[i] = result.vectors[j]
            state.left -= 1
            if state.left == 0:
                state.done.set()

    async def committer() -> None:
        """Commit windows strictly in input order, keeping `ahead` windows at the lanes so
        they never idle while the head window finishes."""
        backlog: collections.deque[_Progress] = collections.deque()
        reader_done = False
        while True:
            while len(backlog) < opts.ahead and not reader_done:
                window = await ready.get()
                if window is None:
                    reader_done = True
                    break
                if isinstance(window, BaseException):
                    raise window
                state = _Progress(window, int(meta["dims"]))
                pending[window.index] = state
                for batch in window.batches:
                    work.put_nowait((window, batch))
                backlog.append(state)
            if not backlog:
                return
            head = backlog.popleft()
            await head.done.wait()
            pending.pop(head.window.index, None)
            _commit(head, ckpt, schema, progress, opts, ranges)

    threading.Thread(target=read, name="batch-reader", daemon=True).start()
    try:
        async with asyncio.TaskGroup() as tg:
            runners = [tg.create_task(runner(e)) for e in embedders]
            await tg.create_task(_supervise(committer(), runners))
    except* SynapseError as group:  # typed errors reach the CLI as themselves
        raise group.exceptions[0] from None
    finally:
        stop_reader.set()


async def _supervise(main, runners) -> None:
    try:
        await main
    finally:
        for task in runners:
            task.cancel()


@dataclass
class _Progress:
    window: Window
    dims: int
    vectors: np.ndarray = field(init=False)
    crashed: dict[int, str] = field(default_factory=dict)
    left: int = field(init=False)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.vectors = np.zeros((len(self.window.rows), self.dims), dtype=np.float32)
        self.left = len(self.window.batches)
        if self.left == 0:
            self.done.set()


def _commit(state: _Progress, ckpt: Checkpoint, schema, progress, opts, ranges=None) -> None:
    w = state.window
    keep = [i for i in range(len(w.rows)) if i not in state.crashed]
    errors = list(w.errors) + [
        error_record(w.rows[i], ENGINE_CRASHED, msg) for i, msg in state.crashed.items()
    ]
    errors.sort(key=lambda e: e["line"])
    row_ids = cast("list[str]", [w.rows[i].id for i in keep])  # ok rows have ids
    n_tokens = [len(w.ids[i]) for i in keep]
    truncated = [w.truncated[i] for i in keep]
    if opts.task == "classify":
        labels = json.loads(schema.metadata[b"synapse.labels"])
        activation = schema.metadata[b"synapse.activation"].decode()
        scores = state.vectors[keep]  # the head's raw logits
        if not opts.raw_scores:
            scores = activate(scores, activation)  # type: ignore[arg-type]
        table = make_classify_table(row_ids, scores, labels, n_tokens, truncated, schema)
    else:
        vectors = convert(state.vectors[keep], opts.dtype, ranges)
        table = make_table(row_ids, vectors, n_tokens, truncated, schema)
    tokens = sum(len(w.ids[i]) for i in keep)
    with _full_disk_aborts(ckpt.root, _resume_advice(ckpt)):
        ckpt.commit(table, errors, w.next_line, tokens)
    progress.update(len(keep), tokens, len(errors))
    _raise_if_over_max_errors(ckpt, opts)


def _classify_metadata(emb: LaneEmbedder, raw_scores: bool) -> dict[str, str]:
    labels = emb.module.labels(emb.model)
    problem_type = emb.module.record(emb.model).manifest.problem_type
    return {
        "task": "classify",
        "labels": json.dumps(labels),
        "activation": activation_for(problem_type, len(labels)),
        "raw_scores": "true" if raw_scores else "false",
    }


def _schema(opts: JobOptions, meta: dict[str, str], *, with_metadata: bool):
    """The output's schema; a part file carries the classify keys it is committed with."""
    if opts.task == "classify":
        keys = ("labels", "activation")
        part_meta = meta if with_metadata else {k: meta[k] for k in keys}
        return classify_schema(int(meta["dims"]), part_meta)
    return output_schema(int(meta["dims"]), meta if with_metadata else None, opts.dtype)


def _full_disk_aborts(where: Path, advice: str):
    """A write under `where` that fails for want of space stops the job as `StorageFull`,
    saying what to do; any other I/O failure stays what it is."""
    return full_disk_as(
        lambda exc: StorageFull(
            f"no space left on the device of {where} ({exc.strerror or exc}); {advice}"
        ),
        where,
    )


def _resume_advice(ckpt: Checkpoint) -> str:
    return (
        f"the checkpoint at {ckpt.root} keeps every committed row: free some space and "
        f"rerun the same command with --resume"
    )


def _raise_if_over_max_errors(ckpt: Checkpoint, opts: JobOptions) -> None:
    if ckpt.state["errors"] > opts.max_errors:
        raise JobAborted(
            f"{ckpt.state['errors']} rows failed, more than --max-errors {opts.max_errors}; "
            f"see {ckpt.errors_path} (the checkpoint stays: fix the input or raise "
            f"--max-errors, then --resume)"
        )


def default_workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))
