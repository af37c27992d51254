"""Durable renames: a rename survives a power cut once the file and its directory are synced.

Shared by the artifact store and the batch job's output (the compile cache, which imports no
other project package, has its own in compile_cache/fsutil.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fsync_file(path)
