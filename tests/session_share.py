"""Build once per test session, across pytest-xdist's processes. No tests here.

A session-scoped fixture runs once per PROCESS: under `pytest -n 2` both processes would build
the same artifact, each on one of the machine's two cores. `build_once` builds it in the first
process that asks, under a file lock in the run's own temp root (shared by its processes, new
for every run); the other process waits for it, then reads what was built.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

_DONE = ".built"


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temp root: xdist gives each process a `popen-gwN` dir under it; without
    xdist the one process's own base dir (a parent would be shared with other runs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """The directory `name` as `build(directory)` filled it, built once per run. A build that
    raises leaves nothing behind: the next process to ask builds it again (and sees the error
    for itself)."""
    root = session_root(tmp_path_factory) / "session-shared"
    root.mkdir(exist_ok=True)
    out = root / name
    with FileLock(str(root / f".{name}.lock")):
        if not (out / _DONE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                build(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            (out / _DONE).touch()
    return out
