"""Deliberately degraded checkpoints, to prove the quality gate bites.

`truncated_mantissa_copy` writes a copy of a HF model directory whose float weights keep
only `bits` of their 23 mantissa bits (rounded toward zero) — what a careless low-precision
conversion does. Ingested as an f32 GGUF, the llama.cpp lane then serves exactly those
weights; certified against the ORIGINAL directory (`--reference-dir`), it must fail.
The Core ML lane has its own in-graph equivalent (LOAD build_options), so this is for llama.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from formats.safetensors_io import read_safetensors


def truncate_mantissa(arr: np.ndarray, bits: int) -> np.ndarray:
    """float32 with the low (23 - bits) mantissa bits cleared."""
    if not 0 <= bits <= 23:
        raise ValueError("bits must be in 0..23")
    a = np.ascontiguousarray(arr, dtype=np.float32)
    mask = np.uint32((0xFFFFFFFF << (23 - bits)) & 0xFFFFFFFF)
    return (a.view(np.uint32) & mask).view(np.float32)


def truncated_mantissa_copy(src_dir: str | Path, out_dir: str | Path, bits: int) -> Path:
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = read_safetensors(src / "model.safetensors")
    degraded = {
        name: truncate_mantissa(w, bits) if w.dtype.kind == "f" else np.ascontiguousarray(w)
        for name, w in weights.items()
    }
    save_file(degraded, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in src.iterdir():  # config, tokenizer, sentence-transformers pooling config
        if item.is_dir():
            shutil.copytree(item, out / item.name, dirs_exist_ok=True)
        elif item.name != "model.safetensors":
            shutil.copyfile(item, out / item.name)
    return out
