"""The Core ML engine's identity constants, importable without coremltools.

HELLO must go out before the heavy imports (coremltools takes seconds to import, 8-11 s with
torch installed), so everything HELLO and the compile-cache keys name lives here: the graph's
kernel revision, its precision and deployment target, and coremltools' version read from the
installed distribution's metadata instead of `coremltools.__version__`.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

#: Names the builder's graph. Bump it whenever the emitted graph changes for the same inputs:
#: it is part of every compile-cache key and of HELLO.
KERNEL_REVISION = "ane-bert-1"

PRECISION = "fp16"
DEPLOYMENT_TARGET = "macOS14"


@functools.cache
def coremltools_version() -> str:
    try:
        return version("coremltools")
    except PackageNotFoundError:
        return "absent"
