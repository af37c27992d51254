"""The host's end of one worker connection on asyncio: a reader task and request exchange.

The reader task owns the socket's receive side for the connection's whole life: it reads
straight into the frame decoder's buffers (`sock_recv_into`, so large tensors are written
once), validates every frame with `HostSession` and queues only VALID events. An exchange
waits on that queue with the watchdog window as its timeout, so the window is renewed only by
progress that already passed validation.

Faults are reported as `ConnectionFault(kind, reason)`; the lane kills the worker and turns
them into typed errors with the worker's log tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass

from workers.protocol import messages as m
from workers.protocol.errors import ProtocolError
from workers.protocol.framing import NEED_DATA, FrameDecoder, frame_header
from workers.protocol.session import (
    HelloReceived,
    HostSession,
    ProgressReceived,
    ReplyReceived,
)

EOF = "eof"
VIOLATION = "violation"
SILENCE = "silence"


class ConnectionFault(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind  # EOF | VIOLATION | SILENCE
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Ended:
    kind: str
    reason: str


WindowFor = Callable[[str | None], float]
"""Silence window (seconds) given the request's current phase (None before any PROGRESS)."""


class WorkerConnection:
    def __init__(self, sock: socket.socket, session: HostSession) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.session = session
        self.decoder = FrameDecoder(session.max_frame)
        self._events: asyncio.Queue[object] = asyncio.Queue()
        self.ended: _Ended | None = None  # set once the stream is unusable
        self._reader = asyncio.create_task(self._read_loop())

    # ---- receive side ---------------------------------------------------------------------

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        decoder, session, sock = self.decoder, self.session, self.sock
        try:
            while True:
                n = await loop.sock_recv_into(sock, decoder.get_buffer())
                if n == 0:
                    why = "mid-frame" if decoder.in_frame else "between frames"
                    return self._end(EOF, f"worker closed the connection ({why})")
                decoder.buffer_updated(n)
                while (frame := decoder.next_frame()) is not NEED_DATA:
                    event = session.receive_frame(frame)  # type: ignore[arg-type]
                    if event is not None:
                        self._events.put_nowait(event)
        except ProtocolError as exc:
            self._end(VIOLATION, exc.reason)
        except (ConnectionError, OSError) as exc:
            self._end(EOF, f"connection error: {exc}")
        except asyncio.CancelledError:
            self._end(EOF, "connection closed by host")
            raise

    def _end(self, kind: str, reason: str) -> None:
        if self.ended is None:
            self.ended = _Ended(kind, reason)
            self._events.put_nowait(self.ended)

    async def _next_event(self, timeout: float) -> object:
        try:
            event = await asyncio.wait_for(self._events.get(), timeout)
        except TimeoutError:
            raise ConnectionFault(SILENCE, f"no valid progress for {timeout:g} s") from None
        if isinstance(event, _Ended):
            raise ConnectionFault(event.kind, event.reason)
        return event

    # ---- send side ------------------------------------------------------------------------

    async def _send(self, msg: object, raw: memoryview | bytes | None) -> None:
        loop = asyncio.get_running_loop()
        body = m.encode(msg)
        head = frame_header(len(body)) + body
        try:
            if raw is None:
                await loop.sock_sendall(self.sock, head)
            else:
                await loop.sock_sendall(self.sock, head + frame_header(len(raw)))
                await loop.sock_sendall(self.sock, raw)
        except (ConnectionError, OSError) as exc:
            self._end(EOF, f"send failed: {exc}")
            raise ConnectionFault(EOF, f"send failed: {exc}") from None

    # ---- protocol -------------------------------------------------------------------------

    async def handshake(self, timeout: float) -> m.HELLO:
        """Wait for a valid HELLO, answer HELLO_ACK. Anything else faults."""
        event = await self._next_event(timeout)
        if not isinstance(event, HelloReceived):  # the session only yields HELLO first
            raise ConnectionFault(VIOLATION, f"unexpected {event!r} before HELLO_ACK")
        ack = self.session.accept_hello()
        self.decoder.max_frame = self.session.max_frame
        await self._send(ack, None)
        return event.hello

    async def exchange(
        self, req: object, raw: memoryview | bytes | None, window_for: WindowFor
    ) -> ReplyReceived:
        """Send `req` (+ raw frame) and wait for its terminal reply under the watchdog."""
        if self.ended is not None:
            raise ConnectionFault(self.ended.kind, self.ended.reason)
        tracker = self.session.start_request(req, None if raw is None else len(raw))
        try:
            # A stopped worker can stall a large send, so the first window covers it too.
            await asyncio.wait_for(self._send(req, raw), window_for(None))
        except TimeoutError:
            raise ConnectionFault(SILENCE, "worker did not take the request") from None
        while True:
            event = await self._next_event(window_for(tracker.phase))
            if isinstance(event, ProgressReceived):
                continue
            assert isinstance(event, ReplyReceived)
            return event

    async def send_shutdown(self) -> None:
        self.session.send_shutdown()
        await self._send(m.SHUTDOWN(), None)

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        self.sock.close()
