"""Compact embedding precisions, and the per-model int8/uint8 ranges a manifest keeps.

Precisions, with the semantics of sentence-transformers' `quantize_embeddings` (tests compare
the two byte for byte on the same vectors and ranges; torch stays out of the serving process):
    float32   the vectors as computed
    int8      each dimension's calibration range [min, max] cut into 256 equal buckets
              (floor, clipped to the ends), stored as bucket - 128
    uint8     the same buckets, 0..255
    binary    one bit a dimension (1 where > 0), packed 8 to a byte by `np.packbits`
              (dimension 0 is the high bit of byte 0; a width that is not a multiple of 8 is
              padded with 0 bits), stored as byte - 128 (int8)
    ubinary   the same packed bytes, as uint8

int8 and uint8 need ranges: per width the vectors are served at (a Matryoshka cut is cut and
renormalized first, then quantized, so each width has its own ranges), from a calibration set
embedded by the model itself. The ranges are symmetric and share one scale across every
dimension (`SCHEME`): a vector store ranks int8 rows by their plain integer dot product, and
only codes that are one common multiple of the float values keep that ranking. Each
dimension's own [min, max] (what `quantize_embeddings` computes from calibration embeddings)
gives each dimension its own offset and step, and the codes' dot products then pick the float
nearest neighbour far less often. `quantize_embeddings` given these ranges still matches
byte for byte: only the ranges differ, not the arithmetic. They are a property of the
model, not of a request: computed once (see `certification.calibration`) and kept in the
manifest as `quantization` (`QuantizationRanges`), so every process serving the model
quantizes alike and a resumed batch job continues with the ranges it began with.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:  # store.py imports this module for the manifest field
    from ingest.store import ArtifactStore, Manifest

log = logging.getLogger("synapse.ingest")

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
RANGED = frozenset({"int8", "uint8"})  # the precisions that need calibration ranges


class WidthRanges(msgspec.Struct, frozen=True):
    min: list[float]  # per dimension, float32 values
    max: list[float]


# How the recorded ranges were chosen. Manifests written before the symmetric ranges carry no
# scheme (read as "per-dimension"); their ranges are not used, and the model calibrates anew.
SCHEME = "symmetric"
OLD_SCHEME = "per-dimension"


class QuantizationRanges(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a manifest records for int8/uint8: per served width, each dimension's range."""

    calibration: str  # the set the ranges come from, with its digest and size
    lane: str  # the lane that embedded it (ranges are the model's; the lane is provenance)
    created_at: str
    widths: dict[int, WidthRanges] = {}
    scheme: str = OLD_SCHEME


def quantize(vectors: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """`vectors` (n, d) at `precision`; `ranges` (2, d) (min row, max row) for int8/uint8.

    The arithmetic is `quantize_embeddings`' own, step for step in float32, so a bucket edge
    falls on the same side in both."""
    v = np.asarray(vectors, dtype=np.float32)
    if precision == "float32":
        return v
    if precision in RANGED:
        if ranges is None:
            raise ValueError(f"{precision} needs calibration ranges")
        r = np.asarray(ranges, dtype=np.float32)
        if r.shape != (2, v.shape[-1]):
            raise ValueError(f"ranges of shape {r.shape} for vectors of width {v.shape[-1]}")
        starts = r[0]
        steps = (r[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)  # a constant dimension: every value in bucket 0
        buckets = np.clip(np.floor((v - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    if precision in ("binary", "ubinary"):
        packed = np.packbits(v > 0, axis=-1)
        if precision == "ubinary":
            return packed
        return (packed.astype(np.int16) - 128).astype(np.int8)
    raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")


def packed_width(dims: int) -> int:
    """Bytes a binary/ubinary vector of `dims` dimensions packs into."""
    return (dims + 7) // 8


def truncate(vectors: np.ndarray, width: int) -> np.ndarray:
    """The first `width` dimensions, renormalized: what a Matryoshka `dimensions` request
    serves (the same arithmetic as the HTTP route), so the ranges of a width describe the
    very vectors that get quantized at it."""
    v = np.asarray(vectors, dtype=np.float32)
    if width == v.shape[1]:
        return v
    cut = v[:, :width]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)


def calibration_ranges(vectors: np.ndarray, width: int) -> np.ndarray:
    """(2, width) float32 symmetric ranges of the calibration vectors cut to `width`: every
    dimension [-128.5 s, 126.5 s] with one scale s = max |x| / 127 over all of them.

    With these, `quantize`'s step is s and its bucket minus 128 is floor(x / s + 0.5): x / s
    rounded to the nearest integer, 0 for 0, and +-127 at the largest magnitude calibrated
    (a larger one clips at 127 or -128). Every code is then the same multiple of its value, so
    an int8 dot product is the float one scaled by 1/s^2 up to rounding, and ranks alike."""
    cut = truncate(vectors, width)
    peak = float(np.max(np.abs(cut))) if cut.size else 0.0
    scale = np.float32(peak / 127 if peak > 0 else 1.0)
    lo = np.full(width, np.float32(-128.5) * scale, dtype=np.float32)
    hi = np.full(width, np.float32(126.5) * scale, dtype=np.float32)
    return np.vstack((lo, hi))


def stored_ranges(manifest: Manifest, width: int) -> np.ndarray | None:
    q = manifest.quantization
    found = q.widths.get(width) if q is not None and q.scheme == SCHEME else None
    if found is None or len(found.min) != width or len(found.max) != width:
        return None
    return np.array([found.min, found.max], dtype=np.float32)


def _as_width_ranges(ranges: np.ndarray) -> WidthRanges:
    # Each float32 written in its shortest round-trip form: "0.0123" rather than float64's
    # 17 digits of the widened value; it parses back to the very same float32.
    r = np.asarray(ranges, dtype=np.float32)
    return WidthRanges(min=[float(str(x)) for x in r[0]], max=[float(str(x)) for x in r[1]])


def record_ranges(
    store: ArtifactStore,
    name: str,
    digest: str,
    computed: Mapping[int, np.ndarray],
    calibration: str,
    lane: str,
    created_at: str,
) -> dict[int, np.ndarray]:
    """Add `computed` (width -> (2, width)) to `name`'s manifest and return every width's
    ranges as the manifest now has them.

    A width the manifest already has keeps its ranges: another process calibrated first, and
    all must quantize alike, so the caller adopts the stored ones. Nothing is written when the
    model was replaced meanwhile (another digest: these ranges are not its), nor when the
    store cannot be written (read-only, full): then the computed ranges serve this process
    only, and the failure is logged."""

    def merge(manifest: Manifest) -> Manifest:
        old = manifest.quantization
        if old is not None and old.scheme != SCHEME:
            old = None  # ranges of another scheme are replaced whole, never mixed with these
        widths = dict(old.widths) if old is not None else {}
        for width, ranges in computed.items():
            widths.setdefault(width, _as_width_ranges(ranges))
        if old is not None:
            q = msgspec.structs.replace(old, widths=widths)
        else:
            q = QuantizationRanges(
                calibration=calibration,
                lane=lane,
                created_at=created_at,
                widths=widths,
                scheme=SCHEME,
            )
        return msgspec.structs.replace(manifest, quantization=q)

    mine = {w: np.asarray(r, dtype=np.float32) for w, r in computed.items()}
    try:
        rec = store.update_manifest(name, digest, merge)
    except OSError as exc:
        log.warning(
            "%s: int8 ranges not recorded in the manifest (%s); this process keeps its own",
            name,
            exc,
        )
        return mine
    except Exception as exc:  # the store's typed errors: replaced, removed, full
        log.warning(
            "%s: int8 ranges not recorded in the manifest (%s)", name, getattr(exc, "msg", exc)
        )
        return mine
    if rec is None:  # replaced by another artifact while calibrating
        return mine
    out = dict(mine)
    for width in rec.manifest.quantization.widths if rec.manifest.quantization else ():
        stored = stored_ranges(rec.manifest, width)
        if stored is not None:
            out[width] = stored
    return out
