"""The output Parquet file: its schema and metadata, row groups, and atomic publication.

Columns: `id` (string), `embedding` (fixed_size_list<float32>[dims], or the `--dtype`'s type:
batch/dtypes.py; absent with `--no-dense`), the token-level outputs asked for (batch/kinds.py:
`sparse_indices`/`sparse_values`, `multivector`, `tokens`), `n_tokens` (int32), `truncated`
(bool). With them, `synapse.outputs` lists the kinds written ("dense,sparse") and
`synapse.multivector_dims` gives a multi-vector head's width. File metadata (key -> UTF-8 value):
`synapse.model`, `synapse.lane`, `synapse.artifact_digest`, `synapse.certificate` (empty when
none), `synapse.normalize` ("true"/"false"), `synapse.dims` (the model's width, also for packed
bits), `synapse.dtype`, and for int8/uint8 `synapse.quantization_ranges`. Plain Arrow types
only, so DuckDB, pandas, polars and LanceDB read the file as is.

`synapse batch classify` writes `classify_schema`'s columns instead (`label`, `score`, `scores`
for `embedding`), with `synapse.task` "classify", `synapse.labels` (a JSON list: the label of
each `scores` column), `synapse.activation` and `synapse.raw_scores`.

Publication is atomic: the final file is written beside its path under a temporary name,
fsynced and renamed over it, so OUTPUT exists only when complete.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batch.dtypes import embedding_array, embedding_type
from ingest.durable import fsync_dir, fsync_file

META_KEYS = ("model", "lane", "artifact_digest", "certificate", "normalize", "dims")


def output_schema(
    dims: int,
    metadata: dict[str, str] | None = None,
    dtype: str = "float32",
    *,
    dense: bool = True,
    extra: list[pa.Field] | None = None,
) -> pa.Schema:
    """`extra`: the token-level outputs' columns (batch/kinds.py), after `embedding` (which
    is absent when `dense` is False)."""
    head = [pa.field("id", pa.string(), nullable=False)]
    if dense:
        head.append(pa.field("embedding", embedding_type(dims, dtype), nullable=False))
    schema = pa.schema(
        [
            *head,
            *(extra or []),
            pa.field("n_tokens", pa.int32(), nullable=False),
            pa.field("truncated", pa.bool_(), nullable=False),
        ]
    )
    if metadata:
        schema = schema.with_metadata({f"synapse.{k}": str(v) for k, v in metadata.items()})
    return schema


def make_table(
    ids: list[str],
    vectors: np.ndarray | None,
    n_tokens: Iterable[int],
    truncated: Iterable[bool],
    schema: pa.Schema,
    extra: list[pa.Array] | None = None,
) -> pa.Table:
    """`vectors` in the embedding column's dtype (batch.dtypes.convert), float32 by default;
    None when the schema has no embedding column. `extra`: the arrays of the schema's
    token-level columns, in its order."""
    head = [pa.array(ids, pa.string())]
    if vectors is not None:
        head.append(embedding_array(vectors, schema.field("embedding").type))
    return pa.Table.from_arrays(
        [
            *head,
            *(extra or []),
            pa.array(list(n_tokens), pa.int32()),
            pa.array(list(truncated), pa.bool_()),
        ],
        schema=schema,
    )


def classify_schema(n_labels: int, metadata: dict[str, str] | None = None) -> pa.Schema:
    """`synapse batch classify`'s columns: `id`, `label` (the best label), `score` (its
    score), `scores` (every label's, in label-id order: `synapse.labels` names them),
    `n_tokens`, `truncated`."""
    schema = pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("label", pa.string(), nullable=False),
            pa.field("score", pa.float32(), nullable=False),
            pa.field("scores", pa.list_(pa.float32(), n_labels), nullable=False),
            pa.field("n_tokens", pa.int32(), nullable=False),
            pa.field("truncated", pa.bool_(), nullable=False),
        ]
    )
    if metadata:
        schema = schema.with_metadata({f"synapse.{k}": str(v) for k, v in metadata.items()})
    return schema


def make_classify_table(
    ids: list[str],
    scores: np.ndarray,
    labels: list[str],
    n_tokens: Iterable[int],
    truncated: Iterable[bool],
    schema: pa.Schema,
) -> pa.Table:
    """`scores` (n, n_labels) float32, already activated (or raw, as the job asked); the
    best label is the first of the highest score, as argmax picks it."""
    scores = np.ascontiguousarray(scores, dtype=np.float32).reshape(len(ids), len(labels))
    best = scores.argmax(axis=1) if len(ids) else np.zeros(0, dtype=np.intp)
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.string()),
            pa.array([labels[j] for j in best], pa.string()),
            pa.array(scores[np.arange(len(ids)), best], pa.float32()),
            pa.FixedSizeListArray.from_arrays(pa.array(scores.reshape(-1)), len(labels)),
            pa.array(list(n_tokens), pa.int32()),
            pa.array(list(truncated), pa.bool_()),
        ],
        schema=schema,
    )


def read_metadata(path: str | Path) -> dict[str, str]:
    raw = pq.read_schema(path).metadata or {}
    return {
        k.decode().removeprefix("synapse."): v.decode()
        for k, v in raw.items()
        if k.startswith(b"synapse.")
    }


def write_part(path: Path, table: pa.Table) -> None:
    """One row group in its own file, published atomically (a checkpoint's unit)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(table, tmp, row_group_size=max(1, table.num_rows))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial part is no part (and a full disk wants it back)
        raise


def merge_parts(parts: list[Path], dest: Path, schema: pa.Schema) -> int:
    """Copy the parts' row groups, one at a time, into `dest` (atomically); rows written."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            for part in parts:
                pf = pq.ParquetFile(part)
                for g in range(pf.num_row_groups):
                    table = pf.read_row_group(g).cast(schema)  # the final schema's metadata
                    writer.write_table(table, row_group_size=max(1, table.num_rows))
                    rows += table.num_rows
        fsync_file(tmp)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return rows


def publish_copy(src: Path, dest: Path) -> None:
    """Copy a finished side file (the errors) into place atomically."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(1 << 20):
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
