"""Connection state for both ends of protocol v3, as pure objects (h11 style).

Every rule about WHICH frame may come WHEN lives in this file:

Host side (`HostSession`), the frames it may receive:

    state        frame received               -> next state
    AWAIT_HELLO  HELLO (v == 3, nonce ok)     -> HELLO_RECEIVED   (host answers HELLO_ACK)
    IDLE         (nothing: unsolicited frame = violation)
    REQUEST      PROGRESS (valid)             -> REQUEST
    REQUEST      reply / ERR                  -> IDLE, or AWAIT_RAW if a raw frame follows
                 (VECTORS n and LABEL_SCORES n must equal the request's item count,
                 LABEL_SCORES n_labels >= 1; ENCODED: see `_check_encoded`)
    AWAIT_RAW    raw frame of exact length    -> IDLE
    anything else                             -> FAILED (ProtocolError; close + kill)

PROGRESS is valid only if: its req_id is the request's, its phase is allowed for the request
kind (inference requests: setup -> inference; LOAD/ADMIT_SHAPE/EVICT/UNLOAD/PING:
setup -> control), phases never go backwards, and `completed` strictly increases. The
caller renews its watchdog only for events this class returned — i.e. after validation.

Worker side (`WorkerSession`): AWAIT_ACK -> (HELLO_ACK v == 3, accept) -> IDLE; IDLE ->
request header -> AWAIT_RAW when ids follow -> IDLE with a complete `Request` event.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import cast

import msgspec

from workers.protocol import messages as m
from workers.protocol import payloads
from workers.protocol.errors import ProtocolError

# Phase order per request kind; a PROGRESS phase must be in the list and never move left.
_INFERENCE_PHASES = ("setup", "inference")
_CONTROL_PHASES = ("setup", "control")


def phases_for(req: object) -> tuple[str, ...]:
    return _INFERENCE_PHASES if type(req) in m.INFERENCE_REQUESTS else _CONTROL_PHASES


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    HELLO_RECEIVED = "hello_received"
    AWAIT_ACK = "await_ack"
    IDLE = "idle"
    REQUEST = "request"
    AWAIT_RAW = "await_raw"
    CLOSED = "closed"
    FAILED = "failed"


# ---- events ---------------------------------------------------------------------------------
# Plain slotted dataclasses, not frozen ones: one is built per frame on the request path, and a
# frozen dataclass's __init__ (object.__setattr__ per field) costs twice as much. Treat them
# as immutable all the same.


@dataclass(slots=True)
class HelloReceived:
    hello: m.HELLO


@dataclass(slots=True)
class ProgressReceived:
    progress: m.PROGRESS


@dataclass(slots=True)
class ReplyReceived:
    reply: object  # a reply struct or m.ERR
    raw: bytes | bytearray | None = None


@dataclass(slots=True)
class RequestReceived:
    request: object
    raw: bytes | bytearray | None = None


@dataclass(slots=True)
class ShutdownReceived:
    pass


@dataclass(slots=True)
class RequestTracker:
    """What the host knows about the request in flight."""

    request: object
    phases: tuple[str, ...]
    phase_index: int = -1  # -1: no PROGRESS seen yet
    completed: int = -1

    @property
    def phase(self) -> str | None:
        return None if self.phase_index < 0 else self.phases[self.phase_index]

    def check_progress(self, p: m.PROGRESS) -> None:
        req_id = self.request.req_id  # type: ignore[attr-defined]
        if p.req_id != req_id:
            raise ProtocolError(f"PROGRESS for req_id {p.req_id} while {req_id} is in flight")
        if p.phase not in self.phases:
            raise ProtocolError(
                f"PROGRESS phase {p.phase!r} not allowed for {m.message_name(self.request)}"
            )
        index = self.phases.index(p.phase)
        if index < self.phase_index:
            raise ProtocolError(f"PROGRESS phase went backwards: {self.phase} -> {p.phase}")
        if p.completed <= self.completed:
            raise ProtocolError(
                f"PROGRESS completed must strictly increase: {self.completed} -> {p.completed}"
            )
        self.phase_index, self.completed = index, p.completed


class _Base:
    def __init__(self) -> None:
        self.state = State.CLOSED

    def _expect(self, *states: State) -> None:
        if self.state not in states:
            raise ProtocolError(f"not allowed in state {self.state.value}")

    def receive_frame(self, frame: bytes | bytearray | memoryview) -> object:
        """Validate one frame; return the event it completes, or None (a header awaiting its
        raw frame). Any violation leaves the session FAILED: nothing after it is trusted."""
        try:
            return self._receive(frame)
        except ProtocolError:
            self.state = State.FAILED
            raise

    def _receive(self, frame: bytes | bytearray | memoryview) -> object:
        raise NotImplementedError


class HostSession(_Base):
    """Host end: validates everything the worker sends."""

    def __init__(self, nonce: str, max_frame: int = m.DEFAULT_MAX_FRAME) -> None:
        super().__init__()
        self.nonce = nonce
        self.max_frame = max_frame
        self.hello: m.HELLO | None = None
        self.state = State.AWAIT_HELLO
        self.current: RequestTracker | None = None
        self._pending_reply: object | None = None
        self._raw_count = 0
        # req_ids are unique per connection; the host issues them increasing, so remembering
        # the last one enforces uniqueness in O(1) memory for a connection's whole life.
        self._last_req_id = -1

    # -- host actions --

    def accept_hello(self) -> m.HELLO_ACK:
        self._expect(State.HELLO_RECEIVED)
        assert self.hello is not None
        self.max_frame = min(self.max_frame, self.hello.max_frame)
        self.state = State.IDLE
        return m.HELLO_ACK(v=m.PROTOCOL_VERSION, accept=True, max_frame=self.max_frame)

    def start_request(self, req: object, raw_len: int | None = None) -> RequestTracker:
        """Record `req` as in flight. `raw_len` is the byte length of its raw frame."""
        self._expect(State.IDLE)
        req_id = req.req_id  # type: ignore[attr-defined]
        if req_id <= self._last_req_id:
            raise ProtocolError(
                f"req_id {req_id} reused on this connection (ids increase; last was "
                f"{self._last_req_id})"
            )
        tokens = payloads.request_payload_tokens(req)
        if (tokens is None) != (raw_len is None):
            raise ProtocolError(f"{m.message_name(req)}: raw frame presence does not match")
        if raw_len is not None and raw_len > self.max_frame:  # the worker would refuse it
            raise ProtocolError(
                f"{m.message_name(req)}: raw frame of {raw_len} bytes exceeds max_frame "
                f"{self.max_frame}"
            )
        if tokens is not None and raw_len is not None:
            payloads.check_raw_length(raw_len, tokens, 4, m.message_name(req))
        self._last_req_id = req_id
        self.current = RequestTracker(req, phases_for(req))
        self.state = State.REQUEST
        return self.current

    def send_shutdown(self) -> None:
        self._expect(State.IDLE)
        self.state = State.CLOSED

    # -- frames from the worker --

    def _receive(self, frame: bytes | bytearray) -> object:
        if self.state is State.AWAIT_RAW:
            return self._receive_raw(frame)
        try:
            msg = m.decode_from_worker(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"undecodable control frame: {exc}") from None
        if self.state is State.AWAIT_HELLO:
            return self._receive_hello(msg)
        if self.state is not State.REQUEST:
            raise ProtocolError(f"unsolicited {m.message_name(msg)} in state {self.state.value}")
        assert self.current is not None
        if type(msg) is m.PROGRESS:  # exact type: see payloads.py on isinstance and Structs
            self.current.check_progress(msg)
            return ProgressReceived(msg)
        return self._receive_reply(msg)

    def _receive_hello(self, msg: object) -> HelloReceived:
        if not isinstance(msg, m.HELLO):
            raise ProtocolError(f"expected HELLO, got {m.message_name(msg)}")
        if msg.v != m.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {msg.v}, this host speaks only v3")
        if msg.nonce != self.nonce:
            raise ProtocolError("HELLO nonce does not match the spawn nonce")
        self.hello = msg
        self.state = State.HELLO_RECEIVED
        return HelloReceived(msg)

    def _receive_reply(self, msg: object) -> ReplyReceived | None:
        req = self.current.request  # type: ignore[union-attr]
        req_id = cast(m.Request, req).req_id
        if getattr(msg, "req_id", None) != req_id:
            raise ProtocolError(
                f"{m.message_name(msg)} for req_id {getattr(msg, 'req_id', None)}, "
                f"expected {req_id}"
            )
        kind = type(msg)
        if kind is not m.REPLY_FOR[type(req)] and kind is not m.ERR:
            raise ProtocolError(f"{m.message_name(msg)} does not answer {m.message_name(req)}")
        if type(msg) is m.VECTORS and type(req) is m.EMBED_BATCH:
            if msg.n != len(req.items):
                raise ProtocolError(f"VECTORS n={msg.n} for {len(req.items)} items")
        if type(msg) is m.LABEL_SCORES and type(req) is m.CLASSIFY:
            # One row per sequence, and at least one label: a row of nothing is no answer.
            if msg.n != len(req.sequences):
                raise ProtocolError(f"LABEL_SCORES n={msg.n} for {len(req.sequences)} sequences")
            if msg.n_labels < 1:
                raise ProtocolError("LABEL_SCORES n_labels=0: a classifier has a label")
        if type(msg) is m.ENCODED and type(req) is m.ENCODE:
            _check_encoded(msg, req)
        floats = payloads.reply_payload_floats(msg, req)
        if floats is not None:
            self._pending_reply, self._raw_count = msg, floats
            self.state = State.AWAIT_RAW
            return None
        return self._finish(ReplyReceived(msg))

    def _receive_raw(self, frame: bytes | bytearray) -> ReplyReceived:
        reply = self._pending_reply
        payloads.check_raw_length(len(frame), self._raw_count, 4, m.message_name(reply))
        self._pending_reply = None
        return self._finish(ReplyReceived(reply, frame))

    def _finish(self, event: ReplyReceived) -> ReplyReceived:
        self.current = None
        self.state = State.IDLE
        return event


class WorkerSession(_Base):
    """Worker end: validates everything the host sends."""

    def __init__(self, max_frame: int = m.DEFAULT_MAX_FRAME) -> None:
        super().__init__()
        self.max_frame = max_frame
        self.state = State.AWAIT_ACK
        self._pending: object | None = None
        self._raw_count = 0

    def _receive(self, frame: bytes | bytearray) -> object:
        if self.state is State.AWAIT_RAW:
            payloads.check_raw_length(len(frame), self._raw_count, 4, m.message_name(self._pending))
            event = RequestReceived(self._pending, frame)
            self._pending, self.state = None, State.IDLE
            return event
        try:
            msg = m.decode_from_host(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"undecodable control frame: {exc}") from None
        if self.state is State.AWAIT_ACK:
            if not isinstance(msg, m.HELLO_ACK):
                raise ProtocolError(f"expected HELLO_ACK, got {m.message_name(msg)}")
            if msg.v != m.PROTOCOL_VERSION or not msg.accept:
                raise ProtocolError(f"host refused: v={msg.v} accept={msg.accept}")
            self.max_frame = min(self.max_frame, msg.max_frame)
            self.state = State.IDLE
            return None
        if self.state is not State.IDLE:
            raise ProtocolError(f"{m.message_name(msg)} in state {self.state.value}")
        if isinstance(msg, m.SHUTDOWN):
            self.state = State.CLOSED
            return ShutdownReceived()
        if isinstance(msg, m.HELLO_ACK):
            raise ProtocolError("second HELLO_ACK")
        tokens = payloads.request_payload_tokens(msg)
        if tokens is None:
            return RequestReceived(msg)
        self._pending, self._raw_count, self.state = msg, tokens, State.AWAIT_RAW
        return None


def _check_encoded(msg: m.ENCODED, req: m.ENCODE) -> None:
    """One section per requested output, in order; one count per item where counts apply;
    a vector has a width. Anything else is no answer to the request."""
    n = len(req.items)
    if msg.n != n:
        raise ProtocolError(f"ENCODED n={msg.n} for {n} items")
    kinds = [s.kind for s in msg.sections]
    if kinds != list(req.outputs):
        raise ProtocolError(f"ENCODED sections {kinds} for outputs {list(req.outputs)}")
    for s in msg.sections:
        if s.dims < 1:
            raise ProtocolError(f"ENCODED {s.kind} dims=0")
        want = 0 if s.kind == "dense" else n
        if len(s.counts) != want:
            raise ProtocolError(f"ENCODED {s.kind} has {len(s.counts)} counts for {n} items")
        if s.kind == "tokens":
            for i, (count, item) in enumerate(zip(s.counts, req.items, strict=True)):
                if count != item.n_tokens:
                    raise ProtocolError(
                        f"ENCODED tokens count {count} for item {i} of {item.n_tokens} tokens"
                    )
