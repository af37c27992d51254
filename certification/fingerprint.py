"""Numerical lane fingerprint: a digest of the lane's outputs on `probe_set()` that fp noise
below the tolerance does not change.

Scheme `grid-margin-v1`:

1. Outputs (L2-normalized embeddings, or rerank scores) are flattened to float64 values v.
2. Each value is placed on a grid of cell `g` (from the threshold table): cell = floor(v / g).
3. Plain rounding has a flaw: a value sitting next to a cell boundary flips cell on the
   slightest noise, and over thousands of values some always sit there, so a naive
   round-and-hash changes on every run. So the certifying run KEEPS only the values at
   least `margin = g / 8` from both edges of their cell (~75% of them) and records which in
   a bitmask. The digest is sha256 over (scheme, g, mask, cells of the kept values).
4. A later run is judged under the PREVIOUS certificate's grid and mask (`digest_under`):
   every kept value of the earlier run had a margin of g/8, so any later change smaller than
   g/8 in every value leaves the digest unchanged — guaranteed, not probable.

Limits, stated:
- It detects change, not error: a change is only SEEN when some kept value crosses a cell
  edge. A shift between g/8 and 7g/8 may or may not be seen; one of at least a full cell
  always is. Quality is judged by the gates, never by the fingerprint.
- Values dropped by the mask (near an edge in the certifying run) are not watched at all;
  with thousands of values this hides nothing systematic, but a change confined to a few
  components can slip through.
- The grid is an absolute scale chosen per output kind (unit vectors: components ~0.05;
  rerank logits: spread ~0.2); it is recorded in the fingerprint, so changing the table
  does not silently re-interpret old certificates.
"""

from __future__ import annotations

import base64
import hashlib
import zlib

import msgspec
import numpy as np

SCHEME = "grid-margin-v1"
MARGIN_FRACTION = 1 / 8


class Fingerprint(msgspec.Struct, frozen=True, kw_only=True):
    digest: str  # sha256 hex
    scheme: str
    grid: float
    n_values: int
    n_kept: int
    mask: str  # base64(zlib(packbits(kept)))

    @property
    def short(self) -> str:
        return self.digest[:12]


def fingerprint(values: np.ndarray, grid: float) -> Fingerprint:
    v = _flat(values)
    pos = v / grid
    frac = pos - np.floor(pos)
    kept = (frac >= MARGIN_FRACTION) & (frac <= 1 - MARGIN_FRACTION)
    mask = base64.b64encode(zlib.compress(np.packbits(kept).tobytes(), 9)).decode("ascii")
    return Fingerprint(
        digest=_digest(v, grid, kept),
        scheme=SCHEME,
        grid=float(grid),
        n_values=int(v.size),
        n_kept=int(kept.sum()),
        mask=mask,
    )


def digest_under(values: np.ndarray, previous: Fingerprint) -> str | None:
    """This run's digest under `previous`'s grid and mask; None if not comparable (other
    scheme or a different number of values, e.g. other output dims: that is drift too)."""
    v = _flat(values)
    if previous.scheme != SCHEME or v.size != previous.n_values:
        return None
    packed = np.frombuffer(zlib.decompress(base64.b64decode(previous.mask)), dtype=np.uint8)
    kept = np.unpackbits(packed, count=v.size).astype(bool)
    return _digest(v, previous.grid, kept)


def _flat(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(v).all():
        # NaN/inf are a result too: map them to fixed cells so the digest stays defined.
        v = np.nan_to_num(v, nan=1e9, posinf=2e9, neginf=-2e9)
    return v


def _digest(v: np.ndarray, grid: float, kept: np.ndarray) -> str:
    cells = np.floor(v[kept] / grid).astype("<i8")
    h = hashlib.sha256()
    h.update(f"{SCHEME};grid={float(grid)!r};n={v.size};".encode())
    h.update(np.packbits(kept).tobytes())
    h.update(cells.tobytes())
    return h.hexdigest()
