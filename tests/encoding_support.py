"""Helpers of the embedding-type tests: a private store over the session's built models, and
sentence-transformers' own quantization to compare with. No tests here.

Calibration writes int8 ranges into a model's manifest; the tests that calibrate do it in a
store of their own, whose model directories hard-link the session store's files (no second
conversion, no extra disk) and copy only the manifest, so the session's manifests stay as
ingest wrote them for every other test.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from ingest.store import MANIFEST_FILE


def private_store(src_root: str | Path, dst_root: str | Path, names: list[str]) -> str:
    src_root, dst_root = Path(src_root), Path(dst_root)
    dst_root.mkdir(parents=True, exist_ok=True)
    for name in names:
        src, dst = src_root / name, dst_root / name
        if dst.exists():
            continue
        dst.mkdir()
        for f in src.iterdir():
            if f.name == MANIFEST_FILE:
                shutil.copy2(f, dst / f.name)
                continue
            try:
                os.link(f, dst / f.name)
            except OSError:  # another filesystem
                shutil.copy2(f, dst / f.name)
    return str(dst_root)


def st_quantize(vectors: np.ndarray, precision: str, ranges=None, calibration=None):
    """sentence-transformers' `quantize_embeddings` (imported here: it brings torch)."""
    from sentence_transformers.util.quantization import quantize_embeddings

    return quantize_embeddings(
        vectors, precision, ranges=ranges, calibration_embeddings=calibration
    )


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k best scores (higher is better), best first; ties by index."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) bit distances between packed uint8 codes."""
    return np.unpackbits(a[:, None, :] ^ b[None, :, :], axis=-1).sum(axis=-1)
