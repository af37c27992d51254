"""One certification run: drive a real lane through the host, judge it, write the certificate.

    cert = await certify(module, RunOptions(model="minilm-l6-v2", lane="llama"), store)

Steps: LOAD the lane (Core ML: admitting the requested shapes); tokenizer agreement over the
whole corpus; the corpus pass through the lane in serving-sized requests while the fp32
reference runs in a thread beside it (2 cores: one each); retrieval agreement on the
queries/documents split; the probe-set fingerprint; placement (Core ML, after admission);
both gates and drift against the previous certificate; unless the verdict is `failed`, the
lane's latency curve (what routing between two lanes reads) and the agreement with the
model's other lane when that lane holds a certificate that passed quality on this machine
(loaded as it was certified, the same corpus items through both); then the record.

`sample_stride` > 1 judges every k-th corpus item only (tests, smoke runs); it is recorded in
the certificate. Retrieval, tokenizer agreement and the fingerprint always use their full
fixed sets.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Protocol

import numpy as np

from certification import gates
from certification.agreement import measure_agreement, measure_curve
from certification.certificate import (
    Certificate,
    Check,
    CorpusInfo,
    Drift,
    Measurements,
    OutputVerdict,
)
from certification.corpus import corpus, documents, probe_set, queries
from certification.errors import ReferenceUnavailable
from certification.fingerprint import Fingerprint, digest_under, fingerprint
from certification.identity import CertificateKey, key_for
from certification.kind_gates import output_verdict
from certification.kinds import judge_kinds
from certification.lane_client import LaneClient
from certification.lane_policy import certified_load_extra, machine_differences
from certification.oracle import ST, ST_INSTALL, Oracle, reference_dir_for, select_reference
from certification.store import CertificateStore
from certification.thresholds import Thresholds, thresholds_for
from common.errors import SynapseError
from host.chat_pairs import ChatPairs
from host.lane_policy import Agreement
from host.module import Module
from host.sanitize import sanitize
from host.tokenization import Tokenizer
from ingest.sparse_heads import encoder_dir
from ingest.store import served_outputs
from workers.ane import apple_device

log = logging.getLogger("synapse.certification")

REFERENCE_CHUNK = 32  # items per reference call: progress granularity and cache unit


class Progress(Protocol):
    def start(self, key: str, description: str, total: int) -> None: ...
    def advance(self, key: str, n: int = 1) -> None: ...


class NullProgress:
    def start(self, key: str, description: str, total: int) -> None:
        pass

    def advance(self, key: str, n: int = 1) -> None:
        pass


@dataclass
class RunOptions:
    model: str
    lane: str = "llama"
    shapes: list[dict] | None = None  # Core ML shapes to admit: [{rows, seq_len, packed?}]
    sample_stride: int = 1
    batch_size: int = 8  # items per lane request in the corpus pass (serving-sized)
    reference_dir: str | None = None
    # The judge: None picks (`select_reference`: sentence-transformers where it imports, else
    # numpy for BERT); "numpy" or "sentence-transformers" insists on one.
    reference: str | None = None
    overrides: dict[str, float] = field(default_factory=dict)
    runtime_config_extra: dict | None = None  # e.g. test-only build_options (Core ML)
    save: bool = True
    agreement: bool = True  # measure agreement with the other lane when it is certified here
    # Measure the lane's latency curve (what routing reads; a certificate without one has it
    # measured at load). Off only for smoke runs and tests that judge quality alone.
    curve: bool = True
    # Judge the token-level outputs beside the pooled vector (late chunking of any mean-pooled
    # embedder; bge-m3's sparse and multi-vector). Off, each is `n/a` saying it was not judged
    # in this run: for tests that certify for another purpose (lanes' agreement, curves,
    # reports), since the late-chunking documents read several contexts through both lane
    # and reference. A model without a pooled vector is judged on them regardless.
    token_outputs: bool = True


@dataclass
class _Judged:
    checks: list[Check]
    probe_values: np.ndarray
    grid: float


async def certify(
    module: Module,
    options: RunOptions,
    store: CertificateStore | None = None,
    progress: Progress | None = None,
) -> Certificate:
    started = time.perf_counter()
    store = store or CertificateStore()
    progress = progress or NullProgress()
    if options.sample_stride < 1 or options.batch_size < 1:
        raise ValueError("sample_stride and batch_size must be >= 1")
    client = LaneClient(module, options.model, options.lane)
    # The judge is settled before the lane loads: a model nothing here can judge (no HF
    # directory, no reference for its family) is refused without starting a worker.
    record = client.record
    ref_dir = options.reference_dir or str(reference_dir_for(record))
    reference = options.reference or select_reference(encoder_dir(Path(ref_dir)))
    oracle = Oracle(
        # An inference-free sparse model keeps its transformer and tokenizer in a route.
        encoder_dir(Path(ref_dir)),
        store.root / "reference-cache",
        pooling=record.manifest.pooling if record.kind == "embed" else "mean",
        reference=reference,
    )
    if record.kind == "embed" and "dense" not in served_outputs(record.manifest):
        if oracle.reference != ST:  # its outputs are all the numpy forward cannot judge
            raise ReferenceUnavailable(
                f"{options.model!r} has no pooled vector: its outputs are judged by "
                f"sentence-transformers only. Install the reference: {ST_INSTALL}"
            )
    progress.start("load", f"load {options.model} on the {options.lane} lane", 1)
    await client.load(options.shapes, options.runtime_config_extra)
    progress.advance("load")
    identity = client.identity()
    key = key_for(identity)
    thresholds = thresholds_for(identity.lane, identity.precision).with_overrides(options.overrides)
    tok = await client.tokenizer()
    texts = list(corpus())[:: options.sample_stride]
    measured = Measurements()

    checks = [_tokenizer_agreement(tok, oracle, thresholds, measured, progress)]
    outputs: list[OutputVerdict] = []
    if record.kind == "embed":
        served = served_outputs(record.manifest)
        if "dense" in served:
            judged = await _judge_embeddings(
                client, tok, oracle, texts, options, thresholds, measured, progress
            )
            checks += judged.checks + [gates.rerank_not_applicable("embedding")]
            outputs.append(output_verdict("dense", judged.checks))
        else:
            what = f"{'/'.join(k for k in served if k != 'tokens')} (no pooled vector)"
            checks += gates.embedding_not_applicable(what)
            checks.append(gates.rerank_not_applicable("embedding"))
        kinds = await judge_kinds(
            client,
            ref_dir,
            texts,
            thresholds,
            measured,
            progress,
            options.batch_size,
            options.sample_stride,
            judge=oracle.reference,
            token_outputs=options.token_outputs,
        )
        checks += kinds.checks
        outputs += kinds.outputs
        if "dense" not in served:
            probe = kinds.probe if kinds.probe is not None else np.zeros(0, np.float32)
            judged = _Judged([], probe, thresholds.fingerprint_grid_embed)
    elif record.manifest.llm_rerank is not None:
        judged = await _judge_llm_rerank(client, oracle, texts, thresholds, measured, progress)
        checks += gates.embedding_not_applicable("LLM reranker") + judged.checks
    elif record.kind == "rerank" and (record.manifest.n_labels or 1) > 1:
        judged = await _judge_classify(client, tok, oracle, texts, options, thresholds, measured)
        checks += gates.embedding_not_applicable("sequence classifier") + judged.checks
    elif record.kind == "rerank":
        if oracle.is_causal_reranker:
            # Its pairs are rendered through the model's chat template; the composer below
            # knows only the encoders' pair template, so it would judge other sequences.
            raise ValueError(
                f"{options.model!r} is a causal LM reranker: certifying one needs its pairs "
                "rendered through the model's template, which this runner does not do yet"
            )
        if not oracle.is_cross_encoder:
            raise ValueError(
                f"reference dir {ref_dir} is not a sequence-classification model "
                "(config.json architectures *ForSequenceClassification)"
            )
        judged = await _judge_rerank(
            client, tok, oracle, texts, options, thresholds, measured, progress
        )
        checks += gates.embedding_not_applicable("cross-encoder") + judged.checks
    else:
        raise ValueError(
            f"model {options.model!r} is a {record.kind} model: certification "
            "covers embedding and sequence-classification (rerank) models"
        )

    progress.start("placement", "placement after admission", 1)
    share, source = await client.placement()
    measured.placement_share, measured.placement_source = share, source
    measured.placement_ops = await client.placement_ops()
    checks.append(
        gates.placement_check(
            identity.lane,
            share,
            source,
            thresholds,
            apple_device.neural_engine_present() if identity.lane == "ane" else None,
        )
    )
    progress.advance("placement")
    fp = fingerprint(judged.probe_values, judged.grid)
    drift = _drift(store, key, judged.probe_values)
    checks.append(_drift_check(fp, drift))
    status, quality, placement, failing = gates.verdict(checks)
    # The curve and the agreement are what routing between two lanes reads, and a lane whose
    # certificate failed never serves routed: a failed run measures neither (the curve's 255
    # requests are most of a Core ML run on the reference executor). Only embedding and rerank
    # calls are routed, so a classifier (labels, no relevance score to rank by) has no curve.
    routed = not (record.kind == "rerank" and (record.manifest.n_labels or 1) > 1)
    if status != "failed" and options.curve and routed:
        progress.start("curve", "latency curve (1, 4, 16, 64 items)", 1)
        measured.latency_curve = await measure_curve(module, options.model, options.lane)
        progress.advance("curve")
    agreement = None
    if status != "failed" and options.agreement:
        agreement = await _agreement(module, store, options, key.id, progress)
    cert = Certificate(
        id=key.id,
        key=key,
        status=status,
        quality=quality,  # type: ignore[arg-type]
        placement=placement,  # type: ignore[arg-type]
        failing=failing,
        checks=checks,
        thresholds=thresholds,
        overrides=dict(options.overrides),
        fingerprint=fp,
        drift=drift,
        corpus=CorpusInfo(
            n_items=len(texts),
            n_total=len(corpus()),
            sample_stride=options.sample_stride,
            digest=hashlib.sha256("\n".join(corpus()).encode()).hexdigest(),
            n_queries=len(queries()),
            n_documents=len(documents()),
            n_probe=len(probe_set()),
        ),
        measurements=measured,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        duration_s=round(time.perf_counter() - started, 3),
        synapse_version=_synapse_version(),
        reference_dir=str(ref_dir),
        reference=oracle.reference_name,
        provenance=record.manifest.provenance,
        agreement=agreement,
        outputs=outputs,
    )
    if options.save:
        store.save(cert)
    return cert


# ---- quality: tokenizer ----------------------------------------------------------------------


def _tokenizer_agreement(
    tok: Tokenizer, oracle: Oracle, t: Thresholds, measured: Measurements, progress: Progress
) -> Check:
    items = list(corpus())  # always the whole corpus: tokenization is cheap
    progress.start("tokenize", "tokenizer agreement", 1)
    lane_ids = tok.encode(items, truncate=True).ids
    ref_ids = oracle.tokenize(items)
    bad = [
        i
        for i, (a, b) in enumerate(zip(lane_ids, ref_ids, strict=True))
        if not np.array_equal(a, b)
    ]
    measured.tokenizer_mismatch_items = bad
    progress.advance("tokenize")
    return gates.tokenizer_check(len(bad), len(items), t)


# ---- quality: embeddings ---------------------------------------------------------------------


async def _judge_embeddings(
    client: LaneClient,
    tok: Tokenizer,
    oracle: Oracle,
    texts: list[str],
    options: RunOptions,
    t: Thresholds,
    measured: Measurements,
    progress: Progress,
) -> _Judged:
    ids = tok.encode(texts, truncate=True).ids  # exactly what Module.embed sends
    progress.start("reference", "fp32 reference forward", len(texts))
    ref_task = asyncio.create_task(asyncio.to_thread(_reference_embed, oracle, ids, progress))
    try:
        progress.start("lane", f"{client.lane} lane: corpus", len(texts))
        lane_vecs = []
        for start in range(0, len(texts), options.batch_size):
            batch = texts[start : start + options.batch_size]
            vecs, ms = await client.embed(batch)
            lane_vecs.append(vecs)
            measured.latencies_ms.append(round(ms, 3))
            measured.request_items.append(len(batch))
            progress.advance("lane", len(batch))
        lane = np.concatenate(lane_vecs)
        progress.start("retrieval", "retrieval split (queries x documents)", 2)
        qs, ds = queries(), documents()
        q_lane, _ = await client.embed(qs)
        d_lane, _ = await client.embed(ds)
        progress.advance("retrieval")
        progress.start("probe", "probe set (fingerprint)", 1)
        probe, _ = await client.embed(probe_set())
        progress.advance("probe")
        ref = await ref_task
    finally:
        if not ref_task.done():
            await asyncio.gather(ref_task, return_exceptions=True)  # never leak the thread
    q_ref = await asyncio.to_thread(oracle.embed, tok.encode(qs, truncate=True).ids)
    d_ref = await asyncio.to_thread(oracle.embed, tok.encode(ds, truncate=True).ids)
    progress.advance("retrieval")
    cos = gates.per_item_cosine(lane, ref)
    overlap = gates.top_k_overlap(q_lane, d_lane, q_ref, d_ref)
    measured.cosines = [round(float(c), 9) for c in cos]
    measured.retrieval_overlap = [float(o) for o in overlap]
    checks = gates.cosine_checks(cos, t) + [gates.retrieval_check(overlap, t)]
    return _Judged(checks, probe, t.fingerprint_grid_embed)


def _reference_embed(oracle: Oracle, ids: list[np.ndarray], progress: Progress) -> np.ndarray:
    out = []
    for start in range(0, len(ids), REFERENCE_CHUNK):
        chunk = ids[start : start + REFERENCE_CHUNK]
        out.append(oracle.embed(chunk))
        progress.advance("reference", len(chunk))
    return np.concatenate(out)


# ---- quality: cross-encoder rerank -----------------------------------------------------------


async def _judge_rerank(
    client: LaneClient,
    tok: Tokenizer,
    oracle: Oracle,
    texts: list[str],
    options: RunOptions,
    t: Thresholds,
    measured: Measurements,
    progress: Progress,
) -> _Judged:
    # Every judged corpus item is a document for one query (round-robin over queries()).
    qs = queries()
    groups: dict[int, list[str]] = {}
    for j, text in enumerate(texts):
        groups.setdefault(j % len(qs), []).append(text)
    composer = _pair_composer(client.lane, tok, oracle.n_token_types)
    progress.start("lane", f"{client.lane} lane: rerank pairs", len(texts))
    progress.start("reference", "fp32 reference forward", len(texts))
    lane_scores, ref_scores = [], []
    for qi, docs in groups.items():
        # The reference scores this group while the lane does: mypy cannot type the default-
        # argument lambda that binds the loop's values.
        ref_task = asyncio.create_task(
            asyncio.to_thread(lambda q=qs[qi], d=docs: oracle.scores(*composer(q, d)))  # type: ignore[misc]
        )
        scores, ms = await client.rerank(qs[qi], docs)
        measured.latencies_ms.append(round(ms, 3))
        measured.request_items.append(len(docs))
        progress.advance("lane", len(docs))
        lane_scores.append(scores)
        ref_scores.append(await ref_task)
        progress.advance("reference", len(docs))
    lane_all = np.concatenate(lane_scores).astype(np.float64)
    ref_all = np.concatenate(ref_scores).astype(np.float64)
    errors = np.abs(lane_all - ref_all)
    _record_scores(measured, lane_all, ref_all, t.rerank_max_abs)
    note = "reference with the model's own token types (1 on the document half)"
    progress.start("probe", "probe set (fingerprint)", 1)
    probe, _ = await client.rerank(qs[0], probe_set())
    progress.advance("probe")
    return _Judged([gates.rerank_check(errors, t, note)], probe, t.fingerprint_grid_rerank)


# ---- quality: sequence classifiers -----------------------------------------------------------


async def _judge_classify(
    client: LaneClient,
    tok: Tokenizer,
    oracle: Oracle,
    texts: list[str],
    options: RunOptions,
    t: Thresholds,
    measured: Measurements,
) -> _Judged:
    """Every corpus item classified by the lane, against transformers' pipeline scores of the
    same ids; the per-item error is its worst label's (recorded where rerank errors go)."""
    ids = tok.encode(texts, truncate=True).ids  # what the lane scores: the same cut
    ref = await asyncio.to_thread(oracle.label_scores, ids)
    rows = []
    for start in range(0, len(texts), options.batch_size):
        chunk = texts[start : start + options.batch_size]
        scores, ms = await client.classify(chunk)
        measured.latencies_ms.append(round(ms, 3))
        measured.request_items.append(len(chunk))
        rows.append(scores)
    lane = np.concatenate(rows).astype(np.float64)
    errors = np.abs(lane - ref).max(axis=1)
    measured.rerank_errors = [float(e) for e in errors]
    top2 = np.sort(ref, axis=1)[:, -2:] if ref.shape[1] > 1 else np.zeros((len(ref), 2))
    clear = (top2[:, 1] - top2[:, 0]) > 2 * t.rerank_max_abs
    agree = lane.argmax(axis=1)[clear] == ref.argmax(axis=1)[clear]
    probe, _ = await client.classify(probe_set())
    checks = gates.label_score_checks(errors, agree, t)
    return _Judged(checks, probe.reshape(-1), t.fingerprint_grid_rerank)


async def _judge_llm_rerank(
    client: LaneClient,
    oracle: Oracle,
    texts: list[str],
    t: Thresholds,
    measured: Measurements,
    progress: Progress,
) -> _Judged:
    """An LLM reranker against sentence-transformers' `CrossEncoder` raw scores of the same
    texts (it renders the pairs itself): the same order on every query, and the largest
    |raw difference| under the rerank bar. Judged with the model's default instruction. A
    pair over the limit is given to the reference as the lane cut it (document tokens first,
    the template kept), since sentence-transformers cuts the rendered text otherwise."""
    if oracle.reference != ST:
        raise ValueError("an LLM reranker is judged by sentence-transformers' CrossEncoder only")
    record = client.record
    path = record.tokenizer_path
    if path is None:
        raise ValueError(f"{record.name} has no tokenizer.json")
    spec = record.manifest.llm_rerank
    assert spec is not None
    fitter = ChatPairs(spec, path.read_text(encoding="utf-8"))
    limit = record.manifest.max_tokens
    qs = queries()
    groups: dict[int, list[str]] = {}
    for j, text in enumerate(texts):
        groups.setdefault(j % len(qs), []).append(text)
    instruction = spec.default_instruction
    progress.start("lane", f"{client.lane} lane: LLM rerank pairs", len(texts))
    progress.start("reference", "fp32 reference forward", len(texts))
    lane_scores, ref_scores = [], []
    for qi, docs in groups.items():
        fitted = [fitter.fit(sanitize(qs[qi]), sanitize(d), instruction, limit)[2:] for d in docs]
        ref_task = asyncio.create_task(
            asyncio.to_thread(
                oracle.st.llm_scores, fitted, instruction, record.manifest.max_tokens_limit
            )
        )
        scores, ms = await client.rerank(qs[qi], docs)
        measured.latencies_ms.append(round(ms, 3))
        measured.request_items.append(len(docs))
        progress.advance("lane", len(docs))
        ref = await ref_task
        progress.advance("reference", len(docs))
        lane_scores.append(scores.astype(np.float64))
        ref_scores.append(np.asarray(ref, np.float64))
    lane_all, ref_all = np.concatenate(lane_scores), np.concatenate(ref_scores)
    all_errors = np.abs(lane_all - ref_all)
    bar = gates.llm_rerank_bar(ref_all, t)[0]
    _record_scores(measured, lane_all, ref_all, bar)
    bad = [
        qi
        for qi, lane, ref in zip(groups, lane_scores, ref_scores, strict=True)
        if gates.reversed_pairs(lane, ref, bar)
    ]
    note = (
        "raw logit[true] - logit[false] vs sentence-transformers CrossEncoder (LogitScore); "
        f"instruction: {instruction!r} (None: the template's default)"
    )
    progress.start("probe", "probe set (fingerprint)", 1)
    probe, _ = await client.rerank(qs[0], probe_set())
    progress.advance("probe")
    checks = [
        gates.llm_rerank_check(all_errors, ref_all, t, note),
        gates.rerank_order_check(bad, len(groups), bar),
    ]
    return _Judged(checks, probe, t.fingerprint_grid_rerank)


def _record_scores(measured: Measurements, lane: np.ndarray, ref: np.ndarray, bar: float) -> None:
    measured.rerank_errors = [float(e) for e in np.abs(lane - ref)]
    measured.rerank_lane_scores = [float(x) for x in lane]
    measured.rerank_ref_scores = [float(x) for x in ref]
    measured.rerank_bar = float(bar)


def _pair_composer(
    lane: str, tok: Tokenizer, n_types: int
) -> Callable[[str, list[str]], tuple[list[np.ndarray], list[np.ndarray]]]:
    """Reference inputs for exactly the pairs the lane scores, as the model was trained.

    llama: the host sends query and documents without specials (`rerank_segments`) and the
    worker composes `pre q mid d post` from the GGUF vocabulary (`[CLS] q [SEP] d [SEP]` for
    BERT), type 1 on `d post` for a model with token types (the worker feeds them as input
    embeddings). The reference composes the same segments with the model's own pair template
    (read off the tokenizer), so a worker that composes pairs otherwise than the model was
    trained fails the gate. Core ML: composed pairs from the pair template with real token
    types (`encode_pairs`). Every lane is judged against the same typed forward, so a lane
    that dropped the types fails the gate.
    """
    pre, mid, post = _pair_template(tok)

    def llama(query: str, docs: list[str]):
        seg = tok.rerank_segments(query, docs, truncate=True)
        ids = [np.concatenate([pre, seg.query, mid, d, post]).astype(np.int32) for d in seg.docs]
        first = len(pre) + len(seg.query) + len(mid)
        types = [
            np.where(np.arange(len(x)) < first, 0, 1 if n_types > 1 else 0).astype(np.int32)
            for x in ids
        ]
        return ids, types

    def ane(query: str, docs: list[str]):
        enc = tok.encode_pairs(query, docs, truncate=True)
        return enc.ids, enc.token_type_ids

    return llama if lane == "llama" else ane


def _pair_template(tok: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix, middle, suffix) special ids of the model's pair template, read off one
    composed pair and its bare segments."""
    pair = [int(x) for x in tok.encode_pairs("a", ["b"], truncate=True).ids[0]]
    seg = tok.rerank_segments("a", ["b"], truncate=True)
    q, d = [int(x) for x in seg.query], [int(x) for x in seg.docs[0]]
    n_special = len(pair) - len(q) - len(d)
    for n_pre in range(n_special + 1):
        for n_mid in range(n_special - n_pre + 1):
            at_d = n_pre + len(q) + n_mid
            if pair[n_pre : n_pre + len(q)] == q and pair[at_d : at_d + len(d)] == d:
                pre, mid, post = (pair[:n_pre], pair[n_pre + len(q) : at_d], pair[at_d + len(d) :])
                return (
                    np.asarray(pre, np.int32),
                    np.asarray(mid, np.int32),
                    np.asarray(post, np.int32),
                )
    raise ValueError(f"the tokenizer's pair template {pair} does not hold the pair's own ids")


# ---- agreement with the other lane ---------------------------------------------------------


async def _agreement(
    module: Module, store: CertificateStore, options: RunOptions, cert_id: str, progress: Progress
) -> Agreement | None:
    """The agreement with the model's other lane, loaded as its newest certificate that
    passed quality on this machine was; None when there is none or it does not load."""
    other = "llama" if options.lane == "ane" else "ane"
    peer = next(
        (
            c
            for c in store.ls()
            if c.key.model == options.model
            and c.key.lane == other
            and c.quality == "pass"
            and not machine_differences(c.key)
        ),
        None,
    )
    if peer is None:
        return None
    progress.start("agreement", f"agreement with the {other} lane ({peer.id})", 1)
    try:
        extra = certified_load_extra(peer) if other == "ane" else None
        if module.supervisor(options.model, other) is None:
            await module.load(options.model, other, extra or None)
        agreement = await measure_agreement(
            module,
            options.model,
            [options.lane, other],
            options.sample_stride,
            [cert_id, peer.id],
            source="certification",
        )
    except SynapseError as exc:
        log.warning("no agreement with the %s lane: %s", other, exc.message)
        return None
    progress.advance("agreement")
    return agreement


# ---- drift -----------------------------------------------------------------------------------


def _drift(store: CertificateStore, key: CertificateKey, values: np.ndarray) -> Drift | None:
    previous = store.get(key.id)
    same_key = previous is not None
    if previous is None:
        previous = store.latest_for(key.model, key.lane)
    if previous is None:
        return None
    under = digest_under(values, previous.fingerprint)
    return Drift(
        previous_id=previous.id,
        previous_created_at=previous.created_at,
        previous_digest=previous.fingerprint.digest,
        digest_under_previous=under,
        drifted=under != previous.fingerprint.digest,
        same_key=same_key,
        key_changes=[] if same_key else key.differences(previous.key),
    )


def _drift_check(fp: Fingerprint, drift: Drift | None) -> Check:
    # Informational: quality is judged by the gates; drift says the numbers moved.
    if drift is None:
        return Check(
            name="fingerprint.drift",
            gate="info",
            status="info",
            detail=f"first certificate of this lane; fingerprint {fp.short}",
        )
    where = "same key" if drift.same_key else "key changed: " + "; ".join(drift.key_changes)
    if drift.drifted:
        return Check(
            name="fingerprint.drift",
            gate="info",
            status="drift",
            detail=f"outputs moved since {drift.previous_id} "
            f"({drift.previous_created_at}, {where})",
        )
    return Check(
        name="fingerprint.drift",
        gate="info",
        status="pass",
        detail=f"stable since {drift.previous_id} ({where})",
    )


def _synapse_version() -> str:
    try:
        return version("synapse")
    except PackageNotFoundError:
        return "dev"
