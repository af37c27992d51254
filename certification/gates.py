"""The two gates and the verdict: pure functions from measurements to named checks.

Quality gate: per-item cosine (min, mean), retrieval top-10 agreement, rerank score error,
tokenizer agreement — each against the threshold table. Placement gate (Core ML lanes only):
the Neural Engine share reported after admission; a share from a static `estimate` can at
most be `provisional`; a `compute_plan` share (Core ML's own MLComputePlan) passes only when
this machine has a Neural Engine and the share meets the threshold. Without one (a hosted
macOS VM) Core ML plans for devices that are not there: `provisional`, with that reason.

Verdict: `failed` if any gating check failed (every one is named), else `provisional` if the
placement check is provisional, else `certified`.
"""

from __future__ import annotations

import numpy as np

from certification.certificate import Check, CheckStatus, Status
from certification.thresholds import Thresholds

TOP_K = 10


def cosine_checks(cosines: np.ndarray, t: Thresholds) -> list[Check]:
    worst = int(np.argmin(cosines))
    lo, mean = float(cosines.min()), float(cosines.mean())
    return [
        Check(
            name="quality.min_cosine",
            gate="quality",
            status=_ge(lo, t.min_cosine),
            value=lo,
            threshold=t.min_cosine,
            op=">=",
            detail=f"worst item #{worst} of {len(cosines)}",
        ),
        Check(
            name="quality.mean_cosine",
            gate="quality",
            status=_ge(mean, t.mean_cosine),
            value=mean,
            threshold=t.mean_cosine,
            op=">=",
            detail=f"over {len(cosines)} items",
        ),
    ]


def per_item_cosine(lane: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Cosine per row, computed in float64 (both sides re-normalized: the lane's own
    normalization is not what is being judged)."""
    a, b = lane.astype(np.float64), ref.astype(np.float64)
    num = np.sum(a * b, axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-30)


def top_k_overlap(
    q_lane: np.ndarray, d_lane: np.ndarray, q_ref: np.ndarray, d_ref: np.ndarray, k: int = TOP_K
) -> np.ndarray:
    """Per query, |top-k(lane) ∩ top-k(reference)| / k by cosine over the documents."""
    k = min(k, d_lane.shape[0])
    lane_top = np.argsort(-(q_lane @ d_lane.T), axis=1, kind="stable")[:, :k]
    ref_top = np.argsort(-(q_ref @ d_ref.T), axis=1, kind="stable")[:, :k]
    return np.array([len(set(a) & set(b)) / k for a, b in zip(lane_top, ref_top, strict=True)])


def retrieval_check(overlap: np.ndarray, t: Thresholds) -> Check:
    mean = float(overlap.mean())
    return Check(
        name="quality.retrieval_top10",
        gate="quality",
        status=_ge(mean, t.retrieval_top10),
        value=mean,
        threshold=t.retrieval_top10,
        op=">=",
        detail=f"{len(overlap)} queries, worst {float(overlap.min()):.2f}",
    )


def rerank_check(errors: np.ndarray, t: Thresholds, note: str) -> Check:
    worst = float(errors.max())
    return Check(
        name="quality.rerank_max_abs_error",
        gate="quality",
        status="pass" if worst <= t.rerank_max_abs else "fail",
        value=worst,
        threshold=t.rerank_max_abs,
        op="<=",
        detail=f"{len(errors)} pairs, mean {float(errors.mean()):.2e}; {note}",
    )


def llm_rerank_bar(ref: np.ndarray, t: Thresholds) -> tuple[float, float]:
    """(bar, scale) for an LLM reranker's raw scores: rerank_max_abs + llm_rerank_rel x the
    reference's largest |score| over the judged pairs. The raw score is a dot product of the
    score row with the final normed state, so a lane's relative error in that state (fp16
    through every layer) reaches the score in proportion to the score's own range, not to
    the pair's score (a pair scoring 0 is off by as much as one scoring 8). The scale comes
    from the reference alone: a broken lane cannot widen its own bar."""
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    return t.rerank_max_abs + t.llm_rerank_rel * scale, scale


def llm_rerank_check(errors: np.ndarray, ref: np.ndarray, t: Thresholds, note: str) -> Check:
    bar, scale = llm_rerank_bar(ref, t)
    worst = float(errors.max())
    how = (
        f"bar {t.rerank_max_abs:g} + {t.llm_rerank_rel:g} x max|ref| {scale:.4g}"
        if t.llm_rerank_rel
        else f"bar {t.rerank_max_abs:g}"
    )
    return Check(
        name="quality.rerank_max_abs_error",
        gate="quality",
        status="pass" if worst <= bar else "fail",
        value=worst,
        threshold=bar,
        op="<=",
        detail=f"{len(errors)} pairs, mean {float(errors.mean()):.2e}; {how}; {note}",
    )


def label_score_checks(errors: np.ndarray, agree: np.ndarray, t: Thresholds) -> list[Check]:
    """A sequence classifier: every label's score within the rerank bar of the reference's,
    and the same top label on every item whose reference margin is wider than twice that bar
    (a closer call may flip within the allowed error without the lane being wrong)."""
    worst = float(errors.max())
    n_bad = int((~agree).sum())
    return [
        Check(
            name="quality.label_score_max_abs_error",
            gate="quality",
            status="pass" if worst <= t.rerank_max_abs else "fail",
            value=worst,
            threshold=t.rerank_max_abs,
            op="<=",
            detail=f"{len(errors)} items, every label; mean {float(errors.mean()):.2e}",
        ),
        Check(
            name="quality.top_label_agreement",
            gate="quality",
            status="pass" if n_bad == 0 else "fail",
            value=n_bad,
            threshold=0,
            op="<=",
            detail=f"items whose top label differs, of {len(agree)} with a clear reference margin",
        ),
    ]


def reversed_pairs(lane: np.ndarray, ref: np.ndarray, margin: float) -> int:
    """Document pairs of one query that the reference separates by more than `margin` and
    the lane ranks the other way round."""
    clear = (ref[:, None] - ref[None, :]) > margin  # [a, b]: the reference puts a above b
    return int((clear & (lane[:, None] <= lane[None, :])).sum())


def rerank_order_check(bad_queries: list[int], n_queries: int, margin: float) -> Check:
    """An LLM reranker ranks each query's documents in the reference's order. Near-ties are
    exempt: documents the reference separates by no more than `margin` (the error bar) may
    swap, since any lane within the bar can swap them (the reference's own gaps go down to
    7e-4 on the tiny seeded reranker; a healthy fp16 lane swaps five pairs of the whole
    corpus, none further apart than 4.2e-3), while a pair it separates by more must keep its
    order (a swap there is a fault the per-pair bar alone lets by)."""
    return Check(
        name="quality.rerank_same_order",
        gate="quality",
        status="pass" if not bad_queries else "fail",
        value=float(len(bad_queries)),
        threshold=0.0,
        op="<=",
        detail=f"{n_queries} queries; order differs on {bad_queries[:5] or 'none'} "
        f"(documents the reference separates by more than {margin:.3g})",
    )


def rerank_not_applicable(kind: str) -> Check:
    return Check(
        name="quality.rerank_max_abs_error",
        gate="quality",
        status="n/a",
        detail=f"{kind} model, not a cross-encoder",
    )


def embedding_not_applicable(kind: str) -> list[Check]:
    return [
        Check(name=name, gate="quality", status="n/a", detail=f"{kind} model")
        for name in ("quality.min_cosine", "quality.mean_cosine", "quality.retrieval_top10")
    ]


def tokenizer_check(mismatches: int, n_items: int, t: Thresholds) -> Check:
    ok = mismatches <= t.tokenizer_mismatches
    return Check(
        name="quality.tokenizer_agreement",
        gate="quality",
        status="pass" if ok else "fail",
        value=mismatches,
        threshold=t.tokenizer_mismatches,
        op="<=",
        detail=f"{mismatches} of {n_items} items tokenized differently",
    )


NO_NEURAL_ENGINE = (
    "Core ML lists no Neural Engine on this machine (a VM?): its compute "
    "plan proves nothing about Neural Engine placement"
)


def placement_check(
    lane: str,
    share: float | None,
    source: str | None,
    t: Thresholds,
    neural_engine: bool | None = None,
) -> Check:
    """`neural_engine`: whether Core ML lists a Neural Engine here (None: not macOS)."""
    if t.placement_share is None:
        return Check(
            name="placement.share",
            gate="placement",
            status="n/a",
            detail=f"{lane} lane runs on the CPU: no Neural Engine placement to gate",
        )
    if share is None:
        return Check(
            name="placement.share",
            gate="placement",
            status="fail",
            threshold=t.placement_share,
            op=">=",
            detail="the lane reported no placement_share after admission",
        )
    detail = f"source: {source}"
    status: CheckStatus
    if share < t.placement_share:
        status = "fail"
    elif source == "compute_plan" and neural_engine:
        status = "pass"
    elif source == "compute_plan":
        status, detail = "provisional", f"{detail}; {NO_NEURAL_ENGINE}"
    else:  # a static estimate (or an unknown source) cannot prove where Core ML runs it
        status = "provisional"
    return Check(
        name="placement.share",
        gate="placement",
        status=status,
        value=float(share),
        threshold=t.placement_share,
        op=">=",
        detail=detail,
    )


def verdict(checks: list[Check]) -> tuple[Status, str, str, list[str]]:
    """(status, quality, placement, failing check names)."""
    failing = [c.name for c in checks if c.gate != "info" and c.status == "fail"]
    quality = "fail" if any(c.gate == "quality" and c.status == "fail" for c in checks) else "pass"
    placement_checks = [c for c in checks if c.gate == "placement"]
    if any(c.status == "fail" for c in placement_checks):
        placement = "fail"
    elif any(c.status == "provisional" for c in placement_checks):
        placement = "provisional"
    elif placement_checks and all(c.status == "n/a" for c in placement_checks):
        placement = "n/a"
    else:
        placement = "pass"
    if failing:
        status: Status = "failed"
    elif placement == "provisional":
        status = "provisional"
    else:
        status = "certified"
    return status, quality, placement, failing


def _ge(value: float, threshold: float) -> CheckStatus:
    return "pass" if value >= threshold else "fail"
