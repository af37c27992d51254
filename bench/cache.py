"""Benchmark of compile_cache; prints ONE JSON object.

- hit latency: `get_or_build` on keys already present in a cache of 1,000 entries, keys drawn
  uniformly at random, timed one call at a time with perf_counter; p50 / p99 in microseconds.
  Measured twice: with the default `touch_interval` (a hit writes its last-use at most once a
  second per entry) and with `touch_interval=0` (every hit writes the index).
- race: N processes (spawned, each opened its CompileCache, then released together by a
  barrier) call `get_or_build` on one key whose build sleeps BUILD_S; wall time is from the
  earliest start to the latest return on CLOCK_MONOTONIC, which is system-wide, so process
  start-up and imports are excluded. The baseline is the same harness with a single process.
  `race_ratio` = median race wall / median solo wall over interleaved trials (target <= 1.2).

    python -m bench.cache [--entries 1000] [--procs 8] [--build-s 0.5] [--trials 3] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from compile_cache import CompileCache

CTX = mp.get_context("spawn")


def _key(i: int) -> dict[str, object]:
    return {
        "manifest_digest": "5e" * 32,
        "kernel_revision": "bench",
        "shape": [1, 16 + i, False],
        "precision": "fp16",
        "deployment_target": "macOS15",
        "coremltools_version": "9.0",
    }


def _small_build(tmp: Path) -> None:
    (tmp / "model.mlpackage").mkdir()
    (tmp / "model.mlpackage" / "weights.bin").write_bytes(b"\0" * 256)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def bench_hits(root: Path, entries: int, n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    cache = CompileCache(root, budget_bytes=None)
    for i in range(entries):
        cache.get_or_build(_key(i), _small_build)
    populate_s = time.perf_counter() - t0
    out: dict[str, float] = {"populate_s": round(populate_s, 2)}
    rng = random.Random(0)
    for label, interval in (("hit", 1.0), ("hit_write_through", 0.0)):
        c = CompileCache(root, budget_bytes=None, touch_interval=interval)
        keys = [_key(rng.randrange(entries)) for _ in range(n)]
        for k in keys[:200]:  # warm-up: page cache, sqlite statement cache
            c.get_or_build(k, _small_build)
        samples = []
        for k in keys:
            t = time.perf_counter()
            c.get_or_build(k, _small_build)
            samples.append(time.perf_counter() - t)
        p50, p99 = _percentiles(samples)
        out[f"{label}_p50_us"] = round(p50, 1)
        out[f"{label}_p99_us"] = round(p99, 1)
        c.close()
    cache.close()
    return out


def _racer(root: str, count_file: str, build_s: float, barrier, out) -> None:  # type: ignore[no-untyped-def]
    cache = CompileCache(root)

    def build(tmp: Path) -> None:
        with open(count_file, "a") as f:
            f.write("x\n")
        time.sleep(build_s)  # stands in for a Core ML compile
        _small_build(tmp)

    barrier.wait()
    start = time.monotonic()
    cache.get_or_build(_key(0), build)
    out.put((start, time.monotonic()))


def _run_race(base: Path, procs: int, build_s: float) -> tuple[float, int]:
    root = Path(tempfile.mkdtemp(dir=base))
    count_file = root / "builds"
    CompileCache(root).close()  # create the layout outside the timed region
    barrier, out = CTX.Barrier(procs), CTX.Queue()
    ps = [
        CTX.Process(target=_racer, args=(str(root), str(count_file), build_s, barrier, out))
        for _ in range(procs)
    ]
    for p in ps:
        p.start()
    times = [out.get(timeout=120) for _ in ps]
    for p in ps:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"racer exited with {p.exitcode}")
    wall = max(e for _, e in times) - min(s for s, _ in times)
    return wall, len(count_file.read_text().splitlines())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__)
    ap.add_argument("--entries", type=int, default=1000)
    ap.add_argument("--hits", type=int, default=5000)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--build-s", type=float, default=0.5)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--dir", type=Path, default=None, help="where to create caches (default: TMPDIR)"
    )
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-cache-") as tmp:
        base = Path(tmp)
        result: dict[str, object] = {"bench": "compile_cache", "entries": args.entries}
        result.update(bench_hits(base / "hits", args.entries, args.hits))
        solo, race, builds = [], [], []
        for _ in range(args.trials):  # interleaved, so load drift hits both sides alike
            solo.append(_run_race(base, 1, args.build_s)[0])
            wall, n_builds = _run_race(base, args.procs, args.build_s)
            race.append(wall)
            builds.append(n_builds)
        result.update(
            {
                "race_procs": args.procs,
                "build_s": args.build_s,
                "trials": args.trials,
                "solo_wall_s": round(statistics.median(solo), 4),
                "race_wall_s": round(statistics.median(race), 4),
                "race_ratio": round(statistics.median(race) / statistics.median(solo), 3),
                "race_builds_per_trial": builds,
                "cpu_count": os.cpu_count(),
                "method": (
                    "hits: per-call perf_counter over uniformly random present keys; "
                    "race: spawned procs open the cache, wait on a barrier, wall = latest "
                    "return - earliest start (CLOCK_MONOTONIC), baseline = same harness with "
                    "1 proc, ratio of medians over interleaved trials"
                ),
            }
        )
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
