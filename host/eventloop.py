"""The host's event loop and HTTP parser: uvloop and httptools where installed, else asyncio
and h11.

Both are declared dependencies, but a platform without wheels for them (Windows, PyPy) must
still run; so each is used only if it imports, and the choice is reported, never guessed.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def loop_name() -> str:
    """uvicorn's `loop` setting: "uvloop" or "asyncio"."""
    return "uvloop" if _importable("uvloop") else "asyncio"


def http_name() -> str:
    """uvicorn's `http` setting: "httptools" or "h11"."""
    return "httptools" if _importable("httptools") else "h11"


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop's loop where it imports."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
