"""The Neural Engine share of a compiled model from Core ML's compute plan: the pure walk.

`coreml_backend.compute_plan_share` (macOS) loads `MLComputePlan` for a `.mlmodelc` and hands
its program structure here with two look-ups into the plan; everything else is this module,
which the Linux suite runs on real `MLModelStructureProgram` objects built from our own saved
packages plus per-op device and cost tables.

    share = sum(weight of ops whose preferred device is the Neural Engine)
            / sum(weight of all non-const ops), over the function's block and nested blocks

- weight: Core ML's estimated cost (`MLComputePlanCost.weight`). Where an op has no cost
  (None), it weighs the mean cost of the ops that have one (so among them it counts as one
  op); if no op has a cost the share is a plain op count.
- device: the op's preferred compute device, "ane" | "cpu" | "gpu", or None when Core ML
  reports no usage for it - counted as not on the Neural Engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

SOURCE = "compute_plan"
DEVICES = ("ane", "cpu", "gpu")


def walk(operations: Iterable[Any]) -> Iterator[Any]:
    """Every operation, depth first, including those in nested blocks (cond, while...)."""
    for op in operations:
        yield op
        for block in getattr(op, "blocks", None) or ():
            yield from walk(block.operations)


def share(
    program: Any,
    cost_of: Callable[[Any], float | None],
    device_of: Callable[[Any], str | None],
    function_name: str = "main",
) -> tuple[float, dict[str, Any]]:
    """(Neural Engine share in [0, 1], details) of `program.functions[function_name]`.

    `program` is an `MLModelStructureProgram` (or anything with `.functions[name].block`);
    `cost_of(op)` / `device_of(op)` answer for one operation."""
    if program is None:
        raise ValueError("not an ML Program: the compute plan has no program structure")
    if function_name not in program.functions:
        raise ValueError(f"no function {function_name!r} in the compute plan")
    ops = [
        op
        for op in walk(program.functions[function_name].block.operations)
        if op.operator_name != "const"
    ]
    costs = [cost_of(op) for op in ops]
    known = [c for c in costs if c is not None]
    fill = sum(known) / len(known) if known else 1.0
    weights = [fill if c is None else float(c) for c in costs]
    devices = [device_of(op) for op in ops]
    for d in devices:
        if d is not None and d not in DEVICES:
            raise ValueError(f"device {d!r}: expected one of {DEVICES} or None")
    total = sum(weights)
    ane = sum(w for w, d in zip(weights, devices, strict=True) if d == "ane")
    details = {
        "ops": len(ops),
        "ops_without_cost": len(costs) - len(known),
        "ops_without_device": sum(d is None for d in devices),
        "weighting": "op_count" if not known else "estimated_cost",
    }
    return (ane / total if total > 0 else 0.0), details
