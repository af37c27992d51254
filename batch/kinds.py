"""The token-level outputs a bulk job can write beside (or instead of) the dense vector, and
their Parquet columns.

- `sparse` (a model's sparse head): `sparse_indices list<int32>` (the active vocabulary ids,
  as the head returns them) and `sparse_values list<float32>` (their weights, same order and
  length);
- `multivector` (a model's multi-vector head): `multivector list<fixed_size_list<float32>[d]>`,
  one vector per output token, d the head's width;
- `tokens` (any embedder): `tokens list<fixed_size_list<float32>[d]>`, every token's final
  state, d the model's width.
Plain Arrow list types, so pyarrow, DuckDB and polars read them as they are written.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

KINDS = ("sparse", "multivector", "tokens")  # what a job may ask beside `dense`


def kind_fields(kind: str, dims: int) -> list[pa.Field]:
    """The columns of one kind; `dims` is the head's width (multivector), the model's
    (tokens), unused for sparse (its width is the vocabulary)."""
    if kind == "sparse":
        return [
            pa.field("sparse_indices", pa.list_(pa.int32()), nullable=False),
            pa.field("sparse_values", pa.list_(pa.float32()), nullable=False),
        ]
    if kind in ("multivector", "tokens"):
        return [pa.field(kind, pa.list_(pa.list_(pa.float32(), dims)), nullable=False)]
    raise ValueError(f"unknown output kind {kind!r}")


def kind_arrays(kind: str, items: Sequence, dims: int) -> list[pa.Array]:
    """The columns of `items`, one per row: (int32 indices, float32 values) for sparse, a
    (k, dims) float32 array for multivector/tokens."""
    if kind == "sparse":
        idx = [np.asarray(i, np.int32).reshape(-1) for i, _ in items]
        val = [np.asarray(v, np.float32).reshape(-1) for _, v in items]
        for i, v in zip(idx, val, strict=True):
            if len(i) != len(v):
                raise ValueError(f"sparse row with {len(i)} indices and {len(v)} values")
        return [_lists(idx, pa.int32()), _lists(val, pa.float32())]
    mats = [np.asarray(x, np.float32).reshape(-1, dims) for x in items]
    flat = np.concatenate(mats).reshape(-1) if mats else np.zeros(0, np.float32)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), dims)
    return [pa.ListArray.from_arrays(_offsets([len(m) for m in mats]), inner)]


def _lists(parts: list[np.ndarray], typ: pa.DataType) -> pa.Array:
    flat = np.concatenate(parts) if parts else np.zeros(0)
    return pa.ListArray.from_arrays(_offsets([len(p) for p in parts]), pa.array(flat, typ))


def _offsets(lengths: list[int]) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), pa.int32())
