"""The fault-injection engine (see the package docstring for the fault list)."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from workers.engine import Engine, EngineError, Progress
from workers.protocol import messages as m
from workers.protocol import payloads
from workers.protocol.blocking import BlockingChannel
from workers.protocol.framing import frame_header

DIMS = 4


def honest_vectors(req: m.EMBED_BATCH, ids: np.ndarray) -> np.ndarray:
    """What a well-behaved answer looks like, so tests can check replies are not mixed up."""
    out = np.zeros((len(req.items), DIMS), dtype=np.float32)
    offset = 0
    for row, item in enumerate(req.items):
        chunk = ids[offset : offset + item.n_tokens]
        offset += item.n_tokens
        out[row] = (chunk.sum(), item.n_tokens, chunk[0] if len(chunk) else 0, item.id)
    return out


class FaultEngine(Engine):
    def __init__(self) -> None:
        self.channel: BlockingChannel | None = None  # set by FaultRuntime after handshake
        self.loaded: set[str] = set()
        # model_ref -> the vocabulary size its LOAD named (runtime_config "n_vocab"): honest
        # answers refuse an id outside it, as an engine validating its input again does.
        self.n_vocab: dict[str, int] = {}
        self.slow_library_pending = False  # --import-s: LOAD imports it first
        self.stop_at_ping = False  # LOAD fault "sigstop_first_ping": the next PING stops it

    def import_slow_library(self) -> None:
        import workers.faulty.slow_library  # noqa: F401  (its import is the slow part)

        self.slow_library_pending = False

    def info(self) -> m.EngineInfo:
        return m.EngineInfo(engine="faulty", version="1", build_flags="fault-injection")

    def load(self, req: m.LOAD, progress: Progress) -> m.LOADED:
        if self.slow_library_pending:
            self.import_slow_library()
            progress.advance("setup")  # a completed stage, under the control window
        fault = req.runtime_config.get("fault")
        if fault == "hang":
            progress.advance("setup")
            time.sleep(3600)
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "sigstop_first_ping":
            self.stop_at_ping = True
        model_ref = str(req.runtime_config.get("model_ref", "echo"))
        progress.advance("control")
        self.loaded.add(model_ref)
        n_vocab = req.runtime_config.get("n_vocab")
        if n_vocab is not None:
            self.n_vocab[model_ref] = int(n_vocab)
        return m.LOADED(req_id=req.req_id, model_ref=model_ref, dims=DIMS, cold_load_ms=0.1)

    def unload(self, req: m.UNLOAD, progress: Progress) -> None:
        if req.model_ref not in self.loaded:
            raise EngineError("model_not_loaded", f"{req.model_ref!r} is not loaded")
        self.loaded.discard(req.model_ref)
        self.n_vocab.pop(req.model_ref, None)

    def placement(self) -> tuple[float | None, str | None]:
        # Asked for every PING before its PONG: stopping here holds that PING unanswered
        # (SIGSTOP, until the test sends SIGCONT), at a point no timing decides.
        if self.stop_at_ping:
            self.stop_at_ping = False
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().placement()

    def models_loaded(self) -> list[str]:
        return sorted(self.loaded)

    def embed(self, req: m.EMBED_BATCH, ids: np.ndarray, progress: Progress) -> np.ndarray:
        name, *args = req.model_ref.removeprefix("fault:").split(":")
        if not req.model_ref.startswith("fault:"):
            name = "ok"
        handler = getattr(self, f"_fault_{name}", None)
        if handler is None:
            raise EngineError("invalid_request", f"unknown fault {name!r}")
        return handler(req, ids, progress, *args)

    # -- honest behaviours --

    def _fault_ok(self, req, ids, progress):
        n_vocab = self.n_vocab.get(req.model_ref)
        if n_vocab is not None and len(ids) and not (0 <= ids.min() and ids.max() < n_vocab):
            bad = next(int(t) for t in ids if not 0 <= t < n_vocab)
            raise EngineError("invalid_request", f"token id {bad} is outside 0..{n_vocab - 1}")
        progress.advance("inference")
        return honest_vectors(req, ids)

    def _fault_echo(self, req, ids, progress):
        progress.advance("inference")
        return ids.view(np.float32).reshape(1, -1)

    def _fault_slow(self, req, ids, progress, steps="5", secs="0.1"):
        for _ in range(int(steps)):
            time.sleep(float(secs))
            progress.advance("inference")
        return honest_vectors(req, ids)

    def _fault_late(self, req, ids, progress, secs="1"):
        time.sleep(float(secs))
        return honest_vectors(req, ids)

    def _fault_spam(self, req, ids, progress, nbytes="100000"):
        line = "spam " * 20 + "\n"
        for i in range(int(nbytes) // len(line) + 1):
            sys.stderr.write(f"{i:08d} {line}")
        sys.stderr.write("END-OF-SPAM\n")
        sys.stderr.flush()
        return self._fault_ok(req, ids, progress)

    def _fault_error(self, req, ids, progress, code="invalid_request"):
        raise EngineError(code, f"injected {code}")

    # -- the process dies --

    def _fault_hang(self, req, ids, progress):
        progress.advance("inference")
        time.sleep(3600)

    def _fault_hang_setup(self, req, ids, progress):
        progress.advance("setup")
        time.sleep(3600)

    def _fault_sigstop(self, req, ids, progress):
        progress.advance("inference")
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)

    def _fault_sigkill(self, req, ids, progress):
        _last_words("about to SIGKILL myself")
        os.kill(os.getpid(), signal.SIGKILL)

    def _fault_abort(self, req, ids, progress):
        _last_words("about to os.abort()")
        os.abort()

    def _fault_bug(self, req, ids, progress):
        raise ValueError("injected engine bug")

    # -- the wire is broken (written directly on the socket, bypassing the runtime) --

    def _fault_garbage(self, req, ids, progress):
        self._raw(frame_header(11) + b"\x00not json\xff\xfe")
        time.sleep(3600)

    def _fault_oversize(self, req, ids, progress):
        assert self.channel is not None
        self._raw(frame_header(self.channel.decoder.max_frame + 1) + b"x" * 64)
        time.sleep(3600)

    def _fault_progress_regress(self, req, ids, progress):
        self._send(m.PROGRESS(req_id=req.req_id, completed=2, phase="inference"))
        self._send(m.PROGRESS(req_id=req.req_id, completed=1, phase="inference"))
        time.sleep(3600)

    def _fault_phase_regress(self, req, ids, progress):
        self._send(m.PROGRESS(req_id=req.req_id, completed=1, phase="inference"))
        self._send(m.PROGRESS(req_id=req.req_id, completed=2, phase="setup"))
        time.sleep(3600)

    def _fault_progress_between(self, req, ids, progress):
        vectors = honest_vectors(req, ids)
        self._send(m.VECTORS(req_id=req.req_id, dims=DIMS, n=len(req.items)))
        self._send(m.PROGRESS(req_id=req.req_id, completed=1, phase="inference"))
        self._raw(frame_header(vectors.nbytes) + vectors.tobytes())
        time.sleep(3600)

    def _fault_short_raw(self, req, ids, progress):
        vectors = honest_vectors(req, ids)
        self._send(m.VECTORS(req_id=req.req_id, dims=DIMS, n=len(req.items)))
        data = vectors.tobytes()[:-4]
        self._raw(frame_header(len(data)) + data)
        time.sleep(3600)

    def _fault_wrong_req_id(self, req, ids, progress):
        vectors = honest_vectors(req, ids)
        self._send(
            m.VECTORS(req_id=req.req_id + 1000, dims=DIMS, n=len(req.items)),
            payloads.floats_to_wire(vectors),
        )
        time.sleep(3600)

    def _send(self, msg, raw=None):
        assert self.channel is not None
        self.channel.send(msg, raw)

    def _raw(self, data: bytes) -> None:
        assert self.channel is not None
        self.channel.send_bytes(data)


def _last_words(text: str) -> None:
    sys.stderr.write(f"faulty worker {os.getpid()}: {text}\n")
    sys.stderr.flush()
