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
  load) over ADMIT_SHAPE of the same shape by a second engine (cache hit: load only).

    python -m bench.ane [--sentences 64] [--trials 3] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
    shapes = [loaded.compiled.shape for loaded in engine._model.shapes.values()]  # noqa: SLF001
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

    # Admission: cold compile, then a second engine hits the cache.
    unpacked = _engine(manifest, cache_root, [])
    cold_ms, cold = _admit(unpacked, UNPACKED)
    assert not cold.cache_hit
    second = _engine(manifest, cache_root, [])
    hit_ms, hit = _admit(second, UNPACKED)
    assert hit.cache_hit
    second.close()
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
        "shapes": {"unpacked": "8x128", "packed": "8x128p8"},
        "trials": trials,
    }


if __name__ == "__main__":
    main()
