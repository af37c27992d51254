"""Keep coremltools from importing the converter frameworks it probes at import time.

`import coremltools` tries `import torch`, `sklearn`, `tensorflow`, `xgboost`, ... to decide
which converters to offer; with torch installed that alone takes 8-11 s on 2 cores. The Core
ML worker converts our own MIL programs and needs none of them, so the worker process marks
them unimportable before anything imports coremltools: a `None` entry in `sys.modules` makes
`import torch` raise ImportError at once, which coremltools' probes (`try: import torch /
except: _HAS_TORCH = False`) take as "not installed". Call this in the worker process only:
the host and the tools may well want torch.
"""

from __future__ import annotations

import sys

BLOCKED = (
    "torch",
    "torchvision",
    "torchaudio",
    "torchao",
    "executorch",
    "sklearn",
    "tensorflow",
    "xgboost",
    "libsvm",
)


def block_converter_frameworks() -> list[str]:
    """Mark every framework in BLOCKED unimportable in this process; returns the ones newly
    blocked (one that is already imported is left alone: too late to save its cost)."""
    blocked = []
    for name in BLOCKED:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
            blocked.append(name)
    return blocked
