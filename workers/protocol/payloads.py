"""Raw tensor payloads: little-endian i32 token ids and f32 results, one frame each.

The rule: a raw frame's length must equal exactly what its header implies; anything else is
a protocol violation (`ProtocolError`), never a silent truncation or a reshape. Views are
zero-copy (`np.frombuffer`) over the received frame; encoders return a memoryview over a
little-endian contiguous array, copying only when the caller's array is not already that.
"""

from __future__ import annotations

import numpy as np

from workers.protocol import messages as m
from workers.protocol.errors import ProtocolError

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


# Messages are matched by exact type: they are final structs, and isinstance() against a
# msgspec Struct class goes through its metaclass (several times slower, on every request).


def request_payload_tokens(req: object) -> int | None:
    """Number of i32 ids the raw frame after `req` carries; None if no raw frame follows."""
    if type(req) is m.EMBED_BATCH or type(req) is m.ENCODE:
        return sum(item.n_tokens for item in req.items)
    if type(req) is m.RERANK:
        return req.query_n_tokens + sum(c.n_tokens for c in req.candidates)
    if type(req) is m.RERANK_SEQUENCES or type(req) is m.CLASSIFY:
        return sum(s.n_tokens for s in req.sequences)
    if type(req) is m.GENERATE:
        # GENERATE's header does not state the prompt length; its raw frame is "the prompt
        # ids", so any whole number of i32 is valid. -1 marks "length from the frame".
        return -1
    return None


def reply_payload_floats(reply: object, req: object) -> int | None:
    """Number of f32 values the raw frame after `reply` must carry; None if none follows."""
    if type(reply) is m.VECTORS:
        return reply.n * reply.dims
    if type(reply) is m.SCORES:
        if type(req) is m.RERANK:
            return len(req.candidates)
        if type(req) is m.RERANK_SEQUENCES:
            return len(req.sequences)
        raise ProtocolError(f"SCORES in reply to {m.message_name(req)}")
    if type(reply) is m.LABEL_SCORES:
        return reply.n * reply.n_labels
    if type(reply) is m.ENCODED:
        return sum(section_words(s, reply.n) for s in reply.sections)
    return None


def section_words(section: m.OutputSection, n: int) -> int:
    """4-byte words `section` takes in ENCODED's frame (i32 and f32 are both 4 bytes)."""
    if section.kind == "dense":
        return n * section.dims
    if section.kind == "sparse":
        return 2 * sum(section.counts)
    return sum(section.counts) * section.dims


def encoded_sections(
    reply: m.ENCODED, frame: bytes | bytearray | memoryview
) -> list[np.ndarray | tuple[np.ndarray, np.ndarray]]:
    """Zero-copy views of each section of an ENCODED frame (its length already checked):
    dense (n, dims), tokens / multivector (sum(counts), dims), sparse (indices, values)."""
    out: list[np.ndarray | tuple[np.ndarray, np.ndarray]] = []
    offset = 0
    for s in reply.sections:
        words = section_words(s, reply.n)
        chunk = memoryview(frame)[offset * 4 : (offset + words) * 4]
        offset += words
        if s.kind == "sparse":
            k = sum(s.counts)
            out.append((np.frombuffer(chunk[: k * 4], I32), np.frombuffer(chunk[k * 4 :], F32)))
        else:
            out.append(np.frombuffer(chunk, F32).reshape(-1, s.dims))
    return out


def check_raw_length(frame_len: int, count: int, itemsize: int, what: str) -> None:
    """`count == -1` accepts any whole number of items."""
    if count == -1:
        if frame_len % itemsize:
            raise ProtocolError(f"{what}: {frame_len} bytes is not a multiple of {itemsize}")
        return
    if frame_len != count * itemsize:
        raise ProtocolError(
            f"{what}: raw frame of {frame_len} bytes, header implies {count * itemsize}"
        )


def ids_view(frame: bytes | bytearray | memoryview) -> np.ndarray:
    """Zero-copy int32 view of a received ids frame (read-only if the frame is bytes)."""
    return np.frombuffer(frame, dtype=I32)


def floats_view(frame: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(frame, dtype=F32).reshape(shape)


def as_wire(array: np.ndarray, dtype: np.dtype) -> memoryview:
    """Little-endian contiguous bytes of `array` as `dtype` (copies only if it must)."""
    arr = np.ascontiguousarray(array, dtype=dtype)
    return arr.data.cast("B")


def ids_to_wire(ids: np.ndarray | list[int]) -> memoryview:
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got {arr.dtype}")
    return as_wire(arr.reshape(-1), I32)


def floats_to_wire(values: np.ndarray) -> memoryview:
    return as_wire(values, F32)
