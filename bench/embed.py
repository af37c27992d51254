"""Embedding and generation throughput: the supervised lane vs the same engine in-process,
sentence-transformers and ONNX Runtime, on the same mixed-length sentences.

    python -m bench.embed [--model minilm-l6-v2] [--store-root DIR] [--repeats 3]
        [--threads 2] [--sentences 512] [--max-chars N] [--prompt-name NAME]
        [--skip-generate]

`--model` is any embedding model in the store (`synapse models ls`). Every contender uses that
model's own tokenizer, limit (its manifest's `max_tokens`), pooling (mean, cls or last token)
and prompt (`--prompt-name`, else the model's default prompt, else none; the same text is
prepended for every contender, as sentence-transformers does). The lane and the in-process
engine use the same LlamaEngine, GGUF, runtime settings, tokenizer and batching plan; the only
difference is the process boundary (socket, framing, validation, asyncio): `lane_ratio`
(target >= 0.95). With the `bench` extra installed, sentence-transformers (torch CPU) and ONNX
Runtime (fp32, our own export of the same safetensors with the model's pooling in the graph,
batches of 32 sorted by length: see bench.ort_baseline) load the model's Hugging Face source
directory (the manifest's `hf-dir:` source; the default MiniLM's package) and run with the
same thread count; a model ingested from a GGUF has no such directory, and both are skipped
with that reason. `lane_vs_ort` (target >= 1.0) compares the lane with ORT. Every contender
runs once per repeat, interleaved, so this shared machine's noise hits all alike; medians are
reported. Cosines between the contenders (against sentence-transformers, and the lane against
ORT, on the items whose ids both tokenizers agree on) check that they compute the same
vectors. Generation tokens/s (lane vs in-process, `generate_ratio` >= 0.95) follows, when the
store has the default generation model.

`plan` says how the lane cut the texts (EMBED_BATCHes, decodes, tokens per decode, streams,
n_ubatch...) and `openblas_core` which kernels the system OpenBLAS runs llama.cpp's BLAS
backend on in this process (a generic "Prescott" means SSE3 matmuls; workers.llama.openblas_core
names the AVX kernels an older OpenBLAS does not pick by itself, in the workers and here):
what to read first when the lane is slow. `kernels` says what every contender ran on: the
lane's worker and the in-process engine (OpenBLAS, read from each process; `same`: they
agree), torch's CPU capability for sentence-transformers, ONNX Runtime's MLAS (bench.kernels).

`run_bench(...)` is the same run as a function (bench.real_sizes and the tests call it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import kernels  # first: it makes the choice (before numpy loads OpenBLAS)

# isort: split

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # same as the lane's workers
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # sentence-transformers loads a local dir only

from certification.corpus import corpus
from common.errors import SynapseError
from host.batching import plan_chunks
from host.config import HostConfig
from host.module import Module, ModuleConfig, resolve_prompt
from ingest.defaults import ensure_defaults
from ingest.store import DEFAULT_EMBED, DEFAULT_GENERATE, EMBED_BY_DTYPE, ArtifactStore, ModelRecord
from workers.engine import NullProgress
from workers.protocol import messages as m

N_SENTENCES = 512
ST_BATCH = 64
GEN_PROMPT = "Write a short note about the history of the bicycle:"
GEN_TOKENS = 64
DEFAULT_NAMES = frozenset({DEFAULT_EMBED, DEFAULT_GENERATE, *EMBED_BY_DTYPE.values()})


def bench_texts(n: int = N_SENTENCES, max_chars: int | None = None) -> list[str]:
    """`n` corpus items (every script, code, emoji, short and long), cycled in a fixed order;
    with `max_chars`, only the items at most that long (a shorter run for a large model)."""
    items = [t for t in corpus() if max_chars is None or len(t) <= max_chars]
    if not items:
        raise ValueError(f"no corpus item is at most {max_chars} characters")
    step = next(s for s in (7, 11, 13, 17, 19) if math.gcd(s, len(items)) == 1)
    return [items[(i * step) % len(items)] for i in range(n)]


@dataclass(frozen=True)
class Target:
    """The model under test and what every contender must do the same way."""

    record: ModelRecord
    prompt: str  # prepended to every text
    prompt_name: str | None
    hf_dir: Path | None  # the Hugging Face directory the GGUF was converted from
    hf_skip: str  # why there is none ("" when there is)

    @property
    def pooling(self) -> str:
        return self.record.manifest.pooling or "mean"


def resolve_target(store: ArtifactStore, name: str, prompt_name: str | None) -> Target:
    from ingest.owned import hf_source_dir

    record = store.get(name)
    if record.kind != "embed":
        raise SystemExit(f"{name!r} is a {record.kind} model: bench.embed measures embedders")
    prompt = resolve_prompt(record, prompt_name, None)
    try:
        hf_dir: Path | None = hf_source_dir(record)
        skip = ""
    except SynapseError:
        hf_dir = None
        skip = (
            f"{name!r} was ingested from {record.manifest.source!r}: no Hugging Face "
            "directory to load"
        )
    if hf_dir is not None and not (hf_dir / "config.json").is_file():
        hf_dir, skip = None, f"its Hugging Face source {hf_dir} is gone"
    return Target(record, prompt, prompt_name, hf_dir, skip)


def _runtime_config(record: ModelRecord, threads: int) -> dict:
    man = record.manifest
    out = {
        "model_ref": record.name,
        "n_ctx": man.n_ctx,
        "n_threads": threads,
        "n_threads_batch": threads,
        "kind": man.kind,  # as the Module serves it: the manifest, not the GGUF, decides
    }
    if man.kind != "generate" and man.pooling:
        out["pooling"] = man.pooling
    return out


def _in_process(
    store: ArtifactStore,
    config: ModuleConfig,
    threads: int,
    target: Target,
    texts: list[str],
    generate: bool,
):
    from host.tokenization import Tokenizer
    from workers.llama.engine import LlamaEngine

    engine = LlamaEngine()
    embed_model = target.record.name
    out = {}
    for name in (embed_model, DEFAULT_GENERATE) if generate else (embed_model,):
        rec = store.get(name)
        engine.load(
            m.LOAD(
                req_id=0,
                artifact_path=str(rec.artifact_path),
                artifact_digest=rec.digest,
                format="gguf",
                runtime_config=_runtime_config(rec, threads),
            ),
            NullProgress(),
        )
        man = rec.manifest
        out[name] = Tokenizer.from_file(
            rec.tokenizer_path, max_tokens=man.max_tokens, hard_limit=man.max_tokens_limit
        )
    dims = target.record.manifest.dims

    def embed_once() -> np.ndarray:
        enc = out[embed_model].encode(texts, truncate=True, prompt=target.prompt)
        lengths = enc.n_tokens
        vectors = []
        for chunk in plan_chunks(
            lengths,
            config.max_worker_batch_tokens,
            config.max_batch_items,
            config.host.max_frame,
            dims,
        ):
            req = m.EMBED_BATCH(
                req_id=0,
                model_ref=embed_model,
                pooling=target.pooling,
                items=[m.EmbedItem(id=i, n_tokens=lengths[i]) for i in chunk],
            )
            vectors.append(
                engine.embed(req, np.concatenate([enc.ids[i] for i in chunk]), NullProgress())
            )
        return np.concatenate(vectors)

    def generate_once() -> int:
        ids = out[DEFAULT_GENERATE].encode([GEN_PROMPT], truncate=False).ids[0]
        req = m.GENERATE(req_id=0, model_ref=DEFAULT_GENERATE, max_tokens=GEN_TOKENS)
        return engine.generate(req, ids, NullProgress()).n_gen

    return engine, embed_once, generate_once


def _plan(engine, config: ModuleConfig, target: Target, lengths: list[int]) -> dict:
    """How the lane cuts this run's texts: EMBED_BATCHes (host.batching.plan_chunks), then
    each batch's decodes in the engine (workers.llama.decode_plan.plan_decodes), and the context
    sizes and streams those decodes run with. What to read when the lane is slow."""
    from workers.llama.decode_plan import plan_decodes

    man = target.record.manifest
    chunks = plan_chunks(
        lengths,
        config.max_worker_batch_tokens,
        config.max_batch_items,
        config.host.max_frame,
        man.dims,
    )
    mdl = engine._models[target.record.name]  # a bench reads the engine's plan
    budget = min(mdl.n_batch, mdl.n_ubatch)
    per_decode: list[int] = []
    for c in chunks:
        sub = [lengths[i] for i in c]
        for group in plan_decodes(
            sub, budget, mdl.n_seq_max, engine._decode_tokens, len(mdl.slots)
        ):
            per_decode.append(sum(sub[i] for i in group))
    return {
        "embed_batches": len(chunks),
        "tokens_per_batch": [sum(lengths[i] for i in c) for c in chunks],
        "decodes": len(per_decode),
        "tokens_per_decode_median": statistics.median(per_decode) if per_decode else 0,
        "tokens_per_decode_max": max(per_decode, default=0),
        "decode_tokens_target": engine._decode_tokens,
        "encode_streams": len(mdl.slots),
        "threads_per_stream": list(mdl.stream_threads),
        "n_ctx": mdl.n_ctx,
        "n_batch": mdl.n_batch,
        "n_ubatch": mdl.n_ubatch,
        "n_seq_max": mdl.n_seq_max,
        "causal": mdl.causal,
        "max_worker_batch_tokens": config.max_worker_batch_tokens,
        "max_batch_items": config.max_batch_items,
    }


def _median_rate(times: list[float], n: int) -> float:
    return n / statistics.median(times)


async def _bench(
    repeats: int,
    threads: int,
    embed_model: str,
    generate: bool,
    *,
    store_root: str | None = None,
    sentences: int = N_SENTENCES,
    max_chars: int | None = None,
    prompt_name: str | None = None,
    baselines: bool = True,
) -> dict:
    # The kernel choice the lane's workers make, made when bench.kernels was imported (before
    # numpy and llama_cpp loaded OpenBLAS): the in-process engine runs on the same kernels.
    choice = kernels.CHOICE
    from workers.llama.native import registered_backends  # llama.cpp, as in _in_process

    store = ArtifactStore(store_root)
    if embed_model in DEFAULT_NAMES or generate:
        store = ensure_defaults(store_root)
    gen_skip = ""
    if generate and DEFAULT_GENERATE not in {r.name for r in store.ls()}:
        generate, gen_skip = False, f"no {DEFAULT_GENERATE!r} in the store"
    target = resolve_target(store, embed_model, prompt_name)
    texts = bench_texts(sentences, max_chars)
    with tempfile.TemporaryDirectory(prefix="syn-bench-") as runtime_dir:
        config = ModuleConfig(
            store_root=str(store.root),
            host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
            planned_workers=max(1, (os.cpu_count() or 1) // threads),
        )
        engine, embed_once, generate_once = _in_process(
            store, config, threads, target, texts, generate
        )
        async with Module(config) as mod:
            await mod.load(embed_model)
            if generate:
                await mod.load(DEFAULT_GENERATE)
            tokenizer = await mod.tokenizer(embed_model)
            result = await mod.embed(texts, model=embed_model, prompt=target.prompt)  # warm
            enc = tokenizer.encode(texts, truncate=True, prompt=target.prompt)
            plan = _plan(engine, config, target, enc.n_tokens)
            same_ids = (
                _same_ids_as_hf(tokenizer, texts, target) if target.hf_dir is not None else None
            )
            tokens = result.usage.total_tokens
            lane = mod.supervisor(embed_model)
            lane_pid = lane.state().pid if lane is not None else None
            ran: dict = {
                "choice": choice,
                "lane_worker": kernels.process_kernels(lane_pid) if lane_pid else None,
                "in_process": kernels.process_kernels(),
            }
            vectors = {"lane": result.vectors, "in_process": embed_once()}
            contenders: dict[str, Callable[[], object]] = {"in_process": embed_once}
            # ORT first: its export loads the HF model once more, best before ST holds one.
            ort = _onnx_runtime(threads, target, store) if baselines else (None, "--no-baselines")
            st = _sentence_transformers(threads, target) if baselines else (None, "--no-baselines")
            for name, (run, _why) in (("sentence_transformers", st), ("ort", ort)):
                if run is not None:
                    vectors[name] = np.asarray(run(texts))  # warm
                    contenders[name] = lambda run=run: run(texts)
            if st[0] is not None:
                ran["sentence_transformers"] = kernels.torch_kernels()
            if ort[0] is not None:
                embedder = getattr(ort[0], "__self__", None)  # OrtEmbedder.embed's owner
                ran["ort"] = kernels.onnxruntime_kernels(getattr(embedder, "session", None))
            ran["same"] = kernels.agree(
                {k: ran[k] for k in ("lane_worker", "in_process") if ran.get(k)}
            )
            times: dict[str, list[float]] = {"lane": [], **{k: [] for k in contenders}}
            lane_g, inproc_g = [], []
            n_gen_lane = n_gen_inproc = 0
            names = ["lane", *contenders]
            for r in range(repeats):
                # Interleaved so machine noise hits every contender alike, and rotated so no
                # contender always runs right after the same other one (e.g. the lane after
                # the in-process generation, whose caches it would find cold).
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    t = time.perf_counter()
                    if name == "lane":
                        await mod.embed(texts, model=embed_model, prompt=target.prompt)
                    else:
                        contenders[name]()
                    times[name].append(time.perf_counter() - t)
                if not generate:
                    continue
                t = time.perf_counter()
                n_gen_lane = (await mod.generate(GEN_PROMPT, GEN_TOKENS)).n_gen
                lane_g.append(time.perf_counter() - t)
                t = time.perf_counter()
                n_gen_inproc = generate_once()
                inproc_g.append(time.perf_counter() - t)
        engine.close()
    n = len(texts)
    rate = {name: _median_rate(t, n) for name, t in times.items()}
    lane_s, inproc_s = statistics.median(times["lane"]), statistics.median(times["in_process"])
    man = target.record.manifest
    result = {
        "bench": "embed",
        "model": embed_model,
        "precision": man.dtype,
        "pooling": target.pooling,
        "dims": man.dims,
        "max_tokens": man.max_tokens,
        "source": man.source,
        "prompt_name": target.prompt_name or man.default_prompt_name,
        "prompt": target.prompt,
        "sentences": n,
        "max_chars": max_chars,
        "tokens": tokens,
        "threads": threads,
        # how the engine computes here: BLAS or not, and one stream per thread by default
        "llama_backends": registered_backends(),
        "openblas_core": ran["in_process"]["openblas"],  # what its BLAS matmuls run on
        "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
        "kernels": ran,  # what every contender ran on (bench.kernels)
        "repeats": repeats,
        "load_avg_1m": round(os.getloadavg()[0], 2),  # this machine is shared: context
        "seconds_per_repeat": {k: round(statistics.median(v), 3) for k, v in times.items()},
        "seconds_all": {k: [round(x, 2) for x in v] for k, v in times.items()},  # in run order
        "plan": plan,
        "embed": {
            "lane_sentences_per_s": round(rate["lane"], 2),
            "lane_tokens_per_s": round(tokens / lane_s, 1),
            "in_process_sentences_per_s": round(rate["in_process"], 2),
            "in_process_tokens_per_s": round(tokens / inproc_s, 1),
            "lane_ratio": round(inproc_s / lane_s, 3),
            "lane_min_cos_vs_in_process": _min_cos(vectors["lane"], vectors["in_process"]),
        },
        "targets": {"lane_ratio": ">= 0.95", "lane_vs_ort": ">= 1.0", "generate_ratio": ">= 0.95"},
    }
    ref = vectors.get("sentence_transformers")
    if same_ids is not None:
        # Our tokenizer reads a special token typed by a user ("[SEP]", "<s>") as text, HF as
        # the special token: compare numerics on the items both tokenize alike.
        result["items_tokenized_differently"] = int(np.sum(~same_ids))
    if st[0] is None:
        result["sentence_transformers"] = {"skipped": st[1]}
    else:
        assert ref is not None and same_ids is not None
        result["sentence_transformers"] = {
            "sentences_per_s": round(rate["sentence_transformers"], 2),
            "lane_ratio_vs_sentence_transformers": round(
                rate["lane"] / rate["sentence_transformers"], 3
            ),
            "lane_mean_cos_vs_sentence_transformers": _mean_cos(vectors["lane"], ref),
            "lane_min_cos_vs_sentence_transformers_same_ids": _min_cos(
                vectors["lane"][same_ids], ref[same_ids]
            ),
            "items_tokenized_differently": int(np.sum(~same_ids)),
        }
    if ort[0] is None:
        result["ort"] = {"skipped": ort[1]}
    else:
        assert same_ids is not None
        result["ort"] = {
            "ort_sentences_per_s": round(rate["ort"], 2),
            "lane_vs_ort": round(rate["lane"] / rate["ort"], 3),
            "in_process_vs_ort": round(rate["in_process"] / rate["ort"], 3),
            "lane_min_cos_vs_ort_same_ids": _min_cos(
                vectors["lane"][same_ids], vectors["ort"][same_ids]
            ),
        }
        if ref is not None:
            result["ort"]["ort_min_cos_vs_sentence_transformers"] = _min_cos(vectors["ort"], ref)
            result["ort"]["ort_mean_cos_vs_sentence_transformers"] = _mean_cos(vectors["ort"], ref)
    if generate:
        lane_gs, inproc_gs = statistics.median(lane_g), statistics.median(inproc_g)
        result["generate"] = {
            "lane_tokens_per_s": round(n_gen_lane / lane_gs, 1),
            "in_process_tokens_per_s": round(n_gen_inproc / inproc_gs, 1),
            "generate_ratio": round((n_gen_lane / lane_gs) / (n_gen_inproc / inproc_gs), 3),
        }
    elif gen_skip:
        result["generate"] = {"skipped": gen_skip}
    return result


def run_bench(
    model: str = DEFAULT_EMBED,
    *,
    repeats: int = 3,
    threads: int | None = None,
    generate: bool = False,
    **kwargs,
) -> dict:
    """One bench.embed run as a dict (see `_bench` for the keyword arguments)."""
    return asyncio.run(_bench(repeats, threads or os.cpu_count() or 1, model, generate, **kwargs))


def _same_ids_as_hf(tokenizer, texts: list[str], target: Target) -> np.ndarray:
    """Mask of the texts our module-side tokenizer encodes exactly as the HF tokenizer of the
    model's source directory does (the one sentence-transformers and ORT use)."""
    from tokenizers import Tokenizer

    assert target.hf_dir is not None
    hf = Tokenizer.from_file(str(target.hf_dir / "tokenizer.json"))
    hf.no_padding()
    hf.enable_truncation(tokenizer.max_tokens)
    ours = tokenizer.encode(texts, truncate=True, prompt=target.prompt).ids
    theirs = hf.encode_batch([target.prompt + t for t in texts])
    return np.array([list(a) == b.ids for a, b in zip(ours, theirs, strict=True)])


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def _min_cos(a: np.ndarray, b: np.ndarray) -> float:
    return round(float(np.min(np.sum(_unit(a) * _unit(b), axis=1))), 6)


def _mean_cos(a: np.ndarray, b: np.ndarray) -> float:
    return round(float(np.mean(np.sum(_unit(a) * _unit(b), axis=1))), 6)


Contender = tuple[Callable[[list[str]], np.ndarray] | None, str]


def _sentence_transformers(threads: int, target: Target) -> Contender:
    if target.hf_dir is None:
        return None, target.hf_skip
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None, "sentence-transformers/torch not installed (optional extra 'bench')"

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(target.hf_dir), device="cpu")
    model.max_seq_length = target.record.manifest.max_tokens  # the lane's truncation
    return (
        lambda texts: model.encode(
            texts, prompt=target.prompt, batch_size=ST_BATCH, normalize_embeddings=True
        )
    ), ""


def _onnx_runtime(threads: int, target: Target, store: ArtifactStore) -> Contender:
    if target.hf_dir is None:
        return None, target.hf_skip
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
        import torch
    except ImportError:
        return None, "onnxruntime/onnx/torch not installed (optional extra 'bench')"
    from bench.ort_baseline import POOLINGS, OrtEmbedder
    from formats.st_layout import read_layout

    if target.pooling not in POOLINGS:
        return None, f"pooling {target.pooling!r}: the ONNX baseline computes {POOLINGS}"
    layout = read_layout(target.hf_dir)
    if layout.dense_dirs:
        return None, "the directory has Dense modules, which the ONNX export leaves out"
    torch.set_num_threads(threads)
    embedder = OrtEmbedder(
        threads,
        target.record.manifest.max_tokens,
        target.hf_dir,
        pooling=target.pooling,
        normalize=layout.normalize,
        prompt=target.prompt,
        cache_root=store.root.parent / "bench" / "onnx",
    )
    return embedder.embed, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.embed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", default=DEFAULT_EMBED, help="embedding model in the store")
    parser.add_argument(
        "--store-root", default=None, help="the store's models dir (default: the user cache's)"
    )
    parser.add_argument(
        "--sentences", type=int, default=N_SENTENCES, help="texts per repeat (corpus items, cycled)"
    )
    parser.add_argument(
        "--max-chars",
        type=int,
        default=None,
        help="only corpus items at most this long (a shorter run)",
    )
    parser.add_argument(
        "--prompt-name",
        default=None,
        help="the model's prompt to prepend (default: its default prompt)",
    )
    parser.add_argument(
        "--skip-generate",
        action="store_true",
        help="embedding only (e.g. where the generation model cannot run)",
    )
    args = parser.parse_args(argv)
    result = asyncio.run(
        _bench(
            args.repeats,
            args.threads,
            args.model,
            not args.skip_generate,
            store_root=args.store_root,
            sentences=args.sentences,
            max_chars=args.max_chars,
            prompt_name=args.prompt_name,
        )
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
