"""`synapse batch embed INPUT -o OUTPUT.parquet ...` and `synapse batch classify ...`:
argument parsing and exit statuses.

Exit 0: the output is complete (the summary says how many rows failed). Exit 1: the job
stopped before that — too many bad rows, an engine that keeps crashing, a full disk, Ctrl-C or
SIGTERM — and its checkpoint stays for `--resume`. Exit 2: usage errors (bad arguments, missing
input, unknown rows format, unwritable output directory, a checkpoint of another job).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from batch.checkpoint import checkpoint_dir
from batch.errors import BatchUsageError, JobAborted
from common.errors import StorageFull, SynapseError


def add_batch_parser(sub: argparse._SubParsersAction) -> None:
    batch = sub.add_parser("batch", help="bulk jobs over a corpus: embed, classify")
    batch_sub = batch.add_subparsers(dest="batch_command", required=True)
    embed = batch_sub.add_parser(
        "embed",
        help="embed a corpus into a Parquet file (streaming, resumable)",
        description="Rows: .jsonl (text in --text-field, id in --id-field, else the line "
        "number), .txt (one text a line), .parquet and .csv (columns by name); '-' reads "
        "JSONL from stdin. Bad rows go to OUTPUT.errors.jsonl.",
    )
    embed.add_argument("input", help="rows file (.jsonl .txt .parquet .csv) or - for stdin")
    embed.add_argument("-o", "--output", required=True, help="OUTPUT.parquet")
    embed.add_argument("--model", help="embedding model (default: minilm-l6-v2)")
    embed.add_argument(
        "--lane",
        help="engine lane: ane or llama, or both (ane,llama: batches go to whichever lane is "
        "free, once their vectors agree); default: the lanes `synapse serve` would use",
    )
    embed.add_argument("--text-field", default="text")
    embed.add_argument("--id-field", default="id")
    embed.add_argument(
        "--workers",
        type=_positive,
        default=None,
        help="lanes on this machine, threads split between them (default: "
        "2, or the cores if fewer); with --ray, embedding actors (default 1)",
    )
    embed.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint (OUTPUT.partial/) an interrupted "
        "run left, with or without --ray: the same layout either way",
    )
    embed.add_argument(
        "--max-errors",
        type=_non_negative,
        default=1000,
        help="abort (exit 1) when more rows than this fail (default 1000)",
    )
    embed.add_argument(
        "--no-truncate",
        action="store_true",
        help="a text over the model's limit is a row error, not cut",
    )
    embed.add_argument("--no-normalize", action="store_true")
    embed.add_argument(
        "--prompt-name",
        metavar="NAME",
        help="prepend the model's prompt NAME to every text (default: the "
        "model's default prompt, if it has one)",
    )
    embed.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "int8", "uint8", "binary", "ubinary"],
        help="the embedding column's type (default float32): float16 halves "
        "it; int8/uint8 bucket each dimension over the model's "
        "calibration ranges; binary/ubinary pack one sign bit a "
        "dimension (sentence-transformers' quantize_embeddings)",
    )
    embed.add_argument(
        "--window-rows",
        type=_positive,
        default=4096,
        help="rows per commit and per output row group (default 4096)",
    )
    embed.add_argument(
        "--late-chunking",
        action="store_true",
        help="rows are chunks of documents (--doc-field): each row's vector is its chunk's, "
        "from token states that read the whole document",
    )
    embed.add_argument(
        "--doc-field",
        metavar="F",
        help="with --late-chunking: consecutive rows with the same F are one document's "
        "chunks, in order",
    )
    embed.add_argument(
        "--sparse",
        action="store_true",
        help="also write the model's sparse vector (sparse_indices, sparse_values columns)",
    )
    embed.add_argument(
        "--multi-vector",
        action="store_true",
        help="also write the model's multi-vectors (multivector column, one vector a token)",
    )
    embed.add_argument(
        "--tokens",
        action="store_true",
        help="also write every token's final state (tokens column)",
    )
    embed.add_argument(
        "--no-dense",
        action="store_true",
        help="leave out the embedding column (with --sparse, --multi-vector or --tokens)",
    )
    embed.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run on Ray Data: a Ray of our own on this machine (loopback "
        "only, token authentication on), or the cluster at ADDRESS "
        "(RAY_AUTH_MODE=token and its token, see docs/operations.md)",
    )
    embed.add_argument("--json", action="store_true", help="print the summary as JSON")
    embed.set_defaults(func=run_batch_embed)
    _add_classify_parser(batch_sub)


def _add_classify_parser(batch_sub: argparse._SubParsersAction) -> None:
    """The same streaming, checkpointed job as `batch embed`, with a sequence classifier's
    label scores for columns (batch/output.py `classify_schema`)."""
    cls = batch_sub.add_parser(
        "classify",
        help="classify a corpus with a sequence classifier into a Parquet file",
        description="Rows as for `batch embed`. Columns: id, label (the best), score (its "
        "score), scores (every label's, in the order of the file's synapse.labels), "
        "n_tokens, truncated. Scores are the model's activation (softmax, or sigmoid for a "
        "multi-label model), or the raw logits with --raw-scores.",
    )
    cls.add_argument("input", help="rows file (.jsonl .txt .parquet .csv) or - for stdin")
    cls.add_argument("-o", "--output", required=True, help="OUTPUT.parquet")
    cls.add_argument("--model", required=True, help="the sequence classifier")
    cls.add_argument("--text-field", default="text")
    cls.add_argument("--id-field", default="id")
    cls.add_argument("--workers", type=_positive, default=None, help="lanes on this machine")
    cls.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    cls.add_argument("--max-errors", type=_non_negative, default=1000)
    cls.add_argument("--no-truncate", action="store_true", help="an over-long text is a row error")
    cls.add_argument("--raw-scores", action="store_true", help="the head's logits, unactivated")
    cls.add_argument("--window-rows", type=_positive, default=4096)
    cls.add_argument("--json", action="store_true", help="print the summary as JSON")
    cls.set_defaults(func=run_batch_classify)


def run_batch_classify(args: argparse.Namespace) -> int:
    from batch.job import JobOptions, default_workers, run_job, validate

    opts = JobOptions(
        input=args.input,
        output=args.output,
        model=args.model,
        lane="llama",
        text_field=args.text_field,
        id_field=args.id_field,
        workers=args.workers or default_workers(),
        resume=args.resume,
        max_errors=args.max_errors,
        truncate=not args.no_truncate,
        window_rows=args.window_rows,
        task="classify",
        raw_scores=args.raw_scores,
    )
    try:
        validate(opts)
        summary = _run_interruptible(run_job(opts), opts.output)
    except SynapseError as exc:
        print(f"synapse batch: {_what(exc)}: {exc.message}", file=sys.stderr)
        return exit_status(exc)
    _print_summary(summary, args.json)
    return 0


def _positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def _non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def run_batch_embed(args: argparse.Namespace) -> int:
    try:
        if args.ray is not None:
            summary = _run_ray(args)
        else:
            summary = _run_local(args)
    except SynapseError as exc:
        print(f"synapse batch: {_what(exc)}: {exc.message}", file=sys.stderr)
        return exit_status(exc)
    _print_summary(summary, args.json)
    return 0


def _stopped_midway(exc: SynapseError) -> bool:
    """The job ran and stopped before its output was complete; its checkpoint stays. A full
    disk stops it so too: every commit is whole or absent, so `--resume` after freeing space
    goes on from the last one."""
    return isinstance(exc, JobAborted | StorageFull)


def _what(exc: SynapseError) -> str:
    if isinstance(exc, BatchUsageError):
        return "error"
    return "aborted" if _stopped_midway(exc) else f"error[{exc.code}]"


def exit_status(exc: SynapseError) -> int:
    """2: nothing ran (a usage error, or any other caller's mistake); 1: the job stopped and
    its checkpoint is kept (aborted, a full disk, or an engine/host fault)."""
    if _stopped_midway(exc):
        return 1
    return 2 if exc.http_status < 500 else 1


def _options(args: argparse.Namespace):
    from batch.job import JobOptions, default_workers

    return JobOptions(
        input=args.input,
        output=args.output,
        model=args.model,
        lane=args.lane,
        text_field=args.text_field,
        id_field=args.id_field,
        workers=args.workers or default_workers(),
        resume=args.resume,
        max_errors=args.max_errors,
        normalize=not args.no_normalize,
        truncate=not args.no_truncate,
        window_rows=args.window_rows,
        prompt_name=args.prompt_name,
        dtype=args.dtype,
        late_chunking=args.late_chunking,
        doc_field=args.doc_field,
        dense=not args.no_dense,
        outputs=tuple(
            kind
            for kind, asked in (
                ("sparse", args.sparse),
                ("multivector", args.multi_vector),
                ("tokens", args.tokens),
            )
            if asked
        ),
    )


def _run_local(args: argparse.Namespace):
    from batch.job import run_job, validate
    from ingest.defaults import ensure_defaults

    opts = _options(args)
    validate(opts)  # usage errors before the models are installed or a worker starts
    ensure_defaults()
    return _run_interruptible(run_job(opts), opts.output)


def _run_ray(args: argparse.Namespace):
    from host.extras import require_extra
    from ingest.defaults import ensure_defaults

    # Ray is an extra: without it, one line naming the extra, before any model is installed.
    require_extra("ray", "ray.data", "synapse batch embed --ray")
    from batch.ray_job import run_ray_job

    opts = _options(args)
    ensure_defaults()
    address = None if args.ray == "local" else args.ray
    return run_ray_job(opts, address, workers=args.workers)


def _run_interruptible(coro, output: str):
    """Ctrl-C and SIGTERM stop the job between commits' steps; the checkpoint stays."""

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        caught: list[str] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda s=sig: (caught.append(s.name), task.cancel()))
        try:
            return await coro
        except asyncio.CancelledError:
            if not caught:
                raise
            raise JobAborted(
                f"interrupted by {caught[0]}; the checkpoint at "
                f"{checkpoint_dir(_abs(output))} keeps every committed row: rerun the same "
                f"command with --resume"
            ) from None

    return asyncio.run(main())


def _abs(path: str):
    from pathlib import Path

    return Path(path).absolute()


def _print_summary(summary, as_json: bool) -> None:
    rate = summary.rows / summary.seconds if summary.seconds > 0 else 0.0
    if as_json:
        print(
            json.dumps(
                {
                    "output": summary.output,
                    "rows": summary.rows,
                    "errors": summary.errors,
                    "errors_file": summary.errors_file,
                    "tokens": summary.tokens,
                    "seconds": round(summary.seconds, 3),
                    "rows_per_s": round(rate, 1),
                    "resumed_from_line": summary.resumed_from_line,
                    "metadata": summary.metadata,
                }
            )
        )
        return
    failed = (
        f"; {summary.errors} rows failed, see {summary.errors_file}"
        if summary.errors
        else "; no row failed"
    )
    resumed = (
        f" (resumed at line {summary.resumed_from_line})" if summary.resumed_from_line > 1 else ""
    )
    print(
        f"synapse batch: wrote {summary.rows} rows to {summary.output}{resumed}{failed}; "
        f"{summary.tokens} tokens in {summary.seconds:.1f} s ({rate:,.0f} rows/s)"
    )
