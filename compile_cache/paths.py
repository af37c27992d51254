"""Where the cache lives by default."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

ENV_CACHE_DIR = "SYNAPSE_CACHE_DIR"


def default_root() -> Path:
    """$SYNAPSE_CACHE_DIR/compile_cache if set, else the user cache dir's synapse/compile_cache."""
    base = os.environ.get(ENV_CACHE_DIR)
    if base:
        return Path(base).expanduser() / "compile_cache"
    return Path(platformdirs.user_cache_dir("synapse")) / "compile_cache"


ENV_CACHE_BUDGET = "SYNAPSE_CACHE_BUDGET"


def default_budget() -> int:
    """$SYNAPSE_CACHE_BUDGET (a SIZE such as "20GiB") if set, else DEFAULT_BUDGET_BYTES."""
    from compile_cache.store import DEFAULT_BUDGET_BYTES
    from compile_cache.units import parse_size

    text = os.environ.get(ENV_CACHE_BUDGET)
    return parse_size(text) if text else DEFAULT_BUDGET_BYTES
