"""`synapse serve` under a bounded mixed load for minutes: does its throughput hold, and its memory?

    python -m bench.soak [--minutes 10] [--window-seconds 60] [--warmup-seconds S]
                         [--concurrency 32] [--budget-mb MB] [--threads N]

The server. One `synapse serve` (a subprocess in its own session) over a private store of three
small models: MiniLM-L6 f16 and f32 (embedders) and a MiniLM-L6 cross-encoder (the TEST
cross-encoder: MiniLM's weights with a seeded random head, so it costs what a real
ms-marco-MiniLM-L6 costs; its scores mean nothing, and nothing here reads them). Its memory
budget (`residency.max_resident_mb`, `--budget-mb`) holds any two of them and never all three,
so the server unloads one model and loads another at every phase change below. keep_alive
stays "forever": the budget alone unloads.

The load. This process is the client, in a process of its own: `--concurrency` keep-alive
connections (bench.serve's lean client, tens of microseconds of CPU per request, so it takes
little from the server on shared cores), each sending one request after another, in turn: an
embedding of one 16-token input, an embedding of one 256-token input, and a rerank of 4
documents of 32 tokens for a 16-token query. Every window (`--window-seconds`, one entry of
`minutes`) is the same three phases of equal length, each with two of the three models:

    phase 0: embed 16 and 256 -> f16, rerank -> the cross-encoder
    phase 1: embed 16 and 256 -> f32, rerank -> the cross-encoder   (f16 unloaded for f32)
    phase 2: embed 16 -> f16, embed 256 and rerank -> f32 (a bi-encoder rerank; the
             cross-encoder unloaded for f16)

so every window loads and unloads each model once. A phase starts no request after its end
and is over when every request in flight has answered; the next phase first sends one
request to the model it keeps, making the outgoing model the least recently used idle one,
which is what the budget unloads (were the outgoing model still busy, the budget would refuse
the incoming one: 503 insufficient_memory, an error here). A warm-up (`--warmup-seconds`,
default one window) runs the same rotation first and is not in `minutes`: first loads and the
engines' first-use buffers would otherwise make the first minute the slowest and hide a decay.

Prints ONE JSON object:
- `minutes`: one entry per window: `throughput` (answered requests per second, all three kinds;
  the window's drains and loads included), `p50_ms`/`p99_ms` (latency of answered requests),
  `host_rss_mb` (the serving process) and `worker_rss_mb` (all its engine workers together),
  each the largest of the window's once-a-second samples (psutil), `requests`, `errors`,
  `restarts` and `unloads` (by the budget) in the window.
- `errors`: requests not answered 200 (a non-200 status, a dropped connection, no answer in
  120 s), warm-up included; `errors_by_status` (0: no HTTP answer), and
  `server_errors_by_code`: the server's own count of typed errors (`synapse_errors_total`).
- `restarts`: workers the server replaced after a fault, from `/metrics`
  (`synapse_worker_restarts_total`, summed over lanes; it keeps counting across unloads).
- `unloads` and `refusals`: the server's memory summary (`/v1/models`).
- `targets`: each target's name, value and whether it is met: the last window's throughput >=
  0.95 of the first's, the serving process's RSS growth from the first window to the last <=
  5 %, no errors, no restarts.

`--minutes` may be fractional (0.25 with `--window-seconds 5`: three 5-second windows), so a
test can run it briefly; shorter than one window, it is one window of that length. Throughput
figures on a machine shared with other work are as noisy as that work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from bench.serve import _READY, _Conn, _Proc, _texts, _wait
from certification.reference.cross_encoder import build_test_cross_encoder
from host import eventloop
from host.residency import DEFAULT_OVERHEAD_MB, MIB
from host.tokenization import Tokenizer
from ingest.defaults import ensure_defaults
from ingest.store import DEFAULT_EMBED_F16, DEFAULT_EMBED_F32, ArtifactStore, ModelRecord

XENC = "soak-xenc-f16"
KINDS = ("embed16", "embed256", "rerank")
# The three phases of every window: which model each kind of request goes to.
PHASES = (
    {"embed16": DEFAULT_EMBED_F16, "embed256": DEFAULT_EMBED_F16, "rerank": XENC},
    {"embed16": DEFAULT_EMBED_F32, "embed256": DEFAULT_EMBED_F32, "rerank": XENC},
    {"embed16": DEFAULT_EMBED_F16, "embed256": DEFAULT_EMBED_F32, "rerank": DEFAULT_EMBED_F32},
)
RERANK_DOCS = 4  # of 32 tokens each: a rerank costs about what one 256-token embedding does
REQUEST_TIMEOUT_S = 120.0
SAMPLE_EVERY_S = 1.0
TARGET_THROUGHPUT_RATIO = 0.95
TARGET_HOST_RSS_GROWTH = 0.05


# ---- the models --------------------------------------------------------------------------------


def _private_store(workdir: Path) -> ArtifactStore:
    """A store of its own (no certificates beside it, so every lane is llama.cpp, and nothing
    is left in the user's store): the default MiniLM builds linked from the user's store, the
    test cross-encoder ingested (f16)."""
    defaults = ensure_defaults()
    root = workdir / "models"
    root.mkdir()
    for name in (DEFAULT_EMBED_F16, DEFAULT_EMBED_F32):
        (root / name).symlink_to(defaults.root / name, target_is_directory=True)
    store = ArtifactStore(str(root))
    src = build_test_cross_encoder(workdir / "xenc-src", seed=0)
    store.ingest_hf_dir(src, name=XENC, dtype="f16")
    shutil.rmtree(src, ignore_errors=True)
    return store


def _estimate_mb(rec: ModelRecord) -> float:
    """What the server budgets a never-loaded model at (host.residency's default estimate)."""
    return rec.manifest.size_bytes / MIB + DEFAULT_OVERHEAD_MB[rec.manifest.kind]


def default_budget_mb(records: list[ModelRecord]) -> float:
    """Room for the two largest models with half the smallest to spare, never all three:
    the budget that makes the rotation load and unload."""
    sizes = sorted(_estimate_mb(r) for r in records)
    return round(sizes[1] + sizes[2] + sizes[0] / 2)


# ---- the requests ------------------------------------------------------------------------------


def _raw(url: str, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.removeprefix('http://')}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


@dataclass
class Requests:
    """Pre-encoded requests by (kind, model); `next(kind, model)` cycles through them."""

    raws: dict[tuple[str, str], list[bytes]]
    turn: Counter = field(default_factory=Counter)

    def next(self, kind: str, model: str) -> bytes:
        options = self.raws[kind, model]
        i = self.turn[kind, model]
        self.turn[kind, model] = i + 1
        return options[i % len(options)]


def _requests(url: str, tokenizer: Tokenizer) -> Requests:
    short, long = _texts(tokenizer, 16, 32), _texts(tokenizer, 256, 16)
    docs = _texts(tokenizer, 32, 4 * RERANK_DOCS)
    raws: dict[tuple[str, str], list[bytes]] = {}
    for plan in PHASES:
        for kind, model in plan.items():
            if (kind, model) in raws:
                continue
            if kind == "rerank":
                raws[kind, model] = [
                    _raw(
                        url,
                        "/v1/rerank",
                        {
                            "model": model,
                            "query": q,
                            "return_documents": False,
                            "documents": docs[
                                i % 4 * RERANK_DOCS : i % 4 * RERANK_DOCS + RERANK_DOCS
                            ],
                        },
                    )  # fmt: skip
                    for i, q in enumerate(short)
                ]
            else:
                texts = short if kind == "embed16" else long
                raws[kind, model] = [
                    _raw(url, "/v1/embeddings", {"model": model, "input": t}) for t in texts
                ]
    return Requests(raws)


# ---- the load ----------------------------------------------------------------------------------


@dataclass
class Tally:
    """What one stretch of load (a window, the warm-up) got back."""

    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)

    @property
    def errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)


class Load:
    def __init__(self, url: str, requests: Requests, concurrency: int) -> None:
        self.url, self.requests, self.concurrency = url, requests, concurrency
        self.conns: list[_Conn] = []
        self.previous: set[str] = set()

    async def open(self) -> None:
        self.conns = [await _Conn.open(self.url) for _ in range(self.concurrency)]

    def close(self) -> None:
        for c in self.conns:
            c.close()

    async def _send(self, i: int, raw: bytes, tally: Tally) -> None:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                status = await self.conns[i].request(raw)
        except (TimeoutError, ValueError, OSError):
            status = 0  # no (whole) HTTP answer: the connection's state is unknown, replace it
            self.conns[i].close()
            with contextlib.suppress(OSError):
                self.conns[i] = await _Conn.open(self.url)
        if status == 200:
            tally.latencies.append(time.perf_counter() - start)
        tally.statuses[status] += 1

    async def phase(self, plan: dict[str, str], seconds: float, tally: Tally) -> None:
        """`seconds` of load by `plan`, then the drain (every request in flight answered)."""
        kept = [m for m in dict.fromkeys(plan.values()) if m in self.previous]
        for model in kept:  # most recently used: the budget unloads the outgoing one
            kind = next(k for k in KINDS if plan[k] == model)
            await self._send(0, self.requests.next(kind, model), tally)
        self.previous = set(plan.values())
        deadline = time.perf_counter() + seconds

        async def client(i: int) -> None:
            turn = i
            while time.perf_counter() < deadline:
                kind = KINDS[turn % len(KINDS)]
                turn += 1
                await self._send(i, self.requests.next(kind, plan[kind]), tally)

        await asyncio.gather(*(client(i) for i in range(self.concurrency)))


# ---- what the server and the OS say ------------------------------------------------------------


class Sampler:
    """The serving process's RSS and its workers' (summed), once a second."""

    def __init__(self, host_pid: int) -> None:
        self.host = psutil.Process(host_pid)
        self.samples: list[tuple[float, float, float]] = []  # (time, host MB, workers MB)

    def sample(self) -> None:
        workers = 0.0
        for child in self.host.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                workers += child.memory_info().rss
        with contextlib.suppress(psutil.Error):
            host = self.host.memory_info().rss
            self.samples.append((time.perf_counter(), host / MIB, workers / MIB))

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_EVERY_S)

    def peaks(self, start: float, end: float) -> tuple[float | None, float | None]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return None, None
        return round(max(s[1] for s in inside), 1), round(max(s[2] for s in inside), 1)


@dataclass
class ServerCounts:
    restarts: int
    errors_by_code: Counter
    unloads: dict[str, int]
    refusals: int


async def _server_counts(client: httpx.AsyncClient) -> ServerCounts:
    text = (await client.get("/metrics")).text
    restarts, codes = 0.0, Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "synapse_worker_restarts_total":
                restarts += s.value
            elif s.name == "synapse_errors_total":
                codes[s.labels["code"]] += int(s.value)
    memory = (await client.get("/v1/models")).json()["memory"]
    return ServerCounts(int(restarts), codes, dict(memory["unloads"]), int(memory["refusals"]))


# ---- the run -----------------------------------------------------------------------------------


def _windows(minutes: float, window_s: float) -> tuple[int, float]:
    total = minutes * 60
    if not total > 0:
        raise SystemExit("--minutes must be > 0")
    if total < window_s:
        return 1, total
    return max(1, round(total / window_s)), window_s


def _entry(index: int, tally: Tally, seconds: float, peaks, restarts: int, unloads: int) -> dict:
    lat = np.array(tally.latencies) * 1000
    return {
        "minute": index + 1,
        "seconds": round(seconds, 2),
        "requests": len(tally.latencies),
        "throughput": round(len(tally.latencies) / seconds, 2),
        "p50_ms": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
        "host_rss_mb": peaks[0],
        "worker_rss_mb": peaks[1],
        "errors": tally.errors,
        "restarts": restarts,
        "unloads": unloads,
    }


def _targets(minutes: list[dict], errors: int, restarts: int) -> list[dict]:
    first, last = minutes[0], minutes[-1]
    ratio = last["throughput"] / first["throughput"] if first["throughput"] else None
    growth = (
        last["host_rss_mb"] / first["host_rss_mb"] - 1
        if first["host_rss_mb"] and last["host_rss_mb"]
        else None
    )
    return [
        {
            "name": "throughput_last_vs_first_minute",
            "target": f">= {TARGET_THROUGHPUT_RATIO}",
            "value": None if ratio is None else round(ratio, 3),
            "met": ratio is not None and ratio >= TARGET_THROUGHPUT_RATIO,
        },
        {
            "name": "host_rss_growth",
            "target": f"<= {TARGET_HOST_RSS_GROWTH}",
            "value": None if growth is None else round(growth, 4),
            "met": growth is not None and growth <= TARGET_HOST_RSS_GROWTH,
        },
        {"name": "no_errors", "target": "== 0", "value": errors, "met": errors == 0},
        {"name": "no_restarts", "target": "== 0", "value": restarts, "met": restarts == 0},
    ]


def _config(workdir: Path, store: ArtifactStore, budget_mb: float, threads: int | None) -> Path:
    module: dict = {"store_root": str(store.root), "host": {"runtime_dir": str(workdir / "rt")}}
    if threads:
        module["planned_workers"] = max(1, (os.cpu_count() or 1) // threads)
    config = {
        "port": 0,
        "preload": [],
        "install_defaults": False,
        "module": module,
        "residency": {"max_resident_mb": budget_mb},
    }
    path = workdir / "serve.json"
    path.write_text(json.dumps(config))
    return path


def _start(workdir: Path, config: Path) -> tuple[_Proc, str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "passive", "OPENBLAS_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "service", "--config", str(config)]
    proc = _Proc(argv, env, str(workdir), "serve")
    found: list[str] = []

    def ready() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"synapse serve exited {proc.proc.returncode}")
        found.extend(m.group(1) for line in proc.lines if (m := _READY.search(line)))
        return bool(found)

    _wait(ready, 180, "synapse serve")
    return proc, found[0]


async def _soak(args, workdir: Path) -> dict:
    store = _private_store(workdir)
    records = [store.get(n) for n in (DEFAULT_EMBED_F16, DEFAULT_EMBED_F32, XENC)]
    budget = args.budget_mb or default_budget_mb(records)
    n_windows, window_s = _windows(args.minutes, args.window_seconds)
    warmup_s = window_s if args.warmup_seconds is None else args.warmup_seconds
    man = records[0].manifest
    tokenizer = Tokenizer.from_file(
        records[0].tokenizer_path, max_tokens=man.max_tokens, hard_limit=man.max_tokens_limit
    )
    proc, url = _start(workdir, _config(workdir, store, budget, args.threads))
    # Where to look (its /health, /metrics, /v1/models) while it runs.
    print(f"bench.soak: synapse serve at {url} (pid {proc.proc.pid})", file=sys.stderr, flush=True)
    sampler = Sampler(proc.proc.pid)
    sampling = asyncio.create_task(sampler.run())
    load = Load(url, _requests(url, tokenizer), args.concurrency)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await load.open()
            start_counts = await _server_counts(client)
            warm = Tally()
            t0 = time.perf_counter()
            for i in range(len(PHASES) if warmup_s > 0 else 0):
                await load.phase(PHASES[i], warmup_s / len(PHASES), warm)
            warmup = {
                "seconds": round(time.perf_counter() - t0, 2),
                "requests": len(warm.latencies),
                "errors": warm.errors,
            }
            counts = await _server_counts(client)
            statuses = Counter(warm.statuses)
            minutes = []
            for w in range(n_windows):
                tally, start = Tally(), time.perf_counter()
                for plan in PHASES:
                    await load.phase(plan, window_s / len(PHASES), tally)
                    if proc.proc.poll() is not None:
                        raise RuntimeError(f"synapse serve exited {proc.proc.returncode}")
                end = time.perf_counter()
                sampler.sample()
                now = await _server_counts(client)
                minutes.append(
                    _entry(
                        w,
                        tally,
                        end - start,
                        sampler.peaks(start, end),
                        now.restarts - counts.restarts,
                        now.unloads.get("budget", 0) - counts.unloads.get("budget", 0),
                    )
                )
                statuses.update(tally.statuses)
                counts = now
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        load.close()
        proc.stop()
    errors = sum(n for status, n in statuses.items() if status != 200)
    restarts = counts.restarts - start_counts.restarts
    return {
        "bench": "soak",
        "models": {
            r.name: {"kind": r.manifest.kind, "estimated_mb": round(_estimate_mb(r), 1)}
            for r in records
        },
        "max_resident_mb": budget,
        "concurrency": args.concurrency,
        "window_seconds": window_s,
        "phase_seconds": round(window_s / len(PHASES), 3),
        "warmup": warmup,
        "minutes": minutes,
        "errors": errors,
        "errors_by_status": {str(s): n for s, n in sorted(statuses.items()) if s != 200},
        "server_errors_by_code": dict(counts.errors_by_code - start_counts.errors_by_code),
        "restarts": restarts,
        "unloads": counts.unloads,
        "refusals": counts.refusals,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "targets": _targets(minutes, errors, restarts),
    }


async def _run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="syn-soak-", dir="/tmp"))  # short: socket paths
    try:
        return await _soak(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.soak", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="measured time (fractional)")
    parser.add_argument("--window-seconds", type=float, default=60.0, help="one `minutes` entry")
    parser.add_argument(
        "--warmup-seconds", type=float, default=None, help="unreported rotation first (one window)"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--budget-mb", type=float, default=None,
        help="max_resident_mb (default: room for two of the three models, never three)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=None,
        help="llama.cpp threads per worker (default: the server's, cores / planned_workers)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.window_seconds <= 0 or args.concurrency < 1 or math.isnan(args.window_seconds):
        parser.error("--window-seconds must be > 0 and --concurrency >= 1")
    print(json.dumps(eventloop.run(_run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
