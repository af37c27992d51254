"""Core ML backend (macOS only): compile a package once, open the compiled model, and ask
Core ML's compute plan where it runs.

    compile: coremltools.models.utils.compile_model(<.mlpackage>) -> <.mlmodelc>
    open:    ct.models.CompiledMLModel(<.mlmodelc>, **coreml_args.compiled_model_arguments(...))
             (no recompilation; a function name only for multifunction packages: see
             coreml_args, since Core ML takes one only on macOS >= 15)
    placement: MLComputePlan.load_from_path(<.mlmodelc>) -> compute_plan.share (macOS >= 14.4;
             older systems report the static estimate, labelled "estimate"), computed once
             at admission: it can outlast PING's window for a large model

Import this module only on macOS (`backends.open_backend` does): coremltools' native runtime
(`libcoremlpython`) does not exist elsewhere. Tests that need it are skipped off macOS.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np

from workers.ane import apple_device, compute_plan, coreml_args, placement, program_ir
from workers.ane.backend_errors import BackendOpenFailed
from workers.ane.ct_quiet import ct

if sys.platform != "darwin":  # fail at import, not halfway through a request
    raise ImportError("workers.ane.coreml_backend needs macOS (Core ML runtime)")

from coremltools.models.compute_device import (
    MLGPUComputeDevice,
    MLNeuralEngineComputeDevice,
)
from coremltools.models.compute_plan import MLComputePlan

log = logging.getLogger("synapse.ane")

COMPUTE_UNITS = {
    ours: getattr(ct.ComputeUnit, member)
    for ours, member in coreml_args.COMPUTE_UNIT_MEMBERS.items()
}
COMPUTE_PLAN_MIN_MACOS = (14, 4)
COMPILED_NAME = "model.mlmodelc"
# The op list (no weights) of the package, kept beside the compiled model: the static
# estimate's input on systems without MLComputePlan.
OPS_NAME = "ops"
# The package's function names, recorded at compile time: whether opening needs a name.
FUNCTIONS_NAME = "functions.json"


class CoreMLBackend:
    name = "coreml"
    compiled_kind = "mlmodelc"
    # Core ML compiles for the Neural Engine while it loads the model (load_ms); the first
    # prediction still allocates its buffers and finishes lazy set-up, which one warm-up
    # prediction at admission keeps off the first caller (warmup_ms).
    warms_up = True

    def __init__(self, compute_units: str) -> None:
        self.compute_units = compute_units

    def compiled_key_fields(self) -> dict[str, str]:
        # A compiled model belongs to one OS build (the Core ML compiler ships with macOS);
        # "layout" 2 entries carry the function list beside the compiled model.
        return {"macos_build": apple_device.macos_build() or "unknown", "layout": "2"}

    def compile(self, package: Path, out_dir: Path) -> None:
        from workers.ane.executor import load_package_program

        ct.models.utils.compile_model(str(package), destination_path=str(out_dir / COMPILED_NAME))
        prog = load_package_program(package)
        program_ir.save(program_ir.from_mil(prog), out_dir / OPS_NAME, weights=False)
        (out_dir / FUNCTIONS_NAME).write_text(json.dumps(list(prog.functions)))

    def open(self, compiled_dir: Path) -> CoreMLRunner:
        return CoreMLRunner(compiled_dir, self.compute_units)


class CoreMLRunner:
    def __init__(self, compiled_dir: Path, compute_units: str, function_name: str | None = None):
        self.path = compiled_dir / COMPILED_NAME
        self.ops_dir = compiled_dir / OPS_NAME
        self.compute_units = compute_units
        try:
            functions = json.loads((compiled_dir / FUNCTIONS_NAME).read_text())
            args = coreml_args.compiled_model_arguments(
                compute_units, functions, function_name, apple_device.macos_version()
            )
        except (OSError, ValueError) as e:
            raise BackendOpenFailed(f"{compiled_dir}: {e}") from e
        self.function_name = args.get("function_name", functions[0])
        try:
            self.model = ct.models.CompiledMLModel(
                str(self.path),
                compute_units=getattr(ct.ComputeUnit, args.pop("compute_units")),
                **args,
            )
        except Exception as e:  # coremltools raises bare Exception/RuntimeError from native code
            raise BackendOpenFailed(f"Core ML could not open {self.path}: {e}") from e
        self._placement: tuple[float, str] | None = None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.model.predict({k: np.ascontiguousarray(v, np.int32) for k, v in feeds.items()})
        return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}

    def compute_placement(self) -> tuple[float, str]:
        """At admission (the long control window), never in PING: MLComputePlan can take
        longer than PING's window for a large model. A plan Core ML cannot give falls back
        to the static estimate, labelled so (certification caps it at provisional)."""
        if self._placement is None:
            if apple_device.version_at_least(apple_device.macos_version(), COMPUTE_PLAN_MIN_MACOS):
                try:
                    self._placement = compute_plan_share(
                        self.path, self.compute_units, self.function_name
                    )
                except Exception as e:  # native errors from the plan: say so, estimate
                    log.warning("compute plan of %s failed (%s); using the estimate", self.path, e)
            if self._placement is None:
                self._placement = placement.estimate(program_ir.load(self.ops_dir))
        return self._placement

    def placement(self) -> tuple[float, str] | None:
        return self._placement

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]


def _device(usage: object) -> str | None:
    if usage is None:
        return None
    dev = usage.preferred_compute_device  # type: ignore[attr-defined]
    if isinstance(dev, MLNeuralEngineComputeDevice):
        return "ane"
    return "gpu" if isinstance(dev, MLGPUComputeDevice) else "cpu"


def compute_plan_share(
    compiled_path: Path, compute_units: str, function_name: str = "main"
) -> tuple[float, str]:
    plan = MLComputePlan.load_from_path(
        path=str(compiled_path), compute_units=COMPUTE_UNITS[compute_units]
    )

    def cost_of(op: object) -> float | None:
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        return None if cost is None else cost.weight

    value, _details = compute_plan.share(
        plan.model_structure.program,
        cost_of,
        lambda op: _device(plan.get_compute_device_usage_for_mlprogram_operation(op)),
        function_name,
    )
    return value, compute_plan.SOURCE
