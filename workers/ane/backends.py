"""Execution backends: how a shape's `.mlpackage` is compiled once, and how the compiled form
is opened. The compiled form is the second kind of compile-cache entry (`compiled_kind`).

- `reference` (everywhere): the project's numpy executor. Its compiled form is the program as
  `program_ir` saves it (op list + weights mapped read-only), so opening a cached shape reads
  no package and imports no coremltools. Placement is the static estimate.
- `coreml` (macOS only, `coreml_backend`): `compile_model` -> `.mlmodelc`, opened with
  `CompiledMLModel(compute_units=...)`; placement from Core ML's `MLComputePlan`.

A backend: `name`, `compiled_kind`, `warms_up` (whether admission runs one prediction after
opening: Core ML compiles for the Neural Engine while it opens the model, and the first
prediction still allocates and finishes lazy set-up; numpy has neither, so the reference
backend skips it), `compiled_key_fields()` (what the compiled form
depends on beyond the package), `compile(package, out_dir)`, `open(compiled_dir)`.

A runner's placement is computed once, at admission (`compute_placement`, under the long
control window with PROGRESS before and after), and only read afterwards (`placement`): Core
ML's compute plan for a Qwen3-size model can take longer than PING's window, and a PING that
computed it would cost the lane a strike. `SYNAPSE_ANE_PLACEMENT_DELAY_S` (test only) makes the
reference backend's placement take that many seconds longer: the slow compute plan, on Linux.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from workers.ane import placement, program_ir
from workers.ane.backend_errors import BackendUnavailable
from workers.ane.config import COMPUTE_UNITS
from workers.ane.executor import CompiledProgram

BACKENDS = ("reference", "coreml")
PLACEMENT_DELAY_ENV = "SYNAPSE_ANE_PLACEMENT_DELAY_S"


def placement_delay_s(environ: dict[str, str] | None = None) -> float:
    """The test-only extra seconds of the reference backend's placement (0 when unset)."""
    raw = (os.environ if environ is None else environ).get(PLACEMENT_DELAY_ENV, "").strip()
    try:
        return max(0.0, float(raw)) if raw else 0.0
    except ValueError:
        raise ValueError(f"{PLACEMENT_DELAY_ENV}={raw!r}: expected seconds") from None


class ShapeRunner(Protocol):
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """int32 feeds by input name -> float32 outputs by output name."""

    def compute_placement(self) -> tuple[float, str]:
        """(share of the work on the Neural Engine, "estimate" | "compute_plan"), computed now
        and kept: may take long (Core ML's compute plan). Admission calls it once."""

    def placement(self) -> tuple[float, str] | None:
        """What `compute_placement` found; None before it ran. Never computes."""

    def close(self) -> None: ...


class Backend(Protocol):
    name: str
    compiled_kind: str
    warms_up: bool

    def compiled_key_fields(self) -> dict[str, str]: ...

    def compile(self, package: Path, out_dir: Path) -> None: ...

    def open(self, compiled_dir: Path) -> ShapeRunner: ...


def default_backend() -> str:
    return "coreml" if sys.platform == "darwin" else "reference"


class ReferenceRunner:
    def __init__(self, func: program_ir.Function) -> None:
        self.program = CompiledProgram(func)  # raises UnsupportedOp for unknown ops
        self._func = func
        self._placement: tuple[float, str] | None = None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.program.run(feeds)

    def compute_placement(self) -> tuple[float, str]:
        if self._placement is None:
            delay = placement_delay_s()
            if delay:
                time.sleep(delay)  # stands in for a slow MLComputePlan.load_from_path
            self._placement = placement.estimate(self._func)
        return self._placement

    def placement(self) -> tuple[float, str] | None:
        return self._placement

    def close(self) -> None:
        self.program = None  # type: ignore[assignment]  # drop the weights now


class ReferenceBackend:
    name = "reference"
    compiled_kind = "reference-program"
    warms_up = False
    PROGRAM_DIR = "program"

    def compiled_key_fields(self) -> dict[str, str]:
        return {"program_format": f"program_ir-{program_ir.FORMAT}"}

    def compile(self, package: Path, out_dir: Path) -> None:
        from workers.ane.executor import load_package_program  # coremltools: compile only

        func = program_ir.from_mil(load_package_program(package))
        CompiledProgram(func)  # refuse ops the executor cannot run before publishing anything
        program_ir.save(func, out_dir / self.PROGRAM_DIR)

    def open(self, compiled_dir: Path) -> ReferenceRunner:
        return ReferenceRunner(program_ir.load(compiled_dir / self.PROGRAM_DIR))


def open_backend(name: str, compute_units: str = "cpu_and_ne") -> Backend:
    if compute_units not in COMPUTE_UNITS:
        raise BackendUnavailable(
            f"compute_units {compute_units!r}: expected one of {COMPUTE_UNITS}"
        )
    if name == "reference":
        return ReferenceBackend()
    if name == "coreml":
        if sys.platform != "darwin":
            raise BackendUnavailable("the coreml backend needs macOS (the Core ML runtime)")
        from workers.ane.coreml_backend import CoreMLBackend

        return CoreMLBackend(compute_units)
    raise BackendUnavailable(f"unknown backend {name!r}; expected one of {BACKENDS}")
