"""Cross-process leases: flock on each object's `.lease` file.

A lease holder has a SHARED flock; an evictor needs an EXCLUSIVE one (non-blocking) and skips
the entry when it cannot get it. The kernel drops a flock when its process dies - even by
SIGKILL - so a crashed user can never pin an entry forever, and no pid bookkeeping is needed.
flock locks belong to the open file, so two leases (or a lease and gc) in the same process
exclude each other exactly like two processes do.

Both sides re-check after locking that the path still names the inode they locked: an evictor
renames the object away while holding its lock, so a lock won on a stale inode means "gone".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import Generic, Protocol, TypeVar

from compile_cache.errors import EntryEvicted
from compile_cache.layout import LEASE_NAME


class Leasable(Protocol):
    """What a lease reads of a published object (compile_cache.model.Entry is one): its lease
    file lives in `object_dir`, and holds `created` (see `lease_token`)."""

    @property
    def digest(self) -> str: ...

    @property
    def created(self) -> float: ...

    @property
    def object_dir(self) -> Path: ...


E = TypeVar("E", bound=Leasable)


def lease_token(created: float) -> bytes:
    """Content of an object's lease file: its publication time, exactly (repr round-trips)."""
    return repr(created).encode() + b"\n"


def read_token(object_dir: Path) -> bytes | None:
    try:
        return (object_dir / LEASE_NAME).read_bytes()
    except FileNotFoundError:
        return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def try_exclusive(object_dir: Path) -> int | None:
    """An fd holding the exclusive lock of `object_dir`, or None if it is leased.

    Raises FileNotFoundError if the object is gone. The caller closes the fd to unlock.
    """
    path = object_dir / LEASE_NAME
    for _ in range(8):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # won a stale inode: the object was replaced meanwhile, look again
    return None  # churning under us: treat as busy rather than evict blindly


def is_leased(object_dir: Path) -> bool:
    try:
        fd = try_exclusive(object_dir)
    except FileNotFoundError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False


class Lease(Generic[E]):
    """Keeps one entry from eviction while held. Use as a context manager:

        with entry.lease():
            model = load(entry.path)

    Raises `EntryEvicted` on acquire if the entry was evicted since it was looked up.
    """

    def __init__(self, entry: E) -> None:
        self.entry = entry
        self._fd: int | None = None
        self._pid = os.getpid()

    @property
    def held(self) -> bool:
        return self._fd is not None and self._pid == os.getpid()

    def acquire(self) -> Lease[E]:
        if self.held:
            return self
        path = self.entry.object_dir / LEASE_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise EntryEvicted(f"entry {self.entry.digest[:12]} was evicted") from None
        try:
            # Blocks only while an evictor holds the exclusive lock (a rename's worth of time).
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not _same_file(fd, path):
                raise EntryEvicted(f"entry {self.entry.digest[:12]} was evicted")
            if os.pread(fd, 64, 0) != lease_token(self.entry.created):
                # Evicted and rebuilt since the Entry was looked up: it describes another object.
                raise EntryEvicted(f"entry {self.entry.digest[:12]} was evicted and rebuilt")
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._pid = fd, os.getpid()
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            os.close(fd)  # closing drops the flock

    def __enter__(self) -> E:
        self.acquire()
        return self.entry

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # may run during interpreter shutdown
            self.release()
