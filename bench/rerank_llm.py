"""LLM reranking at Qwen3-Reranker-0.6B's real shape (random seeded weights): the llama.cpp
lane against sentence-transformers' `CrossEncoder` on torch CPU, against the same engine in
process (no worker, no IPC), and against llama-cpp-python's own `Llama.embed` with RANK
pooling in process, on the same pairs.

    python -m bench.rerank_llm [--pairs 64] [--doc-tokens 190] [--repeats 2] [--out FILE]
        [--skip engine_in_process,llama_cpp_python,sentence_transformers,coreml]
        [--coreml-layers 2] [--coreml-pairs 16] [--coreml-seq-len 1024] [--coreml-segments 4]

The directory (Qwen3ForCausalLM: 28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
intermediate 3072, vocab 151669, tied embeddings; a README naming it a Qwen3-Reranker; a
byte-level BPE trained here that holds "yes" and "no", and a Qwen3-Reranker chat template) is
built once under `<synapse cache>/bench/real-sizes/` and ingested with `ingest_hf_dir` at
this platform's embedding precision. One query against `--pairs` documents of about
`--doc-tokens` tokens each, rendered through the template (the template adds ~70 tokens).
Every contender scores the same ids; the raw scores are compared too (sentence-transformers
runs fp32, the lane the GGUF's precision). Targets, reported not asserted: lane /
sentence-transformers >= 1.5, lane / llama-cpp-python in process >= 0.95.

Each contender reports wall seconds (`s`, `lane_ratio`) and its own CPU seconds (`cpu_s`,
`lane_cpu_ratio`: this process and its live descendants, so the lane's worker is counted): on
a shared machine the CPU figure is the steadier one. Every contender has `--threads` threads:
the lane's worker is planned as one of cores / threads workers. sentence-transformers runs at
its best: `--threads` torch threads, a warm-up call, and what `CrossEncoder.predict` does itself
(inference_mode, length-sorted left-padded batches, the LM head at the last position only);
`sentence_transformers.run` names its kernels. `engine_in_process.decode_plan` is what the
lane's code decoded with (contexts, threads, n_batch/n_ubatch, the shared prefix).

`coreml`: the Core ML lane's owned Qwen3 reranker graph (workers/ane/builder_qwen3.py, the
two-row head on the last real token) on the first `--coreml-pairs` pairs with the reference
executor on Linux: `packed_gain` is items/s on a packed row (`--coreml-segments` pairs per
`--coreml-seq-len` row) over the unpacked row of the same length, as bench.ane defines it, and
`packed_gain_vs_fitted_unpacked` over the unpacked row that just fits the longest pair. The
model is the 0.6B shape cut to `--coreml-layers` layers (the caveat is in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

# The in-process contenders run llama.cpp's BLAS backend in this process: on the OpenBLAS
# kernels the workers choose, decided before numpy loads OpenBLAS (bench.kernels).
from bench import kernels  # first

# isort: split

import numpy as np
import psutil

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


def ensure_dir(root: Path, config: dict | None = None) -> Path:
    """The random-weight reranker directory at CONFIG (or `config`), built once."""
    config = config or CONFIG
    digest = hashlib.sha256(json.dumps([config, TEMPLATE], sort_keys=True).encode()).hexdigest()
    out = root / f"rerank-llm-{digest[:12]}-s{SEED}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".rerank-llm-"))
    _tokenizer(tmp)
    torch.manual_seed(SEED)
    _save_weights(Qwen3ForCausalLM(Qwen3Config(**config)).eval(), tmp)
    _write_json(tmp / "config.json", config)
    (tmp / "README.md").write_text("# Qwen3-Reranker-0.6B (random weights, for benchmarks)\n")
    tmp.replace(out)
    return out


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its live descendants (the lane's
    worker): on a shared, overloaded machine the work a contender does is steadier than its
    wall time, which counts the other jobs' turns on the cores too."""
    total = time.process_time()
    for kid in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a child that exits while it is read
            t = kid.cpu_times()
            total += t.user + t.system
    return total


class _Clock:
    """Wall and CPU seconds of each timed call."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __enter__(self) -> _Clock:
        self._t, self._c = time.perf_counter(), _tree_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall.append(time.perf_counter() - self._t)
        self.cpu.append(_tree_cpu_s() - self._c)


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


async def _lane(store_root: str, query: str, docs: list[str], repeats: int, threads: int):
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    rt = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    # The worker runs `threads` llama.cpp threads, as torch and the in-process contenders do:
    # the server's default plans two workers, one thread each on 2 cores, for a lone model.
    cfg = ModuleConfig(
        store_root=store_root,
        host=HostConfig(runtime_dir=rt, ping_interval_s=0),
        planned_workers=max(1, (os.cpu_count() or 1) // threads),
    )
    async with Module(cfg) as mod:
        first = await mod.rerank(query, docs, model=NAME)
        pairs = mod._chat_pairs(mod._served[NAME]).compose(
            query, docs, None, limit=mod.record(NAME).manifest.max_tokens, truncate=True
        )
        clock = _Clock()
        for _ in range(repeats):
            with clock:
                await mod.rerank(query, docs, model=NAME)
    scores = np.empty(len(docs))
    for i, s in first.results:
        scores[i] = s
    return clock, scores, pairs


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
    clock = _Clock()
    for _ in range(repeats):
        with clock:
            out = engine.rerank_sequences(req, flat, NullProgress())
    _plan.update(_decode_plan(engine, ids))
    engine.close()
    return clock, np.asarray(out, np.float64)


# What the in-process engine (the lane's worker code, the same config) decoded with.
_plan: dict = {}


def _decode_plan(engine, ids: list[np.ndarray]) -> dict:
    # A checkout before last_token.py (the before figures) shares no prefix.
    found = importlib.util.find_spec("workers.llama.last_token") is not None
    shared = importlib.import_module("workers.llama.last_token").shared_prefix if found else None
    mdl = engine._models[NAME]
    return {
        "n_ctx": mdl.n_ctx,
        "n_batch": mdl.n_batch,
        "n_ubatch": mdl.n_ubatch,
        "n_seq_max": mdl.n_seq_max,
        "contexts": len(mdl.slots),
        "threads_per_context": list(mdl.stream_threads),
        "decode_tokens": engine._decode_tokens,
        "last_token_outputs_only": getattr(mdl.slots[0], "last", None) is not None,
        "shared_prefix_tokens": shared(ids) if shared else 0,
    }


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
    clock = _Clock()
    for _ in range(repeats):
        with clock:
            out = llm.embed(keys)
    llm.close()
    p = np.asarray(out, np.float64).reshape(len(ids), -1)
    return clock, np.log(p[:, 0]) - np.log(p[:, 1])


_st_report: dict = {}


def _sentence_transformers(hf_dir: Path, query: str, docs: list[str], threads: int, repeats: int):
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(threads)
    ce = CrossEncoder(str(hf_dir), device="cpu", activation_fn=torch.nn.Identity())
    ce.max_seq_length = 8192
    pairs = [(query, d) for d in docs]
    _st_report.update(
        {
            "kernels": kernels.torch_kernels(),
            "torch": torch.__version__,
            "attn_implementation": getattr(ce.model.config, "_attn_implementation", None)
            if hasattr(ce, "model")
            else None,
            "batch_size": 16,
            # What CrossEncoder.predict does itself: torch.inference_mode, batches sorted by
            # length (left-padded), and the causal LM's logits at the last position only
            # (logits_to_keep=1): no vocabulary head per token on its side either.
            "predict": "inference_mode, length-sorted batches, logits_to_keep=1",
        }
    )
    out = ce.predict(pairs[:2], batch_size=16)  # warm-up: torch's first call allocates
    clock = _Clock()
    for _ in range(repeats):
        with clock:
            out = ce.predict(pairs, batch_size=16)
    return clock, np.asarray(out, np.float64)


def _coreml_packed_gain(
    root: Path, ids: list, layers: int, n: int, seq_len: int, segments: int, trials: int
) -> dict:
    """The Core ML lane's owned Qwen3 reranker graph (two-row head on the last real token)
    on the first `n` pairs, with the reference executor: items/s on a packed shape
    (`segments` pairs per row) over the unpacked shape of the same row length, and over the
    unpacked shape that just fits the longest pair (the alternative without packing). The
    model is the 0.6B shape cut to `layers` layers (same width, heads, vocabulary)."""
    from bench.ane import Inputs, _chunks, _engine, _runner, _times
    from formats.owned.manifest import ingest_owned

    hf = ensure_dir(root, {**CONFIG, "num_hidden_layers": layers})
    work = Path(tempfile.mkdtemp(prefix=".rerank-coreml-", dir=root))
    try:
        manifest = ingest_owned(hf, work / "owned", true_token="yes", false_token="no")
        seqs = [np.asarray(x, np.int32) for x in ids[:n]]
        inputs = Inputs(seqs, [len(x) for x in seqs])
        tight = -(-max(len(x) for x in seqs) // 64) * 64
        shapes = {
            "packed": {"rows": 1, "seq_len": seq_len, "packed": True, "max_segments": segments},
            "unpacked": {"rows": 1, "seq_len": seq_len},
            "unpacked_fitted": {"rows": 1, "seq_len": tight},
        }
        cache = work / "cache"
        engines = {k: _engine(manifest, cache, [shape]) for k, shape in shapes.items()}
        last: dict[str, object] = {}
        times = _times({k: _runner(e, manifest, inputs) for k, e in engines.items()}, trials, last)
        predictions = {k: len(_chunks(e, seqs)) for k, e in engines.items()}
        for e in engines.values():
            e.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {k: len(seqs) / t for k, t in times.items()}
    got = {k: np.asarray(v, np.float64) for k, v in last.items()}
    return {
        "packed_gain": round(rate["packed"] / rate["unpacked"], 3),
        "packed_gain_vs_fitted_unpacked": round(rate["packed"] / rate["unpacked_fitted"], 3),
        "items_per_s": {k: round(v, 3) for k, v in rate.items()},
        "predictions": predictions,
        "shapes": shapes,
        "pairs": len(seqs),
        "mean_pair_tokens": round(float(np.mean([len(x) for x in seqs])), 1),
        "layers": layers,
        "max_abs_diff_packed_vs_unpacked": float(np.abs(got["packed"] - got["unpacked"]).max()),
        "caveat": (
            "the reference executor (numpy, fp16-emulating) on Linux, not Core ML on a Mac: the "
            "ratio is the graph's work per shape, not a Neural Engine speed; "
            f"{layers} of the 0.6B shape's 28 layers (same width, heads and vocabulary) to "
            "keep the run in minutes on 2 shared cores: the ratio is what matters"
        ),
    }


def run(
    pairs: int,
    doc_tokens: int,
    repeats: int,
    threads: int,
    skip: set[str],
    coreml: dict | None = None,
) -> dict:
    import tokenizers

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    hf_dir = ensure_dir(root)
    store = ArtifactStore(root / "models")
    rec = ensure_model(store, hf_dir, NAME)
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    query, docs = _pairs(pairs, doc_tokens, tok)
    lane_c, lane_s, composed = asyncio.run(_lane(str(store.root), query, docs, repeats, threads))
    lane_t, lane_cpu = statistics.median(lane_c.wall), statistics.median(lane_c.cpu)
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
        "lane_s": round(lane_t, 3),
        "lane_cpu_s": round(lane_cpu, 3),
        "lane_tokens_per_s": round(tokens / lane_t, 1),
        "load_average_before": os.getloadavg(),
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
        clock, s = go()
        med, cpu = statistics.median(clock.wall), statistics.median(clock.cpu)
        out[name] = {
            "s": round(med, 3),
            "cpu_s": round(cpu, 3),
            "tokens_per_s": round(tokens / med, 1),
            "lane_ratio": round(med / lane_t, 3),
            "lane_cpu_ratio": round(cpu / lane_cpu, 3),
            "max_abs_raw_diff_vs_lane": float(np.abs(s - lane_s).max()),
            "same_order_as_lane": bool(
                (np.argsort(-s, kind="stable") == np.argsort(-lane_s, kind="stable")).all()
            ),
        }
    if _plan:
        out["engine_in_process"]["decode_plan"] = _plan
    if _st_report:
        out["sentence_transformers"]["run"] = _st_report
    out["kernels"] = {"choice": kernels.CHOICE, "this_process": kernels.process_kernels()}
    if "coreml" not in skip:
        out["coreml"] = _coreml_packed_gain(root, composed.ids, trials=repeats, **(coreml or {}))
    out["load_average_after"] = os.getloadavg()
    out["note"] = (
        "a shared machine (2 cores, other jobs running): wall-time ratios carry their load; "
        "cpu_s counts each contender's own CPU seconds (its process tree)"
    )
    out["targets"] = {
        "lane_vs_sentence_transformers": {
            "at_least": 1.5,
            "value": out.get("sentence_transformers", {}).get("lane_ratio"),
            "by_cpu_s": out.get("sentence_transformers", {}).get("lane_cpu_ratio"),
        },
        "lane_vs_llama_cpp_python": {
            "at_least": 0.95,
            "value": out.get("llama_cpp_python", {}).get("lane_ratio"),
            "by_cpu_s": out.get("llama_cpp_python", {}).get("lane_cpu_ratio"),
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
        help="comma-separated: engine_in_process, llama_cpp_python, sentence_transformers, coreml",
    )
    parser.add_argument("--coreml-layers", type=int, default=2)
    parser.add_argument("--coreml-pairs", type=int, default=16)
    parser.add_argument("--coreml-seq-len", type=int, default=1024)
    parser.add_argument("--coreml-segments", type=int, default=4)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = run(
        args.pairs,
        args.doc_tokens,
        args.repeats,
        args.threads,
        set(filter(None, args.skip.split(","))),
        {
            "layers": args.coreml_layers,
            "n": args.coreml_pairs,
            "seq_len": args.coreml_seq_len,
            "segments": args.coreml_segments,
        },
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
