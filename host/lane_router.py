"""Which of a model's lanes should take a request: the one expected to finish it first.

A model served by two lanes (a Core ML lane and a llama.cpp lane whose vectors agree) sends
each request to one of them. The Neural Engine wins single-request latency and the GPU (or
the CPU's wide batches) wins bulk throughput, so no fixed rule is right on every machine:
each lane's latency curve — seconds for 1, 4, 16 and 64 items at the model's typical length,
measured on this machine (at certification, or at load) — says what a request of n items
costs there, and the items already queued or running on the lane say how long it is busy.

Lanes also differ in what they serve: llama.cpp refuses a ColBERT query side whose expansion
tokens must be hidden even from themselves (its attention cannot express that mask), and a
Core ML lane admitted with no shape whose graph gives token outputs refuses every token-level
output. Each worker declares what it refuses when it loads (`LOADED.refuses`); a request for
token-level outputs (`Ask`) goes only to the lanes that serve it (`refusal`), the size rule
choosing among those; when no lane serves it, the size rule chooses among them all and the
lane refuses it with its reason.

`route` is a pure function of those numbers (no clock, no I/O), so its rule is proved by
table tests; host.routed_lanes keeps the per-lane counts and calls it.

When the lanes cannot serve together (their vectors disagree, or one cannot load), one lane
serves alone: `better_certified` orders the candidates, also a pure function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from workers.protocol import messages as m

# The batch sizes a latency curve is measured at.
CURVE_ITEMS: tuple[int, ...] = (1, 4, 16, 64)


class LatencyCurve(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds a lane takes for `items[i]` inputs of about `tokens` tokens each, one request."""

    items: list[int]
    seconds: list[float]
    tokens: int = 0  # the typical length the curve was measured at

    def __post_init__(self) -> None:
        if not self.items or len(self.items) != len(self.seconds):
            raise ValueError("a latency curve needs one time per item count, at least one")
        if any(b <= a for a, b in zip(self.items, self.items[1:], strict=False)):
            raise ValueError(f"latency curve item counts must increase: {self.items}")
        if self.items[0] < 1 or any(not (0 <= s < math.inf) for s in self.seconds):
            raise ValueError("latency curve: item counts >= 1 and finite times >= 0")


def expected_seconds(curve: LatencyCurve, items: int) -> float:
    """Seconds `curve`'s lane is expected to take for `items` inputs: piecewise linear between
    the measured points, from 0 s at 0 items below the first, and past the last at the last
    segment's cost per item (bulk grows linearly once the lane's batches are full)."""
    if items <= 0:
        return 0.0
    xs, ys = curve.items, curve.seconds
    if items <= xs[0]:
        return ys[0] * items / xs[0]
    for i in range(1, len(xs)):
        if items <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (items - x0) / (x1 - x0)
    if len(xs) == 1:
        per_item = ys[0] / xs[0]
    else:
        per_item = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return ys[-1] + per_item * (items - xs[-1])


def expected_finish(curve: LatencyCurve, queued: int, items: int) -> float:
    """When a request of `items` would be done on a lane with `queued` items ahead of it
    (queued or running): the lane works through those first, then this request."""
    return expected_seconds(curve, queued) + expected_seconds(curve, items)


@dataclass(frozen=True)
class Ask:
    """What a request asks of a lane beyond what every lane serves: ENCODE's outputs, read on
    each of `sides` (a multi-vector rerank reads the query side and the document side)."""

    outputs: tuple[str, ...]
    sides: tuple[str, ...] = ("document",)


def refusal(refuses: Sequence[m.Refusal], ask: Ask | None) -> str | None:
    """Why a lane that declared `refuses` would refuse `ask`, None when it serves it (and
    always None for a request that asks nothing of the kind: `ask` None). A refusal with no
    side covers every side."""
    if ask is None:
        return None
    for r in refuses:
        if r.output in ask.outputs and (r.side is None or r.side in ask.sides):
            where = f" ({r.side} side)" if r.side else ""
            return f"{r.output}{where}: {r.reason}"
    return None


def route(
    curves: Mapping[str, LatencyCurve],
    queued: Mapping[str, int],
    items: int,
    refused: Mapping[str, str] | None = None,
) -> str:
    """The lane of `curves` expected to finish a request of `items` inputs first, given the
    items each lane has queued or in flight (`queued`; absent: none), among the lanes that
    serve it: a lane in `refused` (lane -> why) is passed over unless every lane is, and
    then the rule chooses among them all (the lane refuses the request with its reason). A
    tie goes to the lane listed first, so the caller's order is its preference."""
    if not curves:
        raise ValueError("route: no lanes to choose from")
    serving = {lane: c for lane, c in curves.items() if lane not in (refused or {})}
    best, best_t = "", math.inf
    for lane, curve in (serving or curves).items():
        t = expected_finish(curve, max(0, queued.get(lane, 0)), items)
        if t < best_t:
            best, best_t = lane, t
    return best or next(iter(serving or curves))


class ReferenceFit(msgspec.Struct, frozen=True, kw_only=True):
    """How close a lane's certificate found it to the fp32 reference on the certification
    corpus: the worst item's distance, the same measure for every lane of one model."""

    certificate: str  # the certificate id
    error: float  # embedders: 1 - min cosine; rerankers and classifiers: max |score error|
    measure: str = "1 - min cos"  # what `error` is, for reasons ("max score error")

    def describe(self) -> str:
        return f"{self.measure} {self.error:.2e}, certificate {self.certificate}"


def better_certified(lanes: Sequence[str], fits: Mapping[str, ReferenceFit]) -> list[str]:
    """The lanes of `lanes` that may serve a model alone when they cannot serve it together
    (their vectors disagree, or one cannot load), best first.

    The rule: only a lane certified for this machine is a candidate (`fits` holds exactly
    those: an uncertified lane was never judged against the reference, so nothing says it is
    the right one of two that disagree); among them the closer to the reference (the lower
    worst-item error its certificate measured; a non-finite error counts as the farthest);
    a tie goes to the lane listed first. The caller skips a lane that cannot load and takes
    the next; with none, the single-lane rule applies."""
    ranked = [lane for lane in lanes if lane in fits]

    def closeness(lane: str) -> tuple[float, int]:
        error = fits[lane].error
        return (error if math.isfinite(error) else math.inf, ranked.index(lane))

    return sorted(ranked, key=closeness)
