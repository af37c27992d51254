"""`python -m workers.llama --socket PATH --nonce NONCE`: the llama.cpp worker process."""

from __future__ import annotations

from workers import runtime


def _factory(rest: list[str]):
    if rest:
        raise SystemExit(f"workers.llama takes no engine arguments, got {rest}")
    from workers.llama.engine import LlamaEngine  # heavy import, after argv is checked

    return LlamaEngine()


if __name__ == "__main__":
    runtime.main(_factory)
