"""The token-level outputs of an embedder, judged on a real lane against their references
(certification.reference.token_kinds): one certificate, one verdict per output.

    judged = await judge_kinds(client, ref_dir, texts, thresholds, measured, progress)

What each output is judged on (the gates: certification.kind_gates):

- sparse (SPLADE, inference-free SPLADE, bge-m3's lexical weights): every judged corpus item
  on the document route, and on the query route where it is not the document's (inference-
  free SPLADE: the static weights of the text's bare ids, no forward pass). The reference is
  given the ids the lane encoded.
- multivector (ColBERT, bge-m3): every judged corpus item as a document and every retrieval
  query as a query (bge-m3 has one side), then MaxSim of every query against every judged
  document. ColBERT's reference builds its own ids from the text (prefix, cut, expansion are
  part of the model); items holding a special token's text are left out of that comparison,
  since the host tokenizes such text as text by policy while the reference parses the token.
- late_chunking (any mean-pooled embedder): multi-chunk documents of the corpus (its long
  paragraphs cut at their sentences, and one document read in several context windows).

A lane that refuses an output (a worker ERR `unsupported`: no head for it, a query it cannot
mask as the model does; `shape_unsupported`: a Core ML lane none of whose admitted shapes holds
an item) leaves that output `not served` with the lane's reason, never passed. A Core ML lane
admitted with packed shapes only serves every token-level output, and is judged on them. A run
told to leave the token-level outputs out (`RunOptions.token_outputs`) records each one beside
a pooled vector `n/a`, not judged.
A model without a pooled vector is fingerprinted on its own output over the probe set.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from certification import kind_gates as kg
from certification.certificate import Check, KindMeasurements, Measurements, OutputVerdict
from certification.corpus import SENTENCES, late_chunking_documents, probe_set, queries
from certification.lane_client import LaneClient, NotServed
from certification.oracle import ST, ST_INSTALL
from certification.thresholds import Thresholds
from formats.multivector_head import maxsim
from host.sanitize import sanitize
from ingest.multivector_heads import detect as multivector_kind
from ingest.sparse_heads import sparse_source
from ingest.store import served_outputs

SPARSE_CHECKS = ["sparse.active_set", "sparse.max_value_rel_error", "sparse.min_cosine"]
MULTIVECTOR_CHECKS = [
    "multivector.token_count",
    "multivector.min_cosine",
    "multivector.maxsim_max_abs_error",
]
LATE_CHECKS = ["late_chunking.min_cosine"]
# The reason an output beside a pooled vector carries when the run leaves it out.
UNJUDGED = "not judged in this run: token-level outputs left out (RunOptions.token_outputs)"
LONG_DOCUMENT_SENTENCES = 4096  # at most this many: past 2 x 32k tokens


class _Progress(Protocol):  # certification.runner.Progress, which imports this module
    def start(self, key: str, description: str, total: int) -> None: ...
    def advance(self, key: str, n: int = 1) -> None: ...


@dataclass
class KindsJudged:
    checks: list[Check] = field(default_factory=list)
    outputs: list[OutputVerdict] = field(default_factory=list)
    probe: np.ndarray | None = None  # fingerprint values of a model without a dense output


async def judge_kinds(
    client: LaneClient,
    ref_dir: str | Path,
    texts: list[str],
    t: Thresholds,
    measured: Measurements,
    progress: _Progress,
    batch_size: int = 8,
    sample_stride: int = 1,
    judge: str = ST,
    token_outputs: bool = True,
) -> KindsJudged:
    """`judge`: the run's reference (certification.oracle); the token-level kinds are judged
    by transformers / sentence-transformers only, so under the numpy reference each output
    is `n/a` with that reason. `token_outputs=False` leaves the outputs beside a pooled
    vector unjudged, each `n/a` saying so (runs that certify for another purpose: the long
    late-chunking documents cost more than the dense corpus pass); a model without a pooled
    vector is judged on its token outputs regardless, since they are all it serves."""
    record = client.record
    served = served_outputs(record.manifest)
    if judge != ST:
        why = f"token-level outputs are judged by sentence-transformers only ({ST_INSTALL})"
        return _unjudged(served, why)
    if not token_outputs and "dense" in served:
        return _unjudged(served, UNJUDGED)
    out = KindsJudged()
    from certification.reference.token_kinds import KindsReference

    ref = KindsReference(ref_dir)
    need_probe = "dense" not in served  # else the dense vectors are the fingerprint
    probes: list[np.ndarray] = []
    if "sparse" in served:
        checks, verdict, probe = await _judge_sparse(
            client, ref, Path(ref_dir), texts, t, measured, progress, batch_size, need_probe
        )
        out.checks += checks
        out.outputs.append(verdict)
        probes.append(probe)
    if "multivector" in served:
        checks, verdict, probe = await _judge_multivector(
            client, ref, Path(ref_dir), texts, t, measured, progress, batch_size, need_probe
        )
        out.checks += checks
        out.outputs.append(verdict)
        probes.append(probe)
    if "dense" in served:
        pooling = record.manifest.pooling or "mean"
        if "tokens" not in served or pooling != "mean":
            why = f"late chunking pools by the mean; this model pools by {pooling}"
            checks = kg.not_applicable(LATE_CHECKS, why)
            out.checks += checks
            out.outputs.append(kg.output_verdict("late_chunking", checks))
        else:
            checks, verdict = await _judge_late(client, ref, t, measured, progress, sample_stride)
            out.checks += checks
            out.outputs.append(verdict)
    elif probes:
        out.probe = np.concatenate([p.reshape(-1) for p in probes])
    return out


def _unjudged(served: list[str], why: str) -> KindsJudged:
    """Every token-level output of the model `n/a` with `why`."""
    out = KindsJudged()
    for output, names in (
        ("sparse", SPARSE_CHECKS),
        ("multivector", MULTIVECTOR_CHECKS),
        ("late_chunking", LATE_CHECKS),
    ):
        if output in served or (output == "late_chunking" and "dense" in served):
            checks = kg.not_applicable(names, why)
            out.checks += checks
            out.outputs.append(kg.output_verdict(output, checks))
    return out


# ---- sparse ------------------------------------------------------------------------------------


async def _judge_sparse(
    client: LaneClient,
    ref,
    ref_dir: Path,
    texts: list[str],
    t: Thresholds,
    measured: Measurements,
    progress: _Progress,
    batch_size: int,
    need_probe: bool,
) -> tuple[list[Check], OutputVerdict, np.ndarray]:
    source = sparse_source(ref_dir)
    head = client.record.manifest.heads["sparse"]
    routes = ["document"] + (["query"] if head.bare_query else [])
    items: list[kg.SparseItem] = []
    said = []
    probe = np.zeros(0, np.float32)
    progress.start("sparse", "sparse: lane and reference", len(texts) * len(routes))
    for side in routes:
        try:
            lane, ids = await _encode_all(client, texts, "sparse", side, batch_size)
            if side == "document" and need_probe:
                probe = _dense_probe(await _encode_all(client, probe_set(), "sparse", side, 64))
        except NotServed as exc:
            checks = kg.not_served(SPARSE_CHECKS, f"{side} side: {exc}")
            return checks, kg.output_verdict("sparse", checks, f"{side} side: {exc}"), probe
        if source == "bge_m3":
            want = await asyncio.to_thread(ref.m3_lexical_weights, ids)
        else:
            want = await asyncio.to_thread(ref.splade, ids, side)
        rel, floor = t.sparse_value_rel, t.sparse_value_floor
        items += [kg.compare_sparse(a, b, rel, floor) for a, b in zip(lane, want, strict=True)]
        progress.advance("sparse", len(texts))
        what = "static weights of the bare ids" if side == "query" else "with a forward pass"
        said.append(f"{side} route ({what})")
    judge = "FlagEmbedding's lexical weights" if source == "bge_m3" else "SparseEncoder"
    measured.kinds["sparse"] = KindMeasurements(
        cosines=[_num(it.cosine) for it in items],
        value_errors=[_num(it.value_rel) for it in items],
        n_items=len(items),
    )
    checks = kg.sparse_checks(items, t, f"{', '.join(said)}; against {judge}")
    return checks, kg.output_verdict("sparse", checks), probe


def _dense_probe(got: tuple[list, list]) -> np.ndarray:
    """The probe set's sparse vectors as dense rows over the largest id seen (fingerprint)."""
    vectors = got[0]
    width = 1 + max((int(i.max()) for i, _ in vectors if i.size), default=0)
    rows = np.zeros((len(vectors), width), np.float32)
    for r, (i, v) in enumerate(vectors):
        rows[r, i] = v
    return rows


# ---- multi-vector ------------------------------------------------------------------------------


async def _judge_multivector(
    client: LaneClient,
    ref,
    ref_dir: Path,
    texts: list[str],
    t: Thresholds,
    measured: Measurements,
    progress: _Progress,
    batch_size: int,
    need_probe: bool,
) -> tuple[list[Check], OutputVerdict, np.ndarray]:
    colbert = multivector_kind(ref_dir) == "colbert"
    qs = queries()
    progress.start("multivector", "multi-vector: lane and reference", len(texts) + len(qs))
    refused: str | None = None
    sides: dict[str, tuple[list[str], list, list]] = {}
    probe = np.zeros(0, np.float32)
    skip: set[str] = set()
    if colbert:
        specials = await asyncio.to_thread(ref.special_strings)
        skip = {x for x in [*texts, *qs] if any(s in x for s in specials)}
    for side, items in (("document", texts), ("query", qs)):
        lane_side = side if colbert else "document"  # bge-m3 reads both alike
        try:
            lane, ids = await _encode_all(client, items, "multivector", lane_side, batch_size)
            if side == "document" and need_probe:
                pv, _ = await _encode_all(client, probe_set(), "multivector", lane_side, 64)
                probe = np.concatenate(pv) if pv else probe
        except NotServed as exc:
            refused = f"{side} side: {exc}"
            progress.advance("multivector", len(items))
            continue
        if colbert:
            want = await asyncio.to_thread(ref.colbert, [sanitize(x) for x in items], side)
        else:
            want = await asyncio.to_thread(ref.m3_colbert_vecs, ids)
        sides[side] = (items, lane, want)
        progress.advance("multivector", len(items))
    if not sides:
        checks = kg.not_served(MULTIVECTOR_CHECKS, refused or "")
        return checks, kg.output_verdict("multivector", checks, refused), probe
    differ, worst = [], []
    k = 0
    for items, lane, want in sides.values():
        for text, a, b in zip(items, lane, want, strict=True):
            if text in skip:
                continue
            if a.shape != b.shape:  # judged by the count; no vector pairs to compare
                differ.append(k)
                worst.append(float("nan"))
            else:
                worst.append(float(kg.vector_cosines(a, b).min()) if len(a) else 1.0)
            k += 1
    errors, lengths = np.zeros(0), np.zeros(0)
    if "query" in sides and "document" in sides:
        docs = [(x, a, b) for x, a, b in zip(*sides["document"], strict=True) if x not in skip]
        qrs = [(x, a, b) for x, a, b in zip(*sides["query"], strict=True) if x not in skip]
        lane_scores = np.array([[maxsim(q[1], d[1]) for d in docs] for q in qrs], np.float64)
        ref_scores = await asyncio.to_thread(ref.maxsim, [q[2] for q in qrs], [d[2] for d in docs])
        errors = np.abs(lane_scores - ref_scores).reshape(-1)
        lengths = np.repeat([len(q[2]) for q in qrs], len(docs))
    judge = "MultiVectorEncoder" if colbert else "FlagEmbedding's colbert_vecs"
    detail = f"corpus items as documents, retrieval queries as queries; against {judge}"
    if skip:
        detail += (
            f"; {len(skip)} items holding a special token's text left out (the host reads "
            "it as text, the reference as the token)"
        )
    compared = [c for j, c in enumerate(worst) if j not in set(differ)]
    worst_arr = np.array(compared, np.float64)
    measured.kinds["multivector"] = KindMeasurements(
        cosines=[_num(c) for c in worst],
        maxsim_errors=[_num(e) for e in errors],
        n_items=len(worst),
        skipped=len(skip),
    )
    checks = kg.multivector_checks(differ, len(worst), worst_arr, errors, lengths, t, detail)
    if refused is not None:
        checks[-1] = kg.not_served([checks[-1].name], refused)[0]
    return checks, kg.output_verdict("multivector", checks, refused), probe


# ---- late chunking -----------------------------------------------------------------------------


async def _judge_late(
    client: LaneClient,
    ref,
    t: Thresholds,
    measured: Measurements,
    progress: _Progress,
    sample_stride: int,
) -> tuple[list[Check], OutputVerdict]:
    context = client.record.manifest.max_tokens
    tok = await client.tokenizer()
    docs = [list(d) for d in late_chunking_documents()[::sample_stride]]
    docs.append(_long_document(tok, context))
    progress.start("late", "late chunking: lane and reference", len(docs))
    worst, windows = [], []
    for chunks in docs:
        try:
            lane = await client.late_chunk(chunks)
        except NotServed as exc:
            checks = kg.not_served(LATE_CHECKS, str(exc))
            return checks, kg.output_verdict("late_chunking", checks, str(exc))
        want, n_windows = await asyncio.to_thread(
            ref.late_chunks, [sanitize(c) for c in chunks], context
        )
        worst.append(float(kg.vector_cosines(lane, want).min()))
        windows.append(n_windows)
        progress.advance("late", 1)
    n_chunks = sum(len(d) for d in docs)
    windowed = sum(w > 1 for w in windows)
    detail = (
        f"{n_chunks} chunks; {windowed} documents longer than the {context}-token context, "
        f"read in up to {max(windows)} windows; against transformers' last_hidden_state "
        "pooled by the same character offsets"
    )
    measured.kinds["late_chunking"] = KindMeasurements(
        cosines=[_num(c) for c in worst], n_items=len(docs)
    )
    checks = [kg.late_chunking_check(np.array(worst, np.float64), t, detail)]
    return checks, kg.output_verdict("late_chunking", checks)


def _long_document(tok, context: int) -> list[str]:
    """The base sentences in order (again from the first when they run out), one chunk each,
    until the document spans more than two of the model's contexts: late chunking must read
    it in overlapping windows."""
    doc: list[str] = []
    for k in range(LONG_DOCUMENT_SENTENCES):
        doc.append(SENTENCES[k % len(SENTENCES)] + " ")
        if len(tok.tokenize(["".join(doc)], add_special_tokens=False)[0].ids) > 2 * context:
            break
    return doc


# ---- shared ------------------------------------------------------------------------------------


async def _encode_all(
    client: LaneClient, texts: list[str], output: str, side: str, batch_size: int
) -> tuple[list, list[np.ndarray]]:
    """One output of every text through the lane, in serving-sized requests, and the ids it
    encoded per text."""
    got: list = []
    ids: list[np.ndarray] = []
    for start in range(0, len(texts), batch_size):
        result, _ = await client.encode(texts[start : start + batch_size], [output], side)
        got += getattr(result, output)
        ids += result.token_ids
    return got, ids


def _num(x: float) -> float | None:
    return None if not np.isfinite(x) else round(float(x), 9)
