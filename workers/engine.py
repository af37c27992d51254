"""The in-process engine trait every worker packages.

An engine is a plain object: the worker runtime (`workers.runtime`) drives it behind the Unix
socket, and tests or benchmarks can drive the very same object in-process to measure what the
process boundary costs. Engines receive decoded requests plus their token ids as numpy views
and return plain results; they never see frames or sockets.

Rules for engines:
- raise `EngineError(code, msg)` for every refusal; `code` is one of the protocol's worker
  codes (`workers.protocol.WORKER_ERROR_CODES`). Any other exception is a bug: the runtime
  logs the traceback and exits, and the host reports `engine_crashed` with that log tail.
- call `progress.advance(phase)` only after a unit of work has COMPLETED (a decode, a row
  chunk, a compiled shape): never on a timer.
- validate inputs that would abort the native engine before touching it.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import numpy as np

from workers.protocol import messages as m


class EngineError(Exception):
    """A typed refusal that becomes `ERR {code, msg}` on the wire."""

    def __init__(self, code: str, msg: str) -> None:
        if code not in m.WORKER_ERROR_CODES:
            raise ValueError(f"unknown worker error code {code!r}")
        super().__init__(f"{code}: {msg}")
        self.code = code
        self.msg = msg


class Progress(Protocol):
    def advance(self, phase: m.Phase, completed: int = 1) -> None:
        """Report `completed` more units of finished work in `phase`."""


class NullProgress:
    """Progress sink for in-process use (nobody is watching)."""

    def __init__(self) -> None:
        self.completed = 0

    def advance(self, phase: m.Phase, completed: int = 1) -> None:
        self.completed += completed


class Generation(msgspec.Struct, frozen=True):
    text: str
    n_prompt: int
    n_gen: int
    finish_reason: str


class Section(msgspec.Struct, frozen=True):
    """One ENCODE output, ready for the wire: `arrays` go into the frame in order (f32, or
    sparse's i32 indices then f32 values), `counts` per item where the kind is ragged."""

    kind: m.OutputKind
    dims: int
    counts: list[int]
    arrays: list[np.ndarray]


def dense_section(vectors: np.ndarray) -> Section:
    return Section("dense", int(vectors.shape[1]), [], [np.asarray(vectors, np.float32)])


def ragged_section(kind: m.OutputKind, rows: list[np.ndarray], dims: int) -> Section:
    """Per-item (k_i, dims) arrays as one section (tokens, multivector)."""
    flat = np.concatenate(rows) if rows else np.zeros((0, dims), np.float32)
    return Section(kind, dims, [len(r) for r in rows], [np.asarray(flat, np.float32)])


def sparse_section(items: list[tuple[np.ndarray, np.ndarray]], vocab: int) -> Section:
    """Per-item (indices, values) as one section: every index, then every value."""
    idx = [np.asarray(i, np.int32) for i, _ in items]
    val = [np.asarray(v, np.float32) for _, v in items]
    return Section(
        "sparse",
        vocab,
        [len(i) for i in idx],
        [
            np.concatenate(idx) if idx else np.zeros(0, np.int32),
            np.concatenate(val) if val else np.zeros(0, np.float32),
        ],
    )


class Engine:
    """Base engine: every operation is `unsupported` until an engine implements it."""

    # HELLO fields an engine advertises.
    def info(self) -> m.EngineInfo:
        raise NotImplementedError

    def hello_extras(self) -> dict:
        """Optional HELLO fields: manifest_digest, kernel_revision, packed."""
        return {}

    def load(self, req: m.LOAD, progress: Progress) -> m.LOADED:
        raise EngineError("unsupported", "this engine does not load models")

    def embed(self, req: m.EMBED_BATCH, ids: np.ndarray, progress: Progress) -> np.ndarray:
        """Return float32 (len(req.items), dims)."""
        raise EngineError("unsupported", "this engine does not embed")

    def rerank(self, req: m.RERANK, ids: np.ndarray, progress: Progress) -> np.ndarray:
        """Return float32 (len(req.candidates),)."""
        raise EngineError("unsupported", "this engine does not rerank")

    def rerank_sequences(
        self, req: m.RERANK_SEQUENCES, ids: np.ndarray, progress: Progress
    ) -> np.ndarray:
        """Return float32 (len(req.sequences),)."""
        raise EngineError("unsupported", "this engine does not rerank composed sequences")

    def classify(self, req: m.CLASSIFY, ids: np.ndarray, progress: Progress) -> np.ndarray:
        """Return float32 (len(req.sequences), n_labels): the head's raw logits."""
        raise EngineError("unsupported", "this engine has no sequence-classification head")

    def encode(self, req: m.ENCODE, ids: np.ndarray, progress: Progress) -> list[Section]:
        """One section per `req.outputs`, in order, from one forward pass."""
        raise EngineError("unsupported", "this engine does not return token-level outputs")

    def generate(self, req: m.GENERATE, ids: np.ndarray, progress: Progress) -> Generation:
        raise EngineError("unsupported", "this engine does not generate")

    def admit_shape(self, req: m.ADMIT_SHAPE, progress: Progress) -> m.SHAPE_ADMITTED:
        raise EngineError("unsupported", "this engine has no compiled shapes")

    def evict(self, req: m.EVICT, progress: Progress) -> m.EVICTED:
        raise EngineError("unsupported", "this engine has no compiled shapes")

    def unload(self, req: m.UNLOAD, progress: Progress) -> None:
        raise EngineError("model_not_loaded", f"{req.model_ref!r} is not loaded")

    def models_loaded(self) -> list[str]:
        return []

    def placement(self) -> tuple[float | None, str | None]:
        """(placement_share, source) for PONG; (None, None) where it has no meaning."""
        return None, None

    def pong_extras(self) -> dict:
        """Optional PONG fields: cache_hits, cache_misses, cache_bytes."""
        return {}

    def close(self) -> None:
        """Release native resources before the worker exits."""
