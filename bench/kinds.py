"""Learned sparse and one-pass hybrid outputs at real model shapes (random seeded weights).

    python -m bench.kinds [--which splade|m3|both] [--texts 32] [--repeats 2] [--threads N]
                          [--out FILE]

- splade: SPLADE at bert-base's shape (BertForMaskedLM: 12 layers, hidden 768, 12 heads,
  intermediate 3072, vocabulary 30522 under MiniLM's WordPiece; SpladePooling max), as a
  sentence-transformers SparseEncoder directory. The llama.cpp lane's `sparse` output against
  `SparseEncoder.encode_document` on torch CPU, the same texts. Target, reported not
  asserted: lane / SparseEncoder >= 1.5. Also the worker's peak resident memory while it
  answers one request of 32 inputs of 512 tokens, sampled every 10 ms, checked against its
  bound: the worker's resident size once it has decoded inputs that long (its contexts'
  buffers grown) plus `workers.heads.sparse.splade_request_bytes` (the token states and the
  head's chunks). The bench exits 1 when the peak is over the bound.
- m3: bge-m3's three outputs at multilingual-e5-small's XLM-R shape (12 x 384, vocabulary
  250037) with `sparse_linear.pt` and `colbert_linear.pt` in FlagEmbedding's layout. One
  ENCODE of dense + sparse + multi-vector against (a) transformers on torch CPU with
  FlagEmbedding's head formulas for the same three outputs, and (b) three ENCODEs of our own
  lane, one output each. Targets: lane / transformers >= 1.5, lane / three passes >= 2.5.

Both sides get the same cores: the lane's worker `--threads` llama.cpp threads (the Module
plans cores / threads workers) and torch `--threads` threads (default: every core), gradients
off. Their timed runs alternate (lane, reference, lane, ...) so a machine shared with other
work slows both alike; each side's CPU seconds (the worker's and this process's for the lane)
are reported beside the wall times (m3: the worker's share too, `lane_one_pass_worker_cpu_s`),
and so are both sides' kernels: torch's MKL picks its vector width by CPUID, and the lane's
OpenBLAS gets the workers' choice (an inherited `OPENBLAS_CORETYPE` that names older kernels
than the CPU runs is dropped and reported: see bench.kernels).

Both directories are built once under `<synapse cache>/bench/real-sizes/` and ingested at this
platform's embedding precision. One JSON object on stdout (and in --out); each figure is the
median of `--repeats` timed runs after one warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

# The workers' OpenBLAS choice, made before numpy loads OpenBLAS (bench.kernels): the lane's
# matmuls then run the vector width torch's MKL picks for itself.
from bench import kernels  # first

# isort: split

import numpy as np

from bench.real_sizes import (
    XLMR_CONFIG,
    _cpu,
    _st_files,
    cache_dir,
    ensure_model,
    xlmr_tokenizer,
)
from certification.corpus import corpus
from ingest.store import ArtifactStore

SEED = 0
SPLADE_CONFIG: dict[str, Any] = {
    "architectures": ["BertForMaskedLM"],
    "model_type": "bert",
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
}


def build_splade(out: Path) -> Path:
    """A SparseEncoder directory (MLMTransformer + SpladePooling) at bert-base's shape."""
    if (out / "modules.json").is_file():
        return out
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertConfig, BertForMaskedLM

    from ingest.model_packages import minilm_dir

    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    raw = tmp / "mlm"
    raw.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_dir() / name).is_file():
            shutil.copyfile(minilm_dir() / name, raw / name)
    torch.manual_seed(SEED)
    model = BertForMaskedLM(BertConfig(**SPLADE_CONFIG)).eval()
    with torch.no_grad():  # most of the vocabulary at zero, as in a trained SPLADE
        model.cls.predictions.bias.normal_(-5.0, 1.0)
    model.save_pretrained(raw)
    body = Transformer(str(raw), transformer_task="fill-mask", max_seq_length=512)
    staged = tmp / "splade"
    SparseEncoder(modules=[body, SpladePooling("max")], device="cpu").save(str(staged))
    staged.replace(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_m3(out: Path) -> Path:
    """bge-m3's layout at e5-small's XLM-R shape: the encoder, CLS pooling, both head files."""
    if (out / "sparse_linear.pt").is_file():
        return out
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    config: dict[str, Any] = {**XLMR_CONFIG, "architectures": ["XLMRobertaModel"]}
    xlmr_tokenizer(tmp, config["max_position_embeddings"] - config["pad_token_id"] - 1)
    torch.manual_seed(SEED)
    XLMRobertaModel(XLMRobertaConfig(**config), add_pooling_layer=False).eval().save_pretrained(tmp)
    hidden = config["hidden_size"]
    torch.save(torch.nn.Linear(hidden, hidden).state_dict(), tmp / "colbert_linear.pt")
    torch.save(torch.nn.Linear(hidden, 1).state_dict(), tmp / "sparse_linear.pt")
    # bge-m3's sentence-transformers files: CLS pooling, then Normalize.
    max_seq = config["max_position_embeddings"] - config["pad_token_id"] - 1
    _st_files(tmp, hidden, "cls_token", max_seq, {})
    tmp.replace(out)
    return out


def _module(store: ArtifactStore, runtime_dir: str, threads: int):
    """A Module whose llama.cpp worker runs `threads` threads (it plans cores / threads
    workers, as bench.embed does)."""
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    return Module(
        ModuleConfig(
            store_root=str(store.root),
            host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
            planned_workers=max(1, (os.cpu_count() or 1) // threads),
        )
    )


class _Clock:
    """Wall and CPU seconds of alternating timed runs: CPU is this process's (the host, or
    the torch reference) plus, for the lane, its worker's."""

    def __init__(self, worker_pid: int | None = None):
        import psutil

        self.worker = psutil.Process(worker_pid) if worker_pid else None
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

        self.worker_cpu: dict[str, list[float]] = {}

    def _worker_cpu(self, lane: bool) -> float:
        if lane and self.worker is not None:
            t = self.worker.cpu_times()
            return float(t.user + t.system)
        return 0.0

    def start(self, lane: bool) -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), self._worker_cpu(lane)

    def stop(self, name: str, lane: bool, started: tuple[float, float, float]) -> None:
        worker = self._worker_cpu(lane) - started[2]
        self.wall.setdefault(name, []).append(time.perf_counter() - started[0])
        self.cpu.setdefault(name, []).append(time.process_time() - started[1] + worker)
        self.worker_cpu.setdefault(name, []).append(worker)

    def median(self, name: str) -> tuple[float, float]:
        return statistics.median(self.wall[name]), statistics.median(self.cpu[name])

    def worker_median(self, name: str) -> float:
        """The worker's share of a lane run's CPU seconds (the rest is the host's)."""
        return statistics.median(self.worker_cpu[name])


def _lane_kernels(mod, name: str, threads: int) -> dict:
    """What the lane computes with: llama.cpp's build flags (its BLAS among them), the
    OpenBLAS kernels its worker runs (read from the worker process) and why, and its threads."""
    lane = mod.supervisor(name, "llama")
    hello = lane.hello if lane is not None else None
    return {
        "llama_cpp_build_flags": hello.engine.build_flags if hello else None,
        "openblas_choice": kernels.CHOICE,
        "openblas": kernels.process_kernels(lane.state().pid) if lane is not None else None,
        "n_threads": threads,
        "head_threads": threads,
    }


def _torch_kernels() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "mkl": torch.backends.mkl.is_available(),
        "onednn": torch.backends.mkldnn.is_available(),
        "grad": "off (inference_mode)",
    }


def _texts(n: int) -> list[str]:
    items = list(corpus())
    return [items[i % len(items)] for i in range(n)]


def _peak_rss_mb(pid: int, stop: threading.Event, out: list[float]) -> None:
    import psutil

    proc = psutil.Process(pid)
    peak = 0
    while not stop.is_set():
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.01)
    out.append(peak / 2**20)


def bench_splade(root: Path, n: int, repeats: int, threads: int) -> dict:
    import psutil
    import torch
    from sentence_transformers import SparseEncoder

    from workers.heads.sparse import splade_request_bytes

    hf = build_splade(root / "splade-bert-base-random")
    store = ArtifactStore(root / "kinds-models")
    record = ensure_model(store, hf, "splade-bert-base-random")
    texts = _texts(n)
    runtime = tempfile.mkdtemp(prefix="bk-", dir="/tmp")
    torch.set_num_threads(threads)
    ref_model = SparseEncoder(str(hf), device="cpu")

    def reference():  # SparseEncoder.encode runs under torch.inference_mode
        return ref_model.encode_document(texts, batch_size=32)

    async def lane() -> tuple[_Clock, dict, list]:
        async with _module(store, runtime, threads) as mod:
            got: list = []

            async def once() -> None:
                got[:] = (await mod.encode_outputs(texts, ["sparse"], record.name)).sparse or []

            await once()  # warm-up (loads the model, makes the token contexts)
            reference()
            pid = mod.supervisor(record.name, "llama").state().pid
            clock = _Clock(pid)
            for _ in range(repeats):
                t = clock.start(True)
                await once()
                clock.stop("lane", True, t)
                t = clock.start(False)
                reference()
                clock.stop("reference", False, t)
            # Peak worker memory: one request of 32 inputs of 512 tokens, after inputs that
            # long have gone through every stream once (their buffers grown: what a worker
            # that has served such inputs holds), against the stated bound.
            limit = record.manifest.max_tokens or 512
            long = [" ".join(["lorem ipsum dolor sit amet"] * 200)] * 32
            await mod.encode_outputs(long[: 2 * threads], ["sparse"], record.name)
            base = psutil.Process(pid).memory_info().rss / 2**20
            stop, peak = threading.Event(), list[float]()
            sampler = threading.Thread(target=_peak_rss_mb, args=(pid, stop, peak))
            sampler.start()
            await mod.encode_outputs(long, ["sparse"], record.name)
            stop.set()
            sampler.join()
            cfg = SPLADE_CONFIG
            extra = splade_request_bytes(
                cfg["vocab_size"], cfg["hidden_size"], len(long) * limit, threads
            )
            memory = {"base": base, "peak": peak[0], "bound": base + extra / 2**20}
            return (
                clock,
                {"memory": memory, "kernels": _lane_kernels(mod, record.name, threads)},
                got,
            )

    clock, info, got = asyncio.run(lane())
    lane_s, lane_cpu = clock.median("lane")
    ref_s, ref_cpu = clock.median("reference")
    ref = reference().to_dense().numpy()
    cos, same_set = [], 0
    for (idx, val), want in zip(got, ref, strict=True):
        dense = np.zeros_like(want)
        dense[idx] = val
        same_set += bool(np.array_equal(idx, np.nonzero(want)[0]))
        norms = np.linalg.norm(dense) * np.linalg.norm(want)
        cos.append(
            1.0
            if norms == 0 and not dense.any() and not want.any()
            else float(dense @ want / max(norms, 1e-30))
        )
    mem = info["memory"]
    return {
        "model": record.name,
        "dtype": record.manifest.dtype,
        "texts": n,
        "threads": threads,
        "lane_s": round(lane_s, 3),
        "sparse_encoder_s": round(ref_s, 3),
        "lane_vs_sparse_encoder": round(ref_s / lane_s, 3),
        "target_lane_vs_sparse_encoder": 1.5,
        "lane_cpu_s": round(lane_cpu, 3),
        "sparse_encoder_cpu_s": round(ref_cpu, 3),
        "lane_vs_sparse_encoder_cpu": round(ref_cpu / lane_cpu, 3),
        "min_sparse_cosine_vs_reference": round(min(cos), 6),
        "items_with_the_reference_active_set": f"{same_set}/{len(got)}",
        "mean_active_entries": round(float(np.mean([len(i) for i, _ in got])), 1),
        "worker_rss_mb_before_32x512": round(mem["base"], 1),
        "worker_peak_rss_mb_32x512": round(mem["peak"], 1),
        "worker_peak_bound_mb_32x512": round(mem["bound"], 1),
        "worker_peak_within_bound": mem["peak"] <= mem["bound"],
        "lane_kernels": info["kernels"],
        "reference_kernels": _torch_kernels(),
    }


def _flag_outputs(model, tok, sparse_linear, colbert_linear, texts: list[str]) -> None:
    """The three bge-m3 outputs as FlagEmbedding computes them (one forward, then the heads),
    in batches of 32 as its encode does."""
    import torch
    import torch.nn.functional as F

    with torch.inference_mode():
        for i in range(0, len(texts), 32):
            batch = tok(
                texts[i : i + 32],
                padding=True,
                truncation=True,
                max_length=512,
                return_tensors="pt",
            )
            last = model(**batch).last_hidden_state
            F.normalize(last[:, 0], dim=-1)
            torch.relu(sparse_linear(last))
            F.normalize(colbert_linear(last[:, 1:]) * batch["attention_mask"][:, 1:, None], dim=-1)


def bench_m3(root: Path, n: int, repeats: int, threads: int) -> dict:
    import torch
    from transformers import AutoTokenizer, XLMRobertaModel

    hf = build_m3(root / "bge-m3-e5-small-random")
    store = ArtifactStore(root / "kinds-models")
    record = ensure_model(store, hf, "bge-m3-e5-small-random")
    texts = _texts(n)
    runtime = tempfile.mkdtemp(prefix="bk-", dir="/tmp")
    kinds = ["dense", "sparse", "multivector"]
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = XLMRobertaModel.from_pretrained(str(hf), add_pooling_layer=False).eval()
    hidden = model.config.hidden_size
    sparse_linear, colbert_linear = torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, hidden)
    sparse_linear.load_state_dict(torch.load(hf / "sparse_linear.pt"))
    colbert_linear.load_state_dict(torch.load(hf / "colbert_linear.pt"))

    def reference() -> None:
        _flag_outputs(model, tok, sparse_linear, colbert_linear, texts)

    async def lane() -> tuple[_Clock, dict]:
        async with _module(store, runtime, threads) as mod:
            await mod.encode_outputs(texts, kinds, record.name)  # warm-up
            reference()
            clock = _Clock(mod.supervisor(record.name, "llama").state().pid)
            for _ in range(repeats):
                t = clock.start(True)
                await mod.encode_outputs(texts, kinds, record.name)
                clock.stop("one", True, t)
                t = clock.start(False)
                reference()
                clock.stop("reference", False, t)
                t = clock.start(True)
                for k in kinds:
                    await mod.encode_outputs(texts, [k], record.name)
                clock.stop("three", True, t)
            return clock, _lane_kernels(mod, record.name, threads)

    clock, kernels = asyncio.run(lane())
    one_s, one_cpu = clock.median("one")
    three_s, _ = clock.median("three")
    ref_s, ref_cpu = clock.median("reference")
    return {
        "model": record.name,
        "dtype": record.manifest.dtype,
        "texts": n,
        "threads": threads,
        "lane_one_pass_s": round(one_s, 3),
        "lane_three_passes_s": round(three_s, 3),
        "transformers_flag_formulas_s": round(ref_s, 3),
        "lane_vs_transformers": round(ref_s / one_s, 3),
        "target_lane_vs_transformers": 1.5,
        "one_pass_vs_three_passes": round(three_s / one_s, 3),
        "target_one_pass_vs_three_passes": 2.5,
        "lane_one_pass_cpu_s": round(one_cpu, 3),
        # Of which the worker's (its decodes and heads); the rest is the host's (tokenizer,
        # frames). Nearly all of it: see workers/llama/decode_plan.py for where it goes.
        "lane_one_pass_worker_cpu_s": round(clock.worker_median("one"), 3),
        "transformers_flag_formulas_cpu_s": round(ref_cpu, 3),
        "lane_vs_transformers_cpu": round(ref_cpu / one_cpu, 3),
        "lane_kernels": kernels,
        "reference_kernels": _torch_kernels(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--which", choices=["splade", "m3", "both"], default="both")
    p.add_argument("--texts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="the lane's llama.cpp threads and torch's (default: every core)",
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "kinds", "cpu": _cpu()}
    if args.which in ("splade", "both"):
        result["splade"] = bench_splade(root, args.texts, args.repeats, args.threads)
    if args.which in ("m3", "both"):
        result["m3"] = bench_m3(root, args.texts, args.repeats, args.threads)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not result.get("splade", {}).get("worker_peak_within_bound", True):
        print("worker peak RSS over its stated bound", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
