"""Routing between two lanes of one model versus each lane alone; prints ONE JSON object.

    python -m bench.route [--model minilm-l6-v2] [--single 40] [--bulk 512] [--concurrency 4]
                          [--store-root DIR] [--stride K]

One Module serves the model on both lanes (`model_lanes = {model: ["ane", "llama"]}`: both,
once their vectors agree, with the latency curves the certificates recorded or measured at
load), and each figure is measured three ways in the same run: on the Core ML lane alone, on
the llama.cpp lane alone (`lane=` named), and routed (no `lane=`: the router picks per call).

- single_p50_ms: the median latency of `--single` sequential one-text embeds (a search query).
- bulk_items_per_s: `--bulk` texts embedded as 64-text requests, `--concurrency` at a time
  (an index job): routed, both lanes work at once.
- ratios: routed over the better lane alone (single: best lane's p50 / routed p50, > 1 is
  faster; bulk: routed throughput / best lane's). On a Mac the Neural Engine should win the
  single query and the GPU the bulk, and routed should match the better of each (single ~1)
  and beat both in bulk (> 1: two engines busy).

The harness is for a Mac. Elsewhere the Core ML lane is the numpy reference executor and the
second lane llama.cpp on the same CPU cores, so the two lanes compete for the cores and the
figures say only that the machinery works (`caveat` says so when not on macOS).
`routed_lanes` counts which lane served the routed calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter

from certification.lane_policy import CertificateLanePolicy
from certification.modules import certificate_store
from host.module import Module, ModuleConfig
from ingest.defaults import ensure_defaults
from ingest.store import DEFAULT_EMBED

WORDS = (
    "the cat sat on a mat while stock markets fell sharply and le chat dort sur le "
    "tapis rouge near the old river bank"
).split()


def corpus_texts(n: int, seed: int, lengths: tuple[int, ...] = (6, 20, 60)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice(lengths))) for _ in range(n)]


MODES = ("ane", "llama", "routed")


async def _single(mod: Module, model: str, lane: str | None, n: int, seen: Counter) -> float:
    queries = corpus_texts(n, seed=1, lengths=(8, 12))
    times = []
    for text in queries:
        start = time.perf_counter()
        result = await mod.embed(text, model=model, lane=lane)
        times.append(time.perf_counter() - start)
        if lane is None:
            seen[result.lane] += 1
    return round(statistics.median(times) * 1e3, 3)


async def _bulk(
    mod: Module, model: str, lane: str | None, n: int, concurrency: int, seen: Counter
) -> float:
    docs = corpus_texts(n, seed=2)
    chunks = [docs[i : i + 64] for i in range(0, len(docs), 64)]
    queue: asyncio.Queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)

    async def worker() -> None:
        while not queue.empty():
            result = await mod.embed(queue.get_nowait(), model=model, lane=lane)
            if lane is None:
                seen[result.lane] += len(result.vectors)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return round(len(docs) / (time.perf_counter() - start), 2)


async def run(args: argparse.Namespace) -> dict:
    config = ModuleConfig(store_root=args.store_root, model_lanes={args.model: ["ane", "llama"]})
    policy = CertificateLanePolicy(certificate_store(config), agreement_stride=args.stride)
    load_before = os.getloadavg()
    async with Module(config, policy) as mod:
        await mod.embed("warm up", model=args.model)  # chooses, loads both, measures
        choice = mod.chosen_lanes()[args.model]
        if len(choice.lanes) < 2:
            return {"error": "the model is not served by two lanes", "reason": choice.reason}
        for lane in ("ane", "llama"):  # every shape a run uses, compiled before timing
            await mod.embed(corpus_texts(64, seed=3), model=args.model, lane=lane)
        seen_single: Counter = Counter()
        seen_bulk: Counter = Counter()
        single, bulk = {}, {}
        for mode in MODES:
            lane = None if mode == "routed" else mode
            single[mode] = await _single(mod, args.model, lane, args.single, seen_single)
            bulk[mode] = await _bulk(mod, args.model, lane, args.bulk, args.concurrency, seen_bulk)
        curves = {
            lane: {"items": c.items, "seconds": c.seconds, "tokens": c.tokens}
            for lane, c in mod.latency_curves(args.model).items()
        }
    best_single = min(single["ane"], single["llama"])
    best_bulk = max(bulk["ane"], bulk["llama"])
    out = {
        "bench": "route",
        "model": args.model,
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "routing": choice.reason,
        "curves": curves,
        "single_p50_ms": single,
        "bulk_items_per_s": bulk,
        "ratios": {
            "single_routed_vs_best_lane": round(best_single / single["routed"], 3),
            "bulk_routed_vs_best_lane": round(bulk["routed"] / best_bulk, 3),
        },
        "routed_lanes": {"single": dict(seen_single), "bulk_items": dict(seen_bulk)},
        "config": {"single": args.single, "bulk": args.bulk, "concurrency": args.concurrency},
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    if sys.platform != "darwin":
        out["caveat"] = (
            "not a Mac: the Core ML lane is the numpy reference executor and both lanes share "
            "the same CPU cores, so these figures show the routing works, not what it gains; "
            "the harness is for a Mac (Neural Engine + GPU)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.route")
    ap.add_argument("--model", default=DEFAULT_EMBED)
    ap.add_argument("--single", type=int, default=40, help="one-text calls per mode")
    ap.add_argument("--bulk", type=int, default=512, help="texts per bulk run")
    ap.add_argument("--concurrency", type=int, default=4, help="bulk requests at a time")
    ap.add_argument("--store-root", default=None)
    ap.add_argument(
        "--stride", type=int, default=1, help="corpus stride when agreement is measured at load"
    )
    args = ap.parse_args(argv)
    ensure_defaults(args.store_root)
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
