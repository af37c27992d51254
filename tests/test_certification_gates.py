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
