"""The SQLite index of published entries (WAL mode).

The index is a cache of what `objects/` holds: every object carries its own meta.json, so a
missing, corrupt, replaced or incompatible index file is moved aside and rebuilt from the disk
(the `populate` callback) instead of failing. `synchronous=NORMAL` is enough for the same
reason - a power cut can lose the last few last-use updates, never an entry.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
from filelock import FileLock

SCHEMA_VERSION = 1
_BUSY_TIMEOUT_S = 60.0
_SIDE_FILES = ("-wal", "-shm", "-journal")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    digest TEXT PRIMARY KEY,
    key_json TEXT NOT NULL,
    size INTEGER NOT NULL,
    files_json TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    build_seconds REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used, created, digest);
"""
_COLS = "digest, key_json, size, files_json, created, last_used, build_seconds"

# Connections inherited across fork() must never be used or closed in the child (SQLite forbids
# both); keeping a reference stops the finalizer from closing them.
_INHERITED: list[sqlite3.Connection] = []

T = TypeVar("T")


class Row(msgspec.Struct, frozen=True, array_like=True):
    digest: str
    key_json: str
    size: int
    files_json: str
    created: float
    last_used: float
    build_seconds: float


class Index:
    """One connection per process, shared by its threads behind a lock."""

    def __init__(self, path: Path, lock_path: Path, populate: Callable[[], None]) -> None:
        self.path = path
        self._lock_path = lock_path
        self._populate = populate
        self._mutex = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._ident: tuple[int, int] | None = None
        self._pid = os.getpid()
        self.rebuilt = False  # True once this process had to (re)create the file

    # ---- connection management -------------------------------------------------------------

    def open(self, *, populate: bool) -> None:
        """Connect (creating or rebuilding as needed); run `populate` if asked or if fresh."""
        with self._mutex, FileLock(self._lock_path):
            fresh = self._connect_or_create()
            if fresh or populate:
                self._populate()

    def close(self) -> None:
        with self._mutex:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    def _conn_checked(self) -> sqlite3.Connection:
        conn = self._conn
        if conn is not None and self._pid == os.getpid():
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._ident:
                    return conn
            except FileNotFoundError:
                pass
        # Forked, never opened, or the file was deleted/replaced under us: reconnect; a missing
        # file is recreated and repopulated from the objects.
        self._drop()
        with FileLock(self._lock_path):
            if self._connect_or_create():
                self._populate()
        assert self._conn is not None
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            if self._pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
            else:
                _INHERITED.append(self._conn)
        self._conn = None
        self._pid = os.getpid()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            ok = conn.execute("PRAGMA quick_check").fetchall()
            if ok != [("ok",)]:
                raise sqlite3.DatabaseError(f"quick_check: {ok[:3]}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}, expected {SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect_or_create(self) -> bool:
        """Connect; returns True when the index had to be created from nothing."""
        self._drop()
        fresh = not self.path.exists()
        if fresh:
            # WAL/SHM files left by a deleted index would be replayed into the new file.
            self._remove_side_files()
        try:
            conn = self._connect()
        except sqlite3.OperationalError:
            raise  # locked / unreachable: not corruption, do not destroy anything
        except sqlite3.DatabaseError:
            self._move_aside()
            fresh = True
            conn = self._connect()
        if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            conn.executescript(
                f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version={SCHEMA_VERSION};COMMIT;"
            )
            fresh = True
        st = os.stat(self.path)
        self._conn, self._ident, self._pid = conn, (st.st_dev, st.st_ino), os.getpid()
        self.rebuilt = self.rebuilt or fresh
        return fresh

    def _move_aside(self) -> None:
        # Keep the damaged file for a post-mortem; only the newest one is kept.
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path, self.path.with_name(self.path.name + ".corrupt"))
        self._remove_side_files()

    def _remove_side_files(self) -> None:
        for suffix in _SIDE_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path.with_name(self.path.name + suffix))

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with self._mutex:
            yield self._conn_checked()

    def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn`; if the file turns out corrupt mid-flight, rebuild once and retry."""
        for attempt in (0, 1):
            try:
                with self._db() as conn:
                    return fn(conn)
            except sqlite3.OperationalError:
                raise
            except sqlite3.DatabaseError:
                if attempt:
                    raise
                with self._mutex, FileLock(self._lock_path):
                    self._drop()
                    # The file may already have been repaired by another process: only move
                    # it aside if it still fails the check.
                    if self._connect_or_create():
                        self._populate()
        raise AssertionError("unreachable")

    # ---- queries ---------------------------------------------------------------------------

    def get(self, digest: str) -> Row | None:
        def q(c: sqlite3.Connection) -> Row | None:
            r = c.execute(f"SELECT {_COLS} FROM entries WHERE digest = ?", (digest,)).fetchone()
            return None if r is None else Row(*r)

        return self._run(q)

    def touch(self, digest: str, when: float) -> None:
        self._run(
            lambda c: c.execute(
                "UPDATE entries SET last_used = max(last_used, ?) WHERE digest = ?", (when, digest)
            )
        )

    def upsert(self, row: Row) -> None:
        self._run(
            lambda c: c.execute(
                f"INSERT INTO entries ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
                # The object on disk is the truth: take all of its fields, keep the later use.
                "ON CONFLICT(digest) DO UPDATE SET key_json = excluded.key_json, "
                "size = excluded.size, files_json = excluded.files_json, "
                "created = excluded.created, build_seconds = excluded.build_seconds, "
                "last_used = max(last_used, excluded.last_used)",
                tuple(msgspec.structs.astuple(row)),
            )
        )

    def delete(self, digest: str) -> None:
        self._run(lambda c: c.execute("DELETE FROM entries WHERE digest = ?", (digest,)))

    def digests(self) -> set[str]:
        return self._run(lambda c: {r[0] for r in c.execute("SELECT digest FROM entries")})

    def rows_lru(self) -> list[Row]:
        """All rows, least recently used first."""
        return self._run(
            lambda c: [
                Row(*r)
                for r in c.execute(
                    f"SELECT {_COLS} FROM entries ORDER BY last_used, created, digest"
                )
            ]
        )

    def totals(self) -> tuple[int, int]:
        """(entry count, total bytes)."""
        return self._run(
            lambda c: tuple(
                c.execute("SELECT count(*), coalesce(sum(size), 0) FROM entries").fetchone()
            )
        )  # type: ignore[return-value]

    def match_prefix(self, prefix: str, limit: int = 20) -> list[str]:
        return self._run(
            lambda c: [
                r[0]
                for r in c.execute(
                    "SELECT digest FROM entries WHERE digest GLOB ? ORDER BY digest LIMIT ?",
                    (prefix + "*", limit),
                )
            ]
        )
