"""The routing rule between two lanes of one model (a pure function: tables), the lane that
serves alone when they cannot serve together, the agreement gate's verdict, and what
configures two lanes: the serve config, `--lane ane,llama`, and
certificates written before curves and agreement were recorded."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from batch.errors import BatchUsageError
from batch.job import JobOptions, job_lanes
from certification import gates
from certification.agreement import least_cosine
from certification.certificate import decode, encode
from certification.lane_policy import reference_fit
from host.errors import ConfigInvalid
from host.lane_policy import AGREEMENT_MIN_COS, Agreement
from host.lane_router import (
    Ask,
    LatencyCurve,
    ReferenceFit,
    better_certified,
    expected_finish,
    expected_seconds,
    refusal,
    route,
)
from service.config import load_config
from tests.test_certification_store import make_cert
from workers.protocol import messages as m

# A Neural-Engine-like lane: quick alone, each item costs about the same. A GPU-like lane:
# a fixed dispatch cost, then cheap items in wide batches.
ANE = LatencyCurve(items=[1, 4, 16, 64], seconds=[0.002, 0.008, 0.032, 0.128], tokens=20)
GPU = LatencyCurve(items=[1, 4, 16, 64], seconds=[0.010, 0.011, 0.014, 0.030], tokens=20)
LANES = {"ane": ANE, "llama": GPU}


@pytest.mark.parametrize(
    "curve, items, seconds",
    [
        (ANE, 0, 0.0),
        (ANE, 1, 0.002),
        (ANE, 64, 0.128),
        (GPU, 10, 0.0125),  # halfway between 4 and 16
        (GPU, 40, 0.022),  # halfway between 16 and 64
        (GPU, 128, 0.030 + 64 * (0.016 / 48)),  # past 64: the last segment's cost per item
        (LatencyCurve(items=[4], seconds=[0.04]), 2, 0.02),  # below the first: proportional
        (LatencyCurve(items=[4], seconds=[0.04]), 8, 0.08),  # one point: its cost per item
    ],
)
def test_expected_seconds_interpolates_in_items(curve, items, seconds):
    assert expected_seconds(curve, items) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "items, queued, lane",
    [
        (1, {}, "ane"),  # a single query: the Neural Engine answers first
        (4, {}, "ane"),  # 0.008 < 0.011
        (16, {}, "llama"),  # bulk: the GPU
        (64, {}, "llama"),
        (1000, {}, "llama"),
        # A busy lane is passed over: the GPU finishes 64 queued items before a single one.
        (1, {"ane": 16}, "llama"),  # 0.032 + 0.002 > 0.010
        (1, {"ane": 2}, "ane"),  # 0.004 + 0.002 < 0.010
        (64, {"llama": 1000}, "ane"),  # the GPU's backlog outlasts the slower lane
        (16, {"ane": 5, "llama": 5}, "llama"),
    ],
)
def test_route_picks_the_lane_expected_to_finish_first(items, queued, lane):
    assert route(LANES, queued, items) == lane
    best = min(LANES, key=lambda k: expected_finish(LANES[k], queued.get(k, 0), items))
    assert lane == best


def test_a_tie_goes_to_the_lane_listed_first():
    assert route({"ane": ANE, "llama": ANE}, {}, 8) == "ane"
    assert route({"llama": ANE, "ane": ANE}, {}, 8) == "llama"
    assert route({"llama": GPU}, {"ane": 0}, 1) == "llama"  # one lane: always it
    with pytest.raises(ValueError, match="no lanes"):
        route({}, {}, 1)


# What each lane's LOADED declared: llama.cpp cannot mask a ColBERT query's expansion from
# itself; a Core ML lane admitted with packed shapes only gives no token outputs.
UNMASKED_QUERY = (m.Refusal(output="multivector", side="query", reason="no owned mask"),)
PACKED_ONLY = tuple(m.Refusal(output=k, reason="packed only") for k in m.OUTPUT_KINDS)
IFREE_PACKED = (m.Refusal(output="sparse", side="document", reason="packed only"),)


@pytest.mark.parametrize(
    "refuses, ask, why",
    [
        (UNMASKED_QUERY, None, None),  # embed, rerank: nothing token-level asked
        (UNMASKED_QUERY, Ask(("multivector",), ("document",)), None),
        (UNMASKED_QUERY, Ask(("multivector",), ("query",)), "multivector (query side): no "),
        (UNMASKED_QUERY, Ask(("multivector",), ("query", "document")), "multivector (query"),
        (UNMASKED_QUERY, Ask(("tokens",), ("query",)), None),  # another output
        (PACKED_ONLY, Ask(("tokens",)), "tokens: packed only"),
        (PACKED_ONLY, Ask(("dense", "sparse"), ("query",)), "dense: packed only"),
        (PACKED_ONLY, None, None),
        (IFREE_PACKED, Ask(("sparse",), ("query",)), None),  # its ids alone: no prediction
        (IFREE_PACKED, Ask(("sparse",), ("document",)), "sparse (document side): packed"),
        ((), Ask(("tokens", "multivector"), ("query", "document")), None),
    ],
)
def test_what_a_lane_refuses_of_a_request(refuses, ask, why):
    got = refusal(refuses, ask)
    assert (got is None) if why is None else (got is not None and got.startswith(why))


@pytest.mark.parametrize(
    "items, queued, refused, lane",
    [
        (1, {}, {}, "ane"),  # the size rule alone
        (1, {}, {"ane": "packed only"}, "llama"),  # the lane that serves it, even when slower
        (64, {}, {"llama": "no owned mask"}, "ane"),  # bulk queries go to the lane that masks
        (1, {"ane": 1000}, {"llama": "no owned mask"}, "ane"),  # busy, but the only one
        (64, {}, {"ane": "x", "llama": "y"}, "llama"),  # none serves it: the size rule, and
        (1, {}, {"ane": "x", "llama": "y"}, "ane"),  # the lane refuses it with its reason
        (16, {}, {"gpu": "a lane not routed here"}, "llama"),
    ],
)
def test_route_chooses_among_the_lanes_that_serve_the_request(items, queued, refused, lane):
    assert route(LANES, queued, items, refused) == lane


def fit(error: float) -> ReferenceFit:
    return ReferenceFit(certificate="c", error=error)


@pytest.mark.parametrize(
    "lanes, fits, order",
    [
        (("ane", "llama"), {}, []),  # nothing certified: the single-lane rule decides
        (("ane", "llama"), {"llama": fit(9e-5)}, ["llama"]),  # the certified one, however far
        (("ane", "llama"), {"ane": fit(4e-6), "llama": fit(9e-6)}, ["ane", "llama"]),
        (("ane", "llama"), {"ane": fit(9e-6), "llama": fit(4e-6)}, ["llama", "ane"]),
        (("ane", "llama"), {"ane": fit(5e-6), "llama": fit(5e-6)}, ["ane", "llama"]),  # tie
        (("llama", "ane"), {"ane": fit(5e-6), "llama": fit(5e-6)}, ["llama", "ane"]),
        (("ane", "llama"), {"ane": fit(math.nan), "llama": fit(0.5)}, ["llama", "ane"]),
        (("ane",), {"ane": fit(1e-6), "llama": fit(0.0)}, ["ane"]),  # only lanes of the set
    ],
)
def test_the_better_certified_lane_serves_alone(lanes, fits, order):
    assert better_certified(lanes, fits) == order


def test_a_certificate_measures_its_distance_from_the_reference_by_the_model_kind():
    t = make_cert("x").thresholds  # a real row of the gate table
    embed = gates.cosine_checks(np.array([0.999995, 0.999999]), t)
    rerank = [gates.rerank_check(np.array([1e-3, 4e-3]), t, "")]
    labels = gates.label_score_checks(np.array([2e-3]), np.array([True]), t)
    cases = [
        (gates.embedding_not_applicable("cross-encoder") + rerank, "max score error", 4e-3),
        (embed + [gates.rerank_not_applicable("embedding")], "1 - min cos", 5e-6),
        (gates.embedding_not_applicable("sequence classifier") + labels, "max label", 2e-3),
    ]
    for checks, measure, error in cases:
        cert = msgspec.structs.replace(make_cert("2026-01-01T00:00:00Z"), checks=checks)
        got = reference_fit(cert)
        assert got is not None and got.certificate == cert.id
        assert got.measure.startswith(measure) and got.error == pytest.approx(error)
    failed = gates.cosine_checks(np.array([0.5]), t)  # a failed check measures nothing
    assert reference_fit(msgspec.structs.replace(make_cert("x"), checks=failed)) is None


@pytest.mark.parametrize(
    "items, seconds",
    [([], []), ([1, 4], [0.1]), ([4, 1], [0.1, 0.2]), ([0, 1], [0.0, 0.1]), ([1], [-1.0])],
)
def test_a_malformed_curve_is_refused(items, seconds):
    with pytest.raises(ValueError):
        LatencyCurve(items=items, seconds=seconds)


def test_the_agreement_gate():
    at = Agreement(lanes=["ane", "llama"], n_items=9, min_cosine=AGREEMENT_MIN_COS)
    below = Agreement(lanes=["ane", "llama"], n_items=9, min_cosine=0.9997)
    assert at.passed and not below.passed
    assert below.describe() == "min cos 0.999700 < 0.9998 on 9 items, certified"
    assert not Agreement(lanes=["a", "b"], n_items=9).passed  # NaN vectors: no cosine
    order = Agreement(lanes=["ane", "llama"], n_items=9, same_order=False, source="load")
    assert not order.passed and order.describe() == "different orders on 9 items, measured at load"


def test_serve_config_lanes_per_model(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(
        'aliases = {small = "minilm-l6-v2"}\n'
        '[models."small"]\nlanes = ["ane", "llama"]\n'
        '[models."other"]\nlanes = "auto"\n'
    )
    cfg = load_config(path)
    # By the installed name (aliases resolved); "auto" is the default, not listed.
    assert cfg.module.model_lanes == {"minilm-l6-v2": ["ane", "llama"]}


@pytest.mark.parametrize(
    "lanes, match",
    [
        ('["gpu"]', "unknown lane 'gpu'"),
        ('["ane", "ane"]', "listed twice"),
        ("[]", "at least one lane"),
        ('"all"', "lanes"),
    ],
)
def test_bad_lane_lists_are_config_invalid(tmp_path, lanes, match):
    path = tmp_path / "serve.toml"
    path.write_text(f'[models."m"]\nlanes = {lanes}\n')
    with pytest.raises(ConfigInvalid, match=match):
        load_config(path)


@pytest.mark.parametrize(
    "lane, expected",
    [
        (None, None),  # the Module's own choice (two lanes for a model served by both)
        ("llama", ["llama"]),
        ("ane,llama", ["ane", "llama"]),
        (" ane , llama", ["ane", "llama"]),
    ],
)
def test_batch_lane_option(lane, expected):
    assert job_lanes(JobOptions(input="in.jsonl", output="out.parquet", lane=lane)) == expected


@pytest.mark.parametrize("lane", ["gpu", "ane,ane", "ane,"])
def test_a_bad_batch_lane_list_is_a_usage_error(lane):
    with pytest.raises(BatchUsageError, match=f"--lane {lane}"):
        job_lanes(JobOptions(input="in.jsonl", output="out.parquet", lane=lane))


def test_certificates_without_curve_or_agreement_still_load():
    old = msgspec.json.decode(encode(make_cert("2026-01-01T00:00:00Z")))
    assert "agreement" in old and "latency_curve" in old["measurements"]
    del old["agreement"], old["measurements"]["latency_curve"]  # as written before them
    cert = decode(msgspec.json.encode(old))
    assert cert.agreement is None and cert.measurements.latency_curve is None
    with_both = msgspec.structs.replace(
        cert,
        agreement=Agreement(lanes=["llama", "ane"], n_items=3, min_cosine=0.99991),
        measurements=msgspec.structs.replace(cert.measurements, latency_curve=GPU),
    )
    again = decode(encode(with_both))
    assert again.agreement == with_both.agreement and again.measurements.latency_curve == GPU


def _sparse(ids, values):
    return np.array(ids, np.int32), np.array(values, np.float32)


@pytest.mark.parametrize(
    "a, b, output, want",
    [
        (_sparse([2, 7], [1.0, 2.0]), _sparse([2, 7], [1.0, 2.0]), "sparse", 1.0),
        (_sparse([], []), _sparse([], []), "sparse", 1.0),  # two empty vectors agree
        (_sparse([2, 7], [1.0, 1.0]), _sparse([2], [1.0]), "sparse", 1 / math.sqrt(2)),
        (np.eye(2), np.eye(2), "multivector", 1.0),
        (np.eye(2), np.array([[1.0, 0.0], [1.0, 1.0]]), "multivector", 1 / math.sqrt(2)),
        (np.eye(2), np.eye(3)[:2, :2][:1], "multivector", -1.0),  # another count: never agree
    ],
)
def test_two_lanes_own_outputs_agree_by_their_least_cosine(a, b, output, want):
    """A model without a pooled vector: the agreement gate reads its own output."""
    assert least_cosine(a, b, output) == pytest.approx(want)
