"""`python -m workers.llama --socket PATH --nonce NONCE`: the llama.cpp worker process."""

from __future__ import annotations

import logging

from workers import runtime
from workers.llama import openblas_core


def _factory(rest: list[str]):
    if rest:
        raise SystemExit(f"workers.llama takes no engine arguments, got {rest}")
    # Before llama_cpp loads OpenBLAS: its kernels are fixed when the library loads.
    logging.getLogger("workers.llama").info("%s", openblas_core.apply())
    from workers.llama.engine import LlamaEngine  # heavy import, after argv is checked

    return LlamaEngine()


if __name__ == "__main__":
    runtime.main(_factory)
