"""Benchmark of the Core ML engine on its reference backend; prints ONE JSON object.

All baselines are measured in the same run (these machines are noisy); each timing is the
median of `--trials` interleaved runs.

- executor_ratio: sentences/s of AneEngine.embed (reference backend: the numpy fp16-emulating
  executor of the saved package) over the SAME sentences through the independent fp32 numpy
  reference forward (`certification.reference.bert`), which computes on real tokens only.
  The engine serves with an unpacked 8x128 and a packed 8x128p8 shape (short sentences
  packed), as deployed; `executor_ratio_unpacked` is the same with the unpacked shape alone,
  where every sentence pays for a whole 128-token row; `executor_token_ratio` divides that
  padding out (computed token positions/s over the reference's real tokens/s).
  Target executor_ratio >= 0.5.
- packed_gain: sentences/s of 16-token inputs on the packed 8x128p8 shape over the unpacked
  8x128 shape: the same compiled row length, 8 sequences per packed row. Target >= 2.0.
- admit_speedup: ADMIT_SHAPE on an empty compile cache (build the MIL graph, convert, save,
  compile, publish, open) over ADMIT_SHAPE of the same shape by a second engine (compiled
  form from the cache: open only). `admit` breaks both down with SHAPE_ADMITTED's stage
  timings (build, compile, load, warm-up ms) plus `package_hit_ms`: the compiled form evicted,
  its package still cached (compile + open only).
- start: time to HELLO of the Core ML worker (`Lane.start()`: spawn, imports, handshake)
  against the minimal faulty worker in the same run, and what HELLO no longer waits for:
  `import coremltools` in a fresh interpreter as coremltools does it by default (probing
  torch, scikit-learn... whatever is installed) and as the worker does it (blocked).

    python -m bench.ane [--sentences 64] [--trials 3] [--dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402

from certification.corpus import corpus  # noqa: E402
from certification.reference.bert import BertReference  # noqa: E402
from certification.reference.cross_encoder import minilm_dir  # noqa: E402
from workers.ane.engine import AneEngine  # noqa: E402
from workers.ane.manifest import Manifest, ingest_owned  # noqa: E402
from workers.ane.packing import plan  # noqa: E402
from workers.engine import NullProgress  # noqa: E402
from workers.protocol import messages as m  # noqa: E402

UNPACKED = {"rows": 8, "seq_len": 128}
PACKED = {"rows": 8, "seq_len": 128, "packed": True, "max_segments": 8}


def _engine(manifest: Manifest, cache_root: Path, shapes: list[dict]) -> AneEngine:
    engine = AneEngine(manifest.dir, backend="reference")
    engine.load(
        m.LOAD(req_id=1, artifact_path=manifest.dir, artifact_digest=manifest.digest,
               format="coreml-owned",
               runtime_config={"cache_root": str(cache_root), "shapes": shapes}),
        NullProgress(),
    )
    return engine


def _admit(engine: AneEngine, shape: dict) -> tuple[float, m.SHAPE_ADMITTED]:
    start = time.perf_counter()
    reply = engine.admit_shape(m.ADMIT_SHAPE(req_id=2, model_ref="minilm", **shape),
                               NullProgress())
    return (time.perf_counter() - start) * 1e3, reply


def _embedder(engine: AneEngine, seqs: list[np.ndarray]) -> Callable[[], np.ndarray]:
    req = m.EMBED_BATCH(req_id=3, model_ref="minilm", normalize=True,
                        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)])
    ids = np.concatenate(seqs).astype(np.int32)
    return lambda: engine.embed(req, ids, NullProgress())


def _slots(engine: AneEngine, seqs: list[np.ndarray]) -> int:
    """Token positions the executor computes for `seqs` (padding included): the work it does,
    as opposed to the real tokens the reference computes."""
    shapes = [compiled.shape for compiled in engine._model.shapes.values()]  # noqa: SLF001
    return sum(c.shape.tokens for c in plan([len(s) for s in seqs], shapes))


def _rate(fns: dict[str, Callable[[], object]], n: int, trials: int) -> dict[str, float]:
    """Median sentences/s of each callable, trials interleaved."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: n / statistics.median(v) for k, v in times.items()}


def _stages(reply: m.SHAPE_ADMITTED, total_ms: float) -> dict[str, float]:
    return {"total_ms": total_ms, "build_ms": reply.build_ms, "compile_ms": reply.compile_ms,
            "load_ms": reply.load_ms, "warmup_ms": reply.warmup_ms}


def _package_hit_admit(manifest: Manifest, cache_root: Path) -> tuple[float, AneEngine]:
    """Admit after evicting only the compiled form: the package is reused, not rebuilt.
    Returns the ms and the engine (UNPACKED loaded)."""
    from compile_cache import CompileCache

    with CompileCache(cache_root, budget_bytes=None) as cache:
        for entry in cache.ls():
            if entry.key.get("kind") == "reference-program":
                cache.evict(entry.digest)
    engine = _engine(manifest, cache_root, [])
    ms, reply = _admit(engine, UNPACKED)
    assert not reply.cache_hit and reply.build_ms == 0.0
    return ms, engine


def _fresh_import_s(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


_IMPORT = ("import time; t = time.perf_counter(); {pre}import workers.ane.ct_quiet; "
           "print(time.perf_counter() - t)")


def _start_timings(manifest: Manifest, trials: int) -> dict[str, object]:
    """Median ms from spawn to HELLO accepted, Core ML worker vs faulty worker."""
    from host import HostConfig, Lane, LaneConfig

    async def start_ms(argv: list[str], runtime_dir: str) -> float:
        lane = Lane(LaneConfig(lane_id="bench", argv=argv),
                    HostConfig(runtime_dir=runtime_dir, ping_interval_s=0))
        t = time.perf_counter()
        await lane.start()
        ms = (time.perf_counter() - t) * 1e3
        await lane.stop()
        return ms

    ane = ["python", "-m", "workers.ane", "--artifact", str(manifest.dir),
           "--backend", "reference"]
    faulty = ["python", "-m", "workers.faulty"]
    times: dict[str, list[float]] = {"ane": [], "faulty": []}
    runtime_dir = tempfile.mkdtemp(prefix="bane-", dir="/tmp")
    try:
        for _ in range(trials):
            times["ane"].append(asyncio.run(start_ms(ane, runtime_dir)))
            times["faulty"].append(asyncio.run(start_ms(faulty, runtime_dir)))
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
    ane_ms, faulty_ms = (statistics.median(times[k]) for k in ("ane", "faulty"))
    guard = "from workers.ane.import_guard import block_converter_frameworks as b; b(); "
    return {
        "ane_worker_hello_ms": ane_ms,
        "faulty_worker_hello_ms": faulty_ms,
        "hello_ratio_vs_faulty": ane_ms / faulty_ms,
        "import_coremltools_default_s": _fresh_import_s(_IMPORT.format(pre="")),
        "import_coremltools_in_worker_s": _fresh_import_s(_IMPORT.format(pre=guard)),
        "torch_installed": importlib.util.find_spec("torch") is not None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ane")
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dir", help="work dir (default: a temp dir, removed afterwards)")
    args = ap.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-ane-"))
    try:
        print(json.dumps(run(work, args.sentences, args.trials), sort_keys=True))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def run(work: Path, n_sentences: int, trials: int) -> dict[str, object]:
    manifest = ingest_owned(minilm_dir(), work / "minilm")
    cache_root = work / "cache"
    shutil.rmtree(cache_root, ignore_errors=True)  # cold means cold
    tok = tokenizers.Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    encoded = [np.asarray(tok.encode(t).ids, np.int32) for t in corpus()]

    start = _start_timings(manifest, trials)

    # Admission: cold compile, then a second engine hits the cache.
    unpacked = _engine(manifest, cache_root, [])
    cold_ms, cold = _admit(unpacked, UNPACKED)
    assert not cold.cache_hit
    second = _engine(manifest, cache_root, [])
    hit_ms, hit = _admit(second, UNPACKED)
    assert hit.cache_hit
    second.close()
    unpacked.close()  # releases its lease on the compiled form, which the next step evicts
    package_hit_ms, unpacked = _package_hit_admit(manifest, cache_root)
    both = _engine(manifest, cache_root, [UNPACKED, PACKED])
    packed = _engine(manifest, cache_root, [PACKED])

    # Executor vs the fp32 reference forward on real sentences (<= 128 tokens).
    seqs = [s for s in encoded if len(s) <= 128][:n_sentences]
    reference = BertReference.from_dir(minilm_dir())
    rates = _rate({
        "reference": lambda: reference.embed(seqs, pooling="mean", normalize=True),
        "executor": _embedder(both, seqs),
        "executor_unpacked": _embedder(unpacked, seqs),
    }, len(seqs), trials)

    # Packing: 16-token inputs (cut to 15 + the final [SEP]) at the same 128-token rows.
    short = [np.concatenate([s[:15], s[-1:]]) for s in encoded if len(s) >= 16][:n_sentences]
    pack_rates = _rate({
        "packed": _embedder(packed, short),
        "unpacked": _embedder(unpacked, short),
    }, len(short), trials)
    got_p, got_u = _embedder(packed, short)(), _embedder(unpacked, short)()
    unpacked_slots, real_tokens = _slots(unpacked, seqs), sum(len(s) for s in seqs)
    for engine in (unpacked, both, packed):
        engine.close()
    return {
        "executor_ratio": rates["executor"] / rates["reference"],
        "executor_ratio_unpacked": rates["executor_unpacked"] / rates["reference"],
        # Per computed token position (padding included) vs per real token of the reference:
        # the executor's own speed, independent of how well the shapes fit the sentences.
        "executor_token_ratio": (rates["executor_unpacked"] * unpacked_slots)
        / (rates["reference"] * real_tokens),
        "executor_sentences_per_s": rates["executor"],
        "executor_unpacked_sentences_per_s": rates["executor_unpacked"],
        "reference_sentences_per_s": rates["reference"],
        "sentences": len(seqs),
        "mean_tokens": float(np.mean([len(s) for s in seqs])),
        "packed_gain": pack_rates["packed"] / pack_rates["unpacked"],
        "packed_sentences_per_s": pack_rates["packed"],
        "unpacked_sentences_per_s": pack_rates["unpacked"],
        "packed_vs_unpacked_max_abs_diff": float(np.abs(got_p - got_u).max()),
        "cold_compile_admit_ms": cold_ms,
        "cached_admit_ms": hit_ms,
        "admit_speedup": cold_ms / hit_ms,
        "admit": {
            "cold": _stages(cold, cold_ms),
            "warm_hit": _stages(hit, hit_ms),
            "package_hit_ms": package_hit_ms,
        },
        "start": start,
        "shapes": {"unpacked": "8x128", "packed": "8x128p8"},
        "trials": trials,
    }


if __name__ == "__main__":
    main()
