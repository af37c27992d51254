"""`synapse batch embed --dtype`: the Arrow/Parquet type of the `embedding` column, and the
vectors converted to it.

    float32  fixed_size_list<float32>[dims]       the vectors as computed (the default)
    float16  fixed_size_list<halffloat>[dims]     Parquet FLOAT16: half the bytes, about 3
                                                  significant digits
    int8     fixed_size_list<int8>[dims]          sentence-transformers' int8 / uint8 over the
    uint8    fixed_size_list<uint8>[dims]         model's calibration ranges (ingest.quantization)
    binary   fixed_size_list<int8>[ceil(dims/8)]  packed sign bits - 128: the very numbers
                                                  `quantize_embeddings(..., "binary")` gives
    ubinary  fixed_size_binary[ceil(dims/8)]      the packed bits as bytes (dimension 0 is the
                                                  high bit of byte 0)

Why the packed forms differ: `binary` keeps sentence-transformers' signed numbers for readers
that want them as such; `ubinary` is the compact one (Parquet has no 8-bit integer type, so a
list<int8> is stored as INT32 values and compressed, while a fixed-size binary is one
FIXED_LEN_BYTE_ARRAY of ceil(dims/8) bytes a row), and bytes are what Hamming search takes:
popcount(a XOR b).

The file metadata says `synapse.dtype`, and for int8/uint8 `synapse.quantization_ranges`:
JSON {"calibration", "min", "max"}, the ranges the rows were quantized with, which a reader
needs to quantize its float queries alike.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from ingest.quantization import RANGED, packed_width, quantize

DTYPES = ("float32", "float16", "int8", "uint8", "binary", "ubinary")


def needs_ranges(dtype: str) -> bool:
    return dtype in RANGED


def embedding_type(dims: int, dtype: str = "float32") -> pa.DataType:
    if dtype == "float32":
        return pa.list_(pa.float32(), dims)
    if dtype == "float16":
        return pa.list_(pa.float16(), dims)
    if dtype == "int8":
        return pa.list_(pa.int8(), dims)
    if dtype == "uint8":
        return pa.list_(pa.uint8(), dims)
    if dtype == "binary":
        return pa.list_(pa.int8(), packed_width(dims))
    if dtype == "ubinary":
        return pa.binary(packed_width(dims))
    raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")


def convert(vectors: np.ndarray, dtype: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """float32 vectors (n, dims) as the column's values: (n, dims) or, packed, (n, dims/8)."""
    if dtype == "float16":
        return np.asarray(vectors, dtype=np.float32).astype(np.float16)
    return quantize(vectors, dtype, ranges)


def embedding_array(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """The column from `values` already in its dtype (`convert`); float32 widens to nothing
    else, so a float vector never lands silently in an integer column."""
    n = len(values)
    if pa.types.is_fixed_size_binary(type_):
        data = np.ascontiguousarray(values, dtype=np.uint8)
        assert data.shape == (n, type_.byte_width), (data.shape, type_)
        return pa.FixedSizeBinaryArray.from_buffers(type_, n, [None, pa.py_buffer(data)])
    item = np.dtype(type_.value_type.to_pandas_dtype())
    flat = np.ascontiguousarray(np.asarray(values).astype(item, casting="same_kind"))
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), type_.list_size)


def dtype_metadata(dtype: str, ranges: np.ndarray | None, calibration: str = "") -> dict:
    meta = {"dtype": dtype}
    if needs_ranges(dtype) and ranges is not None:
        r = np.asarray(ranges, dtype=np.float32)
        meta["quantization_ranges"] = json.dumps(
            {
                "calibration": calibration,
                "min": [float(str(x)) for x in r[0]],
                "max": [float(str(x)) for x in r[1]],
            },
            separators=(",", ":"),
        )
    return meta
