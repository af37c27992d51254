"""Execution backends for a compiled shape.

- `reference` (everywhere): the project's numpy executor of the saved package
  (`executor.CompiledProgram`); placement is the static estimate (`placement.estimate`).
- `coreml` (macOS only): Core ML on CPU_AND_NE (`coreml_backend`, imported only there);
  placement from Core ML's own `MLComputePlan`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Protocol

import numpy as np

from workers.ane import placement
from workers.ane.executor import CompiledProgram, load_package_program

BACKENDS = ("reference", "coreml")


class BackendUnavailable(Exception):
    """The backend cannot run on this platform."""


class ShapeRunner(Protocol):
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """int32 feeds by input name -> float32 outputs by output name."""

    def placement(self) -> tuple[float, str]:
        """(share of the work on the Neural Engine, "estimate" | "compute_plan")."""

    def close(self) -> None: ...


def default_backend() -> str:
    return "coreml" if sys.platform == "darwin" else "reference"


class ReferenceRunner:
    def __init__(self, package: Path) -> None:
        prog = load_package_program(package)
        self.program = CompiledProgram(prog)  # raises UnsupportedOp for unknown ops
        self._placement = placement.estimate(prog)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.program.run(feeds)

    def placement(self) -> tuple[float, str]:
        return self._placement

    def close(self) -> None:
        self.program = None  # type: ignore[assignment]  # drop the weights now


def open_runner(backend: str, package: Path) -> ShapeRunner:
    if backend == "reference":
        return ReferenceRunner(package)
    if backend == "coreml":
        if sys.platform != "darwin":
            raise BackendUnavailable("the coreml backend needs macOS (the Core ML runtime)")
        from workers.ane.coreml_backend import CoreMLRunner

        return CoreMLRunner(package)
    raise BackendUnavailable(f"unknown backend {backend!r}; expected one of {BACKENDS}")
