"""Reading a small `torch.save`d state dict (FlagEmbedding's `sparse_linear.pt`,
`colbert_linear.pt`) without torch, and without running the pickle's code.

`torch.save` (since torch 1.6) writes a zip: `<name>/data.pkl` (a pickle of the dict whose
tensors are persistent ids naming raw storages) and `<name>/data/<key>` (each storage's bytes,
in the order `<name>/byteorder` says; little when absent). The pickle is read with an
unpickler that resolves only the globals torch writes for a dict of dense tensors
(`collections.OrderedDict`, `torch._utils._rebuild_tensor_v2`, the typed storage classes) and
refuses any other, so a file that would call anything else is refused, not run. Tensors come
back as float32 numpy arrays (f16 and bf16 widened, exactly).
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np

from common.errors import ArtifactInvalid

# torch's legacy storage classes (what torch 2 still pickles for a tensor's storage type).
_STORAGES: dict[str, np.dtype] = {
    "FloatStorage": np.dtype("<f4"),
    "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype("<u2"),  # widened to f32 below
    "DoubleStorage": np.dtype("<f8"),
}


class TorchStateInvalid(ArtifactInvalid):
    """A `.pt` file is not a zip `torch.save` of a dict of dense float tensors, or names a
    global that such a file never does."""


class _StorageType:
    def __init__(self, name: str) -> None:
        self.name = name


class _Storage:
    def __init__(self, kind: _StorageType, data: np.ndarray) -> None:
        self.kind, self.data = kind, data


def _rebuild_tensor_v2(
    storage: _Storage,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    _requires_grad: bool = False,
    _hooks: object = None,
    _metadata: object = None,
) -> np.ndarray:
    flat = storage.data
    count = int(np.prod(size)) if size else 1
    if len(size) != len(stride) or any(s < 0 for s in (*size, *stride)):
        raise TorchStateInvalid(f"a tensor of size {size} and stride {stride}")
    reach = offset + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
    if count and (offset < 0 or reach >= flat.size):
        raise TorchStateInvalid("a tensor reaches past its storage")
    itemsize = flat.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        flat[offset:], shape=tuple(size), strides=tuple(st * itemsize for st in stride)
    )
    arr = np.array(view)  # a contiguous copy: the strided view shares the zip's buffer
    if storage.kind.name == "BFloat16Storage":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: dict[str, bytes], path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._storages, self._path = storages, path

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        raise TorchStateInvalid(f"{self._path}: refers to {module}.{name}, not read")

    def persistent_load(self, pid: object) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise TorchStateInvalid(f"{self._path}: unexpected persistent id {pid!r}")
        kind, key, _location, numel = pid[1], pid[2], pid[3], pid[4]
        if not isinstance(kind, _StorageType) or not isinstance(numel, int):
            raise TorchStateInvalid(f"{self._path}: malformed storage reference")
        raw = self._storages.get(str(key))
        dtype = _STORAGES[kind.name]
        if raw is None or len(raw) != numel * dtype.itemsize:
            raise TorchStateInvalid(f"{self._path}: storage {key!r} is missing or truncated")
        return _Storage(kind, np.frombuffer(raw, dtype))


def read_torch_state(path: Path) -> dict[str, np.ndarray]:
    """The file's tensors by name (float32), in the dict's order."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise TorchStateInvalid(f"{path}: not a torch.save zip (no single data.pkl)")
            root = pkl[0][: -len("data.pkl")]
            order = z.read(root + "byteorder").decode() if root + "byteorder" in names else "little"
            if order.strip() != "little":
                raise TorchStateInvalid(f"{path}: byte order {order!r}, only little is read")
            prefix = root + "data/"
            storages = {n[len(prefix) :]: z.read(n) for n in names if n.startswith(prefix)}
            data = z.read(pkl[0])
    except (OSError, zipfile.BadZipFile, KeyError, UnicodeDecodeError) as e:
        raise TorchStateInvalid(f"{path}: not a readable torch.save zip: {e}") from e
    try:
        obj = _Unpickler(data, storages, path).load()
    except TorchStateInvalid:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError) as e:
        raise TorchStateInvalid(f"{path}: unreadable pickle: {e!r}") from e
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()
    ):
        raise TorchStateInvalid(f"{path}: not a dict of tensors")
    return dict(obj)
