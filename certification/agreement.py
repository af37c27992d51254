"""What routing between two lanes of one model needs measured: how closely the lanes agree,
and what each costs for a request of n items.

- `measure_agreement`: the certification corpus through every lane; embedding models: the
  least cosine between the lanes' vectors of one item (a model without a pooled vector: its
  own output, read as a document: every multi-vector's cosine with the same vector of the
  other lane, or the cosine of the two sparse vectors); cross-encoders: whether every query
  ranks its documents in the same order on every lane. Two lanes serve one model only when
  it passes (host.lane_policy.AGREEMENT_MIN_COS): an index must not mix two models.
- `measure_curve`: seconds for 1, 4, 16 and 64 items at the corpus's typical (median)
  length, on this machine, the best of a few runs after a warm-up (a first request may
  compile a Core ML shape): what host.lane_router interpolates.

Both run through a `Module` on an explicitly named lane, so they measure exactly what serves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from certification.corpus import corpus, queries
from host.lane_policy import Agreement
from host.lane_router import CURVE_ITEMS, LatencyCurve
from ingest.store import served_outputs

if TYPE_CHECKING:
    from host.module import Module

CURVE_RUNS = 2  # timed runs per point after the warm-up; the best counts
_CHUNK = 32  # corpus items per embed call (well under any admission budget)


async def measure_agreement(
    module: Module,
    model: str,
    lanes: Sequence[str],
    sample_stride: int = 1,
    certificates: Sequence[str] = (),
    source: str = "load",
) -> Agreement:
    """The agreement of the loaded `lanes` of `model` on the certification corpus (every
    `sample_stride`-th item)."""
    if len(lanes) < 2:
        raise ValueError("agreement compares two lanes or more")
    texts = list(corpus())[::sample_stride]
    certs = list(certificates) or [""] * len(lanes)
    if module.record(model).kind == "rerank":
        same = await _same_order(module, model, lanes, texts)
        return Agreement(
            lanes=list(lanes),
            n_items=len(texts),
            same_order=same,
            certificates=certs,
            source=source,
        )
    outs = served_outputs(module.record(model).manifest)
    # The pooled vector, else the model's own head's output (what an index would hold).
    output = "dense" if "dense" in outs else next((o for o in outs if o != "tokens"), outs[0])
    if output == "dense":
        vectors = [await _embed_all(module, model, lane, texts) for lane in lanes]
        first = vectors[0].astype(np.float64)
        least = min(
            float(np.min(np.sum(first * v.astype(np.float64), axis=1))) for v in vectors[1:]
        )
    else:
        got = [await _own_output_all(module, model, lane, texts, output) for lane in lanes]
        least = min(
            least_cosine(a, b, output)
            for other in got[1:]
            for a, b in zip(got[0], other, strict=True)
        )
    return Agreement(
        lanes=list(lanes),
        n_items=len(texts),
        min_cosine=round(least, 9) if np.isfinite(least) else None,
        certificates=certs,
        source=source,
    )


async def _embed_all(module: Module, model: str, lane: str, texts: list[str]) -> np.ndarray:
    out = []
    for start in range(0, len(texts), _CHUNK):
        # No prompt: the same input on every lane, as certification judges it.
        result = await module.embed(
            texts[start : start + _CHUNK], model=model, normalize=True, prompt="", lane=lane
        )
        out.append(result.vectors)
    return np.concatenate(out)


async def _own_output_all(
    module: Module, model: str, lane: str, texts: list[str], output: str
) -> list:
    """A model's own output of every text (no pooled vector: sparse or multi-vector), as a
    document, no prompt."""
    out: list = []
    for start in range(0, len(texts), _CHUNK):
        result = await module.encode_outputs(
            texts[start : start + _CHUNK], [output], model, prompt="", lane=lane
        )
        out += getattr(result, output)
    return out


def least_cosine(a, b, output: str) -> float:
    """The least cosine between two lanes' `output` of one item: every multi-vector against
    the same vector of the other lane (a different count never agrees), or the two sparse
    vectors (an id kept on one lane only counts against them)."""
    if output == "sparse":
        (ia, va), (ib, vb) = a, b
        width = 1 + max(int(ia.max(initial=0)), int(ib.max(initial=0)))
        x, y = np.zeros(width), np.zeros(width)
        x[ia], y[ib] = va, vb
        a, b = x[None], y[None]
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return -1.0
    if a.size == 0:
        return 1.0
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cos = np.sum(a * b, axis=1) / np.maximum(na * nb, 1e-30)
    return float(np.min(np.where((na == 0) & (nb == 0), 1.0, cos)))  # two zeros agree


async def _same_order(module: Module, model: str, lanes: Sequence[str], texts: list[str]) -> bool:
    """Every query's documents (the corpus round-robin over the queries, as certification
    groups them) ranked in one order by every lane."""
    qs = queries()
    groups: dict[int, list[str]] = {}
    for j, text in enumerate(texts):
        groups.setdefault(j % len(qs), []).append(text)
    for qi, docs in groups.items():
        orders = set()
        for lane in lanes:
            result = await module.rerank(qs[qi], docs, model=model, lane=lane)
            orders.add(tuple(i for i, _ in result.results))
        if len(orders) > 1:
            return False
    return True


async def measure_curve(module: Module, model: str, lane: str) -> LatencyCurve:
    """Seconds the loaded `lane` of `model` takes for each of CURVE_ITEMS inputs of the
    corpus's median length, one request each (the best of CURVE_RUNS after a warm-up)."""
    tok = await module.tokenizer(model, lane=lane)
    texts = list(corpus())
    encoded = tok.encode(texts, truncate=True)
    order = sorted(range(len(texts)), key=lambda i: int(encoded.n_tokens[i]))
    mid = order[len(order) // 2]
    record = module.record(model)
    rerank = record.kind == "rerank"
    served = served_outputs(record.manifest)
    query = queries()[0]

    async def one(k: int) -> float:
        start = time.perf_counter()
        if rerank:
            await module.rerank(query, [texts[mid]] * k, model=model, lane=lane)
        elif "dense" in served:
            await module.embed_token_ids([encoded.ids[mid]] * k, model, lane=lane)
        else:  # a sparse or multi-vector model: its own output is what its calls cost
            await module.encode_token_ids([encoded.ids[mid]] * k, served[:1], model, lane=lane)
        return time.perf_counter() - start

    seconds = []
    for k in CURVE_ITEMS:
        await one(k)  # warm-up: a first request of a size may compile or plan it
        seconds.append(round(min([await one(k) for _ in range(CURVE_RUNS)]), 6))
    return LatencyCurve(items=list(CURVE_ITEMS), seconds=seconds, tokens=int(encoded.n_tokens[mid]))
