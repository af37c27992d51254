"""The certificate record (JSON via msgspec) and the checks it is made of.

Schema v1, one JSON object per certificate:

    schema        1
    id            CertificateKey.id (16 hex): what `certify show ID` and the policy look up
    key           CertificateKey: model, lane, precision, artifact/manifest digests, kernel
                  revision, shapes, engine name/version/build flags, runtime versions, OS
    status        "certified" | "provisional" | "failed"   (both gates, see certification.gates)
    quality       "pass" | "fail"
    placement     "pass" | "provisional" | "fail" | "n/a"
    failing       names of the checks that failed ("quality.min_cosine", "placement.share")
    checks        every Check: name, gate, status, value, threshold, op, detail
    thresholds    the Thresholds row actually applied (overrides included)
    overrides     which thresholds were overridden (empty for a production run)
    fingerprint   certification.fingerprint.Fingerprint of the probe-set outputs
    drift         None, or the previous certificate the fingerprint was compared with
    corpus        items, sample stride (1 = whole corpus), corpus digest
    measurements  per-item cosines, per-request latencies, rerank errors (and both scores of
                  every pair, with the bar they were judged at), placement detail,
                  and the lane's latency curve (seconds for 1, 4, 16, 64 items at the corpus's
                  typical length; absent in older certificates: measured at load instead)
    agreement     None, or how closely this lane agreed with the model's other certified lane
                  on the corpus (min cosine; rerank: same order), naming both certificates:
                  what lets the two serve one model together (host.lane_policy.Agreement)
    outputs       an embedder's verdict per output it serves (dense, sparse, multivector,
                  late_chunking): pass | fail | not served (the lane refused it, with the
                  lane's reason) | n/a, naming the checks it was judged on; empty for rerankers
                  and classifiers, and in certificates written before it was recorded
    created_at, duration_s, synapse_version
    reference_dir the HF directory of the reference
    provenance    where the model's files came from (ingest.provenance: the Hub repository and
                  commit, an Ollama model...) with their sha256s; absent for a local directory
                  or file, and in certificates written before it was recorded
    reference     which forward judged the lane, with its versions: "sentence-transformers
                  6.2.0 (transformers 5.24.0, torch 2.13.0, fp32 CPU)" or "numpy BERT
                  reference (numpy 2.3.1, fp32 CPU)"; absent in certificates written before it
                  was recorded, which the numpy reference judged (read back as NUMPY_REFERENCE)
"""

from __future__ import annotations

from typing import Literal

import msgspec

from certification.fingerprint import Fingerprint
from certification.identity import CertificateKey
from certification.thresholds import Thresholds
from host.lane_policy import Agreement
from host.lane_router import LatencyCurve
from ingest.provenance import Provenance

SCHEMA_VERSION = 1
# The judge of every certificate that does not name one: the only reference there was.
NUMPY_REFERENCE = "numpy BERT reference"

Status = Literal["certified", "provisional", "failed"]
CheckStatus = Literal["pass", "fail", "provisional", "n/a", "drift", "info"]
Gate = Literal["quality", "placement", "info"]


class Check(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    gate: Gate
    status: CheckStatus
    value: float | int | None = None
    threshold: float | int | None = None
    op: str = ""  # how value is compared with threshold: ">=", "<=", "=="
    detail: str = ""


class Drift(msgspec.Struct, frozen=True, kw_only=True):
    previous_id: str
    previous_created_at: str
    previous_digest: str
    digest_under_previous: str | None  # None: outputs not comparable (other dims)
    drifted: bool
    same_key: bool
    key_changes: list[str] = []


class CorpusInfo(msgspec.Struct, frozen=True, kw_only=True):
    n_items: int  # corpus items judged by per-item cosine / rerank error
    n_total: int  # items in the full corpus
    sample_stride: int  # 1 = the whole corpus (production); > 1 = every k-th item (tests)
    digest: str  # sha256 of the corpus texts, so a changed corpus is visible
    n_queries: int
    n_documents: int
    n_probe: int


OutputStatus = Literal["pass", "fail", "not served", "n/a"]


class OutputVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """One output of an embedder, judged on its own checks (certification.kind_gates)."""

    output: str  # "dense", "sparse", "multivector", "late_chunking"
    status: OutputStatus
    checks: list[str] = []
    detail: str = ""


class KindMeasurements(msgspec.Struct, kw_only=True):
    """Per judged item of one token-level output (NaN written as null, as for `cosines`)."""

    # sparse: the sparse cosine per item and route; multivector: the worst vector's cosine per
    # item; late_chunking: the worst chunk's cosine per document
    cosines: list[float | None] = []
    value_errors: list[float | None] = []  # sparse: worst |lane - ref| / |ref| per item
    maxsim_errors: list[float | None] = []  # multivector: |lane - ref| per query x document
    n_items: int = 0
    skipped: int = 0  # items left out of the comparison (the detail of the checks says why)


class Measurements(msgspec.Struct, kw_only=True):
    # Per-item values may be NaN (a lane that returns NaN vectors): JSON has no NaN, so it is
    # written as null and reads back as None, which is why these lists admit None.
    cosines: list[float | None] = []  # per corpus item (embedding models)
    latencies_ms: list[float] = []  # per lane request during the corpus pass
    request_items: list[int] = []  # items in each of those requests
    rerank_errors: list[float | None] = []  # |lane - reference| per pair (cross-encoders)
    # Rerankers: the two scores of every judged pair (what the report's scatter plots), and
    # the error bar the pairs were judged at (LLM rerankers: scaled by the reference's
    # scores, see certification.gates.llm_rerank_bar). Empty/None in older certificates.
    rerank_lane_scores: list[float | None] = []
    rerank_ref_scores: list[float | None] = []
    rerank_bar: float | None = None
    retrieval_overlap: list[float | None] = []  # per query
    tokenizer_mismatch_items: list[int] = []  # corpus indices whose ids differ
    placement_share: float | None = None
    placement_source: str | None = None
    placement_ops: dict[str, dict[str, float]] | None = None  # op -> {device: cost}, if known
    latency_curve: LatencyCurve | None = None  # this lane on this machine, for routing
    kinds: dict[str, KindMeasurements] = {}  # token-level outputs by name; empty in older ones


class Certificate(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA_VERSION
    id: str
    key: CertificateKey
    status: Status
    quality: Literal["pass", "fail"]
    placement: Literal["pass", "provisional", "fail", "n/a"]
    failing: list[str]
    checks: list[Check]
    thresholds: Thresholds
    overrides: dict[str, float] = {}
    fingerprint: Fingerprint
    drift: Drift | None = None
    corpus: CorpusInfo
    measurements: Measurements
    created_at: str
    duration_s: float
    synapse_version: str = ""
    reference_dir: str = ""
    reference: str = NUMPY_REFERENCE
    provenance: Provenance | None = None
    agreement: Agreement | None = None  # with the model's other lane, when it was certified
    outputs: list[OutputVerdict] = []  # an embedder's verdict per output; empty in older ones


def encode(cert: Certificate) -> bytes:
    return msgspec.json.format(msgspec.json.encode(cert), indent=2) + b"\n"


def decode(data: bytes) -> Certificate:
    return msgspec.json.decode(data, type=Certificate)
