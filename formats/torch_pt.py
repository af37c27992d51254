"""A reader of PyTorch checkpoints (`torch.save` of a state dict: `.pt`, `pytorch_model.bin`)
without torch and without running the pickle's code.

Some checkpoints keep small heads only as torch pickles: bge-m3's `colbert_linear.pt` and
`sparse_linear.pt` beside its safetensors encoder (FlagEmbedding's layout), older
sentence-transformers `Dense` modules' `pytorch_model.bin`. Workers have no torch, and
`torch.load` of a file from the Hub can run arbitrary code, so this reads the format itself:

- the zip container `torch.save` has written since torch 1.6: `<archive>/data.pkl` (the
  pickled object), `<archive>/data/<key>` (each storage's raw bytes), `<archive>/byteorder`
  (absent in older files: little endian);
- the pickle through a restricted `pickle.Unpickler` that resolves only the globals a state
  dict of dense tensors needs (`collections.OrderedDict`, torch's typed storage classes and its
  `_rebuild_tensor_v2` / `_rebuild_parameter`); any other global (a class of the author's,
  `os.system`...) is refused, never imported;
- each tensor as a numpy array over its storage's bytes (offset, shape and stride as stored),
  BF16 widened to f32 as `formats.safetensors_io` widens it.

The legacy pre-zip format (torch < 1.6), sparse or quantized tensors and anything but a mapping
of names to tensors are `TorchPtInvalid`: an `ArtifactInvalid` naming the file.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import ArtifactInvalid

# torch's typed storage class names -> (numpy dtype, widen BF16).
_STORAGE_DTYPES: dict[str, tuple[np.dtype, bool]] = {
    "DoubleStorage": (np.dtype("f8"), False),
    "FloatStorage": (np.dtype("f4"), False),
    "HalfStorage": (np.dtype("f2"), False),
    "BFloat16Storage": (np.dtype("u2"), True),
    "LongStorage": (np.dtype("i8"), False),
    "IntStorage": (np.dtype("i4"), False),
    "ShortStorage": (np.dtype("i2"), False),
    "CharStorage": (np.dtype("i1"), False),
    "ByteStorage": (np.dtype("u1"), False),
    "BoolStorage": (np.dtype("?"), False),
}


class TorchPtInvalid(ArtifactInvalid):
    """A torch checkpoint is missing, not a zip `torch.save` wrote, holds something other than
    dense tensors by name, or its storages do not match its pickle; the message names the file."""


class _StorageType:
    """Stands in for `torch.FloatStorage` & co. in the pickle: only its name is needed."""

    def __init__(self, name: str) -> None:
        self.name = name


class _Storage:
    """One storage's bytes, as a flat numpy array of its element type."""

    def __init__(self, data: np.ndarray, bf16: bool) -> None:
        self.data = data
        self.bf16 = bf16


class _StateDict(dict):
    """`collections.OrderedDict` in the pickle (a plain dict keeps insertion order); its
    `_metadata` attribute arrives through BUILD into `__dict__` and is ignored."""


def _rebuild_tensor(
    storage: _Storage,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    *_ignored: object,
) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
    backward_hooks[, metadata]) as a numpy array (a copy, contiguous)."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    shape, steps = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(shape) != len(steps) or any(s < 0 for s in shape) or any(s < 0 for s in steps):
        raise pickle.UnpicklingError(f"a tensor of size {size} and stride {stride}")
    data = storage.data
    n = int(np.prod(shape)) if shape else 1
    last = offset + sum((d - 1) * s for d, s in zip(shape, steps, strict=True)) if n else offset
    if offset < 0 or (n and last >= data.size):
        raise pickle.UnpicklingError(
            f"a tensor of size {shape} at offset {offset} overruns its storage of {data.size}"
        )
    itemsize = data.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        data[offset:] if n else data[:0],
        shape=shape,
        strides=tuple(s * itemsize for s in steps),
        writeable=False,
    )
    arr = np.array(view)  # owns its memory: independent of the archive's buffer
    if storage.bf16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _rebuild_parameter(data: np.ndarray, *_ignored: object) -> np.ndarray:
    return data


_GLOBALS: dict[tuple[str, str], Callable[..., Any] | type] = {
    ("collections", "OrderedDict"): _StateDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: Callable[[str, str], _Storage]) -> None:
        super().__init__(io.BytesIO(data))
        self._storages = storages

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        found = _GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        # ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        kind, key = pid[1], pid[2]
        if not isinstance(kind, _StorageType) or not isinstance(key, str):
            raise pickle.UnpicklingError(f"unknown storage {pid!r}")
        return self._storages(kind.name, key)


def read_torch_pt(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a `torch.save`d state dict, by name, in the file's order."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError as e:
        raise TorchPtInvalid(f"{path}: no such file") from e
    except (OSError, zipfile.BadZipFile) as e:
        raise TorchPtInvalid(
            f"{path}: not a zip checkpoint torch.save writes (a torch < 1.6 file, or damaged)"
        ) from e
    with archive:
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise TorchPtInvalid(f"{path}: no single <archive>/data.pkl in the zip")
        prefix = pkl[0][: -len("data.pkl")]
        order = prefix + "byteorder"
        byteorder = archive.read(order).decode() if order in names else "little"
        if byteorder not in ("little", "big"):
            raise TorchPtInvalid(f"{path}: byteorder {byteorder!r}")
        cache: dict[str, _Storage] = {}

        def storage(kind: str, key: str) -> _Storage:
            if key not in cache:
                entry = f"{prefix}data/{key}"
                if entry not in names:
                    raise pickle.UnpicklingError(f"storage {key} is not in the archive")
                dtype, bf16 = _STORAGE_DTYPES[kind]
                raw = archive.read(entry)
                if len(raw) % dtype.itemsize:
                    raise pickle.UnpicklingError(f"storage {key}: {len(raw)} bytes of {kind}")
                order_dtype = dtype.newbyteorder("<" if byteorder == "little" else ">")
                cache[key] = _Storage(np.frombuffer(raw, order_dtype).astype(dtype), bf16)
            return cache[key]

        try:
            obj = _Unpickler(archive.read(pkl[0]), storage).load()
        except (
            pickle.UnpicklingError,
            zipfile.BadZipFile,
            EOFError,
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            IndexError,
        ) as e:
            raise TorchPtInvalid(f"{path}: {e}") from e
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()
    ):
        raise TorchPtInvalid(f"{path}: not a state dict (a mapping of names to tensors)")
    return dict(obj)
