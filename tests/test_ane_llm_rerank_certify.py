"""`synapse certify` of an LLM reranker (Qwen3-Reranker) on the Core ML lane, on the reference
executor (fp16 emulated), against sentence-transformers' CrossEncoder raw scores: a healthy
graph certifies (provisionally: the placement is an estimate off a Mac) at the fp16 bar that
scales with the reference's scores, a graph built from degraded weights fails it, and the
HTML report plots every pair's lane score against the reference's with the bar's band.
The tiny seeded reranker is tests.test_llm_rerank's."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from html.parser import HTMLParser

import numpy as np
import pytest

from certification import report
from certification.certificate import Certificate
from certification.thresholds import thresholds_for
from tests.test_llm_rerank import tiny_qwen3_reranker
from workers.ane.identity import kernel_revision

pytestmark = pytest.mark.model

MODEL = "llmr"
SHAPES = [{"rows": 4, "seq_len": 192}]  # the manifest's pair limit: no pair is cut further
HEALTHY_STRIDE = 4  # 84 pairs: about two documents for every one of the 43 queries
DEGRADED_STRIDE = 8  # 42 pairs: the degraded graph misses by several bars
# Weights cut to 6 mantissa bits in the graph (what a careless low-precision conversion
# does; fp16 keeps 10): the certification degrade the Core ML lane builds in-graph.
DEGRADED = {"weight_mantissa_bits": 6}


@pytest.fixture(scope="module")
def certs(module_tmp) -> dict[str, Certificate]:
    from certification.runner import RunOptions, certify
    from certification.store import CertificateStore
    from host.config import HostConfig
    from host.module import Module, ModuleConfig
    from ingest.store import ArtifactStore

    cache = module_tmp / "cache"
    model_dir = tiny_qwen3_reranker(module_tmp / "Qwen3-Reranker-tiny")
    ArtifactStore(cache / "models").ingest_hf_dir(model_dir, MODEL, dtype="f32")
    store = CertificateStore(cache / "certificates")
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    config = ModuleConfig(
        store_root=str(cache / "models"), host=HostConfig(runtime_dir=runtime, ping_interval_s=0)
    )

    async def run(stride: int, build_options: dict | None) -> Certificate:
        extra: dict = {"backend": "reference"}
        if build_options:
            extra["build_options"] = build_options
        async with Module(config) as mod:
            return await certify(
                mod,
                RunOptions(
                    model=MODEL,
                    lane="ane",
                    shapes=SHAPES,
                    sample_stride=stride,
                    runtime_config_extra=extra,
                    agreement=False,
                    curve=False,  # quality alone: ~255 pairs on the reference executor
                ),
                store,
            )

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SYNAPSE_CACHE_DIR", str(cache))  # the worker's compile cache
            return {
                "healthy": asyncio.run(run(HEALTHY_STRIDE, None)),
                "degraded": asyncio.run(run(DEGRADED_STRIDE, DEGRADED)),
            }
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _check(cert: Certificate, name: str):
    return next(c for c in cert.checks if c.name == name)


def test_the_core_ml_llm_reranker_certifies_at_the_bar_its_scores_set(certs):
    cert = certs["healthy"]
    t = thresholds_for("ane", "fp16")
    assert cert.quality == "pass" and cert.failing == [], cert.checks
    assert cert.status == "provisional" and cert.measurements.placement_source == "estimate"
    assert cert.key.kernel_revision == kernel_revision("qwen3", "rank_last")
    m = cert.measurements
    lane, ref = np.asarray(m.rerank_lane_scores), np.asarray(m.rerank_ref_scores)
    assert len(lane) == len(ref) == len(m.rerank_errors) == cert.corpus.n_items
    # The bar is recorded three ways: the table row applied, the check's threshold, and the
    # measurement the report draws; all from the reference's own range.
    bar = t.rerank_max_abs + t.llm_rerank_rel * float(np.abs(ref).max())
    err = _check(cert, "quality.rerank_max_abs_error")
    assert cert.thresholds.llm_rerank_rel == t.llm_rerank_rel > 0
    assert err.threshold == pytest.approx(bar) and m.rerank_bar == pytest.approx(bar)
    assert err.status == "pass" and err.value == pytest.approx(np.abs(lane - ref).max())
    assert "max|ref|" in err.detail
    # The bar stays far inside the scores' spread: a wrong token, row or position moves
    # scores by that spread. (fp16 through the decoder costs more than the cross-encoder
    # bar, 5e-3: the reason it scales; the run prints by how much.)
    assert ref.std() > 20 * bar
    # Same order on every query, and the gate had orders to compare.
    order = _check(cert, "quality.rerank_same_order")
    assert order.status == "pass", order
    assert cert.corpus.n_items >= 2 * cert.corpus.n_queries - 2  # 2 documents for all but 2
    print(
        f"\ncore ml llm rerank certify: max |raw diff| {err.value:.3e} (bar {bar:.3e}, "
        f"max|ref| {np.abs(ref).max():.2f}), mean {np.abs(lane - ref).mean():.2e}"
    )


def test_a_degraded_core_ml_llm_reranker_fails(certs):
    cert, healthy = certs["degraded"], certs["healthy"]
    assert cert.status == "failed" and "quality.rerank_max_abs_error" in cert.failing
    err = _check(cert, "quality.rerank_max_abs_error")
    # It misses its bar by far, and that bar is the healthy run's formula (the reference
    # sets it, not the lane under test).
    assert err.value > 2 * err.threshold, err
    t = cert.thresholds
    ref = np.asarray(cert.measurements.rerank_ref_scores)
    assert err.threshold == pytest.approx(t.rerank_max_abs + t.llm_rerank_rel * np.abs(ref).max())
    assert "weight_mantissa_bits" in cert.key.build_options  # never shares a healthy cert
    assert cert.id != healthy.id
    print(f"\ndegraded (6 mantissa bits): {err.value:.3e} vs bar {err.threshold:.3e}")


class _Scatter(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.plots: set[str] = set()
        self.points: list[dict] = []
        self.residuals: list[dict] = []
        self.band: list[dict] = []
        self.diagonal = 0
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self._in = a.get("data-plot")
            self.plots.add(str(self._in))
        elif self._in == "scores" and a.get("class") == "point":
            self.points.append(a)
        elif self._in == "scores" and a.get("class") == "residual":
            self.residuals.append(a)
        elif self._in == "scores" and a.get("class") in ("band", "band-residual"):
            self.band.append(a)
        elif self._in == "scores" and a.get("class") == "diagonal":
            self.diagonal += 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self._in = None


def _scatter(cert: Certificate, tmp_path) -> _Scatter:
    parser = _Scatter()
    parser.feed(report.write(cert, tmp_path / f"{cert.id}.html").read_text())
    return parser


def test_the_report_plots_lane_against_reference_scores_with_the_bars_band(certs, tmp_path):
    for name, cert in certs.items():
        m = cert.measurements
        plot = _scatter(cert, tmp_path)
        assert {"cosine", "scores", "placement", "latency"} <= plot.plots
        # One point per judged pair, at its two scores; the diagonal; the band at the bar.
        assert len(plot.points) == cert.corpus.n_items
        xs = [float(p["data-x"]) for p in plot.points]
        ys = [float(p["data-y"]) for p in plot.points]
        np.testing.assert_allclose(xs, m.rerank_ref_scores, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ys, m.rerank_lane_scores, rtol=1e-5, atol=1e-5)
        assert plot.diagonal == 1 and len(plot.band) == 2  # around the diagonal, around 0
        for band in plot.band:
            assert float(band["data-half-width"]) == pytest.approx(m.rerank_bar, rel=1e-5)
        # Beside it, each pair's difference, on an axis where the band is visible.
        diffs = [float(p["data-y"]) for p in plot.residuals]
        np.testing.assert_allclose(
            diffs, np.subtract(m.rerank_lane_scores, m.rerank_ref_scores), atol=1e-5
        )
        # Points outside the band are the pairs over the bar: none when healthy, the failing
        # ones when degraded.
        outside = sum(p.get("data-outside") == "1" for p in plot.points)
        over = sum(e is not None and e > (m.rerank_bar or 0) for e in m.rerank_errors)
        assert outside == over and (outside == 0) == (name == "healthy"), (name, outside)
