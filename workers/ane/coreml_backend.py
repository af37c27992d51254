"""Core ML backend (macOS only): the compiled shape runs on CPU_AND_NE, and the placement
share comes from Core ML's own compute plan.

Import this module only on macOS (`backends.open_runner` does): coremltools' native runtime
(`libcoremlpython`) does not exist elsewhere, so `MLModel.predict` and `MLComputePlan` raise.
Tests that need it are skipped off macOS with that reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from workers.ane.ct_quiet import ct

if sys.platform != "darwin":  # fail at import, not halfway through a request
    raise ImportError("workers.ane.coreml_backend needs macOS (Core ML runtime)")

from coremltools.models.compute_device import MLNeuralEngineComputeDevice  # noqa: E402
from coremltools.models.compute_plan import MLComputePlan  # noqa: E402

SOURCE = "compute_plan"


class CoreMLRunner:
    def __init__(self, package: Path, function_name: str = "main") -> None:
        self.function_name = function_name
        # CPU_AND_NE: the Neural Engine with CPU fallback; never the GPU, whose fp16
        # numerics and scheduling differ from what is certified.
        self.model = ct.models.MLModel(
            str(package),
            compute_units=ct.ComputeUnit.CPU_AND_NE,
            function_name=function_name,
        )
        self._placement: tuple[float, str] | None = None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.model.predict({k: np.ascontiguousarray(v, np.int32) for k, v in feeds.items()})
        return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}

    def placement(self) -> tuple[float, str]:
        if self._placement is None:
            self._placement = compute_plan_share(
                self.model.get_compiled_model_path(), self.function_name
            )
        return self._placement

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]


def compute_plan_share(compiled_path: str, function_name: str = "main") -> tuple[float, str]:
    """Share of Core ML's estimated cost on the Neural Engine over non-const operations."""
    plan = MLComputePlan.load_from_path(
        path=str(compiled_path), compute_units=ct.ComputeUnit.CPU_AND_NE
    )
    program = plan.model_structure.program
    if program is None:
        raise ValueError("not an ML Program")
    total = ane = 0.0
    for op in program.functions[function_name].block.operations:
        if op.operator_name == "const":
            continue
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        weight = cost.weight if cost is not None else 0.0
        total += weight
        if usage is not None and isinstance(
            usage.preferred_compute_device, MLNeuralEngineComputeDevice
        ):
            ane += weight
    return (ane / total if total else 0.0), SOURCE
