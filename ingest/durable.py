"""Durable renames and full disks.

A rename survives a power cut once the file and its directory are synced. A write that fails
for want of space must be told apart from other I/O failures, so that the caller can say
"free some space" rather than show a traceback.

Shared by the artifact store and the batch job's output (the compile cache, which imports no
other project package, has its own in compile_cache/fsutil.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from common.errors import StorageFull

_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fsync_file(path)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def ran_out_of_space(exc: BaseException, path: Path, need_bytes: int = 0) -> bool:
    """Whether `exc`, raised while writing about `need_bytes` under `path`, means the disk was
    full. ENOSPC and EDQUOT say so. A short write says nothing (numpy's `tofile` raises a bare
    OSError "N requested and M written"), so then the free space decides: call this after the
    partial files are removed, when what is free is what the write had."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in _FULL:
        return True
    return exc.errno is None and need_bytes > 0 and free_bytes(path) < need_bytes


def require_space(path: Path, need_bytes: int, what: str, retry: str) -> None:
    """Refuse, before writing, a write of `need_bytes` under `path` that cannot fit."""
    free = free_bytes(path)
    if need_bytes > free:
        raise StorageFull(
            f"{what} needs about {mib(need_bytes)} under {path}, and {mib(free)} "
            f"are free; free some space and {retry}"
        )


@contextlib.contextmanager
def full_disk_as(
    error: Callable[[OSError], Exception], path: Path, need_bytes: int = 0
) -> Iterator[None]:
    """Raise `error(exc)` for an OSError that `ran_out_of_space` calls a full disk; any other
    exception passes as it is. Remove partial files inside the block: the free space is read
    after them."""
    try:
        yield
    except OSError as exc:
        if not ran_out_of_space(exc, path, need_bytes):
            raise
        raise error(exc) from exc
