"""What a certificate is keyed by and judged against: equivalent configurations share a key,
numerics-changing settings do not, thresholds cannot be switched off with NaN, and the
reference pools the way the lane does. Pure functions and the real fp32 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from certification.certificate import Certificate, Measurements
from certification.identity import LaneIdentity, key_for
from certification.lane_client import load_settings
from certification.oracle import Oracle
from certification.policy import loosened
from certification.reference.bert import BertReference
from certification.thresholds import thresholds_for
from ingest.model_packages import minilm_dir
from tests.test_certification_store import make_cert


def _key(shapes, settings=None):
    identity = LaneIdentity.from_mapping(
        "m", "ane", {"artifact_digest": "a" * 64, "shapes": shapes, "settings": settings}
    )
    return key_for(identity)


def test_equivalent_shape_lists_share_a_key():
    # The worker gives an unnamed packed 4x256 shape 16 segments; the order is not numerics.
    a = _key([{"rows": 8, "seq_len": 128}, {"rows": 4, "seq_len": 256, "packed": True}])
    b = _key(
        [
            {"rows": 4, "seq_len": 256, "packed": True, "max_segments": 16},
            {"rows": 8, "seq_len": 128},
        ]
    )
    assert a.id == b.id and a.shapes == ("4x256p/16", "8x128")
    c = _key([{"rows": 4, "seq_len": 256, "packed": True, "max_segments": 8}])
    assert c.id != _key([{"rows": 4, "seq_len": 256, "packed": True}]).id


def test_runtime_settings_that_change_numbers_are_in_the_key(monkeypatch):
    monkeypatch.delenv("SYNAPSE_COREML_COMPUTE_UNITS", raising=False)
    shapes = [{"rows": 8, "seq_len": 128}]
    default = load_settings("ane", {"shapes": shapes, "cache_root": "/x"})
    assert default == {"compute_units": "cpu_and_ne"}  # resolved, where files live left out
    cpu = load_settings("ane", {"compute_units": "cpu_only"})
    assert _key(shapes, default).id != _key(shapes, cpu).id
    monkeypatch.setenv("SYNAPSE_COREML_COMPUTE_UNITS", "cpu_only")  # the worker's override
    assert load_settings("ane", None) == cpu
    assert load_settings("llama", {"flash_attn": False, "model_ref": "m"}) == {"flash_attn": False}
    assert load_settings("llama", None) == {}


def test_the_heads_are_in_the_key_and_a_model_without_keeps_its_id():
    """A head file is not in the artifact's digest: its digest keys the certificate. A key
    without heads hashes as before the field existed, so no certificate already written is
    orphaned."""
    import hashlib

    import msgspec

    def key(heads):
        raw = {"artifact_digest": "a" * 64, "shapes": [{"rows": 8, "seq_len": 64}]}
        return key_for(LaneIdentity.from_mapping("m", "ane", raw | {"heads": heads}))

    bare = key(None)
    older = msgspec.to_builtins(bare, order="sorted")
    del older["heads"]  # what a certificate written before the field was stored under
    assert bare.id == hashlib.sha256(msgspec.json.encode(older)).hexdigest()[:16]
    sparse = key({"sparse": "1" * 64})
    assert sparse.id != bare.id and key({"sparse": "2" * 64}).id != sparse.id
    assert sparse.differences(bare) == [f"heads:  -> {sparse.heads[:37]}..."]


def test_a_nan_threshold_is_refused_and_counts_as_loosened():
    table = thresholds_for("ane", "fp16")
    for name in ("placement_share", "min_cosine"):
        with pytest.raises(ValueError, match="not a finite number"):
            table.with_overrides({name: math.nan})
    cert = make_cert("2026-01-01T00:00:00Z")
    cert.overrides = {"min_cosine": math.nan}  # an older record written before the check
    assert loosened(cert)


def test_a_certificate_with_nan_measurements_reads_back(tmp_path):
    from certification.report import _cosine_plot
    from certification.store import CertificateStore

    cert: Certificate = make_cert("2026-01-01T00:00:00Z", "failed")
    cert.measurements = Measurements(cosines=[0.99999, math.nan], retrieval_overlap=[math.nan])
    store = CertificateStore(tmp_path)
    store.save(cert)
    back = store.get(cert.id)
    assert back is not None and back.measurements.cosines == [0.99999, None]
    assert "1 not a number" in _cosine_plot(back)


@pytest.mark.model
def test_the_reference_pools_as_the_lane_does(tmp_path):
    ids = [np.array([101, 7592, 2088, 102], np.int32), np.array([101, 2129, 102], np.int32)]
    bert = BertReference.from_dir(minilm_dir())
    for pooling in ("mean", "cls"):
        got = Oracle(minilm_dir(), tmp_path / "cache", pooling=pooling).embed(ids)
        want = bert.embed(ids, pooling=pooling, normalize=True)
        assert np.allclose(got, want, atol=1e-6), pooling
    with pytest.raises(ValueError, match="'mean' or 'cls'"):
        Oracle(minilm_dir(), pooling="last")
    with pytest.raises(ValueError, match="lacks model.safetensors"):
        Oracle(tmp_path / "nowhere")
