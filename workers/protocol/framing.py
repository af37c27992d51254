"""Sans-IO framing: ``u32 little-endian length`` then ``length`` payload bytes.

`FrameDecoder` never touches a socket. Adapters either hand it bytes (`receive_data`) or,
to avoid copying large tensors, ask it where to put the next bytes (`get_buffer`) and tell it
how many arrived (`buffer_updated`) — the shape of asyncio's BufferedProtocol and of
`socket.recv_into`. Small frames are cut out of a scratch buffer; a frame larger than the
scratch gets its own bytearray that the socket fills directly, so a 64 MiB tensor is written
to memory exactly once.

Rule: a length above `max_frame` is a protocol violation the moment the header is complete —
the decoder never allocates for it and stays failed (the connection must be closed).
"""

from __future__ import annotations

import struct

import numpy as np

from workers.protocol.errors import ProtocolError
from workers.protocol.messages import DEFAULT_MAX_FRAME

HEADER = struct.Struct("<I")
HEADER_SIZE = HEADER.size
MAX_U32 = 0xFFFF_FFFF


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()
"""Sentinel: `next_frame()` has nothing complete yet."""

_SCRATCH = 256 * 1024  # covers every control frame and small tensors in one recv


def frame_header(length: int) -> bytes:
    if not 0 <= length <= MAX_U32:
        raise ProtocolError(f"frame length {length} does not fit in u32")
    return HEADER.pack(length)


def encode_frame(payload: bytes | bytearray | memoryview) -> bytes:
    """Header + payload in one bytes object (for small control frames)."""
    return frame_header(len(payload)) + bytes(payload)


class FrameDecoder:
    """Turns a byte stream into frames. Frames come out as `bytes` or `bytearray`."""

    def __init__(
        self, max_frame: int = DEFAULT_MAX_FRAME, scratch: int = _SCRATCH, reuse_large: bool = False
    ) -> None:
        self.max_frame = max_frame
        # reuse_large: large frames come out as memoryviews of ONE reused buffer, valid only
        # until the next read. Right for a worker, which consumes each request before reading
        # the next; it saves faulting in fresh pages for every large tensor.
        self._reuse: np.ndarray | None = np.empty(0, np.uint8) if reuse_large else None
        self._buf = bytearray(scratch)
        self._start = 0  # first unconsumed byte in _buf
        self._end = 0  # one past the last received byte in _buf
        self._body: memoryview | None = None  # large frame being filled in place
        self._body_filled = 0
        self._frames: list[bytes | bytearray] = []
        self._failed: ProtocolError | None = None

    # ---- feeding ------------------------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """Writable memory for the next bytes from the peer (never empty)."""
        self._raise_if_failed()
        if self._body is not None:
            return memoryview(self._body)[self._body_filled :]
        if self._end == len(self._buf):
            self._compact()
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """`nbytes` were written at the start of the last `get_buffer()`."""
        if self._body is not None:
            self._body_filled += nbytes
            if self._body_filled == len(self._body):
                self._frames.append(self._body)
                self._body = None
            return
        self._end += nbytes
        self._cut_frames()

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Copying convenience for tests and adapters that already hold bytes."""
        view = memoryview(data).cast("B")
        while view:
            buf = self.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)

    # ---- reading ------------------------------------------------------------------------

    def next_frame(self) -> bytes | bytearray | _NeedData:
        """The next complete frame, or NEED_DATA. Raises the stored ProtocolError if failed."""
        if self._frames:
            return self._frames.pop(0)
        self._raise_if_failed()
        return NEED_DATA

    @property
    def in_frame(self) -> bool:
        """True while bytes of an unfinished frame are buffered (EOF now = truncated frame)."""
        return self._body is not None or self._end > self._start

    # ---- internals ----------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _large_buffer(self, length: int) -> memoryview:
        if self._reuse is None:
            # Uninitialised memory: bytearray(n) would memset n bytes the socket overwrites
            # anyway (94 ms for 64 MiB here); numpy's empty maps pages lazily instead.
            return np.empty(length, dtype=np.uint8).data
        if len(self._reuse) < length:
            self._reuse = np.empty(length, dtype=np.uint8)
        return self._reuse.data[:length]

    def _compact(self) -> None:
        pending = self._end - self._start
        if self._start:
            self._buf[:pending] = self._buf[self._start : self._end]
            self._start, self._end = 0, pending
        if pending == len(self._buf):  # a frame bigger than scratch is still being headed
            self._buf.extend(bytes(len(self._buf)))

    def _cut_frames(self) -> None:
        buf = self._buf
        while self._end - self._start >= HEADER_SIZE:
            (length,) = HEADER.unpack_from(buf, self._start)
            if length > self.max_frame:
                self._failed = ProtocolError(
                    f"frame of {length} bytes exceeds max_frame {self.max_frame}"
                )
                self._start = self._end = 0
                return
            begin = self._start + HEADER_SIZE
            available = self._end - begin
            if available >= length:
                self._frames.append(bytes(buf[begin : begin + length]))
                self._start = begin + length
                continue
            if length > len(buf) // 2:
                # Large frame: give it its own buffer and let the socket fill it directly.
                body = self._large_buffer(length)
                body[:available] = buf[begin : self._end]
                self._body, self._body_filled = body, available
                self._start = self._end = 0
                return
            break
        if self._start == self._end:
            self._start = self._end = 0
