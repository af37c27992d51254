"""`synapse serve` vs llama-cpp-python's own server, same GGUF, same client, same run.

    python -m bench.serve [--requests 240] [--rounds 4] [--threads 2] [--scheduler JSON]
                          [--encoding-format float|base64]

Both servers run as subprocesses on loopback ports with the same minilm GGUF from the
artifact store, the same llama.cpp thread count and `OMP_WAIT_POLICY=passive`. One lean
load client (`_Conn`) drives both with one input per request (`POST /v1/embeddings`), at
concurrency 1, 8 and 32, for inputs of exactly 16 and 128 tokens (specials included). Each
point is measured in `rounds` alternating slices (ours, theirs, theirs, ours, ...) so this
shared machine's noise hits both alike. Bounded: `--requests` per server per point, and
`--max-seconds` per slice.
`--encoding-format` is what each request asks for: `float` (the default; JSON numbers, about
7.7 KB per 384-d vector) or `base64` (2 KB of little-endian float32), which OpenAI's Python
SDK asks for whenever its caller does not choose. llama-cpp-python's server ignores the field
and answers floats either way.
At concurrency 32, use `--requests 1280` or more: the default leaves 60 requests per slice,
under two batches, and the slices' start and end then dominate the figure.

Prints ONE JSON object: embeddings/s and p50/p99 latency per point and server, and the ratios
`throughput_ratio` (ours / theirs; target >= 2 at concurrency 8 and 32) and `p99_ratio` (ours /
theirs; target <= 1, no worse, at concurrency 1); `targets` says which are met.
`engine_in_process_ceiling` is the engine's own batch-32 vs batch-1 throughput, in-process: the
most any batching server can gain over a one-request-at-a-time server with the same engine on
this machine. `synapse_share_of_ceiling` (target >= 0.9 at 16 tokens, concurrency 32) divides
our throughput at concurrency >= 8 by the engine's in-process batch-32 rate measured right
after each of our slices, for as long as the slice ran (this machine's speed drifts 10-35%
within minutes; a ceiling taken only at the end compared a different machine). The end-of-run
figure is reported beside it. Our side of each point also says where its CPU went per request
(`cpu_ms_per_request`: host process, engine workers, this load client, all on the same cores)
and `engine_share_of_cpu`, the workers' part of it: however the work is scheduled, the share of
the ceiling stays near or below that (above it only as far as the served engine happened to run
faster than the in-process one). `engine_cores` compares the cores the served engine kept busy
with those the in-process engine did between the slices: unlike the share, it does not move
with the machine's speed, so it tells a change in the serving path from drift.
`kernels` says which OpenBLAS kernels each side ran on (our workers, the peer server, the
in-process ceiling; `same`: they agree): every side gets the kernels our workers choose
(bench.kernels), or the ratios would measure the kernels, not the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

# Every side on the OpenBLAS kernels our workers run on, decided before anything here loads
# OpenBLAS (numpy below does) and inherited by both servers: see bench.kernels.
from bench import kernels  # first: it makes the choice (before numpy loads OpenBLAS)
from bench.sigterm import exit_on_sigterm

# isort: split

import httpx
import numpy as np
import psutil

# The in-process engine (the ceiling) as the lane's workers run: idle OpenMP threads sleep. A
# spinning one took a lone 128-token decode from 18 ms to 137 ms here (2 cores).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from certification.corpus import corpus
from host import eventloop
from host.tokenization import Tokenizer
from ingest.defaults import ensure_defaults
from ingest.store import DEFAULT_EMBED

REPO = Path(__file__).resolve().parent.parent
_READY = re.compile(r"synapse serve: listening on (http://\S+)")


def _texts(tokenizer: Tokenizer, n_tokens: int, count: int) -> list[str]:
    """`count` distinct texts of exactly `n_tokens` tokens (with [CLS]/[SEP])."""
    words = " ".join(corpus()).split()
    out: list[str] = []
    start = 0
    while len(out) < count:
        lo, hi = 1, n_tokens  # every word is at least one token: more words never fit
        while lo < hi:  # the most words that still fit
            mid = (lo + hi + 1) // 2
            text = " ".join(words[start : start + mid])
            if len(tokenizer.encode([text], truncate=False, max_tokens=512).ids[0]) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[start : start + lo])
        if len(tokenizer.encode([text], truncate=False, max_tokens=512).ids[0]) == n_tokens:
            out.append(text)
        start = (start + 37) % max(1, len(words) - 4 * n_tokens)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    def __init__(self, argv: list[str], env: dict, workdir: str, name: str) -> None:
        exit_on_sigterm()  # before the server exists: no window in which it could be orphaned
        self.log = open(Path(workdir) / f"{name}.log", "wb")  # closed in stop()
        self.lines: list[str] = []
        # Own session for each server: with CFS autogroups, CPU is shared per session, and
        # our workers already run in sessions of their own (the host starts them that way).
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not become ready in {timeout_s} s")


def _start_ours(
    workdir: str, threads: int, env: dict, scheduler: dict | None = None
) -> tuple[_Proc, str]:
    config = {
        "port": 0,
        "preload": [DEFAULT_EMBED],
        "install_defaults": False,
        "module": {
            "planned_workers": max(1, (os.cpu_count() or 1) // threads),
            "host": {"runtime_dir": str(Path(workdir) / "rt")},
        },
    }
    if scheduler:
        config["scheduler"] = scheduler
    path = Path(workdir) / "serve.json"
    path.write_text(json.dumps(config))
    proc = _Proc([sys.executable, "-m", "service", "--config", str(path)], env, workdir, "ours")
    found: list[str] = []

    def ready() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"synapse serve exited {proc.proc.returncode}")
        found.extend(m.group(1) for line in proc.lines if (m := _READY.search(line)))
        return bool(found)

    _wait(ready, 180, "synapse serve")
    return proc, found[0]


def _start_theirs(workdir: str, gguf: str, threads: int, env: dict) -> tuple[_Proc, str]:
    port = _free_port()
    argv = [
        sys.executable, "-m", "llama_cpp.server",
        "--model", gguf, "--embedding", "true",
        "--host", "127.0.0.1", "--port", str(port),
        "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--n_ctx", "512", "--n_batch", "512", "--n_ubatch", "512",
        "--flash_attn", "true", "--verbose", "false",
    ]  # fmt: skip
    proc = _Proc(argv, env, workdir, "theirs")
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited {proc.proc.returncode}")
        try:
            return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(ready, 180, "llama_cpp.server")
    return proc, url


class _Framing(asyncio.Protocol):
    """One connection's response framing: completes `waiter` with the status once a
    Content-Length-framed response has fully arrived; fails it if the connection drops.

    Only Content-Length framing is read (both servers send it). A response without it (e.g.
    chunked) fails the request with ValueError rather than counting its headers as a whole
    response, which would inflate the throughput measured."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.waiter: asyncio.Future[int] | None = None
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower() + b"\r\n"
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(ValueError(f"no Content-Length: {head[:200]!r}"))
            return
        length = int(head[at + 17 : head.find(b"\r\n", at + 2)])
        if len(self.buffer) < end + 4 + length:
            return
        del self.buffer[: end + 4 + length]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(int(head[9:12]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the server closed the connection"))


class _Conn:
    """A minimal keep-alive HTTP/1.1 client connection for the load loop.

    Load client and servers share this machine's 2 cores, so every cycle the client spends is
    taken from the server under test: httpx costs ~8 ms of CPU per request here, asyncio's
    stream reader 0.1-0.2 ms. This sends pre-encoded requests through a bare protocol (on
    uvloop where installed) for a few tens of microseconds. Same client for both servers.
    """

    def __init__(self, url: str, transport: asyncio.Transport, framing: _Framing) -> None:
        self.url, self.transport, self.framing = url, transport, framing

    @classmethod
    async def open(cls, url: str) -> _Conn:
        return cls(url, *await _connect(url))

    async def request(self, raw: bytes) -> int:
        """The response status. A connection the server closed while it sat idle (its
        keep-alive timeout: llama_cpp.server's is 5 s, and warming 32 connections on a busy
        machine can take longer) is reopened and the request sent again, as HTTP clients do;
        0 (an error) if that fails too."""
        for attempt in range(2):
            try:
                return await self._request(raw)
            except ConnectionError:
                self.close()
                if attempt == 0:
                    self.transport, self.framing = await _connect(self.url)
        return 0

    async def _request(self, raw: bytes) -> int:
        if self.framing.lost:
            raise ConnectionError("the server closed the connection")
        self.framing.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.framing.waiter

    def close(self) -> None:
        self.transport.close()


async def _connect(url: str) -> tuple[asyncio.Transport, _Framing]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.get_running_loop().create_connection(_Framing, host, int(port))


def _raw_request(url: str, text: str, encoding_format: str) -> bytes:
    host = url.removeprefix("http://")
    body = json.dumps(
        {"input": text, "model": DEFAULT_EMBED, "encoding_format": encoding_format}
    ).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _slice(
    url: str,
    texts: list[str],
    concurrency: int,
    n: int,
    max_s: float,
    encoding_format: str,
    mark: Callable[[], None] | None = None,
) -> tuple[list[float], int, float]:
    """Latencies of `n` requests at `concurrency` (one connection each), errors, wall time.
    `mark()` runs right before and right after the timed requests (after the untimed warm-up
    round), so what it measures covers exactly the requests counted."""
    raws = [_raw_request(url, t, encoding_format) for t in texts]
    conns = [await _Conn.open(url) for _ in range(concurrency)]
    latencies: list[float] = []
    errors = 0
    try:
        await asyncio.gather(*(c.request(raws[i % len(raws)]) for i, c in enumerate(conns)))
        issued = 0
        if mark is not None:
            mark()
        start = time.perf_counter()
        deadline = start + max_s

        async def worker(conn: _Conn) -> None:
            nonlocal issued, errors
            while issued < n and time.perf_counter() < deadline:
                raw = raws[issued % len(raws)]
                issued += 1
                t = time.perf_counter()
                status = await conn.request(raw)
                if status == 200:
                    latencies.append(time.perf_counter() - t)
                else:
                    errors += 1

        await asyncio.gather(*(worker(c) for c in conns))
        wall = time.perf_counter() - start
        if mark is not None:
            mark()
    finally:
        for c in conns:
            c.close()
    return latencies, errors, wall


def _summary(latencies: list[float], errors: int, wall: float) -> dict:
    lat = np.array(latencies) * 1000
    return {
        "embeddings_per_s": round(len(latencies) / wall, 1) if wall else 0.0,
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
        "requests": len(latencies),
        "errors": errors,
    }


async def _measure(
    urls: dict[str, str],
    texts: list[str],
    conc: int,
    args,
    engine: _Engine | None = None,
    n_tokens: int = 0,
    meter: _CpuMeter | None = None,
) -> tuple[dict, float | None]:
    """Per server: the point's summary. With `engine`: also the engine's in-process batch-32
    rate, measured right after each of our slices for as long as that slice ran, so that this
    machine's drift (10-35% within minutes) hits the share's numerator and denominator alike.
    With `meter`: where our slices' CPU went, per request."""
    names = list(urls)
    acc = {name: ([], 0, 0.0) for name in names}
    ceiling = [0, 0.0]
    cpu: dict[str, float] = {}
    walls = {"served": 0.0, "in_process": 0.0}  # seconds the CPU figures cover
    in_process_cpu = 0.0
    per_slice = max(conc, args.requests // args.rounds)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            ours = name == names[0]
            samples: list[dict[str, float]] = []
            mark = (lambda s=samples: s.append(meter.sample())) if meter and ours else None
            lat, err, wall = await _slice(
                urls[name], texts, conc, per_slice, args.max_seconds, args.encoding_format, mark
            )
            if len(samples) == 2:  # the timed requests only, not the warm-up round
                for key, seconds in samples[1].items():
                    cpu[key] = cpu.get(key, 0.0) + seconds - samples[0][key]
                walls["served"] += wall
            a = acc[name]
            acc[name] = (a[0] + lat, a[1] + err, a[2] + wall)
            if engine is not None and ours:
                cpu_before = _cpu_seconds(meter.client) if meter else 0.0
                wall_before = time.perf_counter()  # rate()'s warm-up batch too, like the CPU
                done, seconds = engine.rate(n_tokens, 32, wall)
                ceiling = [ceiling[0] + done, ceiling[1] + seconds]
                if meter:  # this process runs nothing else meanwhile
                    in_process_cpu += _cpu_seconds(meter.client) - cpu_before
                    walls["in_process"] += time.perf_counter() - wall_before
    rate = round(ceiling[0] / ceiling[1], 1) if ceiling[1] else None
    summaries = {name: _summary(*acc[name]) for name in names}
    served = len(acc[names[0]][0])
    if cpu and served:
        summaries[names[0]]["cpu_ms_per_request"] = {
            key: round(1000 * seconds / served, 3) for key, seconds in cpu.items()
        }
        # The engine's part of all the CPU the three processes used on the shared cores:
        # what the share of the ceiling would be if no core ever idled.
        summaries[names[0]]["engine_share_of_cpu"] = round(
            cpu["engine_workers"] / max(sum(cpu.values()), 1e-9), 3
        )
    if cpu and walls["served"] and walls["in_process"]:
        served_cores = cpu["engine_workers"] / walls["served"]
        in_process_cores = in_process_cpu / walls["in_process"]
        summaries[names[0]]["engine_cores"] = {
            "served": round(served_cores, 3),
            "in_process": round(in_process_cores, 3),
            "ratio": round(served_cores / max(in_process_cores, 1e-9), 3),
        }
    return summaries, rate


class _CpuMeter:
    """CPU seconds of our server (its host process and its engine workers) and of this load
    client, which all share the machine's cores."""

    def __init__(self, host_pid: int) -> None:
        self.host = psutil.Process(host_pid)
        self.client = psutil.Process()

    def sample(self) -> dict[str, float]:
        workers = 0.0
        for child in self.host.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                workers += _cpu_seconds(child)
        return {
            "host": _cpu_seconds(self.host),
            "engine_workers": workers,
            "load_client": _cpu_seconds(self.client),
        }


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


class _Engine:
    """The engine in this process (no HTTP, no IPC), for the ceiling figures."""

    def __init__(self, rec, threads: int) -> None:
        from workers.engine import NullProgress
        from workers.llama.engine import LlamaEngine
        from workers.protocol import messages as m

        self._m, self._progress, self.name = m, NullProgress(), rec.name
        self.engine = LlamaEngine()
        cfg = {"model_ref": rec.name, "n_ctx": 512, "n_threads": threads,
               "n_threads_batch": threads}  # fmt: skip
        load = m.LOAD(
            req_id=0,
            artifact_path=str(rec.artifact_path),
            artifact_digest=rec.digest,
            format="gguf",
            runtime_config=cfg,
        )
        self.engine.load(load, self._progress)

    def rate(self, n_tokens: int, batch: int, seconds: float) -> tuple[int, float]:
        """(embeddings, seconds) of back-to-back batches of `batch` inputs for ~`seconds`."""
        m = self._m
        seq = np.array([101] + [2773] * (n_tokens - 2) + [102], np.int32)
        items = [m.EmbedItem(id=i, n_tokens=n_tokens) for i in range(batch)]
        req = m.EMBED_BATCH(req_id=0, model_ref=self.name, items=items)
        ids = np.tile(seq, batch)
        self.engine.embed(req, ids, self._progress)  # warm
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.engine.embed(req, ids, self._progress)
            done += batch
        return done, time.perf_counter() - start

    def close(self) -> None:
        self.engine.close()


def _engine_ceiling(engine: _Engine, lengths: list[int], budget_s: float = 6.0) -> dict:
    """The engine's own batching gain in-process: embeddings/s at batch 1 and batch 32.
    No server can out-batch this ratio against a batch-1 server on this machine (e.g.
    128-token inputs are already FLOP-bound at batch 1)."""
    out = {}
    for n_tokens in lengths:
        rates = {}
        for batch in (1, 32):
            done, seconds = engine.rate(n_tokens, batch, budget_s / 2)
            rates[batch] = done / seconds
        out[str(n_tokens)] = {
            "batch1_embeddings_per_s": round(rates[1], 1),
            "batch32_embeddings_per_s": round(rates[32], 1),
            "batching_gain": round(rates[32] / rates[1], 2),
        }
    return out


def _agreement(ours: str, theirs: str, text: str, encoding_format: str) -> float:
    """Cosine of the two servers' vectors for `text`, ours in the format the load asks for
    (so a base64 run also checks what it measures decodes to the same vector)."""
    body = {"input": text, "encoding_format": encoding_format}
    a = httpx.post(f"{ours}/v1/embeddings", json=body, timeout=60).json()
    b = httpx.post(f"{theirs}/v1/embeddings", json={"input": text}, timeout=60).json()
    va = _vector(a["data"][0]["embedding"])
    vb = _vector(b["data"][0]["embedding"])
    return float(va @ vb / (np.linalg.norm(va) * np.linalg.norm(vb)))


def _vector(embedding: list[float] | str) -> np.ndarray:
    if isinstance(embedding, str):  # base64: little-endian float32
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4").astype(np.float64)
    return np.array(embedding)


def _kernels_ran(ours_pid: int, theirs_pid: int, engine: _Engine | None) -> dict:
    """The OpenBLAS kernels each side runs on (bench.kernels), read from the live processes:
    our engine workers (the server's children), llama-cpp-python's server, and this process
    (the in-process ceiling, when it is measured)."""
    workers = [
        kernels.process_kernels(child.pid)
        for child in psutil.Process(ours_pid).children(recursive=True)
    ]
    ran: dict = {
        "choice": kernels.CHOICE,
        "synapse_workers": workers,
        "llama_cpp_server": kernels.process_kernels(theirs_pid),
    }
    if engine is not None:
        ran["in_process_ceiling"] = kernels.process_kernels()
    ran["same"] = kernels.agree({k: v for k, v in ran.items() if k != "choice"})
    return ran


async def _serve_points(args, rec, texts: dict[int, list[str]], engine: _Engine | None):
    """Both servers started, every (length, concurrency) point measured, both stopped:
    (vector agreement, points, the kernels each side ran)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "passive", "OPENBLAS_NUM_THREADS": "1"}
    workdir = tempfile.mkdtemp(prefix="syn-bench-", dir="/tmp")  # short: worker socket paths
    procs: list[_Proc] = []
    try:
        ours, ours_url = _start_ours(workdir, args.threads, env, json.loads(args.scheduler))
        procs.append(ours)
        theirs, theirs_url = _start_theirs(workdir, str(rec.artifact_path), args.threads, env)
        procs.append(theirs)
        urls = {"synapse": ours_url, "llama_cpp_server": theirs_url}
        meter = _CpuMeter(ours.proc.pid)
        ran = _kernels_ran(ours.proc.pid, theirs.proc.pid, engine)
        agreement = _agreement(
            ours_url, theirs_url, texts[args.lengths[0]][0], args.encoding_format
        )
        points = []
        for n_tokens in args.lengths:
            for conc in args.concurrency:
                interleave = engine if conc >= 8 else None
                res, ceiling_rate = await _measure(
                    urls, texts[n_tokens], conc, args, interleave, n_tokens, meter
                )
                s, t = res["synapse"], res["llama_cpp_server"]
                points.append(
                    {
                        "tokens": n_tokens,
                        "concurrency": conc,
                        **res,
                        "engine_batch32_interleaved_embeddings_per_s": ceiling_rate,
                        "throughput_ratio": round(
                            s["embeddings_per_s"] / max(t["embeddings_per_s"], 1e-9), 2
                        ),
                        "p99_ratio": round(s["p99_ms"] / t["p99_ms"], 2)
                        if s["p99_ms"] and t["p99_ms"]
                        else None,
                    }
                )
        return agreement, points, ran
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def _run(args) -> dict:
    store = ensure_defaults()
    rec = store.get(DEFAULT_EMBED)
    man = rec.manifest
    tokenizer = Tokenizer.from_file(
        rec.tokenizer_path, max_tokens=man.max_tokens, hard_limit=man.max_tokens_limit
    )
    texts = {n: _texts(tokenizer, n, 64) for n in args.lengths}
    engine = _Engine(rec, args.threads) if args.ceiling else None
    try:
        agreement, points, ran = await _serve_points(args, rec, texts, engine)
        # After the servers have stopped, so that they do not share the cores with it.
        ceiling = _engine_ceiling(engine, args.lengths) if engine is not None else None
    finally:
        if engine is not None:
            engine.close()
    high = [p for p in points if p["concurrency"] >= 8]
    # What share of the engine's own batched throughput the whole HTTP + scheduling path
    # delivers (target >= 0.9 at 16 tokens, concurrency 32): against the batch-32 rate
    # measured between our slices, and (for comparison) against the end-of-run one.
    of_ceiling, of_end_ceiling = {}, {}
    for p in high:
        key = f"{p['tokens']}_tokens_concurrency_{p['concurrency']}"
        ours = p["synapse"]["embeddings_per_s"]
        if p["engine_batch32_interleaved_embeddings_per_s"]:
            of_ceiling[key] = round(ours / p["engine_batch32_interleaved_embeddings_per_s"], 2)
        c = (ceiling or {}).get(str(p["tokens"]))
        if c and c["batch32_embeddings_per_s"]:
            of_end_ceiling[key] = round(ours / c["batch32_embeddings_per_s"], 2)
    single = [p for p in points if p["concurrency"] == 1]
    return {
        "bench": "serve",
        "model": DEFAULT_EMBED,
        "gguf_sha256": rec.digest,
        "threads": args.threads,
        "encoding_format": args.encoding_format,
        "requests_per_point": args.requests,
        "rounds": args.rounds,
        "vector_agreement_cosine": round(agreement, 6),
        "kernels": ran,
        "points": points,
        "engine_in_process_ceiling": ceiling,
        "synapse_share_of_ceiling": of_ceiling,
        "synapse_share_of_end_of_run_ceiling": of_end_ceiling,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "targets": {
            "throughput_ratio_at_concurrency_8_and_32": ">= 2",
            "synapse_share_of_ceiling_16_tokens_concurrency_32": ">= 0.9",
            "p99_ratio_at_concurrency_1": "<= 1",
            "throughput_met": all(p["throughput_ratio"] >= 2 for p in high),
            "share_met": of_ceiling["16_tokens_concurrency_32"] >= 0.9
            if "16_tokens_concurrency_32" in of_ceiling
            else None,
            "p99_met": all(p["p99_ratio"] is not None and p["p99_ratio"] <= 1 for p in single),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.serve", description=__doc__)
    parser.add_argument("--requests", type=int, default=240, help="per server per point")
    parser.add_argument("--rounds", type=int, default=4, help="alternating slices per point")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--max-seconds", type=float, default=60.0, help="cap per slice")
    parser.add_argument(
        "--encoding-format", choices=["float", "base64"], default="float",
        help="what every request asks for (OpenAI's Python SDK asks for base64 by default)",
    )  # fmt: skip
    parser.add_argument(
        "--scheduler", default="{}", help="our [scheduler] overrides, JSON (tuning A/B runs)"
    )
    parser.add_argument(
        "--no-ceiling", dest="ceiling", action="store_false",
        help="skip the in-process engine batching-gain measurement",
    )  # fmt: skip
    args = parser.parse_args(argv)
    print(json.dumps(eventloop.run(_run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
