"""The Core ML backend for real (macOS only; skipped elsewhere with the reason): every served
shape predicts like the reference executor on the same inputs, the compute plan of a compiled
model yields a share in [0, 1], and a warm cache admits without compiling.

Compute units follow SYNAPSE_COREML_COMPUTE_UNITS (the macOS CI job sets cpu_only: hosted VMs
have no usable Neural Engine), so these run on any Mac."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from compile_cache import CompileCache
from tests import test_ane_helpers as h
from workers.ane.engine import AneEngine
from workers.engine import NullProgress
from workers.protocol import messages as m

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        sys.platform != "darwin",
        reason="needs macOS: Core ML's runtime (compile_model, CompiledMLModel, MLComputePlan) "
        "does not exist on Linux",
    ),
]

# What the lane serves out of the box (config.DEFAULT_SHAPES, seq 0 = max_seq_length) plus the
# packed shape the tests use.
SERVED = [{"rows": 8, "seq_len": 128}, {"rows": 4, "seq_len": 256}, h.EMBED_PACKED]


def _engine(backend: str, shape: dict, cache_root) -> AneEngine:
    engine = AneEngine(h.minilm().dir, backend=backend)
    engine.load(
        h.load_request(h.minilm(), shapes=[shape], backend=backend, cache_root=str(cache_root)),
        NullProgress(),
    )
    return engine


def _embed(engine: AneEngine, seqs: list[np.ndarray]) -> np.ndarray:
    req, ids = h.embed_request(h.minilm(), seqs)
    return engine.embed(req, ids, NullProgress())


@pytest.mark.parametrize("shape", SERVED, ids=lambda s: "x".join(map(str, s.values())))
def test_every_served_shape_predicts_like_the_reference_executor(shape, tmp_path):
    seqs = [s for s in (h.encode(t) for t in h.embed_corpus()) if len(s) <= shape["seq_len"]]
    seqs = seqs[: 2 * shape["rows"]]  # two runs of the shape
    coreml = _engine("coreml", shape, tmp_path)
    reference = _engine("reference", shape, tmp_path)
    try:
        cos = h.cosines(_embed(coreml, seqs), _embed(reference, seqs))
        assert cos.min() >= 0.9999, float(cos.min())
    finally:
        coreml.close()
        reference.close()


def test_compute_plan_yields_a_share_in_the_unit_interval(tmp_path):
    from workers.ane import apple_device
    from workers.ane.coreml_backend import COMPUTE_PLAN_MIN_MACOS

    if not apple_device.version_at_least(apple_device.macos_version(), COMPUTE_PLAN_MIN_MACOS):
        pytest.skip("needs macOS >= 14.4: MLComputePlan (older systems report the estimate)")
    engine = _engine("coreml", h.EMBED_UNPACKED, tmp_path)
    try:
        share, source = engine.placement()
        assert source == "compute_plan" and 0.0 <= share <= 1.0
    finally:
        engine.close()


def test_warm_cache_admission_opens_the_compiled_model_without_compiling(tmp_path):
    cold = _engine("coreml", {"rows": 2, "seq_len": 32}, tmp_path)
    cold.close()
    with CompileCache(tmp_path) as cache:
        before = {e.digest: e.key["kind"] for e in cache.ls()}
    assert sorted(before.values()) == ["mlmodelc", "mlpackage"]
    warm = AneEngine(h.minilm().dir, backend="coreml")
    try:
        warm.load(
            h.load_request(h.minilm(), shapes=[], backend="coreml", cache_root=str(tmp_path)),
            NullProgress(),
        )
        reply = warm.admit_shape(
            m.ADMIT_SHAPE(req_id=3, model_ref="minilm", rows=2, seq_len=32), NullProgress()
        )
        assert reply.cache_hit and reply.build_ms == 0 and reply.compile_ms == 0
        assert reply.load_ms > 0 and reply.warmup_ms > 0  # opened, then one prediction
        with CompileCache(tmp_path) as cache:
            assert {e.digest: e.key["kind"] for e in cache.ls()} == before  # nothing new
    finally:
        warm.close()
