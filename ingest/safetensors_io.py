"""A small, strict safetensors reader (F32/F16/BF16) over a read-only memory map.

Owned rather than `safetensors.numpy` because that cannot represent BF16 (numpy has no
bfloat16) and because a corrupt header must become a typed `ArtifactInvalid`, not a panic.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from ingest.errors import ArtifactInvalid

_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to f32 on read
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}
_MAX_HEADER = 100 * 1024 * 1024


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy arrays (float ones as f32/f16, BF16 widened to f32)."""
    mm, entries = _entries(path)
    out: dict[str, np.ndarray] = {}
    for name, (kind, shape, begin, end) in entries.items():
        arr = mm[begin:end].view(_DTYPES[kind]).reshape(shape)
        if kind == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr
    return out


def _entries(path: Path) -> tuple[np.memmap, dict[str, tuple[str, list[int], int, int]]]:
    """The file's map and its tensors' (dtype, shape, begin, end), offsets into the map,
    checked against the file; no tensor data is read."""
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise ArtifactInvalid(f"cannot read {path}: {e}") from e
    if mm.size < 8:
        raise ArtifactInvalid(f"{path} is too short to be safetensors")
    (hlen,) = struct.unpack("<Q", bytes(mm[:8]))
    if hlen > _MAX_HEADER or 8 + hlen > mm.size:
        raise ArtifactInvalid(f"{path}: header length {hlen} out of bounds")
    try:
        header = json.loads(bytes(mm[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactInvalid(f"{path}: header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ArtifactInvalid(f"{path}: header is not an object")
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
            raise ArtifactInvalid(f"{path}: bad entry for {name!r}: {e}") from e
        nbytes = math.prod(shape) * dt.itemsize
        if begin < 0 or end - begin != nbytes or base + end > mm.size:
            raise ArtifactInvalid(f"{path}: tensor {name!r} data out of bounds")
        out[name] = (spec["dtype"], shape, base + begin, base + end)
    return mm, out


def weight_elements(model_dir: Path) -> int:
    """How many weight elements `model_dir`'s safetensors hold, from their headers alone (no
    tensor data read): what sizes a conversion before it writes anything."""
    return sum(
        math.prod(shape)
        for path in _weight_files(model_dir)
        for _kind, shape, _b, _e in _entries(path)[1].values()
    )


def read_model_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    out: dict[str, np.ndarray] = {}
    for path in _weight_files(model_dir):
        out.update(read_safetensors(path))
    return out


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise ArtifactInvalid(f"{index}: {e}") from e
        return [model_dir / shard for shard in sorted(set(weight_map.values()))]
    raise ArtifactInvalid(
        f"{model_dir} has no model.safetensors (pytorch .bin checkpoints are not read: no torch)"
    )
