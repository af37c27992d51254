"""`synapse certify` of the token-level kinds on the Core ML lane (the reference executor: fp16
emulated after every op), against the same references as the llama.cpp lane's certificates
(tests/test_certification_kinds.py) and at the lane's own fp16 bars
(certification.thresholds, ("ane", "fp16")). Token-level outputs run on unpacked shapes, so
each model is admitted with its own unpacked shapes.

- Each kind passes: inference-free SPLADE (through `synapse certify` itself: the command
  line, its JSON and its HTML report), bge-m3's dense, sparse and multi-vector outputs,
  ColBERT, late chunking.
- ColBERT is the one whose query expansion is not attended, which the llama.cpp lane refuses:
  served here (the owned graph builds the mask), and it passes.
- A fault fails the gates it touches: the lane's bge-m3 judged against the checkpoint with
  perturbed head files.
- The certificate says what a reader needs: lane, shapes, kernel revision, the fp16 bars it
  was judged at, one verdict per output; the report's placement chart has the heads' ops.

The tiny models and their ingest are shared with the llama lane's module (tests.kinds_support).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from certification import report
from certification.certificate import Certificate, Measurements, decode
from certification.corpus import corpus
from certification.kinds import KindsJudged, judge_kinds
from certification.lane_client import LaneClient
from certification.runner import NullProgress, RunOptions, certify
from certification.shapes import parse_shapes
from certification.store import CertificateStore
from certification.thresholds import thresholds_for
from tests.encoding_support import private_store
from tests.kinds_support import BAD_HEADS, kinds_dirs, kinds_store
from tests.session_share import build_once
from tests.test_certification import parse_report

pytestmark = pytest.mark.model

STRIDE = 32  # 11 of the 335 corpus items
# Unpacked shapes (`ROWSxSEQ`, the command line's spelling), each model's longest input in
# one: ColBERT and the SPLADE model read at most 64 tokens, the XLM-RoBERTa 48; bge-m3 reads
# 256, which two of the judged corpus items reach (short rows for those).
SHAPES = {
    "ifree": "8x64",
    "m3": "8x64,2x256",
    "colbert-unattended": "8x64",
    "xlmr": "8x48",
}
# ColBERT is certified as its variant whose expansion is not attended: the same checkpoint
# (prefixes, Dense layers, skiplist, expansion), in the mask only the owned graph can build;
# the attended one is the Core ML lane's head test's (tests/test_multivector_heads.py).
IN_PROCESS = ("m3", "colbert-unattended", "xlmr")
FP16 = thresholds_for("ane", "fp16")


@dataclass
class Runs:
    certs: dict[str, Certificate]
    fault: KindsJudged  # the lane's bge-m3 judged against the perturbed heads
    cli: CliRun
    report_html: str
    cache: Path  # the command line's SYNAPSE_CACHE_DIR


@pytest.fixture(scope="module")
def cache(synapse_cache_dir, module_tmp, tmp_path_factory) -> Path:
    """A SYNAPSE_CACHE_DIR of the module's own: the session's default models (linked, as the
    command line ensures them) and the kinds' models in its store, its own compile cache and
    certificates."""
    from ingest.defaults import ensure_defaults

    dst = module_tmp / "cache"
    # The session's defaults as tests/conftest.py converted them (built: a lookup here).
    built = build_once(tmp_path_factory, "default-models", lambda d: ensure_defaults(str(d)))
    private_store(built, dst / "models", sorted(p.name for p in built.iterdir() if p.is_dir()))
    kinds_store(tmp_path_factory, dst / "models")
    return dst


@dataclass
class CliRun:
    status: int
    stdout: str
    stderr: str


def _certify_cli(cache: Path, html: Path) -> CliRun:
    """Inference-free SPLADE through `synapse certify --lane ane` (the reference backend off
    macOS), in this process (its imports are paid already): the command line's parser, its
    run, its JSON and its report, with the exit status it returns. No latency curve: the
    llama.cpp lane's module proves how a model without a pooled vector times its own output,
    and on the reference executor the curve costs as much as the rest of the run."""
    from cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as mp,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        mp.setenv("SYNAPSE_CACHE_DIR", str(cache))  # its store, compile cache, certificates
        status = main(
            [
                "certify",
                "--model",
                "ifree",
                "--lane",
                "ane",
                "--shapes",
                SHAPES["ifree"],
                "--sample",
                str(STRIDE),
                "--no-curve",
                "--json",
                "--report",
                str(html),
            ]
        )
    return CliRun(status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def runs(cache, tmp_path_factory) -> Runs:
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    started, cpu = time.perf_counter(), _cpu()
    html = cache / "ifree.html"
    cli = _certify_cli(cache, html)
    took_cli, cpu_cli = time.perf_counter() - started, _cpu() - cpu
    certificates = CertificateStore(cache / "certificates")
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    config = ModuleConfig(
        store_root=str(cache / "models"), host=HostConfig(runtime_dir=runtime, ping_interval_s=0)
    )
    extra = {"backend": "reference", "cache_root": str(cache / "compile_cache")}
    certs: dict[str, Certificate] = {}
    fault: list[KindsJudged] = []

    async def run() -> None:
        async with Module(config) as mod:  # one host; each model its own worker
            for name in IN_PROCESS:
                options = RunOptions(
                    model=name,
                    lane="ane",
                    shapes=parse_shapes(SHAPES[name]),
                    sample_stride=STRIDE,
                    runtime_config_extra=extra,
                    agreement=False,  # no other lane certified here: quality alone
                    curve=False,  # what routing reads, not what this module judges
                )
                certs[name] = await certify(mod, options, certificates)
            # The served bge-m3 judged against a checkpoint whose head files differ.
            client = LaneClient(mod, "m3", "ane")
            texts = list(corpus())[::STRIDE]
            fault.append(
                await judge_kinds(
                    client,
                    kinds_dirs(tmp_path_factory)[BAD_HEADS],
                    texts,
                    FP16,
                    Measurements(),
                    NullProgress(),
                    8,
                    STRIDE,
                )
            )

    try:
        asyncio.run(run())
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    print(
        f"\nkinds on the Core ML lane: command line {took_cli:.1f} s ({cpu_cli:.1f} s CPU), "
        f"{len(IN_PROCESS)} runs and a fault {time.perf_counter() - started - took_cli:.1f} s "
        f"({_cpu() - cpu - cpu_cli:.1f} s CPU, workers included)"
    )
    if cli.status in (0, 4):  # certified / provisional: its JSON is the certificate
        certs["ifree"] = decode(cli.stdout.encode())
    return Runs(certs, fault[0], cli, html.read_text() if html.is_file() else "", cache)


def _cpu() -> float:
    """CPU seconds of this process and its ended children (the workers): what the runs cost
    whatever else the machine runs."""
    own, ended = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


def _check(cert: Certificate, name: str):
    return next(c for c in cert.checks if c.name == name)


def _outputs(cert: Certificate) -> dict[str, str]:
    return {o.output: o.status for o in cert.outputs}


def _quality(cert: Certificate) -> None:
    # On the reference executor the placement share is an estimate: at most provisional.
    assert cert.quality == "pass", cert.failing
    assert cert.status in ("certified", "provisional"), cert.failing


def test_splade_is_certified_through_the_command_line(runs):
    cli = runs.cli
    assert cli.status in (0, 4), cli.stderr[-3000:]  # certified / provisional
    cert = runs.certs["ifree"]
    _quality(cert)
    assert _outputs(cert) == {"sparse": "pass"}
    m = cert.measurements.kinds["sparse"]
    assert m.n_items == 2 * cert.corpus.n_items  # the document route and the query route
    assert _check(cert, "sparse.min_cosine").threshold == FP16.sparse_min_cosine == 0.9995
    assert cert.measurements.latency_curve is None  # --no-curve
    # The report gives the output's verdict, and its placement chart the SPLADE head's ops
    # (the vocabulary projection pooled by max, then log1p(relu)) beside the encoder's.
    assert 'data-output="sparse"' in runs.report_html
    ops = cert.measurements.placement_ops
    assert ops is not None and {"conv", "reduce_max", "log"} <= set(ops), ops
    charted = {b["data-label"].split()[0] for b in parse_report(runs.report_html)["placement"]}
    assert {"reduce_max", "log"} <= charted, charted
    print(
        f"\nCore ML SPLADE: worst sparse cos {_check(cert, 'sparse.min_cosine').value:.7f}, "
        f"worst value error {_check(cert, 'sparse.max_value_rel_error').value:.4f}; "
        f"placement {cert.measurements.placement_share:.4f} ({cert.measurements.placement_source})"
    )


def test_each_kind_passes_at_the_lanes_fp16_bars(runs):
    certs = runs.certs
    for name in IN_PROCESS:
        _quality(certs[name])
    assert _outputs(certs["m3"]) == {
        "dense": "pass",
        "sparse": "pass",
        "multivector": "pass",
        "late_chunking": "n/a",  # CLS-pooled
    }
    assert _outputs(certs["xlmr"]) == {"dense": "pass", "late_chunking": "pass"}
    late = _check(certs["xlmr"], "late_chunking.min_cosine")
    assert "longer than the 48-token context" in late.detail and late.threshold == 0.9995
    # bge-m3's long items ran on the 256-token rows: none was refused as not fitting.
    assert all(o.status != "not served" for c in certs.values() for o in c.outputs)
    m3 = certs["m3"]
    print(
        f"\nCore ML bge-m3: dense min cos {_check(m3, 'quality.min_cosine').value:.6f}; sparse "
        f"cos {_check(m3, 'sparse.min_cosine').value:.6f}, value error "
        f"{_check(m3, 'sparse.max_value_rel_error').value:.2e}; vector cos "
        f"{_check(m3, 'multivector.min_cosine').value:.6f}, MaxSim error "
        f"{_check(m3, 'multivector.maxsim_max_abs_error').value:.2e}; late chunking cos "
        f"{late.value:.6f}"
    )


def test_unattended_query_expansion_is_served_and_passes(runs):
    """The llama.cpp lane refuses these queries (its attention cannot hide a token from
    itself); the owned graph's mask serves them, and MaxSim is judged."""
    cert = runs.certs["colbert-unattended"]
    assert _outputs(cert) == {"multivector": "pass"}
    assert "MultiVectorEncoder" in _check(cert, "multivector.token_count").detail
    maxsim = _check(cert, "multivector.maxsim_max_abs_error")
    assert maxsim.status == "pass" and maxsim.threshold == FP16.maxsim_max_abs
    assert "not served" not in maxsim.detail
    print(
        f"\nCore ML unattended ColBERT: worst vector cos "
        f"{_check(cert, 'multivector.min_cosine').value:.6f}, MaxSim error {maxsim.value:.2e} "
        "per query vector"
    )


def test_perturbed_heads_fail_the_gates_they_touch(runs):
    bad = runs.fault
    assert {o.output: o.status for o in bad.outputs} == {
        "sparse": "fail",
        "multivector": "fail",
        "late_chunking": "n/a",
    }
    failing = {c.name for c in bad.checks if c.status == "fail"}
    assert {"sparse.min_cosine", "multivector.min_cosine"} <= failing, failing
    # The transformer and the token ids are intact: the vectors' count stays right.
    assert "multivector.token_count" not in failing
    by_name = {c.name: c for c in bad.checks}
    print(
        f"\nCore ML faults: perturbed heads sparse cos {by_name['sparse.min_cosine'].value:.5f}, "
        f"vector cos {by_name['multivector.min_cosine'].value:.5f}"
    )


def test_the_certificate_names_lane_shapes_revision_and_verdicts(runs, tmp_path):
    from ingest.store import ArtifactStore
    from workers.ane.identity import kernel_revision

    m3 = runs.certs["m3"]
    key = m3.key
    assert key.lane == "ane" and key.precision == "fp16" and key.engine == "coreml-ane"
    assert key.shapes == ("2x256", "8x64")  # what was admitted (sorted): unpacked, no `p`
    assert key.kernel_revision == kernel_revision("xlm-roberta", "embed_cls")
    # Its head files are not in the artifact's digest: their own digests are in the key.
    heads = ArtifactStore(runs.cache / "models").get("m3").manifest.heads
    assert json.loads(key.heads) == {k: h.digest for k, h in heads.items()}
    assert set(heads) == {"sparse", "multivector"}
    assert m3.thresholds == FP16  # judged at the lane's own bars
    assert [o.output for o in m3.outputs] == ["dense", "sparse", "multivector", "late_chunking"]
    for o in m3.outputs:  # each verdict names the checks it stands on
        assert o.checks and all(any(c.name == n for c in m3.checks) for n in o.checks)
    # `synapse certify show` reads the command line's certificate back from its store.
    cert = runs.certs["ifree"]
    assert CertificateStore(runs.cache / "certificates").get(cert.id) == cert
    # The per-op estimate found the packages built with both heads (the lexical weights'
    # relu among their ops), and the report charts it.
    ops = m3.measurements.placement_ops
    assert ops is not None and "relu" in ops, ops
    html = report.write(m3, tmp_path / "m3.html").read_text()
    charted = {b["data-label"].split()[0] for b in parse_report(html)["placement"]}
    assert charted and charted <= set(ops)
