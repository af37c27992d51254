"""Our side of Core ML's open rules, on any OS: the arguments `CompiledMLModel` gets.

coremltools 9.0 hands any non-empty function name to `MLModelConfiguration.functionName`,
which throws on macOS < 15: a single-function package must be opened without one (or every
load fails on macOS 14, the oldest our macOS 14-targeted packages open on), and a
multifunction package needs macOS 15."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from workers.ane.coreml_args import (
    COMPUTE_UNIT_MEMBERS,
    FunctionSelectionUnsupported,
    compiled_model_arguments,
    uses_gpu,
)


@pytest.mark.parametrize("macos", ["13.6", "14.4.1", "15.1", "26.0", None])
def test_a_single_function_package_is_opened_without_a_function_name(macos):
    for name in (None, "main"):
        args = compiled_model_arguments("cpu_and_ne", ["main"], name, macos)
        assert args == {"compute_units": "CPU_AND_NE"}  # no "function_name" on any macOS


def test_a_multifunction_package_names_its_function_on_macos_15_only():
    functions = ["embed_8x128", "embed_4x256"]
    assert compiled_model_arguments("all", functions, "embed_4x256", "15.0") == {
        "compute_units": "ALL",
        "function_name": "embed_4x256",
    }
    assert (
        compiled_model_arguments("all", functions, "embed_4x256", "26.1")["function_name"]
        == "embed_4x256"
    )
    for old in ("14.7", "13.0", None):
        with pytest.raises(FunctionSelectionUnsupported, match="only on macOS >= 15.0"):
            compiled_model_arguments("all", functions, "embed_4x256", old)


def test_bad_asks_are_value_errors_naming_what_is_there():
    with pytest.raises(ValueError, match="needs a function name"):
        compiled_model_arguments("all", ["a", "b"], None, "15.0")
    with pytest.raises(ValueError, match=r"no function 'c' in the package \(a, b\)"):
        compiled_model_arguments("all", ["a", "b"], "c", "15.0")
    with pytest.raises(ValueError, match=r"no function 'other' in the package \('main'\)"):
        compiled_model_arguments("all", ["main"], "other", "15.0")
    with pytest.raises(ValueError, match="declares no function"):
        compiled_model_arguments("all", [], None, "15.0")
    with pytest.raises(ValueError, match="compute_units 'gpu'"):
        compiled_model_arguments("gpu", ["main"], None, "15.0")


def _pinned_compute_units() -> set[str]:
    """The members of `coremltools.ComputeUnit`, read from the pinned package's source:
    importing coremltools takes seconds, and every test process collects this module."""
    spec = importlib.util.find_spec("coremltools")  # finds the package, runs none of it
    assert spec is not None and spec.origin is not None, "coremltools is not installed"
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "ComputeUnit":
            return {
                target.id
                for stmt in node.body
                if isinstance(stmt, ast.Assign)
                for target in stmt.targets
                if isinstance(target, ast.Name)
            }
    raise AssertionError(f"no class ComputeUnit in {spec.origin}")


def test_compute_unit_members_exist_in_the_pinned_coremltools():
    members = _pinned_compute_units()
    for ours, member in COMPUTE_UNIT_MEMBERS.items():
        assert member in members, ours


def test_gpu_compute_units_are_the_ones_that_reach_the_gpu():
    assert uses_gpu("all") and uses_gpu("cpu_and_gpu")
    assert not uses_gpu("cpu_and_ne") and not uses_gpu("cpu_only")


def test_the_lane_device_names_the_gpu_when_core_ml_may_use_it():
    from workers.ane.coreml_args import lane_device

    assert lane_device("cpu_and_ne") == "ane" and lane_device("cpu_only") == "ane"
    assert lane_device("all") == "ane+gpu" and lane_device("cpu_and_gpu") == "ane+gpu"
