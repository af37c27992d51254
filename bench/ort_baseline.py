"""ONNX Runtime baseline for bench.embed: the model's own Hugging Face weights, fp32, exported
by us.

What fastembed and TEI's CPU path do: the Hugging Face model exported to ONNX
(`torch.onnx.export`, dynamic batch and sequence axes), run by ONNX Runtime in fp32 with
`intra_op_num_threads` = the lane's threads, inputs sorted by length and cut into batches of
32 (padding only within a batch, on the right). Pooling is part of the exported graph and is
the model's own: mean over the attention mask, the first token (cls), or the last non-pad
token (last: Qwen3-Embedding's "lasttoken"; with right padding that is `mask.sum(1) - 1`), then
L2 normalization when the directory declares a Normalize module; so the timed loop is
tokenize + session.run. No int8 quantization: with default settings it drops the mean cosine
to 0.93 on MiniLM, too far from fp32 to be a fair baseline.

The export is cached under `<synapse cache>/bench/onnx/`, keyed by the directory's config and
weight files (size and mtime), the pooling, Normalize and the torch version, so repeated runs
only pay it once. A model over 2 GB is written with its weights as ONNX external data beside
the graph, hence one directory per export.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from importlib.metadata import version
from pathlib import Path

import numpy as np

from ingest.model_packages import minilm_dir
from ingest.store import default_root

BATCH = 32
OPSET = 17
POOLINGS = ("mean", "cls", "last")


def _weights_key(model_dir: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.name == "config.json":
            h.update(p.read_bytes())
        elif p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json"):
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def onnx_path(model_dir: Path, pooling: str, normalize: bool, root: Path | None = None) -> Path:
    """Where the export of `model_dir` with this head lives (one directory per export, under
    `root`, default `<synapse cache>/bench/onnx`)."""
    key = (
        f"{model_dir.name}-{_weights_key(model_dir)}-{pooling}{'-norm' if normalize else ''}"
        f"-torch-{version('torch')}-opset{OPSET}"
    )
    root = root or default_root().parent / "bench" / "onnx"
    return root / key / "model.onnx"


class _Pooled:
    """The Hugging Face encoder plus the model's pooling (and Normalize), as one graph."""

    @staticmethod
    def build(model, pooling: str, normalize: bool):
        import torch

        # A decoder (Qwen3) would build a KV cache the graph never reads.
        kwargs = (
            {"use_cache": False}
            if "use_cache" in inspect.signature(model.forward).parameters
            else {}
        )

        class Pooled(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
                if pooling == "mean":
                    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                elif pooling == "cls":
                    pooled = hidden[:, 0]
                else:  # last non-pad token; the embedder pads on the right
                    last = attention_mask.sum(1) - 1
                    pooled = hidden[torch.arange(hidden.shape[0]), last]
                if normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                return pooled

        return Pooled().eval()


def export_onnx(model_dir: Path, out: Path, pooling: str, normalize: bool) -> Path:
    """Export `model_dir` (its safetensors, fp32) with in-graph pooling, once."""
    if out.is_file():
        return out
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r}: the ONNX baseline computes {POOLINGS}")
    import torch
    from transformers import AutoModel

    model = _Pooled.build(
        AutoModel.from_pretrained(str(model_dir), dtype=torch.float32), pooling, normalize
    )
    ids = torch.ones((2, 8), dtype=torch.int64)
    out.parent.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent.with_name(out.parent.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            model,
            (ids, torch.ones_like(ids)),
            str(tmp / out.name),
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "embedding": {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )
    del model
    # Atomic: a concurrent run never loads a half-written export (external data included).
    try:
        tmp.replace(out.parent)
    except OSError:  # another run published it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class OrtEmbedder:
    """fp32 ONNX Runtime session plus the directory's own tokenizer.json, truncated at
    `max_tokens` (special tokens included) as the lane and sentence-transformers truncate;
    `prompt` is prepended to every text, as sentence-transformers does."""

    def __init__(
        self,
        threads: int,
        max_tokens: int,
        model_dir: Path | None = None,
        pooling: str = "mean",
        normalize: bool = True,
        prompt: str = "",
        cache_root: Path | None = None,
    ) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        model_dir = model_dir or minilm_dir()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ORT's default thread wait policy (spinning), as fastembed/TEI users run it: turning
        # spinning off made ORT 2x slower here, which would flatter the lane.
        path = export_onnx(
            model_dir, onnx_path(model_dir, pooling, normalize, cache_root), pooling, normalize
        )
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_tokens)
        config = json.loads((model_dir / "config.json").read_text())
        self.pad_id = int(config.get("pad_token_id") or 0)  # RoBERTa's positions skip it
        self.prompt = prompt
        self.version = ort.__version__

    def embed(self, texts: list[str]) -> np.ndarray:
        if self.prompt:
            texts = [self.prompt + t for t in texts]
        encs = self.tokenizer.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: len(encs[i].ids))
        out: np.ndarray | None = None
        for start in range(0, len(order), BATCH):
            idx = order[start : start + BATCH]
            width = max(len(encs[i].ids) for i in idx)
            ids = np.full((len(idx), width), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for row, i in enumerate(idx):
                n = len(encs[i].ids)
                ids[row, :n] = encs[i].ids
                mask[row, :n] = 1
            (vectors,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[idx] = vectors
        assert out is not None, "no texts"
        return out
