"""The arguments we hand Core ML, built by pure functions so their rules are tested anywhere.

coremltools 9.0's `CompiledMLModel(path, compute_units, function_name=None)` turns `None` into
`""`, and its native `Model::Model` (coremlpython/CoreMLPython.mm) sets
`MLModelConfiguration.functionName` for any non-empty name, which exists only on macOS >= 15:
on older systems it throws "The 'functionName' property can only be set on macOS >= 15.0".
So a name is passed only to select one function of a multifunction package; a package with
one function is opened without it, which works on macOS 14, the oldest system our packages
open on at all: the builders target macOS 14 (`ct.target.macOS14`, specification version 8),
which macOS 13's Core ML refuses whatever the arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.ane.apple_device import version_at_least

# Our compute-unit names -> the `coremltools.ComputeUnit` member names.
COMPUTE_UNIT_MEMBERS = {
    "cpu_and_ne": "CPU_AND_NE",
    "cpu_only": "CPU_ONLY",
    "cpu_and_gpu": "CPU_AND_GPU",
    "all": "ALL",
}
FUNCTION_NAME_MIN_MACOS = (15, 0)
# Compute units that let Core ML run work on the GPU: such a lane shares the one Apple GPU.
GPU_COMPUTE_UNITS = frozenset({"cpu_and_gpu", "all"})


class FunctionSelectionUnsupported(ValueError):
    """A multifunction package's function cannot be chosen on this macOS."""


def compiled_model_arguments(
    compute_units: str,
    functions: Sequence[str],
    function_name: str | None,
    macos_version: str | None,
) -> dict[str, str]:
    """Keyword arguments for `CompiledMLModel` (compute units by member name).

    `functions`: the package's function names, `function_name`: the one to run (None: the
    package's only one). Raises ValueError for an unknown compute unit or function, and
    FunctionSelectionUnsupported for a multifunction package on macOS < 15.
    """
    if compute_units not in COMPUTE_UNIT_MEMBERS:
        raise ValueError(
            f"compute_units {compute_units!r}: expected one of {sorted(COMPUTE_UNIT_MEMBERS)}"
        )
    if not functions:
        raise ValueError("the package declares no function")
    args = {"compute_units": COMPUTE_UNIT_MEMBERS[compute_units]}
    if len(functions) == 1:
        if function_name not in (None, functions[0]):
            raise ValueError(f"no function {function_name!r} in the package ({functions[0]!r})")
        return args  # the only function: no name, so macOS 14 (our minimum) can open it
    if function_name is None:
        raise ValueError(f"a multifunction package ({', '.join(functions)}) needs a function name")
    if function_name not in functions:
        raise ValueError(f"no function {function_name!r} in the package ({', '.join(functions)})")
    if not version_at_least(macos_version, FUNCTION_NAME_MIN_MACOS):
        raise FunctionSelectionUnsupported(
            f"function {function_name!r} of a multifunction package: Core ML selects functions "
            f"only on macOS >= 15.0 (this is {macos_version or 'unknown'})"
        )
    args["function_name"] = function_name
    return args


def uses_gpu(compute_units: str) -> bool:
    """Whether Core ML may place work on the GPU with these compute units."""
    return compute_units in GPU_COMPUTE_UNITS


def lane_device(compute_units: str) -> str:
    """The device(s) a Core ML lane computes on, as LOADED names them for the host's permits:
    "ane+gpu" when Core ML may also use the GPU (one shared Apple GPU), else "ane"."""
    return "ane+gpu" if uses_gpu(compute_units) else "ane"
