"""`python -m workers.ane --socket PATH --nonce NONCE [--artifact DIR] [--backend B]
[--cache-root DIR] [--build-options JSON]`: the Core ML (Neural Engine) worker process."""

from __future__ import annotations

from workers import runtime


def _factory(rest: list[str]):
    from workers.ane.engine import AneEngine  # heavy import (coremltools), after argv parse

    return AneEngine.from_argv(rest)


if __name__ == "__main__":
    runtime.main(_factory)
