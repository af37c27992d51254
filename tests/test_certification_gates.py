"""The placement gate and the verdict it leads to: pure functions, every branch."""

from __future__ import annotations

import pytest

from certification import gates
from certification.identity import os_identity
from certification.thresholds import thresholds_for

ANE = thresholds_for("ane", "fp16")
LLAMA = thresholds_for("llama", "f16")


def _verdict(check):
    return gates.verdict([check])[0]


def test_compute_plan_passes_only_with_a_neural_engine_and_a_share_at_the_threshold():
    t = ANE.placement_share
    ok = gates.placement_check("ane", t, "compute_plan", ANE, neural_engine=True)
    assert ok.status == "pass" and _verdict(ok) == "certified"
    below = gates.placement_check("ane", t - 0.01, "compute_plan", ANE, neural_engine=True)
    assert below.status == "fail" and _verdict(below) == "failed"


@pytest.mark.parametrize("neural_engine", [False, None])
def test_compute_plan_without_a_neural_engine_is_provisional_with_the_reason(neural_engine):
    check = gates.placement_check("ane", 1.0, "compute_plan", ANE, neural_engine=neural_engine)
    assert check.status == "provisional" and _verdict(check) == "provisional"
    assert "no Neural Engine" in check.detail and "compute_plan" in check.detail


def test_an_estimate_is_at_most_provisional_even_on_a_machine_with_a_neural_engine():
    check = gates.placement_check("ane", 1.0, "estimate", ANE, neural_engine=True)
    assert check.status == "provisional" and "no Neural Engine" not in check.detail
    # Below the threshold an estimate fails like any share.
    low = gates.placement_check("ane", 0.0, "estimate", ANE, neural_engine=True)
    assert low.status == "fail"


def test_no_share_fails_and_a_cpu_lane_has_no_placement_gate():
    assert gates.placement_check("ane", None, None, ANE, neural_engine=True).status == "fail"
    assert gates.placement_check("llama", None, None, LLAMA).status == "n/a"


def test_certificate_os_identity_names_macos_build_and_chip():
    apple = {
        "chip": "Apple M2 Pro",
        "macos": "14.4.1",
        "macos_build": "23E224",
        "neural_engine": True,
    }
    mac = os_identity("Darwin", "arm64", apple)
    assert mac == "macOS-14.4.1-23E224-arm64-Apple_M2_Pro"
    # Another build or another chip is another identity: no certificate carries over.
    assert os_identity("Darwin", "arm64", {**apple, "macos_build": "23F79"}) != mac
    assert os_identity("Darwin", "arm64", {**apple, "chip": "Apple M1"}) != mac
    # Linux keeps its identity (kernel releases do not change the numbers).
    assert os_identity("Linux", "x86_64", {"chip": None}) == "Linux-x86_64"


# ---- LLM rerankers ---------------------------------------------------------------------------


def test_an_llm_rerankers_bar_scales_with_the_references_scores_and_a_cross_encoders_does_not():
    import numpy as np

    ref = np.array([-8.0, 0.1, 3.0])
    bar, scale = gates.llm_rerank_bar(ref, ANE)
    assert scale == 8.0 and bar == pytest.approx(ANE.rerank_max_abs + ANE.llm_rerank_rel * 8.0)
    # Twice the scores, the same relative error: the bar grows with them.
    assert gates.llm_rerank_bar(2 * ref, ANE)[0] > bar
    # Taken from the reference alone: an error of the bar's size passes, just past it fails.
    ok = gates.llm_rerank_check(np.array([0.0, bar, 0.0]), ref, ANE, "n")
    over = gates.llm_rerank_check(np.array([0.0, bar * 1.01, 0.0]), ref, ANE, "n")
    assert (ok.status, over.status) == ("pass", "fail") and ok.threshold == bar
    assert "max|ref| 8" in ok.detail
    # The llama rows keep their absolute bar; a cross-encoder (gates.rerank_check) is judged
    # at rerank_max_abs on every lane, however large its scores.
    assert gates.llm_rerank_bar(ref, LLAMA)[0] == LLAMA.rerank_max_abs
    ce = gates.rerank_check(np.array([ANE.rerank_max_abs * 1.01]), ANE, "n")
    assert ce.status == "fail" and ce.threshold == ANE.rerank_max_abs


def test_the_same_order_gate_exempts_near_ties_only():
    import numpy as np

    ref = np.array([3.0, 1.0, 0.99, -2.0])
    # Two documents 1e-2 apart swap within a bar of 2e-2: not a reversal.
    assert gates.reversed_pairs(np.array([3.0, 0.98, 1.0, -2.0]), ref, 2e-2) == 0
    # The same swap judged at a tighter margin, and a swap of documents 2 apart, are.
    assert gates.reversed_pairs(np.array([3.0, 0.98, 1.0, -2.0]), ref, 5e-3) == 1
    assert gates.reversed_pairs(np.array([1.0, 3.0, 0.99, -2.0]), ref, 2e-2) == 1
    # Negated scores (the yes/no rows swapped) reverse every clear pair: 5 of the 6.
    assert gates.reversed_pairs(-ref, ref, 2e-2) == 5
    check = gates.rerank_order_check([4], 10, 2e-2)
    assert check.status == "fail" and "0.02" in check.detail
    assert gates.rerank_order_check([], 10, 2e-2).status == "pass"


def test_a_wider_llm_rerank_scale_is_a_loosened_override_and_a_narrower_one_is_not():
    from certification.policy import loosened
    from tests.test_certification_store import make_cert

    cert = make_cert("2026-01-01T00:00:00Z")  # a llama row: llm_rerank_rel 0
    cert.overrides = {"llm_rerank_rel": 1e-2}
    assert loosened(cert) == ["llm_rerank_rel 0.01 vs table 0"]
    cert.overrides = {"llm_rerank_rel": 0.0}
    assert loosened(cert) == []
    assert ANE.with_overrides({"llm_rerank_rel": 1e-3}).llm_rerank_rel == 1e-3
