"""A fast, bounds-checked GGUF header scanner (metadata + tensor infos, no tensor data).

Why not `gguf.GGUFReader`: it materialises every array field element by element. Measured
with gguf 0.19.0 on a 2-core x86_64 machine: 18.7 s to open Gemma 3 270M (262k-token
vocabulary) against 0.20 s here, and 1.46 s against 0.03 s for MiniLM. The worker reads the
header on every LOAD, so that difference is load latency. This scanner skips arrays it is not
asked for.
Why scan at all: so a truncated or corrupt file, or an architecture we refuse, is answered
with a typed error before llama.cpp is handed the file.

One copy serves both sides (`formats` imports no project package): the host's ingest and
tokenizer derivation, and the llama.cpp worker's LOAD.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# The one key of ours in a GGUF: a decoder sequence classifier's pad token id (-1: none),
# written by our converter, read by the worker (workers/llama/llm_head.py says why).
SEQ_CLS_PAD_KEY = "synapse.sequence_classifier.pad_token_id"
# GGUF value types -> struct format (strings=8, arrays=9 handled apart).
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 32
_ALIGN_KEY = "general.alignment"


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF."""


@dataclass
class ArrayInfo:
    """An array field that was skipped: its element type and length."""

    type: int
    length: int


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    type: int
    offset: int  # relative to the data section
    nbytes: int


@dataclass
class GGUFHeader:
    version: int
    kv: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0

    @property
    def architecture(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.kv.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise GGUFFormatError(f"truncated header at byte {self.pos} (need {n} more)")
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"invalid UTF-8 string at byte {self.pos}") from e

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.take(n)


def _value(cur: _Cursor, vtype: int, key: str, want_arrays: set[str]) -> Any:
    if vtype in _SCALAR:
        return cur.unpack(_SCALAR[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype != _ARRAY:
        raise GGUFFormatError(f"{key}: unknown value type {vtype}")
    etype, n = cur.unpack("<I"), cur.unpack("<Q")
    if n > _MAX_COUNT:
        raise GGUFFormatError(f"{key}: array length {n} is absurd")
    if key in want_arrays:
        return [_value(cur, etype, key, set()) for _ in range(n)]
    if etype in _SCALAR:
        cur.take(n * struct.calcsize(_SCALAR[etype]))
    elif etype == _STRING:
        for _ in range(n):
            cur.skip_string()
    else:
        raise GGUFFormatError(f"{key}: unsupported array element type {etype}")
    return ArrayInfo(etype, n)


def _nbytes(shape: tuple[int, ...], ttype: int, name: str) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError) as e:
        raise GGUFFormatError(f"tensor {name!r}: unknown ggml type {ttype}") from e
    if not shape or shape[0] % block:
        raise GGUFFormatError(f"tensor {name!r}: shape {shape} does not fit block size {block}")
    return math.prod(shape) // block * size


def read_gguf_header(path: str | Path, want_arrays: frozenset[str] = frozenset()) -> GGUFHeader:
    """Parse the header and check that every tensor's data lies inside the file.

    Arrays are skipped (returned as ArrayInfo) unless their key is in `want_arrays`.
    Raises GGUFFormatError for malformed files and OSError for unreadable ones.
    """
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFFormatError("file too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm)
            if cur.take(4) != _MAGIC:
                raise GGUFFormatError("bad magic (not a GGUF file)")
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise GGUFFormatError(f"unsupported GGUF version {version}")
            n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
            if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
                raise GGUFFormatError("absurd tensor/kv counts")
            hdr = GGUFHeader(version=version)
            for _ in range(n_kv):
                key = cur.string()
                hdr.kv[key] = _value(cur, cur.unpack("<I"), key, set(want_arrays))
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.unpack("<I")
                if not 1 <= n_dims <= 4:
                    raise GGUFFormatError(f"tensor {name!r}: {n_dims} dims")
                shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
                ttype, offset = cur.unpack("<I"), cur.unpack("<Q")
                hdr.tensors.append(
                    TensorInfo(name, shape, ttype, offset, _nbytes(shape, ttype, name))
                )
            align = hdr.kv.get(_ALIGN_KEY, 32)
            if not isinstance(align, int) or align <= 0 or align & (align - 1):
                raise GGUFFormatError(f"bad alignment {align!r}")
            hdr.data_offset = -(-cur.pos // align) * align
    for t in hdr.tensors:
        if t.offset % align or hdr.data_offset + t.offset + t.nbytes > size:
            raise GGUFFormatError(f"tensor {t.name!r} data is outside the file (truncated?)")
    return hdr
