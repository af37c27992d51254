"""Embedding and generation throughput: the supervised lane vs the same engine in-process,
sentence-transformers and ONNX Runtime, on the same 512 mixed-length sentences.

    python -m bench.embed [--repeats 3] [--threads 2] [--model minilm-l6-v2] [--skip-generate]

The lane and the in-process engine use the same LlamaEngine, GGUF, runtime settings,
tokenizer and batching plan; the only difference is the process boundary (socket, framing,
validation, asyncio): `lane_ratio` (target >= 0.95). With the `bench` extra installed,
sentence-transformers (torch CPU) and ONNX Runtime (fp32, our own export of the same
safetensors, batches of 32 sorted by length: see bench.ort_baseline) run with the same thread
count, and `lane_vs_ort` (target >= 1.0) compares the lane with ORT. Every contender runs once
per repeat, interleaved, so this shared machine's noise hits all alike; medians are reported.
Cosines against sentence-transformers check that the contenders compute the same vectors.
Generation tokens/s (lane vs in-process, `generate_ratio` >= 0.95) follows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # same as the lane's workers
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # sentence-transformers loads a local dir only

from certification.corpus import corpus
from host.batching import plan_chunks
from host.config import HostConfig
from host.module import DEFAULT_EMBED, DEFAULT_GENERATE, Module, ModuleConfig
from ingest.defaults import ensure_defaults
from ingest.store import ArtifactStore
from workers.engine import NullProgress
from workers.protocol import messages as m

N_SENTENCES = 512
GEN_PROMPT = "Write a short note about the history of the bicycle:"
GEN_TOKENS = 64


def _texts() -> list[str]:
    items = corpus()
    return [items[(i * 7) % len(items)] for i in range(N_SENTENCES)]


def _runtime_config(record, threads: int) -> dict:
    return {
        "model_ref": record.name,
        "n_ctx": record.manifest.n_ctx,
        "n_threads": threads,
        "n_threads_batch": threads,
    }


def _in_process(store: ArtifactStore, config: ModuleConfig, threads: int, embed_model: str,
                generate: bool):
    from host.tokenization import Tokenizer
    from workers.llama.engine import LlamaEngine

    engine = LlamaEngine()
    out = {}
    for name in (embed_model, DEFAULT_GENERATE) if generate else (embed_model,):
        rec = store.get(name)
        engine.load(
            m.LOAD(req_id=0, artifact_path=str(rec.artifact_path), artifact_digest=rec.digest,
                   format="gguf", runtime_config=_runtime_config(rec, threads)),
            NullProgress(),
        )
        man = rec.manifest
        out[name] = Tokenizer.from_file(
            rec.tokenizer_path, max_tokens=man.max_tokens, hard_limit=man.max_tokens_limit
        )
    texts = _texts()

    def embed_once() -> np.ndarray:
        enc = out[embed_model].encode(texts, truncate=True)
        lengths = enc.n_tokens
        vectors = []
        for chunk in plan_chunks(lengths, config.max_batch_tokens, config.max_batch_items,
                                 config.host.max_frame, 384):
            req = m.EMBED_BATCH(req_id=0, model_ref=embed_model,
                                items=[m.EmbedItem(id=i, n_tokens=lengths[i]) for i in chunk])
            vectors.append(
                engine.embed(req, np.concatenate([enc.ids[i] for i in chunk]), NullProgress())
            )
        return np.concatenate(vectors)

    def generate_once() -> int:
        ids = out[DEFAULT_GENERATE].encode([GEN_PROMPT], truncate=False).ids[0]
        req = m.GENERATE(req_id=0, model_ref=DEFAULT_GENERATE, max_tokens=GEN_TOKENS)
        return engine.generate(req, ids, NullProgress()).n_gen

    return engine, embed_once, generate_once


def _median_rate(times: list[float], n: int) -> float:
    return n / statistics.median(times)


async def _bench(repeats: int, threads: int, embed_model: str, generate: bool) -> dict:
    from workers.llama.engine import registered_backends  # llama.cpp, as in _in_process

    store = ensure_defaults()
    texts = _texts()
    with tempfile.TemporaryDirectory(prefix="syn-bench-") as runtime_dir:
        config = ModuleConfig(
            host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
            planned_workers=max(1, (os.cpu_count() or 1) // threads),
        )
        engine, embed_once, generate_once = _in_process(store, config, threads, embed_model,
                                                        generate)
        async with Module(config) as mod:
            await mod.load(embed_model)
            if generate:
                await mod.load(DEFAULT_GENERATE)
            result = await mod.embed(texts, model=embed_model)  # warm both paths
            same_ids = _same_ids_as_hf(await mod.tokenizer(embed_model), texts)
            tokens = result.usage.total_tokens
            vectors = {"lane": result.vectors, "in_process": embed_once()}
            contenders: dict[str, Callable[[], object]] = {"in_process": embed_once}
            st, ort = _sentence_transformers(threads), _onnx_runtime(threads, store, embed_model)
            for name, (run, _why) in (("sentence_transformers", st), ("ort", ort)):
                if run is not None:
                    vectors[name] = np.asarray(run(texts))  # warm
                    contenders[name] = lambda run=run: run(texts)
            times: dict[str, list[float]] = {"lane": [], **{k: [] for k in contenders}}
            lane_g, inproc_g = [], []
            n_gen_lane = n_gen_inproc = 0
            names = ["lane", *contenders]
            for r in range(repeats):
                # Interleaved so machine noise hits every contender alike, and rotated so no
                # contender always runs right after the same other one (e.g. the lane after
                # the in-process generation, whose caches it would find cold).
                for name in names[r % len(names):] + names[: r % len(names)]:
                    t = time.perf_counter()
                    if name == "lane":
                        await mod.embed(texts, model=embed_model)
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
    rate = {name: _median_rate(t, N_SENTENCES) for name, t in times.items()}
    lane_s, inproc_s = statistics.median(times["lane"]), statistics.median(times["in_process"])
    rec = store.get(embed_model)
    result = {
        "bench": "embed",
        "model": embed_model,
        "precision": rec.manifest.dtype,
        "sentences": N_SENTENCES,
        "tokens": tokens,
        "threads": threads,
        # how the engine computes here: BLAS or not, and one stream per thread by default
        "llama_backends": registered_backends(),
        "repeats": repeats,
        "load_avg_1m": round(os.getloadavg()[0], 2),  # this machine is shared: context
        "embed": {
            "lane_sentences_per_s": round(rate["lane"], 1),
            "lane_tokens_per_s": round(tokens / lane_s, 1),
            "in_process_sentences_per_s": round(rate["in_process"], 1),
            "in_process_tokens_per_s": round(tokens / inproc_s, 1),
            "lane_ratio": round(inproc_s / lane_s, 3),
            "lane_min_cos_vs_in_process": _min_cos(vectors["lane"], vectors["in_process"]),
        },
        "targets": {"lane_ratio": ">= 0.95", "lane_vs_ort": ">= 1.0",
                    "generate_ratio": ">= 0.95"},
    }
    ref = vectors.get("sentence_transformers")
    if st[0] is None:
        result["sentence_transformers"] = {"skipped": st[1]}
    else:
        result["sentence_transformers"] = {
            "sentences_per_s": round(rate["sentence_transformers"], 1),
            "lane_ratio_vs_sentence_transformers": round(
                rate["lane"] / rate["sentence_transformers"], 3),
            "lane_mean_cos_vs_sentence_transformers": round(
                float(np.mean(np.sum(vectors["lane"] * ref, axis=1))), 6),
            # Our tokenizer reads "[SEP]" typed by a user as text, HF as the special token
            # (4 corpus items): compare numerics on the items both tokenize alike.
            "lane_min_cos_vs_sentence_transformers_same_ids": _min_cos(
                vectors["lane"][same_ids], ref[same_ids]),
            "items_tokenized_differently": int(np.sum(~same_ids)),
        }
    if ort[0] is None:
        result["ort"] = {"skipped": ort[1]}
    else:
        result["ort"] = {"ort_sentences_per_s": round(rate["ort"], 1),
                         "lane_vs_ort": round(rate["lane"] / rate["ort"], 3),
                         "in_process_vs_ort": round(rate["in_process"] / rate["ort"], 3)}
        if ref is not None:
            result["ort"]["ort_min_cos_vs_sentence_transformers"] = _min_cos(vectors["ort"], ref)
            result["ort"]["ort_mean_cos_vs_sentence_transformers"] = round(
                float(np.mean(np.sum(vectors["ort"] * ref, axis=1))), 6)
    if generate:
        lane_gs, inproc_gs = statistics.median(lane_g), statistics.median(inproc_g)
        result["generate"] = {
            "lane_tokens_per_s": round(n_gen_lane / lane_gs, 1),
            "in_process_tokens_per_s": round(n_gen_inproc / inproc_gs, 1),
            "generate_ratio": round((n_gen_lane / lane_gs) / (n_gen_inproc / inproc_gs), 3),
        }
    return result


def _same_ids_as_hf(tokenizer, texts: list[str]) -> np.ndarray:
    """Mask of the texts our module-side tokenizer encodes exactly as the HF tokenizer does."""
    from tokenizers import Tokenizer

    from bench.ort_baseline import minilm_dir

    hf = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    hf.no_padding()
    hf.enable_truncation(tokenizer.max_tokens)
    ours = tokenizer.encode(texts, truncate=True).ids
    theirs = hf.encode_batch(texts)
    return np.array([list(a) == b.ids for a, b in zip(ours, theirs, strict=True)])


def _min_cos(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return round(float(np.min(np.sum(a * b, axis=1))), 6)


Contender = tuple[Callable[[list[str]], np.ndarray] | None, str]


def _sentence_transformers(threads: int) -> Contender:
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None, "sentence-transformers/torch not installed (optional extra 'bench')"
    from bench.ort_baseline import minilm_dir

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    return (lambda texts: model.encode(texts, batch_size=64, normalize_embeddings=True)), ""


def _onnx_runtime(threads: int, store: ArtifactStore, embed_model: str) -> Contender:
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return None, "onnxruntime/onnx/torch not installed (optional extra 'bench')"
    from bench.ort_baseline import OrtEmbedder

    embedder = OrtEmbedder(threads, store.get(embed_model).manifest.max_tokens)
    return embedder.embed, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.embed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", default=DEFAULT_EMBED, help="embedding model in the store")
    parser.add_argument("--skip-generate", action="store_true",
                        help="embedding only (e.g. where the generation model cannot run)")
    args = parser.parse_args(argv)
    result = asyncio.run(_bench(args.repeats, args.threads, args.model, not args.skip_generate))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
