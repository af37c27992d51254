"""The gates of the token-level kinds: pure functions from the lane's and the reference's
outputs to per-item figures and named checks.

Sparse (per item, one route of one text):
- active set: the lane's non-zero ids are the reference's, except at a boundary the model
  itself draws: an id on one side only passes when its value is within the value tolerance
  of the reference's smallest kept |value| (the `max_active_dims` cut, where two entries
  within the tolerance may trade places; without a cut, the smallest value the reference
  keeps). Such traded ids are compared as absent on both sides.
- values: |lane - reference| / |reference| on the ids both keep, the worst per item; a value
  under `sparse_value_floor` of the vector's largest |value| is measured against that floor
  instead (relu(x) near 0 keeps x's absolute error, which no relative bar can hold: on the
  tiny bge-m3 a weight at 1.8 % of its vector's peak is 10.2 % off at sparse cosine 0.999999).
- cosine: the sparse cosine of the two vectors (traded ids absent on both sides).
Multi-vector (per item): the same number of vectors, each vector's cosine; MaxSim of every
query against every judged document: |lane - reference|.
Late chunking (per document): every chunk's cosine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from certification.certificate import Check, CheckStatus, OutputVerdict
from certification.thresholds import Thresholds

SparseVector = tuple[np.ndarray, np.ndarray]

NOT_SERVED = "not served on this lane"


@dataclass(frozen=True)
class SparseItem:
    cosine: float
    value_rel: float  # worst relative value error over the shared ids (0 when none)
    differs: int  # ids on one side only that no boundary explains
    traded: int  # ids on one side only within the tolerance of the boundary
    worst: tuple[float, float, float] = (0.0, 0.0, 0.0)  # its (lane, reference, vector peak)


def compare_sparse(
    lane: SparseVector, ref: SparseVector, value_rel: float, floor: float
) -> SparseItem:
    """`floor`: the fraction of the vector's largest |value| under which a value's error is
    measured against that fraction rather than against the value itself."""
    li, lv = np.asarray(lane[0], np.int64), np.asarray(lane[1], np.float64)
    ri, rv = np.asarray(ref[0], np.int64), np.asarray(ref[1], np.float64)
    lane_map = dict(zip(li.tolist(), lv.tolist(), strict=True))
    ref_map = dict(zip(ri.tolist(), rv.tolist(), strict=True))
    cut = float(np.abs(rv).min()) if rv.size else 0.0
    least = floor * float(np.abs(rv).max()) if rv.size else 0.0
    differs = traded = 0
    for i in set(lane_map) ^ set(ref_map):
        near = max(abs(lane_map.get(i, 0.0)), abs(ref_map.get(i, 0.0)))
        if rv.size and abs(near - cut) <= value_rel * max(cut, least):
            traded += 1
            lane_map.pop(i, None)
            ref_map.pop(i, None)
        else:
            differs += 1
    shared = sorted(set(lane_map) & set(ref_map))
    a = np.array([lane_map[i] for i in shared])
    b = np.array([ref_map[i] for i in shared])
    scale = np.maximum(np.abs(b), max(least, 1e-30))
    errs = np.abs(a - b) / scale
    rel = float(errs.max()) if shared else 0.0
    k = int(np.argmax(errs)) if shared else 0
    worst = (float(a[k]), float(b[k]), least / floor if floor else 0.0) if shared else (0, 0, 0)
    # Sparse cosine over the kept ids: an id kept on one side only adds to that side's norm.
    na = np.sqrt(sum(v * v for v in lane_map.values()))
    nb = np.sqrt(sum(v * v for v in ref_map.values()))
    if na == 0 and nb == 0:
        cos = 1.0  # two empty vectors agree
    else:
        cos = float(a @ b / max(na * nb, 1e-30)) if shared else 0.0
    if not np.isfinite(rel) or not np.isfinite(cos):
        return SparseItem(float("nan"), float("nan"), differs, traded, worst)
    return SparseItem(cos, rel, differs, traded, worst)


def sparse_checks(items: list[SparseItem], t: Thresholds, detail: str) -> list[Check]:
    n = len(items)
    differ = [k for k, it in enumerate(items) if it.differs]
    traded = sum(it.traded for it in items)
    cos = np.array([it.cosine for it in items], np.float64)
    rel = np.array([it.value_rel for it in items], np.float64)
    worst_cos = _worst_low(cos)
    worst_rel = _worst_high(rel)
    at = _arg(rel, high=True)
    lane_v, ref_v, peak = items[at].worst if items else (0.0, 0.0, 0.0)
    return [
        Check(
            name="sparse.active_set",
            gate="quality",
            status="pass" if not differ else "fail",
            value=len(differ),
            threshold=0,
            op="<=",
            detail=f"items whose active ids differ, of {n} ({detail}); first: "
            f"{differ[:5] or 'none'}; {traded} ids traded at the boundary within the value bar",
        ),
        Check(
            name="sparse.max_value_rel_error",
            gate="quality",
            status=_le(worst_rel, t.sparse_value_rel),
            value=worst_rel,
            threshold=t.sparse_value_rel,
            op="<=",
            detail=f"|lane - ref| / max(|ref|, {t.sparse_value_floor:g} x the vector's largest "
            f"|ref|) over the ids both keep; worst item #{at} of {n}: lane {lane_v:.4g}, "
            f"ref {ref_v:.4g}, vector peak {peak:.4g}",
        ),
        Check(
            name="sparse.min_cosine",
            gate="quality",
            status=_ge(worst_cos, t.sparse_min_cosine),
            value=worst_cos,
            threshold=t.sparse_min_cosine,
            op=">=",
            detail=f"sparse cosine per item, worst item #{_arg(cos, high=False)} of {n}",
        ),
    ]


def vector_cosines(lane: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Cosine of each row pair, in float64 (both sides re-normalized)."""
    a, b = lane.astype(np.float64), ref.astype(np.float64)
    num = np.sum(a * b, axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-30)


def multivector_checks(
    counts_differ: list[int],
    n_items: int,
    worst_per_item: np.ndarray,
    maxsim_errors: np.ndarray,
    query_vectors: np.ndarray,
    t: Thresholds,
    detail: str,
) -> list[Check]:
    """`maxsim_errors`: |lane - reference| raw MaxSim per query x document pair (row-major),
    `query_vectors`: the number of vectors of each pair's query. The bar holds per query
    vector: raw MaxSim sums one best dot product per query vector, so its error grows with
    the query's length (on the tiny bge-m3, 60-vector queries at vector cosine 0.999998 are
    6.6e-3 off raw); per vector it is the error of the mean MaxSim bge-m3's `colbert_score`
    and sentence-transformers' `meanmaxsim` return."""
    per_vector = maxsim_errors / np.maximum(query_vectors, 1)
    worst_cos = _worst_low(worst_per_item)
    worst_err = _worst_high(per_vector) if per_vector.size else 0.0
    worst_raw = _worst_high(maxsim_errors) if maxsim_errors.size else 0.0
    return [
        Check(
            name="multivector.token_count",
            gate="quality",
            status="pass" if not counts_differ else "fail",
            value=len(counts_differ),
            threshold=0,
            op="<=",
            detail=f"items whose number of vectors differs, of {n_items} ({detail}); first: "
            f"{counts_differ[:5] or 'none'}",
        ),
        Check(
            name="multivector.min_cosine",
            gate="quality",
            status=_ge(worst_cos, t.multivector_min_cosine),
            value=worst_cos,
            threshold=t.multivector_min_cosine,
            op=">=",
            detail=f"every vector of every item with as many vectors as the reference; worst "
            f"item #{_arg(worst_per_item, high=False)}",
        ),
        Check(
            name="multivector.maxsim_max_abs_error",
            gate="quality",
            status=_le(worst_err, t.maxsim_max_abs),
            value=worst_err,
            threshold=t.maxsim_max_abs,
            op="<=",
            detail=f"MaxSim error per query vector, {maxsim_errors.size} query x document "
            f"pairs, against sentence-transformers' maxsim of the reference's vectors; raw "
            f"MaxSim (what rerank returns) worst {worst_raw:.3g}",
        ),
    ]


def late_chunking_check(worst_per_doc: np.ndarray, t: Thresholds, detail: str) -> Check:
    worst = _worst_low(worst_per_doc)
    return Check(
        name="late_chunking.min_cosine",
        gate="quality",
        status=_ge(worst, t.late_chunk_min_cosine),
        value=worst,
        threshold=t.late_chunk_min_cosine,
        op=">=",
        detail=f"every chunk of {len(worst_per_doc)} documents ({detail}); worst document "
        f"#{_arg(worst_per_doc, high=False)}",
    )


def not_served(names: list[str], reason: str) -> list[Check]:
    return [
        Check(name=n, gate="quality", status="n/a", detail=f"{NOT_SERVED}: {reason}") for n in names
    ]


def not_applicable(names: list[str], reason: str) -> list[Check]:
    return [Check(name=n, gate="quality", status="n/a", detail=reason) for n in names]


def output_verdict(output: str, checks: list[Check], reason: str | None = None) -> OutputVerdict:
    """One output's verdict from its checks: `fail` when any failed, else `not served` when
    the lane refused it (`reason`), else `n/a` when nothing was judged, else `pass`."""
    names = [c.name for c in checks]
    if any(c.status == "fail" for c in checks):
        failing = ", ".join(c.name for c in checks if c.status == "fail")
        return OutputVerdict(
            output=output, status="fail", checks=names, detail=f"failing: {failing}"
        )
    if reason is not None:
        return OutputVerdict(
            output=output, status="not served", checks=names, detail=f"{NOT_SERVED}: {reason}"
        )
    if checks and all(c.status == "n/a" for c in checks):
        return OutputVerdict(output=output, status="n/a", checks=names, detail=checks[0].detail)
    return OutputVerdict(output=output, status="pass", checks=names)


def _worst_low(values: np.ndarray) -> float:
    # NaN is a result too, and the worst one: it passes no comparison.
    return float("nan") if np.isnan(values).any() else float(values.min()) if values.size else 1.0


def _worst_high(values: np.ndarray) -> float:
    return float("nan") if np.isnan(values).any() else float(values.max()) if values.size else 0.0


def _arg(values: np.ndarray, high: bool) -> int:
    if not values.size:
        return 0
    v = np.where(np.isnan(values), np.inf if high else -np.inf, values)
    return int(np.argmax(v) if high else np.argmin(v))


def _ge(value: float, threshold: float) -> CheckStatus:
    return "pass" if value >= threshold else "fail"


def _le(value: float, threshold: float) -> CheckStatus:
    return "pass" if value <= threshold else "fail"
