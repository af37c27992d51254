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
from batch.kinds import KINDS, kind_arrays, kind_fields
from batch.late import Pool, document_record
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
from batch.rows import InputSpec, Row, count_records
from batch.windows import Window, error_record, late_windows, windows
from certification.calibration import Calibrations, calibration_set
from certification.modules import build_module
from common.errors import StorageFull, SynapseError
from host.classify import activate, activation_for
from host.errors import ConfigInvalid
from host.lane_router import Ask, refusal
from host.module import ModuleConfig, check_lane_list
from ingest.durable import full_disk_as
from ingest.store import DEFAULT_EMBED, served_outputs

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
    # Late chunking (batch/late.py): rows grouped into documents by `doc_field`, each row
    # the late-chunked vector of its chunk.
    late_chunking: bool = False
    doc_field: str | None = None
    dense: bool = True  # the `embedding` column
    outputs: tuple[str, ...] = ()  # token-level columns beside it (batch/kinds.py)

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
            # Each only when asked, so a checkpoint from before them still resumes.
            **({"late_chunking": True, "doc_field": self.doc_field} if self.late_chunking else {}),
            **(
                {"dense": self.dense, "outputs": list(self.outputs)}
                if self.outputs or not self.dense
                else {}
            ),
        }

    def embedder_args(self) -> dict:
        """How each lane is asked: late chunking reads unnormalized token states (the chunk
        vectors are normalized after pooling); token-level outputs come with the dense one
        from one pass."""
        if self.late_chunking:
            return {"normalize": False, "outputs": ("tokens",)}
        if self.outputs:
            return {
                "normalize": self.normalize,
                "outputs": (("dense",) if self.dense else ()) + self.outputs,
            }
        return {"normalize": self.normalize}


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
    _check_kinds(opts)
    job_lanes(opts)
    spec = InputSpec(opts.input, opts.text_field, opts.id_field, opts.doc_field)
    if opts.doc_field is not None and spec.format == "txt":
        raise BatchUsageError(
            f"input {opts.input}: a .txt input has no fields; --doc-field reads .jsonl, .csv "
            f"or .parquet rows"
        )
    spec.check()
    if Path(opts.output).suffix.lower() != ".parquet":
        raise BatchUsageError(f"output {opts.output}: the output is a .parquet file")
    if Path(opts.output).is_dir():
        raise BatchUsageError(f"output {opts.output} is a directory; name a .parquet file")
    return spec


def _check_kinds(opts: JobOptions) -> None:
    """What late chunking and the token-level outputs combine with."""
    unknown = [k for k in opts.outputs if k not in KINDS]
    if unknown:
        raise BatchUsageError(f"output {unknown[0]!r}: one of {', '.join(KINDS)}")
    if len(set(opts.outputs)) != len(opts.outputs):
        raise BatchUsageError("each output kind once")
    if opts.late_chunking != (opts.doc_field is not None):
        raise BatchUsageError(
            "--late-chunking needs --doc-field F (the field naming each row's document), "
            "and --doc-field is for --late-chunking"
        )
    if not opts.dense and not opts.outputs:
        raise BatchUsageError(
            "--no-dense leaves nothing to write: ask --sparse, --multi-vector or --tokens"
        )
    if not opts.dense and opts.dtype != "float32":
        raise BatchUsageError(
            f"--dtype {opts.dtype} is the embedding column's, and --no-dense writes none"
        )
    if opts.task != "embed" and (opts.late_chunking or opts.outputs or not opts.dense):
        raise BatchUsageError("batch classify writes label scores only")
    if opts.late_chunking and (opts.outputs or not opts.dense):
        raise BatchUsageError(
            "--late-chunking writes each chunk's dense vector only: drop --sparse, "
            "--multi-vector, --tokens and --no-dense"
        )


def _check_model_kinds(opts: JobOptions, emb: LaneEmbedder) -> dict[str, str]:
    """Before anything is embedded: the model can give what the job asks. Returns the
    metadata keys saying what the file holds."""
    if opts.late_chunking:
        return late_chunking_metadata(emb, opts.doc_field or "")
    manifest = emb.module.record(emb.model).manifest
    if opts.task == "embed" and opts.dense and "dense" not in served_outputs(manifest):
        raise BatchUsageError(
            f"model {emb.model!r} has no pooled vector (it serves "
            f"{', '.join(served_outputs(manifest))}): pass --no-dense with what it serves"
        )
    return outputs_metadata(emb)


def late_chunking_metadata(emb: LaneEmbedder, doc_field: str) -> dict[str, str]:
    """The metadata keys of a late-chunking job; a model that does not pool by the mean is a
    usage error (a chunk in a document's middle has no CLS or last token of its own)."""
    pooling = emb.module.record(emb.model).manifest.pooling or "mean"
    if pooling != "mean":
        raise BatchUsageError(
            f"--late-chunking pools a chunk's tokens by their mean; model {emb.model!r} "
            f"pools by {pooling}"
        )
    return {"late_chunking": "true", "doc_field": doc_field}


def outputs_metadata(emb: LaneEmbedder) -> dict[str, str]:
    """The metadata keys of an embedder asked for token-level outputs (none otherwise);
    an output the model does not serve is a usage error."""
    kinds = [k for k in emb.outputs if k != "dense"]
    if not kinds:
        return {}
    manifest = emb.module.record(emb.model).manifest
    served = served_outputs(manifest)
    for kind in emb.outputs:
        if kind not in served:
            what = f"no {kind} head" if kind in ("sparse", "multivector") else f"no {kind} output"
            hint = " (--no-dense)" if kind == "dense" else ""
            raise BatchUsageError(
                f"model {emb.model!r} has {what}{hint}; it serves {', '.join(served)}"
            )
    heads = manifest.heads
    meta = {"outputs": ",".join(emb.outputs)}
    if "multivector" in kinds:
        meta["multivector_dims"] = str(heads["multivector"].dims)
    return meta


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
                runtime_config=opts.runtime_config,
                prompt_name=opts.prompt_name,
                task=opts.task,
                **opts.embedder_args(),
            )
            for mod in modules
        ]
        await asyncio.gather(*(e.start() for e in embedders))
        kinds_meta = _check_model_kinds(opts, embedders[0])
        embedders += await _second_lanes(embedders, lanes, opts)
        embedders = _serving(embedders)
        meta = describe(embedders, opts.normalize)
        meta.update(kinds_meta)
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
                        emb.module,
                        emb.model,
                        lane,
                        prompt_name=opts.prompt_name,
                        **opts.embedder_args(),
                    )
                )
    await asyncio.gather(*(e.start() for e in more))
    return more


def _serving(embedders: list[LaneEmbedder]) -> list[LaneEmbedder]:
    """Of a job's lanes, those that serve the token-level outputs it asks, on the document
    side (each worker declared at load what it refuses, host.lane_router); all of them when
    none does, and each window is then refused with its lane's reason."""
    if not embedders[0].outputs:
        return embedders
    ask = Ask(embedders[0].outputs)
    serving = [e for e in embedders if refusal(e.module.refusals(e.model, e.lane), ask) is None]
    return serving or embedders


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
            if opts.late_chunking:
                source = late_windows(
                    spec,
                    ckpt.next_line,
                    opts.window_rows,
                    embedders[0].tokenizer,
                    cfg.max_worker_batch_tokens,
                    cfg.max_batch_items,
                    cfg.budgets,
                    ckpt.state["parts"],
                    embedders[0].prompt,
                )
            else:
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
                    state.put(i, result.vectors[j])
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
                state = _Progress(window, int(meta["dims"]), bool(opts.outputs))
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
    """A window at the lanes: what came back of each of its inputs (`window.ids`)."""

    window: Window
    dims: int
    tokens_kinds: bool = False  # inputs give dicts of token-level outputs, not vectors
    vectors: np.ndarray = field(init=False)
    items: list = field(init=False)  # per input, its outputs (token-level kinds)
    pools: list[Pool] = field(init=False)  # late chunking: per document
    crashed: dict[int, str] = field(default_factory=dict)
    left: int = field(init=False)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        w = self.window
        plain = not self.tokens_kinds and not w.late
        self.vectors = np.zeros((len(w.rows) if plain else 0, self.dims), dtype=np.float32)
        self.items = [None] * (len(w.ids) if self.tokens_kinds else 0)
        self.pools = [Pool(d, self.dims) for d in w.docs]
        self.left = len(w.batches)
        if self.left == 0:
            self.done.set()

    def put(self, i: int, got) -> None:
        if self.window.late:  # pooled now: the states are dropped as they arrive
            doc, w = self.window.seq_ref[i]
            self.pools[doc].add(w, got["tokens"])
        elif self.tokens_kinds:
            self.items[i] = got
        else:
            self.vectors[i] = got


def _commit(state: _Progress, ckpt: Checkpoint, schema, progress, opts, ranges=None) -> None:
    if state.window.late:
        return _commit_late(state, ckpt, schema, progress, opts, ranges)
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
    elif opts.outputs:
        dense = None
        if opts.dense:
            dense = np.stack([state.items[i]["dense"] for i in keep]) if keep else state.vectors
            dense = convert(dense.reshape(len(keep), state.dims), opts.dtype, ranges)
        extra = [
            array
            for kind in opts.outputs
            for array in kind_arrays(
                kind, [state.items[i][kind] for i in keep], _kind_dims(kind, schema)
            )
        ]
        table = make_table(row_ids, dense, n_tokens, truncated, schema, extra)
    else:
        vectors = convert(state.vectors[keep], opts.dtype, ranges)
        table = make_table(row_ids, vectors, n_tokens, truncated, schema)
    tokens = sum(len(w.ids[i]) for i in keep)
    with _full_disk_aborts(ckpt.root, _resume_advice(ckpt)):
        ckpt.commit(table, errors, w.next_line, tokens)
    progress.update(len(keep), tokens, len(errors))
    _raise_if_over_max_errors(ckpt, opts)


def _kind_dims(kind: str, schema) -> int:
    typ = schema.field("sparse_indices" if kind == "sparse" else kind).type
    return typ.value_type.list_size if kind != "sparse" else 0


def _commit_late(state: _Progress, ckpt: Checkpoint, schema, progress, opts, ranges) -> None:
    done = late_results(state, opts.normalize)
    table = make_table(
        cast("list[str]", [r.id for r in done.rows]),  # embedded rows have ids
        convert(done.vectors, opts.dtype, ranges),
        done.n_tokens,
        [False] * len(done.rows),
        schema,
    )
    with _full_disk_aborts(ckpt.root, _resume_advice(ckpt)):
        ckpt.commit(table, done.errors, state.window.next_line, done.tokens)
    progress.update(len(done.rows), done.tokens, len(done.errors))
    _raise_if_over_max_errors(ckpt, opts)


@dataclass
class LateResults:
    """A late-chunking window, embedded: what its commit writes."""

    rows: list[Row]  # the embedded rows, input order
    n_tokens: list[int]  # tokens each row's chunk owns
    vectors: np.ndarray  # float32 (len(rows), dims), normalized if asked
    errors: list[dict]  # its error records, by line
    tokens: int  # tokens read (every forward window, overlaps included)


def late_results(state: _Progress, normalize: bool) -> LateResults:
    """Each document's rows with its chunks' vectors; a document one of whose windows
    crashed the engine twice gets one error record instead."""
    w = state.window
    crashed_docs: dict[int, str] = {}
    for i, msg in state.crashed.items():
        d = w.seq_ref[i][0]
        name = w.docs[d].rows[0].doc
        crashed_docs.setdefault(d, msg.replace("this row", f"a window of document {name!r}", 1))
    errors = list(w.errors)
    rows: list[Row] = []
    n_tokens: list[int] = []
    vectors: list[np.ndarray] = []
    tokens = 0
    for d, (doc, pool) in enumerate(zip(w.docs, state.pools, strict=True)):
        if d in crashed_docs:
            first = doc.rows[0]
            errors.append(
                document_record(
                    first,
                    first.doc or "",
                    doc.rows[-1].line,
                    len(doc.rows),
                    ENGINE_CRASHED,
                    crashed_docs[d],
                )
            )
            continue
        rows += doc.rows
        n_tokens += [int(c) for c in doc.counts]
        vectors.append(pool.vectors(normalize))
        tokens += doc.tokens_read
    errors.sort(key=lambda e: e["line"])
    stacked = np.concatenate(vectors) if vectors else np.zeros((0, state.dims), np.float32)
    return LateResults(rows, n_tokens, stacked, errors, tokens)


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
    dims = int(meta["dims"])
    extra = [
        f
        for kind in opts.outputs
        for f in kind_fields(kind, int(meta["multivector_dims"]) if kind == "multivector" else dims)
    ]
    return output_schema(
        dims, meta if with_metadata else None, opts.dtype, dense=opts.dense, extra=extra
    )


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
