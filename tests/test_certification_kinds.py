"""`synapse certify` of the token-level kinds on the llama.cpp lane, against their references
on the CPU (certification.reference.token_kinds): sparse (inference-free SPLADE: SPLADE
documents and static queries; bge-m3's lexical weights), multi-vector (ColBERT, bge-m3) and
late chunking (a mean-pooled XLM-RoBERTa), one certificate per model with one verdict per
output. Faults fail the gates they touch: a served lane judged against a checkpoint whose
head files were perturbed (bge-m3) or whose weights kept 4 mantissa bits (late chunking); a
ColBERT whose query expansion is not attended has its query side refused by the lane, which
the certificate says, never passing it.

The tiny seeded models are the head tests' own builders (tests.test_sparse_heads,
tests.test_multivector_heads, tests.test_hf_xlmr), built and ingested once per test run for
this module and the Core ML lane's (tests.kinds_support); the runs judge every STRIDE-th
corpus item."""

from __future__ import annotations

import asyncio
import io
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
from rich.console import Console

from certification import report
from certification.certificate import Certificate, Measurements, decode, encode
from certification.corpus import corpus
from certification.degrade import truncated_mantissa_copy
from certification.errors import ReferenceUnavailable
from certification.kinds import KindsJudged, judge_kinds
from certification.lane_client import LaneClient
from certification.runner import NullProgress, RunOptions, certify
from certification.store import CertificateStore
from certification.terminal import print_certificate
from certification.thresholds import thresholds_for
from tests.kinds_support import BAD_HEADS, KIND_MODELS, kinds_dirs, kinds_store

pytestmark = pytest.mark.model

STRIDE = 32  # 11 of the 335 corpus items


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return kinds_dirs(tmp_path_factory)


@dataclass
class Runs:
    certs: dict[str, Certificate]
    faults: dict[str, KindsJudged]  # a served lane judged against a faulty checkpoint
    numpy_refusal: str | None


@pytest.fixture(scope="module")
def runs(dirs, module_tmp, tmp_path_factory) -> Runs:
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    started = time.perf_counter()
    store = kinds_store(tmp_path_factory, module_tmp / "models")
    # Faults: the checkpoint a served lane is judged against differs from what it serves by
    # perturbed head files (bge-m3), or by weights cut to 4 mantissa bits (late chunking).
    faulty = {
        "m3": dirs[BAD_HEADS],
        "xlmr": truncated_mantissa_copy(dirs["xlmr"], module_tmp / "xlmr-4bits", 4),
    }
    certificates = CertificateStore(module_tmp / "certificates")
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    config = ModuleConfig(
        store_root=str(store.root), host=HostConfig(runtime_dir=runtime, ping_interval_s=0)
    )
    out = Runs({}, {}, None)

    async def run(name: str) -> None:
        async with Module(config) as mod:
            if name == "ifree":  # the numpy forward judges none of its outputs
                numpy = RunOptions(model=name, reference="numpy", save=False)
                with pytest.raises(ReferenceUnavailable) as refused:
                    await certify(mod, numpy, certificates)
                out.numpy_refusal = refused.value.message
                assert mod.supervisor(name, "llama") is None  # refused before any worker
            # No other lane to agree with; one latency curve (a model without a pooled
            # vector times its own output), the others judge quality alone.
            options = RunOptions(
                model=name, sample_stride=STRIDE, agreement=False, curve=name == "ifree"
            )
            out.certs[name] = await certify(mod, options, certificates)
            if name in faulty:
                client = LaneClient(mod, name)
                texts = list(corpus())[::STRIDE]
                t = thresholds_for("llama", "f32")
                out.faults[name] = await judge_kinds(
                    client, faulty[name], texts, t, Measurements(), NullProgress(), 8, STRIDE
                )

    try:
        ingested = time.perf_counter()
        for name in KIND_MODELS:
            asyncio.run(run(name))
        print(
            f"\nkinds: ingest {ingested - started:.1f} s, certify "
            f"{time.perf_counter() - ingested:.1f} s ({len(KIND_MODELS)} runs)"
        )
        return out
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def certs(runs) -> dict[str, Certificate]:
    return runs.certs


def _check(cert: Certificate, name: str):
    return next(c for c in cert.checks if c.name == name)


def _outputs(cert: Certificate) -> dict[str, str]:
    return {o.output: o.status for o in cert.outputs}


def test_inference_free_splade_certifies_both_routes(certs, runs):
    cert = certs["ifree"]
    assert cert.status == "certified", cert.failing
    assert _outputs(cert) == {"sparse": "pass"}  # no pooled vector: no dense, no late chunking
    assert _check(cert, "quality.min_cosine").status == "n/a"
    m = cert.measurements.kinds["sparse"]
    assert m.n_items == 2 * cert.corpus.n_items  # the document route and the query route
    assert "query route (static weights" in _check(cert, "sparse.active_set").detail
    assert "has no pooled vector" in str(runs.numpy_refusal)
    curve = cert.measurements.latency_curve
    assert curve is not None and len(curve.seconds) == len(curve.items) and min(curve.seconds) > 0
    print(
        f"\nifree SPLADE: worst sparse cos {_check(cert, 'sparse.min_cosine').value:.9f}, "
        f"worst value error {_check(cert, 'sparse.max_value_rel_error').value:.4f}"
    )


def test_bge_m3_is_certified_on_each_output(certs):
    cert = certs["m3"]
    assert cert.status == "certified", cert.failing
    assert _outputs(cert) == {
        "dense": "pass",
        "sparse": "pass",
        "multivector": "pass",
        "late_chunking": "n/a",  # a CLS-pooled model: no chunk has a first token of its own
    }
    mv = _check(cert, "multivector.maxsim_max_abs_error")
    assert len(cert.measurements.kinds["multivector"].maxsim_errors) == (
        cert.corpus.n_queries * cert.corpus.n_items
    )
    print(
        f"\nbge-m3: dense min cos {_check(cert, 'quality.min_cosine').value:.7f}; sparse cos "
        f"{_check(cert, 'sparse.min_cosine').value:.7f}, value error "
        f"{_check(cert, 'sparse.max_value_rel_error').value:.2e}; multi-vector cos "
        f"{_check(cert, 'multivector.min_cosine').value:.7f}, MaxSim error {mv.value:.2e} per "
        f"query vector ({mv.detail.rsplit(';', 1)[-1].strip()})"
    )


def test_colbert_is_certified_against_multivectorencoder(certs):
    cert = certs["colbert"]
    assert cert.status == "certified", cert.failing
    assert _outputs(cert) == {"multivector": "pass"}
    assert "MultiVectorEncoder" in _check(cert, "multivector.token_count").detail
    print(
        f"\nColBERT: worst vector cos {_check(cert, 'multivector.min_cosine').value:.7f}, "
        f"MaxSim error {_check(cert, 'multivector.maxsim_max_abs_error').value:.2e} per query "
        f"vector ({_check(cert, 'multivector.maxsim_max_abs_error').detail.rsplit(';', 1)[-1]})"
    )


def test_late_chunking_is_certified_within_and_beyond_the_context(certs):
    cert = certs["xlmr"]
    assert cert.status == "certified", cert.failing
    assert _outputs(cert) == {"dense": "pass", "late_chunking": "pass"}
    late = _check(cert, "late_chunking.min_cosine")
    assert "longer than the 48-token context" in late.detail
    assert not late.detail.startswith("0 documents")
    print(f"\nlate chunking: worst chunk cos {late.value:.7f} ({late.detail})")


def test_faults_fail_the_gates_they_touch(runs):
    bad = runs.faults["m3"]
    # Both heads fail, each by the check that names the fault; the sparse vectors' ids and
    # the vectors' count stay right (the transformer and the token ids are intact).
    status = {o.output: o.status for o in bad.outputs}
    assert status == {"sparse": "fail", "multivector": "fail", "late_chunking": "n/a"}
    failing = {c.name for c in bad.checks if c.status == "fail"}
    assert {"sparse.min_cosine", "multivector.min_cosine"} <= failing, failing
    assert "multivector.token_count" not in failing
    detail = {o.output: o.detail for o in bad.outputs}
    assert "sparse.min_cosine" in detail["sparse"] and "multivector" in detail["multivector"]
    late = runs.faults["xlmr"]
    assert [o.status for o in late.outputs] == ["fail"]
    (check,) = late.checks
    assert check.name == "late_chunking.min_cosine" and check.status == "fail"
    by_name = {c.name: c for c in bad.checks}
    print(
        f"\nfaults: perturbed heads sparse cos {by_name['sparse.min_cosine'].value:.5f}, "
        f"vector cos {by_name['multivector.min_cosine'].value:.5f}; 4-bit weights late "
        f"chunking cos {check.value:.5f}"
    )


def test_an_output_the_lane_refuses_is_not_served_never_passed(certs):
    """llama.cpp cannot hide the unattended expansion tokens from themselves, so the lane
    refuses such queries: the certificate says so with the lane's reason, and the document
    side it does serve is still judged."""
    cert = certs["colbert-unattended"]
    verdict = next(o for o in cert.outputs if o.output == "multivector")
    assert verdict.status == "not served"
    assert verdict.detail.startswith("not served on this lane: query side:"), verdict.detail
    maxsim = _check(cert, "multivector.maxsim_max_abs_error")
    assert maxsim.status == "n/a" and "not served on this lane" in maxsim.detail
    assert _check(cert, "multivector.min_cosine").status == "pass"  # the documents
    assert cert.failing == []
    # `certify show` says it beside the checks.
    console = Console(record=True, width=160, file=io.StringIO())
    print_certificate(console, cert)
    assert "output multivector: not served on this lane: query side:" in (
        " ".join(console.export_text().split())
    )


def test_the_certificate_reads_back_and_the_report_gives_each_output(certs, tmp_path):
    cert = certs["m3"]
    assert decode(encode(cert)) == cert
    html = report.write(cert, tmp_path / "r.html").read_text()
    for o in cert.outputs:
        assert f'data-output="{o.output}"' in html
        assert f'data-status="{o.status}"' in html
    # A certificate written before the token-level kinds (no outputs, no kinds, no kind
    # thresholds) still reads.
    old = msgspec.json.decode(encode(certs["xlmr"]))
    del old["outputs"], old["measurements"]["kinds"]
    for name in [k for k in old["thresholds"] if k.startswith(("sparse", "multivector", "late"))]:
        del old["thresholds"][name]
    del old["thresholds"]["maxsim_max_abs"]
    back = decode(msgspec.json.encode(old))
    assert back.outputs == [] and back.measurements.kinds == {}
    assert np.isclose(back.thresholds.sparse_value_rel, 0.10)
