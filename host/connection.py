"""The host's end of one worker connection on asyncio: a reader task and request exchange.

A BufferedProtocol owns the socket's receive side for the connection's whole life: the event
loop reads straight into the frame decoder's buffers (so a large tensor is written once),
every frame is validated by `HostSession`, and only VALID events are queued. An exchange
waits on that queue with the watchdog window as its timeout, so the window is renewed only by
progress that already passed validation.

An `Exchange` keeps its progress (bytes still to send, when the watchdog was last renewed) in
itself rather than in a coroutine frame, so `wait()` can be interrupted — the caller cancelled
— and resumed by another task that drains the reply, with the same watchdog deadline. That
lets the lane run the common request in the caller's own task (no task, no shield).

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
from typing import cast

from workers.protocol import messages as m
from workers.protocol.errors import ProtocolError
from workers.protocol.framing import NEED_DATA, FrameDecoder, frame_header
from workers.protocol.session import (
    HelloReceived,
    HostSession,
    ProgressReceived,
    ReplyReceived,
    RequestTracker,
)

EOF = "eof"
THREAD_SEND_BYTES = 4 << 20  # above what the widened socket buffer takes at once
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
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
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
        return await self._next_event_by(self._loop.time() + timeout, timeout)

    async def _next_event_by(self, expiry: float, window: float) -> object:
        """The next valid event, or a SILENCE fault at loop time `expiry`."""
        if not self._events:
            if self._waiter is None:
                self._arm(expiry)
            try:
                await self._waiter  # type: ignore[misc]
            finally:
                self._disarm()
            if not self._events:
                raise ConnectionFault(SILENCE, f"no valid progress for {window:g} s")
        elif self._waiter is not None:
            self._disarm()
        event = self._events.popleft()
        if isinstance(event, _Ended):
            self._events.appendleft(event)  # stays the answer for anyone who asks again
            raise ConnectionFault(event.kind, event.reason)
        return event

    def _arm(self, expiry: float) -> None:
        """Create the waiter the next event resolves, with its watchdog timer."""
        waiter = self._waiter = self._loop.create_future()
        self._timer = self._loop.call_at(expiry, _expire, waiter)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiter = None

    # ---- send side ------------------------------------------------------------------------

    async def _send_bytes(self, data: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self._wsock, data)
        except (ConnectionError, OSError) as exc:
            self._end(EOF, f"send failed: {exc}")
            raise ConnectionFault(EOF, f"send failed: {exc}") from None

    async def _send(self, msg: m.HostToWorker) -> None:
        """A control frame outside any exchange (HELLO_ACK, SHUTDOWN)."""
        body = m.encode(msg)
        await self._send_bytes(frame_header(len(body)) + body)

    # ---- protocol -------------------------------------------------------------------------

    async def handshake(self, timeout: float) -> m.HELLO:
        """Wait for a valid HELLO, answer HELLO_ACK. Anything else faults."""
        event = await self._next_event(timeout)
        if not isinstance(event, HelloReceived):  # the session only yields HELLO first
            raise ConnectionFault(VIOLATION, f"unexpected {event!r} before HELLO_ACK")
        if self.ended is not None:  # e.g. a second frame right behind HELLO: a fault, typed
            raise ConnectionFault(self.ended.kind, self.ended.reason)
        try:
            ack = self.session.accept_hello()
        except ProtocolError as exc:
            raise ConnectionFault(VIOLATION, exc.reason) from None
        self.decoder.max_frame = self.session.max_frame
        await self._send(ack)
        return event.hello

    def start_exchange(
        self, req: m.Request, raw: memoryview | bytes | None, window_for: WindowFor
    ) -> Exchange:
        """Record `req` as in flight and send what the socket takes now (usually all of it:
        no await, no timer). Raises ProtocolError if the request breaks the contract (then
        nothing was sent) or ConnectionFault if the connection is gone."""
        if self.ended is not None:
            raise ConnectionFault(self.ended.kind, self.ended.reason)
        # Every frame is built and measured before the session records the request: a frame
        # the worker would refuse (over the agreed max_frame, or over u32) fails this request
        # alone, with nothing sent and the session still idle.
        body = m.encode(req)
        head = frame_header(len(body)) + body
        if len(body) > self.session.max_frame:
            raise ProtocolError(
                f"control frame of {len(body)} bytes exceeds max_frame {self.session.max_frame}"
            )
        if raw is None:
            parts = [head]
        else:
            parts = [head + frame_header(len(raw)), raw]
        self.session.start_request(req, None if raw is None else len(raw))
        ex = Exchange(self, window_for, parts)
        if raw is None or len(raw) < THREAD_SEND_BYTES:
            # Armed BEFORE the send: the reply can come back within microseconds, and on a
            # busy machine the worker may share our core, so nothing should sit between the
            # send and this task's return to the event loop.
            if not self._events:
                self._arm(ex.renewed + window_for(None))
            ex.send_some()
        return ex

    async def exchange(
        self, req: m.Request, raw: memoryview | bytes | None, window_for: WindowFor
    ) -> ReplyReceived:
        """Send `req` (+ raw frame) and wait for its terminal reply under the watchdog."""
        return await self.start_exchange(req, raw, window_for).wait()

    async def _writable(self, expiry: float) -> None:
        """Wait until the send socket has room; SILENCE at `expiry` (a stopped worker)."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self._wsock.fileno()
        loop.add_writer(fd, _expire, ready)
        timer = loop.call_at(expiry, _fail_with, ready, _NOT_TAKEN)
        try:
            await ready
        except _NotTaken:
            raise ConnectionFault(SILENCE, "worker did not take the request") from None
        finally:
            timer.cancel()
            loop.remove_writer(fd)

    async def send_shutdown(self) -> None:
        self.session.send_shutdown()
        await self._send(m.SHUTDOWN())

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        else:
            self.sock.close()
        self._wsock.close()
        self._tsock.close()
        self._end(EOF, "connection closed by host")


class _NotTaken(Exception):
    pass


_NOT_TAKEN = _NotTaken()


class Exchange:
    """One request on the wire until its reply. Resumable: see the module docstring."""

    __slots__ = ("conn", "tracker", "window_for", "out", "renewed", "_large")

    def __init__(self, conn: WorkerConnection, window_for: WindowFor, parts: list) -> None:
        self.conn = conn
        self.tracker = cast(RequestTracker, conn.session.current)  # start_request just set it
        self.window_for = window_for
        # Bytes not yet sent, in order (an empty raw frame has nothing to send).
        self.out = [p for p in parts if len(p)]
        self.renewed = conn._loop.time()  # the watchdog's last renewal
        self._large = len(self.out) == 2 and len(self.out[1]) >= THREAD_SEND_BYTES

    def send_some(self) -> None:
        """One non-blocking send of what is left."""
        try:
            sent = self.conn._wsock.sendmsg(self.out)
        except BlockingIOError:
            return
        except (ConnectionError, OSError) as exc:
            self.conn._end(EOF, f"send failed: {exc}")
            raise ConnectionFault(EOF, f"send failed: {exc}") from None
        while sent:
            head = self.out[0]
            if sent < len(head):
                self.out[0] = memoryview(head).cast("B")[sent:]
                return
            sent -= len(head)
            self.out.pop(0)

    async def wait(self) -> ReplyReceived:
        """Finish sending, then wait for the terminal reply; PROGRESS that passed validation
        renews the watchdog, nothing else does."""
        conn = self.conn
        loop = conn._loop
        if self.out:
            # A stopped worker can stall a send, so the first window covers it too.
            expiry = self.renewed + self.window_for(None)
            if self._large:
                self._large = False
                head, raw = self.out
                self.out = []
                try:
                    async with asyncio.timeout_at(expiry):
                        await conn._send_bytes(head)
                        await asyncio.to_thread(conn._tsock.sendall, raw)
                except TimeoutError:
                    raise ConnectionFault(SILENCE, "worker did not take the request") from None
                except (ConnectionError, OSError) as exc:
                    conn._end(EOF, f"send failed: {exc}")
                    raise ConnectionFault(EOF, f"send failed: {exc}") from None
            while self.out:
                await conn._writable(expiry)
                self.send_some()
            self.renewed = loop.time()
        while True:
            window = self.window_for(self.tracker.phase)
            event = await conn._next_event_by(self.renewed + window, window)
            self.renewed = loop.time()
            if isinstance(event, ProgressReceived):
                continue
            assert isinstance(event, ReplyReceived)
            return event


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


def _fail_with(waiter: asyncio.Future, exc: BaseException) -> None:
    if not waiter.done():
        waiter.set_exception(exc)


def _widen_buffers(sock: socket.socket) -> None:
    # Bigger kernel buffers mean fewer wake-ups per large tensor (the kernel caps the value).
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 2**20)
