"""A GGUF file's metadata and its f32 / f16 / bf16 tensors as float32 numpy arrays, for the
owned Core ML ingest of a model that exists only as a GGUF (`formats.owned.manifest_gguf`).

The header is read with the project's bounds-checked scanner (`formats.gguf_header`), not
`gguf.GGUFReader`, which builds every array field element by element (seconds for a 250k-token
vocabulary) and is not needed here: the scanner already gives each tensor's type, ggml shape and
data offset, checked to lie inside the file.

Shapes: ggml lists dimensions innermost first (ne0 = a Linear layer's input width), so the
row-major array is the reverse, HF's (out, in), with nothing transposed.

Quantized tensors are refused, naming the tensor and its type. The graph is built and certified
as the model's own weights in fp16; a quantized tensor holds only an approximation of them, and
dequantizing it would serve that approximation's error as if it were the model (and the owned
f32 copy would be several times the GGUF's size).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from formats.gguf_header import GGUFFormatError, GGUFHeader, TensorInfo, read_gguf_header
from formats.owned.model import ManifestError, UnsupportedModel

_FLOAT_TYPES: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.BF16: np.dtype("<u2"),  # the top half of an f32: widened below
}


class QuantizedTensor(UnsupportedModel):
    """A tensor the GGUF stores quantized: the model's own weights are not in the file."""

    def __init__(self, name: str, type_name: str) -> None:
        super().__init__(
            f"tensor {name!r} is {type_name}: the Core ML lane builds from f16/f32 (or bf16) "
            "weights only; a quantized GGUF holds an approximation of the model, which this "
            "lane would serve as the model itself. Ingest the model's f16/f32 GGUF or its "
            "Hugging Face directory for the Core ML lane (llama.cpp serves this file as it is)"
        )
        self.tensor = name
        self.type_name = type_name


def read_header(path: Path, want_arrays: frozenset[str] = frozenset()) -> GGUFHeader:
    try:
        return read_gguf_header(path, want_arrays)
    except (OSError, GGUFFormatError) as e:
        raise ManifestError(f"{path.name} is not a readable GGUF: {e}") from e


def type_name(info: TensorInfo) -> str:
    try:
        return GGMLQuantizationType(info.type).name
    except ValueError:
        return f"ggml type {info.type}"


def check_float(info: TensorInfo) -> None:
    if info.type not in _FLOAT_TYPES:
        raise QuantizedTensor(info.name, type_name(info))


def read_tensor(path: Path, hdr: GGUFHeader, info: TensorInfo) -> np.ndarray:
    """The tensor as a C-contiguous float32 array in row-major (HF) order."""
    check_float(info)
    dtype = _FLOAT_TYPES[GGMLQuantizationType(info.type)]
    shape = tuple(reversed(info.shape))
    count = int(np.prod(shape))
    try:
        raw = np.fromfile(path, dtype=dtype, count=count, offset=hdr.data_offset + info.offset)
    except OSError as e:
        raise ManifestError(f"{path.name}: tensor {info.name!r}: {e}") from e
    if raw.size != count:
        raise ManifestError(f"{path.name}: tensor {info.name!r} is truncated")
    if info.type == GGMLQuantizationType.BF16:
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(raw.reshape(shape), dtype=np.float32)
