"""`compute_plan.share`, the pure walk behind the macOS placement share, on real
`MLModelStructureProgram` objects (coremltools' own classes) built from the program of one of
our saved packages, with per-op device and cost tables standing in for Core ML's answers."""

from __future__ import annotations

import pytest
from coremltools.models.compute_plan import (
    MLModelStructureProgram,
    MLModelStructureProgramBlock,
    MLModelStructureProgramFunction,
    MLModelStructureProgramOperation,
)

from compile_cache import CompileCache
from tests import test_ane_helpers as h
from workers.ane import compute_plan, placement
from workers.ane.build_options import BuildOptions
from workers.ane.compiler import PACKAGE_NAME, AdmitTimings, package_entry
from workers.ane.executor import load_package_program
from workers.ane.program_ir import from_mil
from workers.ane.shapes import Shape

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker


def _op(kind: str, blocks=()) -> MLModelStructureProgramOperation:
    return MLModelStructureProgramOperation(
        inputs={}, operator_name=kind, outputs=[], blocks=list(blocks), __proxy__=None
    )


def _program(ops) -> MLModelStructureProgram:
    block = MLModelStructureProgramBlock(inputs=[], operations=list(ops), output_names=[])
    return MLModelStructureProgram(
        functions={"main": MLModelStructureProgramFunction(inputs=[], block=block)}
    )


@pytest.fixture(scope="module")
def our_program():
    """(structure, op by structure op, IR op) of the converted 4x256 MiniLM package."""
    with CompileCache(h.CACHE_ROOT) as cache:
        entry, _ = package_entry(
            cache,
            h.minilm(),
            Shape(**h.EMBED_UNPACKED),
            BuildOptions(),
            lambda _s: None,
            AdmitTimings(),
        )
        with entry.lease().acquire():
            func = from_mil(load_package_program(entry.path / PACKAGE_NAME))
    ir_of = {}
    ops = []
    for ir_op in func.operations:
        op = _op(ir_op.op_type)
        ir_of[id(op)] = ir_op
        ops.append(op)
    return _program(ops), ir_of, func


def test_share_weights_by_cost_skips_const_and_matches_the_estimate_tables(our_program):
    program, ir_of, func = our_program

    # Device and cost tables from the static estimate: the share must equal the estimate's.
    def device(op):
        return "ane" if placement.ane_eligible(ir_of[id(op)]) else "cpu"

    share, details = compute_plan.share(
        program, lambda op: placement.op_cost(ir_of[id(op)]), device
    )
    assert share == pytest.approx(placement.estimate(func)[0], rel=1e-12)
    assert details["weighting"] == "estimated_cost" and details["ops_without_cost"] == 0
    n_const = sum(op.op_type == "const" for op in func.operations)
    assert details["ops"] == len(func.operations) - n_const > 100


def test_costs_missing_everywhere_fall_back_to_op_counts(our_program):
    program, ir_of, _ = our_program
    on_ane = {
        id(op) for op in program.functions["main"].block.operations if op.operator_name == "conv"
    }
    share, details = compute_plan.share(
        program, lambda op: None, lambda op: "ane" if id(op) in on_ane else "cpu"
    )
    assert details["weighting"] == "op_count"
    assert share == pytest.approx(len(on_ane) / details["ops"])


def test_partial_costs_and_unknown_devices():
    # Two costed ops (3.0 on the ANE, 1.0 on the CPU), one uncosted ANE op that weighs their
    # mean (2.0), one op with no device usage (counted, never as ANE), and a const (skipped).
    a, b, c, d, k = _op("conv"), _op("softmax"), _op("gelu"), _op("cast"), _op("const")
    costs = {id(a): 3.0, id(b): 1.0, id(c): None, id(d): 2.0, id(k): 100.0}
    devices = {id(a): "ane", id(b): "cpu", id(c): "ane", id(d): None, id(k): "ane"}
    share, details = compute_plan.share(
        _program([a, b, c, d, k]), lambda op: costs[id(op)], lambda op: devices[id(op)]
    )
    assert share == pytest.approx((3.0 + 2.0) / (3.0 + 1.0 + 2.0 + 2.0))
    assert details == {
        "ops": 4,
        "ops_without_cost": 1,
        "ops_without_device": 1,
        "weighting": "estimated_cost",
    }


def test_nested_blocks_are_walked():
    inner = MLModelStructureProgramBlock(
        inputs=[], operations=[_op("conv"), _op("const")], output_names=[]
    )
    loop = _op("while_loop", blocks=[inner, inner])
    program = _program([loop, _op("add")])
    share, details = compute_plan.share(
        program, lambda op: 1.0, lambda op: "ane" if op.operator_name == "conv" else "cpu"
    )
    assert details["ops"] == 4  # while_loop, conv twice (two blocks), add; consts skipped
    assert share == pytest.approx(2 / 4)


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="not an ML Program"):
        compute_plan.share(None, lambda op: 1.0, lambda op: "ane")
    with pytest.raises(ValueError, match="no function 'other'"):
        compute_plan.share(_program([]), lambda op: 1.0, lambda op: "ane", "other")
    with pytest.raises(ValueError, match="device 'npu'"):
        compute_plan.share(_program([_op("add")]), lambda op: 1.0, lambda op: "npu")
    assert compute_plan.share(_program([_op("const")]), lambda op: 1.0, lambda op: "ane")[0] == 0.0
