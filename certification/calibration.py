"""int8/uint8 calibration: each served width's per-dimension ranges, from the certification
corpus embedded by the model itself, computed on first use and kept in the manifest.

Why on first use, and not at ingest or certification:
- ingest cannot run a model (it sits below `host`), and would charge every ingest, the
  defaults `make run` installs included, a corpus embedding that most models never need;
- certification is optional and per lane (llama.cpp lanes serve uncertified), so ranges made
  there would leave most models without int8;
- on first use, the lane that serves the model embeds the corpus once (335 texts, about
  19,000 MiniLM tokens: 25 s on a loaded 2-core machine, paid by the first int8/uint8 request
  or batch job of the model), and the manifest keeps the ranges for every process after it. A
  re-ingested model has a new manifest, so stale ranges cannot outlive their artifact.

The corpus is embedded as a call naming no prompt is (the model's default prompt, if any),
normalized, as the HTTP routes and batch jobs serve it. The widths calibrated together are
the one asked for, the model's full width and its declared Matryoshka widths (the corpus
vectors are kept in memory per process, so another width later costs no second embedding).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from functools import cache

import numpy as np

from certification.corpus import corpus
from host.module import Module
from ingest.quantization import calibration_ranges, record_ranges, stored_ranges

log = logging.getLogger("synapse.calibration")


@cache
def calibration_set() -> str:
    """What the ranges are computed from, as the manifest names it."""
    items = corpus()
    digest = hashlib.sha256("\x00".join(items).encode()).hexdigest()[:12]
    return f"certification corpus sha256:{digest} ({len(items)} texts)"


class Calibrations:
    """One process's int8/uint8 ranges, per (model, artifact digest, width): from memory,
    else the manifest, else computed once. Each is resolved by one task that concurrent
    callers share and that finishes (and records) even when every caller gave up waiting."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self._ranges: dict[tuple[str, str, int], np.ndarray] = {}
        self._vectors: dict[tuple[str, str], asyncio.Future] = {}
        self._resolving: dict[tuple[str, str, int], asyncio.Future] = {}

    async def ranges(self, model: str, width: int, lane: str | None = None) -> np.ndarray:
        """(2, width) float32 ranges of `model`'s vectors cut to `width` (its full width:
        the vectors as served). `lane` is the lane that embeds the corpus when they are not
        known yet (None: the one the module serves the model with)."""
        digest = self.module.record(model).digest
        key = (model, digest, width)
        found = self._ranges.get(key)
        if found is not None:
            return found
        task = self._resolving.get(key)
        if task is None:
            task = self._resolving[key] = asyncio.ensure_future(
                self._resolve(model, digest, width, lane)
            )
            task.add_done_callback(lambda t: self._finished(key, t))
        return await asyncio.shield(task)

    def _finished(self, key: tuple[str, str, int], task: asyncio.Future) -> None:
        self._resolving.pop(key, None)
        if not task.cancelled() and task.exception() is not None:  # retrieved: logged once
            log.warning("%s: int8 calibration failed: %s", key[0], task.exception())

    async def _resolve(self, model: str, digest: str, width: int, lane: str | None) -> np.ndarray:
        key = (model, digest, width)
        fresh = await asyncio.to_thread(self.module.store.get, model)  # another process's?
        if fresh.digest == digest:
            found = stored_ranges(fresh.manifest, width)
            if found is not None:
                self._ranges[key] = found
                return found
        vectors = await self.corpus_vectors(model, lane)
        dims = vectors.shape[1]
        declared = self.module.record(model).manifest.matryoshka_dims
        widths = {w for w in (width, dims, *declared) if 1 <= w <= dims}
        computed = {w: calibration_ranges(vectors, w) for w in sorted(widths)}
        served_by = lane or self.module.default_lane(model).lane
        kept = await asyncio.to_thread(
            record_ranges,
            self.module.store,
            model,
            digest,
            computed,
            calibration_set(),
            served_by,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        for w, r in kept.items():
            self._ranges.setdefault((model, digest, w), r)
        return self._ranges[key]

    async def corpus_vectors(self, model: str, lane: str | None = None) -> np.ndarray:
        """The calibration corpus embedded by `model` (once per process and artifact). A
        caller that gives up (a client gone) does not cancel it: others may be waiting."""
        digest = self.module.record(model).digest
        return await asyncio.shield(self._corpus_vectors(model, digest, lane))

    def _corpus_vectors(self, model: str, digest: str, lane: str | None) -> asyncio.Future:
        key = (model, digest)
        task = self._vectors.get(key)
        if task is None:
            task = self._vectors[key] = asyncio.ensure_future(self._embed(model, lane))
            # A failure (a crashed lane) is not remembered: the next caller tries again.
            task.add_done_callback(
                lambda t: self._vectors.pop(key, None) if t.cancelled() or t.exception() else None
            )
        return task

    async def _embed(self, model: str, lane: str | None) -> np.ndarray:
        t0 = time.monotonic()
        result = await self.module.embed(list(corpus()), model, lane=lane)
        log.info("%s: calibration corpus embedded in %.1f s", model, time.monotonic() - t0)
        return np.asarray(result.vectors, dtype=np.float32)
