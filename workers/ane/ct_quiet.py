"""coremltools, imported quietly.

On Linux coremltools logs a warning per missing native proxy at import ("Failed to load
_MLModelProxy ...") and draws a tqdm bar per MIL pass pipeline. Neither is actionable for a
worker, and both would flood the host's per-worker log ring, so the loggers are set to ERROR
before the import and the pass pipeline's progress bar is disabled. Import coremltools through
this module only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator

for _name in ("coremltools", "coremltools.models", "coremltools.converters"):
    logging.getLogger(_name).setLevel(logging.ERROR)

import coremltools as ct  # noqa: E402
from coremltools.converters.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import Function, Program, Var, types  # noqa: E402
from coremltools.converters.mil.mil.passes import pass_pipeline as _pass_pipeline  # noqa: E402

# The pipeline module calls `tqdm(...)` by its module-global name: hand it a disabled one.
_pass_pipeline.tqdm = functools.partial(_pass_pipeline.tqdm, disable=True)

COREMLTOOLS_VERSION: str = ct.__version__


@contextlib.contextmanager
def quiet_numpy_warnings() -> Iterator[None]:
    """coremltools' passes cast fp32 range bounds to fp16 and trip numpy overflow warnings on
    every conversion (optimize_repeat_ops); they say nothing about our graph."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


__all__ = [
    "COREMLTOOLS_VERSION",
    "Function",
    "Program",
    "Var",
    "ct",
    "mb",
    "quiet_numpy_warnings",
    "types",
]
