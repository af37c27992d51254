"""The one safetensors reader: strict, over a read-only memory map, BF16 widened to f32.

Every weight our code reads goes through here: the Hugging Face converters (host side), the
owned Core ML artifact's build and its load in the worker (`formats.owned`), the store's size
estimate and the certification references. It lives in `formats` so that both sides may
import it. Writes stay with `safetensors.numpy.save_file`.

Owned rather than `safetensors.numpy` / `safe_open` because those cannot represent BF16
(numpy has no bfloat16) and raise their own error types (or panic) on a damaged header; here
every corrupt or truncated file is a typed `SafetensorsInvalid` naming the file and what is
wrong with it. Tensors are views of the map: nothing is read until it is used.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from common.errors import ArtifactInvalid

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to f32 on read
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_MAX_HEADER = 100 * 1024 * 1024

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsInvalid(ArtifactInvalid):
    """A safetensors file (or a sharded checkpoint's index) is missing, unreadable, corrupt or
    truncated; the message names the file."""


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy arrays in the file's order (BF16 widened to f32, every
    other dtype as stored)."""
    mm, entries = _entries(Path(path))
    out: dict[str, np.ndarray] = {}
    for name, (kind, shape, begin, end) in entries.items():
        arr = mm[begin:end].view(_DTYPES[kind]).reshape(shape)
        if kind == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr
    return out


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the header alone (no tensor data read)."""
    return {name: tuple(shape) for name, (_k, shape, _b, _e) in _entries(Path(path))[1].items()}


def _entries(path: Path) -> tuple[np.memmap, dict[str, tuple[str, list[int], int, int]]]:
    """The file's map and its tensors' (dtype, shape, begin, end), offsets into the map,
    checked against the file; no tensor data is read."""
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:  # missing, a directory, or empty (mmap refuses 0 bytes)
        raise SafetensorsInvalid(f"cannot read {path}: {e}") from e
    if mm.size < 8:
        raise SafetensorsInvalid(f"{path} is too short to be safetensors")
    (hlen,) = struct.unpack("<Q", bytes(mm[:8]))
    if hlen > _MAX_HEADER or 8 + hlen > mm.size:
        raise SafetensorsInvalid(f"{path}: header length {hlen} out of bounds")
    try:
        header = json.loads(bytes(mm[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsInvalid(f"{path}: header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise SafetensorsInvalid(f"{path}: header is not an object")
    base = 8 + hlen
    out: dict[str, tuple[str, list[int], int, int]] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = _DTYPES[spec["dtype"]]
            shape = [int(s) for s in spec["shape"]]
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsInvalid(f"{path}: bad entry for {name!r}: {e!r}") from e
        if any(s < 0 for s in shape):
            raise SafetensorsInvalid(f"{path}: tensor {name!r} has a negative dimension")
        nbytes = math.prod(shape) * dt.itemsize
        if begin < 0 or end - begin != nbytes or base + end > mm.size:
            raise SafetensorsInvalid(f"{path}: tensor {name!r} data out of bounds")
        out[name] = (spec["dtype"], shape, base + begin, base + end)
    return mm, out


def weight_files(model_dir: Path) -> list[Path]:
    """A checkpoint's weight files: model.safetensors, or the shards its index lists."""
    model_dir = Path(model_dir)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SafetensorsInvalid(f"{index}: {e!r}") from e
        except json.JSONDecodeError as e:
            raise SafetensorsInvalid(f"{index}: not JSON: {e}") from e
        if not all(isinstance(s, str) for s in shards):
            raise SafetensorsInvalid(f"{index}: weight_map names a shard that is not a file name")
        return [model_dir / shard for shard in shards]
    raise SafetensorsInvalid(
        f"{model_dir} has no {SINGLE_FILE} (pytorch .bin checkpoints are not read: no torch)"
    )


def weight_elements(model_dir: Path) -> int:
    """How many weight elements `model_dir`'s safetensors hold, from their headers alone (no
    tensor data read): what sizes a conversion before it writes anything."""
    shapes = [shape for path in weight_files(model_dir) for shape in tensor_shapes(path).values()]
    return sum(math.prod(shape) for shape in shapes)


def read_model_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """model.safetensors, or the shards listed by model.safetensors.index.json; a tensor
    named in two shards is refused (which copy the model means is not known)."""
    out: dict[str, np.ndarray] = {}
    for path in weight_files(model_dir):
        tensors = read_safetensors(path)
        twice = sorted(tensors.keys() & out.keys())
        if twice:
            raise SafetensorsInvalid(f"{path}: tensor {twice[0]!r} is in another shard too")
        out.update(tensors)
    return out
