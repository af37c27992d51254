"""File-system primitives: durable writes, directory fsync, tree hashing.

Publishing is only crash-safe if every file and every directory entry reaches the disk before
the rename that makes the entry visible, so these helpers fsync as they go.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20
_READONLY = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH


class TreeError(ValueError):
    """The tree holds something a content-addressed entry cannot carry (symlink, fifo, ...)."""


def full_fsync(fd: int) -> None:
    # On macOS fsync() only reaches the drive's cache; F_FULLFSYNC is the durable barrier.
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # not supported by this file system: fall back to plain fsync
    os.fsync(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a directory's entries (new names, renames) - a rename is not durable without it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Create `path` (must not exist) with `data`, durably."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        full_fsync(f.fileno())


def hash_file(path: str | os.PathLike[str], *, sync: bool = False) -> tuple[str, int]:
    """sha256 hex digest and size of a file; optionally fsync it in the same pass."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            full_fsync(f.fileno())
    return h.hexdigest(), size


def scan_tree(
    root: Path, *, sync: bool = False, make_readonly: bool = False
) -> tuple[dict[str, str], int]:
    """Manifest (relative POSIX path -> sha256) and total byte size of the files under `root`.

    With `sync`, every file and directory is fsynced. With `make_readonly`, files become
    read-only so a user of an entry cannot corrupt it by accident (directories stay writable
    so eviction can still delete them).
    """
    files: dict[str, str] = {}
    total = 0

    def walk(directory: str, rel: str) -> None:
        nonlocal total
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            name = rel + e.name
            try:
                name.encode("utf-8")
            except UnicodeEncodeError as err:
                raise TreeError(f"{name!r}: file name is not valid UTF-8") from err
            if e.is_symlink():
                raise TreeError(f"{name}: symlinks are not allowed in an entry")
            if e.is_dir(follow_symlinks=False):
                if make_readonly:
                    # A build may leave a read-only directory; eviction must be able to empty it.
                    os.chmod(e.path, stat.S_IMODE(e.stat(follow_symlinks=False).st_mode) | 0o700)
                walk(e.path, name + "/")
            elif e.is_file(follow_symlinks=False):
                if make_readonly:
                    os.chmod(e.path, _READONLY)  # before fsync, so the mode is persisted too
                digest, size = hash_file(e.path, sync=sync)
                files[name] = digest
                total += size
            else:
                raise TreeError(f"{name}: only regular files and directories are allowed")
        if sync:
            fsync_dir(directory)

    walk(os.fspath(root), "")
    return files, total


def dir_size(path: Path) -> int:
    """Apparent size of everything under `path`, ignoring files that vanish meanwhile."""
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


def remove_tree(path: Path) -> None:
    """Delete a tree, tolerating concurrent deleters and read-only directories."""

    def retry(func: Any, p: str, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            return
        if isinstance(exc, PermissionError):
            try:
                os.chmod(os.path.dirname(p), 0o700)
                func(p)
                return
            except FileNotFoundError:
                return
            except OSError:
                pass
        raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=lambda f, p, ei: retry(f, p, ei[1]))
