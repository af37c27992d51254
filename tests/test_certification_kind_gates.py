"""The token-level kinds' gates (certification.kind_gates): pure functions, each rule once."""

from __future__ import annotations

import numpy as np

from certification import gates
from certification import kind_gates as kg
from certification.thresholds import thresholds_for

LLAMA = thresholds_for("llama", "f32")
REL, FLOOR = LLAMA.sparse_value_rel, LLAMA.sparse_value_floor


def _vec(pairs: dict[int, float]):
    ids = sorted(pairs)
    return np.array(ids, np.int32), np.array([pairs[i] for i in ids], np.float32)


def test_ids_traded_at_the_cut_pass_and_any_other_difference_fails():
    ref = _vec({3: 2.0, 7: 1.0, 9: 0.50})  # a top-3 cut at 0.50
    # The lane keeps id 11 at 0.49 instead of id 9 at 0.50: both within 10 % of the cut.
    traded = kg.compare_sparse(_vec({3: 2.0, 7: 1.0, 11: 0.49}), ref, REL, FLOOR)
    assert (traded.differs, traded.traded) == (0, 2) and traded.cosine > 0.9999
    # An id far above the cut, on one side only, is a different vector.
    extra = kg.compare_sparse(_vec({3: 2.0, 7: 1.0, 9: 0.5, 12: 1.5}), ref, REL, FLOOR)
    assert extra.differs == 1 and extra.cosine < 0.9
    checks = kg.sparse_checks([traded, extra], LLAMA, "test")
    assert {c.name: c.status for c in checks}["sparse.active_set"] == "fail"


def test_values_are_relative_above_the_floor_and_absolute_under_it():
    ref = _vec({1: 10.0, 2: 0.01})  # 0.01 is 0.1 % of the peak: under the 5 % floor
    near_zero = kg.compare_sparse(_vec({1: 10.0, 2: 0.03}), ref, REL, FLOOR)
    assert near_zero.value_rel == np.float32(0.02) / np.float32(0.5)  # 0.02 of a 0.5 floor
    big = kg.compare_sparse(_vec({1: 11.5, 2: 0.01}), ref, REL, FLOOR)
    assert abs(big.value_rel - 0.15) < 1e-6 and big.worst[:2] == (11.5, 10.0)
    (_, value, _) = kg.sparse_checks([big], LLAMA, "test")
    assert value.status == "fail" and "lane 11.5, ref 10" in value.detail


def test_nan_fails_every_gate_it_reaches_and_two_empty_vectors_agree():
    nan = kg.compare_sparse(_vec({1: float("nan")}), _vec({1: 1.0}), REL, FLOOR)
    checks = kg.sparse_checks([nan], LLAMA, "test")
    assert [c.status for c in checks][1:] == ["fail", "fail"]
    empty = kg.compare_sparse(_vec({}), _vec({}), REL, FLOOR)
    assert empty.cosine == 1.0 and empty.differs == 0
    late = kg.late_chunking_check(np.array([0.99999, float("nan")]), LLAMA, "test")
    assert late.status == "fail"


def test_maxsim_is_held_per_query_vector():
    # 32 query vectors, raw error 0.016: 5e-4 per vector passes; 2 vectors, 0.016 does not.
    errors = np.array([0.016, 0.016])
    ok = kg.multivector_checks([], 2, np.array([1.0, 1.0]), errors, np.array([32, 32]), LLAMA, "")
    bad = kg.multivector_checks([], 2, np.array([1.0, 1.0]), errors, np.array([2, 32]), LLAMA, "")
    assert ok[2].status == "pass" and bad[2].status == "fail"
    assert "worst 0.016" in ok[2].detail  # the raw figure is said too


def test_an_output_verdict_is_never_a_pass_when_the_lane_refused_it():
    served = kg.multivector_checks([], 1, np.array([1.0]), np.zeros(0), np.zeros(0), LLAMA, "")
    refused = served[:2] + kg.not_served([served[2].name], "query side: no mask")
    verdict = kg.output_verdict("multivector", refused, "query side: no mask")
    assert verdict.status == "not served"
    assert verdict.detail == "not served on this lane: query side: no mask"
    # A refused output's checks are n/a: the certificate's verdict is the served outputs'.
    assert gates.verdict(refused)[0] == "certified"
    wrong = served[:1] + [kg.late_chunking_check(np.array([0.5]), LLAMA, "")]
    assert kg.output_verdict("multivector", wrong, "r").status == "fail"  # a failure wins
    na = kg.output_verdict("late_chunking", kg.not_applicable(["late"], "pools by cls"))
    assert na.status == "n/a" and na.detail == "pools by cls"
