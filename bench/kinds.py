"""Learned sparse and one-pass hybrid outputs at real model shapes (random seeded weights).

    python -m bench.kinds [--which splade|m3|both] [--texts 32] [--repeats 2] [--out FILE]

- splade: SPLADE at bert-base's shape (BertForMaskedLM: 12 layers, hidden 768, 12 heads,
  intermediate 3072, vocabulary 30522 under MiniLM's WordPiece; SpladePooling max), as a
  sentence-transformers SparseEncoder directory. The llama.cpp lane's `sparse` output against
  `SparseEncoder.encode_document` on torch CPU, the same texts. Target, reported not
  asserted: lane / SparseEncoder >= 1.5. Also the worker's peak resident memory while it
  answers one request of 32 inputs of 512 tokens, sampled every 10 ms.
- m3: bge-m3's three outputs at multilingual-e5-small's XLM-R shape (12 x 384, vocabulary
  250037) with `sparse_linear.pt` and `colbert_linear.pt` in FlagEmbedding's layout. One
  ENCODE of dense + sparse + multi-vector against (a) transformers on torch CPU with
  FlagEmbedding's head formulas for the same three outputs, and (b) three ENCODEs of our own
  lane, one output each. Targets: lane / transformers >= 1.5, lane / three passes >= 2.5.

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


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _module(store: ArtifactStore, runtime_dir: str):
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    return Module(
        ModuleConfig(
            store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
        )
    )


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


def bench_splade(root: Path, n: int, repeats: int) -> dict:
    from sentence_transformers import SparseEncoder

    hf = build_splade(root / "splade-bert-base-random")
    store = ArtifactStore(root / "kinds-models")
    record = ensure_model(store, hf, "splade-bert-base-random")
    texts = _texts(n)
    runtime = tempfile.mkdtemp(prefix="bk-", dir="/tmp")

    async def lane() -> tuple[float, float, list]:
        async with _module(store, runtime) as mod:
            got: list = []

            async def once() -> None:
                got[:] = (await mod.encode_outputs(texts, ["sparse"], record.name)).sparse or []

            loop_time = []
            await once()  # warm-up (loads the model, makes the token context)
            for _ in range(repeats):
                t0 = time.perf_counter()
                await once()
                loop_time.append(time.perf_counter() - t0)
            # Peak worker memory: one request of 32 inputs of 512 tokens.
            long = [" ".join(["lorem ipsum dolor sit amet"] * 200)] * 32
            pid = mod.supervisor(record.name, "llama").state().pid
            stop, peak = threading.Event(), list[float]()
            sampler = threading.Thread(target=_peak_rss_mb, args=(pid, stop, peak))
            sampler.start()
            await mod.encode_outputs(long, ["sparse"], record.name)
            stop.set()
            sampler.join()
            return statistics.median(loop_time), peak[0], got

    lane_s, peak_mb, got = asyncio.run(lane())
    ref_model = SparseEncoder(str(hf), device="cpu")
    ref_s = _timed(lambda: ref_model.encode_document(texts, batch_size=32), repeats)
    ref = ref_model.encode_document(texts, batch_size=32).to_dense().numpy()
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
    return {
        "model": record.name,
        "dtype": record.manifest.dtype,
        "texts": n,
        "lane_s": round(lane_s, 3),
        "sparse_encoder_s": round(ref_s, 3),
        "lane_vs_sparse_encoder": round(ref_s / lane_s, 3),
        "target_lane_vs_sparse_encoder": 1.5,
        "min_sparse_cosine_vs_reference": round(min(cos), 6),
        "items_with_the_reference_active_set": f"{same_set}/{len(got)}",
        "mean_active_entries": round(float(np.mean([len(i) for i, _ in got])), 1),
        "worker_peak_rss_mb_32x512": round(peak_mb, 1),
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


def bench_m3(root: Path, n: int, repeats: int) -> dict:
    import torch
    from transformers import AutoTokenizer, XLMRobertaModel

    hf = build_m3(root / "bge-m3-e5-small-random")
    store = ArtifactStore(root / "kinds-models")
    record = ensure_model(store, hf, "bge-m3-e5-small-random")
    texts = _texts(n)
    runtime = tempfile.mkdtemp(prefix="bk-", dir="/tmp")
    kinds = ["dense", "sparse", "multivector"]

    async def lane() -> tuple[float, float]:
        async with _module(store, runtime) as mod:
            await mod.encode_outputs(texts, kinds, record.name)  # warm-up
            one, three = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                await mod.encode_outputs(texts, kinds, record.name)
                one.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for k in kinds:
                    await mod.encode_outputs(texts, [k], record.name)
                three.append(time.perf_counter() - t0)
            return statistics.median(one), statistics.median(three)

    one_s, three_s = asyncio.run(lane())
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = XLMRobertaModel.from_pretrained(str(hf), add_pooling_layer=False).eval()
    hidden = model.config.hidden_size
    sparse_linear, colbert_linear = torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, hidden)
    sparse_linear.load_state_dict(torch.load(hf / "sparse_linear.pt"))
    colbert_linear.load_state_dict(torch.load(hf / "colbert_linear.pt"))
    ref_s = _timed(lambda: _flag_outputs(model, tok, sparse_linear, colbert_linear, texts), repeats)
    return {
        "model": record.name,
        "dtype": record.manifest.dtype,
        "texts": n,
        "lane_one_pass_s": round(one_s, 3),
        "lane_three_passes_s": round(three_s, 3),
        "transformers_flag_formulas_s": round(ref_s, 3),
        "lane_vs_transformers": round(ref_s / one_s, 3),
        "target_lane_vs_transformers": 1.5,
        "one_pass_vs_three_passes": round(three_s / one_s, 3),
        "target_one_pass_vs_three_passes": 2.5,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--which", choices=["splade", "m3", "both"], default="both")
    p.add_argument("--texts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args(argv)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "kinds", "cpu": _cpu()}
    if args.which in ("splade", "both"):
        result["splade"] = bench_splade(root, args.texts, args.repeats)
    if args.which in ("m3", "both"):
        result["m3"] = bench_m3(root, args.texts, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
