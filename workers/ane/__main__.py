"""`python -m workers.ane --socket PATH --nonce NONCE [--artifact DIR] [--backend B]
[--cache-root DIR] [--build-options JSON]`: the Core ML (Neural Engine) worker process.

HELLO goes out before any heavy import: the engine's constructor reads the manifest's body
digest only, and coremltools is imported by LOAD / ADMIT_SHAPE when a package is built or the
Core ML runtime is opened (under the control window, with PROGRESS). The converter frameworks
coremltools would probe (torch, scikit-learn...) are blocked in this process first.
"""

from __future__ import annotations

from workers import runtime
from workers.ane.import_guard import block_converter_frameworks


def _factory(rest: list[str]):
    from workers.ane.engine import AneEngine  # cheap: no coremltools at import

    return AneEngine.from_argv(rest)


if __name__ == "__main__":
    block_converter_frameworks()
    runtime.main(_factory)
