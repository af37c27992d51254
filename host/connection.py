"""The host's end of one worker connection on asyncio: a reader task and request exchange.

A BufferedProtocol owns the socket's receive side for the connection's whole life: the event
loop reads straight into the frame decoder's buffers (so a large tensor is written once),
every frame is validated by `HostSession`, and only VALID events are queued. An exchange
waits on that queue with the watchdog window as its timeout, so the window is renewed only by
progress that already passed validation.

Faults are reported as `ConnectionFault(kind, reason)`; the lane kills the worker and turns
them into typed errors with the worker's log tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
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
_THREAD_SEND_BYTES = 4 << 20  # above what the widened socket buffer takes at once
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
    """Open with `await WorkerConnection.open(sock, session)`."""

    def __init__(self, sock: socket.socket, session: HostSession) -> None:
        self.sock = sock
        self.session = session
        self.decoder = FrameDecoder(session.max_frame)
        self.ended: _Ended | None = None  # set once the stream is unusable
        self._events: deque[object] = deque()
        self._waiter: asyncio.Future | None = None
        self._transport: asyncio.BaseTransport | None = None
        # Sends go through a dup of the socket: the read side belongs to the transport (whose
        # reader stays registered, no per-read setup), while sock_sendall sends large payloads
        # straight from the caller's buffer — asyncio's transport.write would copy them.
        self._wsock = sock.dup()
        self._wsock.setblocking(False)
        # Large payloads are sent from a thread by a socket in timeout mode, whose sendall
        # waits for room in C (poll) with the GIL released: no event-loop round per chunk.
        self._tsock = sock.dup()
        self._tsock.settimeout(3600.0)

    @classmethod
    async def open(cls, sock: socket.socket, session: HostSession) -> WorkerConnection:
        _widen_buffers(sock)
        conn = cls(sock, session)
        loop = asyncio.get_running_loop()
        conn._transport, _ = await loop.connect_accepted_socket(lambda: _Reader(conn), sock)
        return conn

    # ---- receive side (called by _Reader) -------------------------------------------------

    def _on_bytes(self, nbytes: int) -> None:
        decoder, session = self.decoder, self.session
        try:
            decoder.buffer_updated(nbytes)
            while (frame := decoder.next_frame()) is not NEED_DATA:
                event = session.receive_frame(frame)  # type: ignore[arg-type]
                if event is not None:
                    self._deliver(event)
        except ProtocolError as exc:
            self._end(VIOLATION, exc.reason)
            if self._transport is not None:
                self._transport.pause_reading()  # nothing after a violation is trusted

    def _end(self, kind: str, reason: str) -> None:
        if self.ended is None:
            self.ended = _Ended(kind, reason)
            self._deliver(self.ended)

    def _deliver(self, event: object) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _next_event(self, timeout: float) -> object:
        if not self._events:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._events:
                raise ConnectionFault(SILENCE, f"no valid progress for {timeout:g} s")
        event = self._events.popleft()
        if isinstance(event, _Ended):
            self._events.appendleft(event)  # stays the answer for anyone who asks again
            raise ConnectionFault(event.kind, event.reason)
        return event

    # ---- send side ------------------------------------------------------------------------

    async def _send_bytes(self, data: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self._wsock, data)
        except (ConnectionError, OSError) as exc:
            self._end(EOF, f"send failed: {exc}")
            raise ConnectionFault(EOF, f"send failed: {exc}") from None

    async def _send(self, msg: object, raw: memoryview | bytes | None) -> None:
        loop = asyncio.get_running_loop()
        body = m.encode(msg)
        head = frame_header(len(body)) + body
        try:
            if raw is None:
                await loop.sock_sendall(self._wsock, head)
            else:
                await loop.sock_sendall(self._wsock, head + frame_header(len(raw)))
                if len(raw) >= _THREAD_SEND_BYTES:
                    await asyncio.to_thread(self._tsock.sendall, raw)
                else:
                    await loop.sock_sendall(self._wsock, raw)
        except (ConnectionError, OSError) as exc:
            self._end(EOF, f"send failed: {exc}")
            raise ConnectionFault(EOF, f"send failed: {exc}") from None

    def _send_now(self, msg: object) -> bytes:
        """One non-blocking send of a control frame; returns what is left to send (usually
        nothing: a small frame fits the socket buffer, so no await and no timer)."""
        body = m.encode(msg)
        frame = frame_header(len(body)) + body
        try:
            sent = self._wsock.send(frame)
        except BlockingIOError:
            sent = 0
        except (ConnectionError, OSError) as exc:
            self._end(EOF, f"send failed: {exc}")
            raise ConnectionFault(EOF, f"send failed: {exc}") from None
        return frame[sent:]

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
        rest = self._send_now(req) if raw is None else None
        if rest != b"":
            try:
                # A stopped worker can stall a large send, so the first window covers it too.
                async with asyncio.timeout(window_for(None)):
                    if rest is None:
                        await self._send(req, raw)
                    else:
                        await self._send_bytes(rest)
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
        if self._transport is not None:
            self._transport.close()
        else:
            self.sock.close()
        self._wsock.close()
        self._tsock.close()
        self._end(EOF, "connection closed by host")


class _Reader(asyncio.BufferedProtocol):
    """Bytes go straight from the socket into the decoder's buffers."""

    def __init__(self, conn: WorkerConnection) -> None:
        self.conn = conn

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.conn._on_bytes(nbytes)

    def eof_received(self) -> bool:
        why = "mid-frame" if self.conn.decoder.in_frame else "between frames"
        self.conn._end(EOF, f"worker closed the connection ({why})")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._end(EOF, f"connection lost: {exc}" if exc else "connection lost")


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _widen_buffers(sock: socket.socket) -> None:
    # Bigger kernel buffers mean fewer wake-ups per large tensor (the kernel caps the value).
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 2**20)
