"""Bulk embedding job throughput: the job vs the in-process engine ceiling, and Ray vs local.

    python -m bench.batch [--rows 20000] [--workers 2]

On one corpus of `--rows` mixed-length rows (JSONL, real multilingual sentences joined to
lengths of ~5 to ~250 tokens), in one run:
- ceiling: the same LlamaEngine run in process by `--workers` processes (each in its own
  session, the cores split as the job splits them), fed the same tokens in the same
  length-sorted batches: no IPC, no reading, no writing; the engine alone.
- job: `run_job` (`synapse batch embed`), wall time from the call to the published file.
- ray: `run_ray_job` (`--ray`, a local Ray started by the job), wall time likewise, plus
  seconds from the call to Ray being up and to the first embedded row.
Prints one JSON object: rows/s and tokens/s of each, `job_ratio` = job / ceiling (target
>= 0.9), `ray_ratio` = ray / job (target >= 0.8), and `uptime` load before and after (the
machine may be shared: ratios, measured in the same run, are the figures to read). Every side
runs on the OpenBLAS kernels our workers choose (bench.kernels): the ceiling shards and the
job's workers each report theirs (`kernels`), and `kernels_same` says they agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The ceiling shards, the job's workers and Ray's inherit the OpenBLAS kernels our workers
# choose, decided here before numpy loads OpenBLAS (bench.kernels).
from bench import kernels  # first: it makes the choice (before numpy loads OpenBLAS)
from bench.sigterm import exit_on_sigterm

# isort: split

import numpy as np

from batch.job import JobOptions, run_job
from batch.windows import plan_batches
from certification.corpus import corpus
from host.config import HostConfig
from host.module import ModuleConfig
from ingest.defaults import ensure_defaults
from ingest.store import DEFAULT_EMBED, ArtifactStore
from workers.engine import NullProgress
from workers.protocol import messages as m

WORDS_PER_ROW = (3, 6, 12, 25, 60, 150)  # -> about 5 .. 256 (truncated) tokens


def write_corpus(path: Path, n: int) -> None:
    rng = random.Random(0)
    words = " ".join(corpus()).split()
    with open(path, "w") as f:
        for i in range(n):
            k = rng.choice(WORDS_PER_ROW)
            start = rng.randrange(0, len(words) - k)
            f.write(json.dumps({"id": f"r{i}", "text": " ".join(words[start : start + k])}) + "\n")


def ceiling(path: Path, config: ModuleConfig, workers: int) -> dict:
    """The engine alone: `workers` processes, each running the LlamaEngine in process on its
    share of the batches (cores split as the job splits them between its lanes), fed the same
    tokens in the same length-sorted batches. No IPC, no reading, no writing: the upper bound
    of the job on this layout. Each runs in its own session, as the job's workers do, so on a
    shared machine CFS gives both sides the same number of autogroup shares."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.batch",
                "--shard",
                f"{k}/{workers}",
                "--corpus",
                str(path),
                "--max-worker-batch-tokens",
                str(config.max_worker_batch_tokens),
                "--max-batch-items",
                str(config.max_batch_items),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for k in range(workers)
    ]
    try:
        for p in procs:  # each has loaded and tokenized (outside the timing)
            assert p.stdout.readline().strip() == "ready"
        start = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        shards = [json.loads(p.communicate()[0]) for p in procs]
        seconds = time.perf_counter() - start
    finally:  # a failed or interrupted bench leaves no shard computing on
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    result = _rates(sum(s["rows"] for s in shards), sum(s["tokens"] for s in shards), seconds)
    result["engines"], result["threads_each"] = workers, shards[0]["threads"]
    result["kernels"] = [s["kernels"] for s in shards]
    return result


def run_shard(shard: str, corpus_path: str, max_tokens: int, max_items: int) -> None:
    from batch.rows import InputSpec, read_rows
    from host.tokenization import Tokenizer
    from workers.llama.engine import LlamaEngine

    k, n = (int(x) for x in shard.split("/"))
    rec = ArtifactStore().get(DEFAULT_EMBED)
    threads = max(1, (os.cpu_count() or 1) // n)
    engine = LlamaEngine()
    engine.load(
        m.LOAD(
            req_id=0,
            artifact_path=str(rec.artifact_path),
            artifact_digest=rec.digest,
            format="gguf",
            runtime_config={
                "model_ref": DEFAULT_EMBED,
                "n_ctx": rec.manifest.n_ctx,
                "n_threads": threads,
                "n_threads_batch": threads,
            },
        ),
        NullProgress(),
    )
    man = rec.manifest
    tok = Tokenizer.from_file(
        rec.tokenizer_path, max_tokens=man.max_tokens, hard_limit=man.max_tokens_limit
    )
    ids = tok.encode([r.text for r in read_rows(InputSpec(corpus_path))], truncate=True).ids
    work = []
    window = 4096  # the job's window: batches are planned the same way
    for w in range(0, len(ids), window):
        part = ids[w : w + window]
        lengths = [len(x) for x in part]
        for batch in plan_batches(lengths, max_tokens, max_items):
            req = m.EMBED_BATCH(
                req_id=0,
                model_ref=DEFAULT_EMBED,
                normalize=True,
                items=[m.EmbedItem(id=j, n_tokens=lengths[i]) for j, i in enumerate(batch)],
            )
            work.append((req, np.concatenate([part[i] for i in batch])))
    mine = work[k::n]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return  # end of input: the bench that started this shard is gone; nobody would read it
    for req, payload in mine:
        engine.embed(req, payload, NullProgress())
    print(
        json.dumps(
            {
                "rows": sum(len(r.items) for r, _ in mine),
                "tokens": int(sum(len(p) for _, p in mine)),
                "threads": threads,
                "kernels": kernels.process_kernels(),  # the engine's, read in this shard
            }
        )
    )


def _rates(rows: int, tokens: int, seconds: float) -> dict:
    return {
        "rows": rows,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "rows_per_s": round(rows / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
    }


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batch")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--shard", help=argparse.SUPPRESS)  # internal: one ceiling process
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--max-worker-batch-tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-batch-items", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard:
        run_shard(args.shard, args.corpus, args.max_worker_batch_tokens, args.max_batch_items)
        return
    exit_on_sigterm()  # its shards, in sessions of their own, are killed on the way out
    ensure_defaults()
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="syn-bb-", dir="/tmp") as tmp:
        tmpdir = Path(tmp)
        path = tmpdir / "corpus.jsonl"
        write_corpus(path, args.rows)
        config = ModuleConfig(host=HostConfig(runtime_dir=str(tmpdir), ping_interval_s=0))
        ceil = ceiling(path, config, args.workers)

        opts = JobOptions(
            input=str(path),
            output=str(tmpdir / "job.parquet"),
            workers=args.workers,
            module=config,
            progress_interval_s=3600,
        )
        start = time.perf_counter()
        with kernels.WorkerWatch() as watch:  # reads the job's llama workers while they run
            summary = asyncio.run(run_job(opts))
        job = _rates(summary.rows, summary.tokens, time.perf_counter() - start)
        job["workers"] = args.workers
        job["kernels"] = watch.seen
        result = {
            "corpus_rows": args.rows,
            "cores": os.cpu_count(),
            "ceiling": ceil,
            "job": job,
            "job_ratio": round(job["rows_per_s"] / ceil["rows_per_s"], 3),
            "kernel_choice": kernels.CHOICE,
            "kernels_same": kernels.agree({"ceiling": ceil["kernels"], "job": job["kernels"]}),
        }
        if not args.skip_ray:
            from batch.ray_job import run_ray_job

            timings: dict = {}
            opts = JobOptions(
                input=str(path),
                output=str(tmpdir / "ray.parquet"),
                workers=args.workers,
                module=config,
            )
            start = time.perf_counter()
            rsum = run_ray_job(opts, None, workers=args.workers, timings=timings)
            ray = _rates(rsum.rows, rsum.tokens, time.perf_counter() - start)
            ray["ray_init_s"] = round(timings["ray_init_s"], 2)
            ray["first_row_s"] = round(timings["first_row_s"], 2)
            result["ray"] = ray
            result["ray_ratio"] = round(ray["rows_per_s"] / job["rows_per_s"], 3)
            result["ray_first_row_s"] = ray["first_row_s"]
    result["targets"] = {"job_ratio": 0.9, "ray_ratio": 0.8}
    result["uptime_load"] = {"before": load_before, "after": _load()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
