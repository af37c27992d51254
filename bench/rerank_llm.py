"""LLM reranking at Qwen3-Reranker-0.6B's real shape (random seeded weights): the llama.cpp
lane against sentence-transformers' `CrossEncoder` on torch CPU, against the same engine in
process (no worker, no IPC), and against llama-cpp-python's own `Llama.embed` with RANK
pooling in process, on the same pairs.

    python -m bench.rerank_llm [--pairs 64] [--doc-tokens 256] [--repeats 2] [--out FILE]

The directory (Qwen3ForCausalLM: 28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
intermediate 3072, vocab 151669, tied embeddings; a README naming it a Qwen3-Reranker; a
byte-level BPE trained here that holds "yes" and "no", and a Qwen3-Reranker chat template) is
built once under `<synapse cache>/bench/real-sizes/` and ingested with `ingest_hf_dir` at
this platform's embedding precision. One query against `--pairs` documents of about
`--doc-tokens` tokens each, rendered through the template (the template adds ~70 tokens).
Every contender scores the same ids; the raw scores are compared too (sentence-transformers
runs fp32, the lane the GGUF's precision). Targets, reported not asserted: lane /
sentence-transformers >= 1.5, lane / llama-cpp-python in process >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np

from bench.real_sizes import (
    QWEN2_SPLIT,
    QWEN3_CONFIG,
    QWEN3_SPECIALS,
    _cpu,
    _save_weights,
    _write_json,
    cache_dir,
    ensure_model,
)
from certification.corpus import corpus
from ingest.store import ArtifactStore

SEED = 0
NAME = "qwen3-reranker-0.6b-random"
CONFIG = {**QWEN3_CONFIG, "architectures": ["Qwen3ForCausalLM"]}
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Reranker's prompt for sentence-transformers' query/document roles.
TEMPLATE = (
    "{%- set ns = namespace(instruction='" + DEFAULT_INSTRUCTION + "', query='', document='') -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message.role == 'system' -%}{%- set ns.instruction = message.content -%}\n"
    "{%- elif message.role == 'query' -%}{%- set ns.query = message.content -%}\n"
    "{%- elif message.role == 'document' -%}{%- set ns.document = message.content -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {{ ns.instruction }}\n<Query>: {{ ns.query }}\n"
    "<Document>: {{ ns.document }}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def _tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        list(corpus()) + ["yes", "no", TEMPLATE] * 50,
        trainers.BpeTrainer(
            vocab_size=8000,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.add_special_tokens(QWEN3_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 8192,
            "chat_template": TEMPLATE,
        },
    )


def ensure_dir(root: Path) -> Path:
    digest = hashlib.sha256(json.dumps([CONFIG, TEMPLATE], sort_keys=True).encode()).hexdigest()
    out = root / f"rerank-llm-{digest[:12]}-s{SEED}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".rerank-llm-"))
    _tokenizer(tmp)
    torch.manual_seed(SEED)
    _save_weights(Qwen3ForCausalLM(Qwen3Config(**CONFIG)).eval(), tmp)
    _write_json(tmp / "config.json", CONFIG)
    (tmp / "README.md").write_text("# Qwen3-Reranker-0.6B (random weights, for benchmarks)\n")
    tmp.replace(out)
    return out


def _pairs(n: int, doc_tokens: int, tok) -> tuple[str, list[str]]:
    texts = list(corpus())
    query = texts[0]
    docs, k = [], 1
    for _ in range(n):
        words: list[str] = []
        while len(tok.encode(" ".join(words)).ids) < doc_tokens:
            words.append(texts[k % len(texts)])
            k += 1
        docs.append(" ".join(words))
    return query, docs


async def _lane(store_root: str, query: str, docs: list[str], repeats: int):
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    rt = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    cfg = ModuleConfig(store_root=store_root, host=HostConfig(runtime_dir=rt, ping_interval_s=0))
    async with Module(cfg) as mod:
        first = await mod.rerank(query, docs, model=NAME)
        pairs = mod._chat_pairs(mod._served[NAME]).compose(
            query, docs, None, limit=mod.record(NAME).manifest.max_tokens, truncate=True
        )
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await mod.rerank(query, docs, model=NAME)
            times.append(time.perf_counter() - t0)
    scores = np.empty(len(docs))
    for i, s in first.results:
        scores[i] = s
    return times, scores, pairs


def _engine_in_process(rec, ids: list[np.ndarray], threads: int, repeats: int):
    from workers.engine import NullProgress
    from workers.llama.engine import LlamaEngine
    from workers.protocol import messages as m

    engine = LlamaEngine()
    engine.load(
        m.LOAD(
            req_id=0,
            artifact_path=str(rec.artifact_path),
            artifact_digest=rec.digest,
            format="gguf",
            runtime_config={
                "model_ref": NAME,
                "kind": "rerank",
                "n_ctx": rec.manifest.n_ctx,
                "n_threads": threads,
                "n_threads_batch": threads,
            },
        ),
        NullProgress(),
    )
    req = m.RERANK_SEQUENCES(
        req_id=0,
        model_ref=NAME,
        sequences=[m.RerankSequence(n_tokens=len(x), n_first=len(x)) for x in ids],
    )
    flat = np.concatenate(ids)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.rerank_sequences(req, flat, NullProgress())
        times.append(time.perf_counter() - t0)
    engine.close()
    return times, np.asarray(out, np.float64)


def _llama_cpp_python(rec, ids: list[np.ndarray], threads: int, repeats: int):
    """llama-cpp-python's `Llama.embed` with RANK pooling (what llama.cpp computes for a Qwen3
    reranker: the softmax of the two rows), fed the same ids."""
    import llama_cpp

    n_ctx = max(len(x) for x in ids) * 8
    llm = llama_cpp.Llama(
        str(rec.artifact_path),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_seq_max=8,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    keys = [f"pair {i}" for i in range(len(ids))]
    by_key = {k: [int(t) for t in x] for k, x in zip(keys, ids, strict=True)}
    llm.tokenize = lambda text, add_bos=True, special=False: by_key[text.decode()]  # type: ignore[method-assign]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.embed(keys)
        times.append(time.perf_counter() - t0)
    llm.close()
    p = np.asarray(out, np.float64).reshape(len(ids), -1)
    return times, np.log(p[:, 0]) - np.log(p[:, 1])


def _sentence_transformers(hf_dir: Path, query: str, docs: list[str], threads: int, repeats: int):
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(threads)
    ce = CrossEncoder(str(hf_dir), device="cpu", activation_fn=torch.nn.Identity())
    ce.max_seq_length = 8192
    pairs = [(query, d) for d in docs]
    times = []
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = ce.predict(pairs, batch_size=16)
        times.append(time.perf_counter() - t0)
    return times, np.asarray(out, np.float64)


def run(pairs: int, doc_tokens: int, repeats: int, threads: int, skip: set[str]) -> dict:
    import tokenizers

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    hf_dir = ensure_dir(root)
    store = ArtifactStore(root / "models")
    rec = ensure_model(store, hf_dir, NAME)
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    query, docs = _pairs(pairs, doc_tokens, tok)
    lane_t, lane_s, composed = asyncio.run(_lane(str(store.root), query, docs, repeats))
    tokens = composed.total_tokens
    out: dict = {
        "bench": "rerank_llm",
        "shape_of": "Qwen/Qwen3-Reranker-0.6B",
        "dtype": rec.manifest.dtype,
        "cpu": _cpu(),
        "threads": threads,
        "pairs": pairs,
        "tokens": tokens,
        "mean_pair_tokens": round(tokens / pairs, 1),
        "truncated": int(sum(composed.truncated)),
        "lane_s": round(statistics.median(lane_t), 3),
        "lane_tokens_per_s": round(tokens / statistics.median(lane_t), 1),
    }
    rivals = {
        "engine_in_process": lambda: _engine_in_process(rec, composed.ids, threads, repeats),
        "llama_cpp_python": lambda: _llama_cpp_python(rec, composed.ids, threads, repeats),
        "sentence_transformers": lambda: _sentence_transformers(
            hf_dir, query, docs, threads, repeats
        ),
    }
    for name, go in rivals.items():
        if name in skip:
            continue
        t, s = go()
        med = statistics.median(t)
        out[name] = {
            "s": round(med, 3),
            "tokens_per_s": round(tokens / med, 1),
            "lane_ratio": round(med / statistics.median(lane_t), 3),
            "max_abs_raw_diff_vs_lane": float(np.abs(s - lane_s).max()),
            "same_order_as_lane": bool(
                (np.argsort(-s, kind="stable") == np.argsort(-lane_s, kind="stable")).all()
            ),
        }
    out["targets"] = {
        "lane_vs_sentence_transformers": {
            "at_least": 1.5,
            "value": out.get("sentence_transformers", {}).get("lane_ratio"),
        },
        "lane_vs_llama_cpp_python": {
            "at_least": 0.95,
            "value": out.get("llama_cpp_python", {}).get("lane_ratio"),
        },
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.rerank_llm")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=190, help="each document's own tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated: engine_in_process, llama_cpp_python, sentence_transformers",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = run(
        args.pairs,
        args.doc_tokens,
        args.repeats,
        args.threads,
        set(filter(None, args.skip.split(","))),
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
