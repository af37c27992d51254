"""The worker-side loop every engine shares.

    python -m workers.<engine> --socket PATH --nonce NONCE [engine args...]

connect -> HELLO -> wait for HELLO_ACK -> serve one request at a time -> exit.

Exit codes: 0 after SHUTDOWN or when the host closes the socket; 2 on a protocol violation
by the host (or a refused handshake); 70 when the engine raised something other than an
`EngineError` — a bug, whose traceback goes to stderr so the host can attach it to the
`engine_crashed` it reports. Logs go to stderr, which the host captures into its log ring.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import numpy as np
import psutil

from workers.engine import Engine, EngineError, Section
from workers.protocol import messages as m
from workers.protocol import payloads
from workers.protocol.blocking import BlockingChannel
from workers.protocol.errors import ProtocolError
from workers.protocol.session import RequestReceived, ShutdownReceived, WorkerSession

log = logging.getLogger("synapse.worker")

EXIT_OK = 0
EXIT_PROTOCOL = 2
EXIT_ENGINE_BUG = 70
_PR_SET_PDEATHSIG = 1
_SELF = psutil.Process()
_PAGE = os.sysconf("SC_PAGE_SIZE")
_STATM: int | None = None  # elsewhere (macOS has no /proc): psutil's memory_info
if sys.platform.startswith("linux"):
    try:  # one pread of statm is ~3 us; psutil's memory_info ~40 us on a PING hot path
        _STATM = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        pass


def _rss_mb() -> float:
    if _STATM is not None:
        return int(os.pread(_STATM, 128, 0).split()[1]) * _PAGE / 2**20
    return _SELF.memory_info().rss / 2**20


class WireProgress:
    """Sends PROGRESS for completed work only. Keeps the counter strictly increasing and the
    phase monotonic itself, so an engine bug shows up here rather than as a host-side kill."""

    def __init__(self, channel: BlockingChannel, req: object) -> None:
        self._channel = channel
        self._req_id = req.req_id  # type: ignore[attr-defined]
        self._phases = (
            ("setup", "inference") if type(req) in m.INFERENCE_REQUESTS else ("setup", "control")
        )
        self._phase_index = -1
        self.completed = 0

    def advance(self, phase: m.Phase, completed: int = 1) -> None:
        index = self._phases.index(phase)  # ValueError = engine bug: wrong phase for request
        if index < self._phase_index or completed < 1:
            raise RuntimeError(f"progress must move forward (phase {phase}, +{completed})")
        self._phase_index = index
        self.completed += completed
        self._channel.send(m.PROGRESS(req_id=self._req_id, completed=self.completed, phase=phase))


class WorkerRuntime:
    """One connection, one engine. Subclasses (the fault-injection worker) override hooks."""

    def __init__(self, engine: Engine, socket_path: str, nonce: str) -> None:
        self.engine = engine
        self.socket_path = socket_path
        self.nonce = nonce
        self.worker_id = os.environ.get("SYNAPSE_WORKER_ID", "?")
        self.channel: BlockingChannel | None = None
        self.session = WorkerSession()

    # -- hooks --

    def hello_message(self) -> m.HELLO:
        return m.HELLO(
            v=m.PROTOCOL_VERSION,
            nonce=self.nonce,
            engine=self.engine.info(),
            pid=os.getpid(),
            max_frame=m.DEFAULT_MAX_FRAME,
            **self.engine.hello_extras(),
        )

    def after_handshake(self) -> None:
        """Called once HELLO_ACK is accepted."""

    # -- loop --

    def connect(self) -> BlockingChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            # Bigger kernel buffers: fewer wake-ups per large tensor (the kernel caps it).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 2**20)
        sock.connect(self.socket_path)
        self.channel = BlockingChannel(sock)
        return self.channel

    def run(self) -> int:
        channel = self.connect()
        try:
            channel.send(self.hello_message())
            self.session.receive_frame(channel.recv_frame())  # HELLO_ACK or ProtocolError
            channel.set_max_frame(self.session.max_frame)
            self.after_handshake()
            _freeze_heap()
            log.info("worker %s ready (pid %d)", self.worker_id, os.getpid())
            while True:
                event = self.session.receive_frame(channel.recv_frame())
                if event is None:
                    continue
                if isinstance(event, ShutdownReceived):
                    log.info("SHUTDOWN received; exiting")
                    return EXIT_OK
                assert isinstance(event, RequestReceived)
                self.serve(event.request, event.raw)
        except EOFError:
            log.info("host closed the connection; exiting")
            return EXIT_OK
        except ProtocolError as exc:
            log.error("protocol violation by host: %s", exc.reason)
            return EXIT_PROTOCOL
        except OSError as exc:  # host vanished mid-send
            log.error("socket error: %s", exc)
            return EXIT_OK
        finally:
            self.engine.close()

    def serve(self, req: object, raw: bytes | bytearray | None) -> None:
        channel = self.channel
        assert channel is not None
        progress = WireProgress(channel, req)
        req_id = req.req_id  # type: ignore[attr-defined]
        try:
            reply, out = self.dispatch(req, raw, progress)
        except EngineError as exc:
            channel.send(m.ERR(req_id=req_id, code=exc.code, msg=exc.msg))
            return
        except MemoryError:
            channel.send(m.ERR(req_id=req_id, code="oom", msg="worker ran out of memory"))
            return
        except Exception:  # an engine bug: say so loudly and let the host restart us
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(EXIT_ENGINE_BUG)
        channel.send(reply, out)
        if isinstance(req, m.LOAD):
            _freeze_heap()  # the model's objects live until UNLOAD

    def dispatch(
        self, req: object, raw: bytes | bytearray | None, progress: WireProgress
    ) -> tuple[m.WorkerToHost, memoryview | None]:
        engine = self.engine
        # Every request the engine serves carries its ids frame (payloads.request_payload_tokens).
        ids = payloads.ids_view(raw if raw is not None else b"")
        if isinstance(req, m.EMBED_BATCH):
            vectors = _check_f32(engine.embed(req, ids, progress), len(req.items), "embed")
            return m.VECTORS(req_id=req.req_id, dims=vectors.shape[1], n=vectors.shape[0]), (
                payloads.floats_to_wire(vectors)
            )
        if isinstance(req, m.RERANK):
            scores = _check_f32(engine.rerank(req, ids, progress), len(req.candidates), "rerank")
            return m.SCORES(req_id=req.req_id), payloads.floats_to_wire(scores)
        if isinstance(req, m.RERANK_SEQUENCES):
            scores = engine.rerank_sequences(req, ids, progress)
            scores = _check_f32(scores, len(req.sequences), "rerank_sequences")
            return m.SCORES(req_id=req.req_id), payloads.floats_to_wire(scores)
        if isinstance(req, m.CLASSIFY):
            logits = _check_f32(engine.classify(req, ids, progress), len(req.sequences), "classify")
            if logits.ndim != 2 or logits.shape[1] < 1:
                raise RuntimeError(f"classify: engine returned shape {logits.shape}")
            return m.LABEL_SCORES(
                req_id=req.req_id, n=logits.shape[0], n_labels=logits.shape[1]
            ), payloads.floats_to_wire(logits)
        if isinstance(req, m.ENCODE):
            return _encoded(req, engine.encode(req, ids, progress))
        if isinstance(req, m.GENERATE):
            g = engine.generate(req, ids, progress)
            return m.TEXT(
                req_id=req.req_id,
                text=g.text,
                n_prompt=g.n_prompt,
                n_gen=g.n_gen,
                finish_reason=g.finish_reason,
            ), None
        if isinstance(req, m.LOAD):
            return engine.load(req, progress), None
        if isinstance(req, m.ADMIT_SHAPE):
            return engine.admit_shape(req, progress), None
        if isinstance(req, m.EVICT):
            return engine.evict(req, progress), None
        if isinstance(req, m.UNLOAD):
            engine.unload(req, progress)
            return m.UNLOADED(req_id=req.req_id), None
        if isinstance(req, m.PING):
            share, source = engine.placement()
            return m.PONG(
                req_id=req.req_id,
                rss_mb=_rss_mb(),
                models_loaded=engine.models_loaded(),
                placement_share=share,
                placement_source=source,
                **engine.pong_extras(),
            ), None
        raise EngineError("invalid_request", f"unhandled request {m.message_name(req)}")


def _encoded(req: m.ENCODE, sections: list[Section]) -> tuple[m.ENCODED, memoryview]:
    """ENCODED and its one frame; a section that is not what was asked is an engine bug."""
    if [s.kind for s in sections] != list(req.outputs):
        raise RuntimeError(f"encode: engine returned {[s.kind for s in sections]}")
    parts = []
    for s in sections:
        for a in s.arrays:
            parts.append(np.ascontiguousarray(a, dtype="<i4" if a.dtype.kind in "iu" else "<f4"))
    frame = b"".join(p.tobytes() for p in parts)
    reply = m.ENCODED(
        req_id=req.req_id,
        n=len(req.items),
        sections=[m.OutputSection(kind=s.kind, dims=s.dims, counts=s.counts) for s in sections],
    )
    return reply, memoryview(frame)


def _freeze_heap() -> None:
    """Keep what is alive now (imports, loaded models) out of the cyclic collector's scans.

    A full collection walks every tracked object: ~10 ms over a loaded worker's ~50,000 when
    idle, far more with the engine's working set in the caches, and it lands inside whatever
    request allocated last. Frozen objects are still freed by reference counting.
    """
    gc.collect()
    gc.freeze()


def _check_f32(values: np.ndarray, rows: int, what: str) -> np.ndarray:
    """The engine must answer one row per item; a mismatch is an engine bug, not a reply."""
    arr = np.asarray(values, dtype=np.float32)
    if arr.shape[0] != rows:
        raise RuntimeError(f"{what}: engine returned {arr.shape[0]} rows for {rows} inputs")
    return arr


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL us if the host dies, even mid-computation (when we are
    not reading the socket and would not see its EOF). macOS has no equivalent; there the
    EOF on the next read ends the worker."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=True)
    parser.add_argument("--socket", required=True, help="Unix socket the host listens on")
    parser.add_argument("--nonce", required=True, help="spawn nonce to echo in HELLO")
    return parser.parse_known_args(argv)


def main(
    engine_factory: Callable[[list[str]], Engine],
    argv: Sequence[str] | None = None,
    runtime_class: type[WorkerRuntime] = WorkerRuntime,
) -> None:
    """Entry point for `python -m workers.<engine>`; never returns."""
    args, rest = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=os.environ.get("SYNAPSE_WORKER_LOG", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _die_with_parent()
    started = time.monotonic()
    engine = engine_factory(rest)
    log.debug("engine constructed in %.1f ms", (time.monotonic() - started) * 1e3)
    code = runtime_class(engine, args.socket, args.nonce).run()
    sys.stderr.flush()
    os._exit(code)
