"""Blocking-socket adapter over the sans-IO framing (what a worker process uses)."""

from __future__ import annotations

import socket

from workers.protocol import messages as m
from workers.protocol.framing import NEED_DATA, FrameDecoder, frame_header


class BlockingChannel:
    """Frames over one connected stream socket. `recv_frame` raises EOFError on a clean EOF
    and ProtocolError on a violation; `send` writes a control frame and its raw frame."""

    def __init__(self, sock: socket.socket, max_frame: int = m.DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.decoder = FrameDecoder(max_frame, reuse_large=True)  # one request at a time

    def set_max_frame(self, max_frame: int) -> None:
        self.decoder.max_frame = max_frame

    def send(self, msg: m.WorkerToHost, raw: memoryview | bytes | None = None) -> None:
        body = m.encode(msg)
        head = frame_header(len(body)) + body
        if raw is None:
            self.sock.sendall(head)
            return
        # The header and the raw frame's length go out together; the (possibly huge) raw
        # payload is sent from the caller's buffer without another copy.
        self.sock.sendall(head + frame_header(len(raw)))
        self.sock.sendall(raw)

    def send_bytes(self, data: bytes) -> None:
        """Unframed bytes, for fault injection only."""
        self.sock.sendall(data)

    def recv_frame(self) -> bytes | bytearray:
        decoder = self.decoder
        while True:
            frame = decoder.next_frame()
            if frame is not NEED_DATA:
                return frame  # type: ignore[return-value]
            n = self.sock.recv_into(decoder.get_buffer())
            if n == 0:
                raise EOFError("peer closed the connection")
            decoder.buffer_updated(n)
