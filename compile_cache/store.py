"""`CompileCache`: get-or-build with one builder per key across processes, atomic publish,
leases, verify, LRU garbage collection.

Invariants (each protects against a crash at any instruction):
- an entry is visible iff `objects/<digest>/` exists; it appears by one rename of a fully
  written and fsynced directory (data + meta.json + .lease), and disappears by one rename into
  `tmp/` before deletion. The index follows the disk and is repaired from it, never the reverse;
- a build's temp dir exists only while its builder holds the key's file lock, so "lock free"
  means "temp dir is a leftover" - that is how open() tells dead builds from running ones;
- eviction holds the entry's exclusive flock, which a lease (shared flock) blocks.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Literal

import msgspec
from filelock import FileLock, Timeout

from compile_cache.errors import (
    AmbiguousPrefix,
    BuildFailed,
    EntryEvicted,
    EntryLeased,
    EntryNotFound,
    InvalidArgument,
    InvalidRoot,
    InvalidSelector,
    InvalidSize,
    LockTimeout,
)
from compile_cache.fsutil import (
    TreeError,
    dir_size,
    fsync_dir,
    remove_tree,
    scan_tree,
    write_synced,
)
from compile_cache.index import Index, Row
from compile_cache.keys import canonical_json, digest_of_json, is_digest_prefix, key_digest
from compile_cache.layout import (
    BUILD_PREFIX,
    DATA_NAME,
    FORMAT,
    LEASE_NAME,
    META_NAME,
    TRASH_PREFIX,
    Layout,
    MetaError,
    ObjectMeta,
    encode_meta,
)
from compile_cache.lease import is_leased, lease_token, read_token, try_exclusive
from compile_cache.model import CorruptEntry, Entry, EvictionReport, Usage, VerifyReport

DEFAULT_BUDGET_BYTES = 10 * 1024**3

#: Points where `fault_hook(point)` is called during get_or_build, in order. Tests block there
#: and SIGKILL the process to prove every crash point leaves the cache consistent.
HOOK_POINTS = (
    "build_start",  # temp dir created, build() not yet called
    "built",  # build() returned, nothing hashed or synced
    "hashed",  # data hashed and fsynced, no meta.json yet
    "before_rename",  # meta.json + .lease written and synced; not visible
    "after_rename",  # visible on disk, not yet in the index
    "indexed",  # in the index, lock still held
)

Build = Callable[[Path], object]
FaultHook = Callable[[str], None]
_Outcome = Literal["evicted", "gone", "leased"]
_files_decoder = msgspec.json.Decoder(dict[str, str])
_key_decoder = msgspec.json.Decoder(dict)


def _disk_full(exc: BaseException) -> bool:
    """A failure the full disk caused: ENOSPC/EDQUOT anywhere in its chain of causes."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


@functools.lru_cache(maxsize=4096)
def _object_paths(objects: Path, digest: str) -> tuple[Path, Path]:
    # Path objects are immutable; caching them takes pathlib parsing off the hit path.
    obj = objects / digest
    return obj, obj / DATA_NAME


def _check_seconds(name: str, value: object) -> float:
    if type(value) not in (int, float) or not 0 <= value < float("inf"):  # type: ignore[operator]
        raise InvalidArgument(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_budget(budget: object) -> int | None:
    if budget is None:
        return None
    if type(budget) is not int or budget < 0:
        raise InvalidSize(f"a byte budget must be a non-negative int or None, got {budget!r}")
    return budget


class CompileCache:
    """A content-addressed store of compiled artifacts under `root`.

    Safe to use from several processes (and threads) at once. `budget_bytes` is enforced
    after every build by evicting least-recently-used unleased entries (None: no automatic
    gc). The newest entry is always kept, even if it alone exceeds the budget.

    A hit records its use (for LRU) at most once per `touch_interval` seconds per entry, so
    hot entries are served by a read-only index lookup; 0 records every hit.
    `lock_poll_interval` is how often a waiter re-tries the lock of a key being built.
    `fault_hook` is a test seam: it is called with each name in `HOOK_POINTS`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        budget_bytes: int | None = DEFAULT_BUDGET_BYTES,
        *,
        touch_interval: float = 1.0,
        lock_poll_interval: float = 0.005,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        self.budget_bytes = check_budget(budget_bytes)
        self._touch_interval = _check_seconds("touch_interval", touch_interval)
        self._poll = _check_seconds("lock_poll_interval", lock_poll_interval)
        self._hook = fault_hook
        self._layout = Layout(self.root)
        self._ensure_layout()
        self._index = Index(self._layout.index_path, self._layout.index_lock, self._reconcile)
        self._index.open(populate=True)
        self._clean_tmp()

    def close(self) -> None:
        self._index.close()

    def _ensure_layout(self) -> None:
        try:
            self._layout.ensure()
        except OSError as e:
            raise InvalidRoot(f"cannot use {self.root} as a cache root: {e}") from e

    def __enter__(self) -> CompileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def index_rebuilt(self) -> bool:
        """True if this instance had to create the index from the objects on disk."""
        return self._index.rebuilt

    # ---- lookups and builds ----------------------------------------------------------------

    def get(self, key: Mapping[str, object]) -> Entry | None:
        """The entry for `key`, or None. A hit counts as a use (LRU)."""
        return self._lookup(key_digest(key), touch=True)

    def get_or_build(
        self, key: Mapping[str, object], build: Build, *, timeout: float | None = None
    ) -> Entry:
        """The entry for `key`, building it with `build(tmp_dir)` if absent.

        One process builds a given key at a time; the others wait on the key's lock (at
        most `timeout` seconds, else `LockTimeout`) and then reuse its result. A failing
        `build` raises `BuildFailed` and publishes nothing.
        """
        key_json = canonical_json(key)
        digest = digest_of_json(key_json)
        entry = self._lookup(digest, touch=True)
        if entry is not None:
            return entry
        if timeout is not None:
            _check_seconds("timeout", timeout)
        lock = FileLock(self._layout.build_lock(digest), poll_interval=self._poll)
        try:
            lock.acquire(timeout=-1 if timeout is None else timeout)
        except Timeout:
            raise LockTimeout(f"waited {timeout} s for another build of {digest[:12]}") from None
        try:
            # Someone else may have published while we waited.
            entry = self._lookup(digest, touch=True)
            built = entry is None
            if entry is None:
                try:
                    entry = self._build_and_publish(digest, key_json, build)
                except BuildFailed as exc:
                    # The disk filled, not the budget: make room as the budget's gc would
                    # (least recently used, unleased, never this key) and build once more.
                    if not (_disk_full(exc) and self._make_room(keep={digest})):
                        raise
                    entry = self._build_and_publish(digest, key_json, build)
        finally:
            lock.release()
        if built and self.budget_bytes is not None:
            if self._index.totals()[1] > self.budget_bytes:
                self.gc(keep={digest})
        return entry

    @contextlib.contextmanager
    def lease(
        self, key: Mapping[str, object], build: Build | None = None, *, timeout: float | None = None
    ) -> Iterator[Entry]:
        """`get_or_build` (or `get` without `build`) and hold a lease, race-free:

            with cache.lease(key, build) as entry: ...

        Raises `EntryNotFound` when there is no entry and no `build`.
        """
        for _ in range(5):
            if build is None:
                found = self.get(key)
                if found is None:
                    raise EntryNotFound(f"no entry for key {key_digest(key)[:12]}")
                entry = found
            else:
                entry = self.get_or_build(key, build, timeout=timeout)
            try:
                held = entry.lease().acquire()
            except EntryEvicted:
                # Evicted (or rebuilt) between lookup and lease: look up again, and make sure
                # the index row describes whatever object is on disk now.
                with contextlib.suppress(MetaError):
                    self._adopt(entry.digest)
                continue
            with held:
                yield entry
            return
        raise EntryEvicted(f"entry {entry.digest[:12]} keeps being evicted")

    def _fault(self, point: str) -> None:
        if self._hook is not None:
            self._hook(point)

    def _lookup(self, digest: str, *, touch: bool) -> Entry | None:
        obj = os.path.join(self._layout.objects, digest)
        lease_file = os.path.join(obj, LEASE_NAME)
        row = self._index.get(digest)
        if row is None:
            if not os.path.exists(obj):
                return None
            # Published but not indexed (a crash between rename and insert): adopt it.
            return self._adopt_or_none(digest)
        now = time.time()
        if touch and now - row.last_used >= self._touch_interval:
            try:
                # The lease file's mtime mirrors last use, so a rebuilt index keeps LRU order.
                os.utime(lease_file, (now, now))
            except FileNotFoundError:
                self._index.delete(digest)  # evicted (or damaged) behind the index's back
                return None
            self._index.touch(digest, now)
            row = msgspec.structs.replace(row, last_used=now)
        elif not os.path.exists(lease_file):
            self._index.delete(digest)
            return None
        return self._entry(row)

    def _adopt_or_none(self, digest: str) -> Entry | None:
        try:
            row = self._adopt(digest)
        except MetaError:
            return None
        return None if row is None else self._entry(row)

    def _entry(self, row: Row) -> Entry:
        obj, data = _object_paths(self._layout.objects, row.digest)
        return Entry(
            digest=row.digest,
            path=data,
            size=row.size,
            created=row.created,
            last_used=row.last_used,
            key=_key_decoder.decode(row.key_json),
            files=_files_decoder.decode(row.files_json),
            build_seconds=row.build_seconds,
            object_dir=obj,
        )

    def _build_and_publish(self, digest: str, key_json: str, build: Build) -> Entry:
        """Called with the key's lock held."""
        layout = self._layout
        self._ensure_layout()  # survive someone deleting the cache directory under us
        obj = layout.object_dir(digest)
        if obj.exists() and self._evict_object(digest) == "leased":
            # An object _lookup could not adopt (damaged metadata) would block the rename.
            raise EntryLeased(f"damaged entry {digest[:12]} is leased; cannot replace it yet")
        # We hold the lock, so every other temp dir of this key belongs to a dead build.
        for name in os.listdir(layout.tmp):
            if name.startswith(f"{BUILD_PREFIX}{digest}."):
                remove_tree(layout.tmp / name)
        work = layout.new_build_dir(digest)
        data = work / DATA_NAME
        data.mkdir(parents=True)
        published = False
        try:
            self._fault("build_start")
            t0 = time.monotonic()
            try:
                build(data)
            except Exception as e:
                raise BuildFailed(f"build of {digest[:12]} failed: {e!r}") from e
            build_seconds = time.monotonic() - t0
            self._fault("built")
            try:
                files, size = scan_tree(data, sync=True, make_readonly=True)
            except TreeError as e:
                raise BuildFailed(f"build of {digest[:12]} produced an unusable tree: {e}") from e
            if not files:
                raise BuildFailed(f"build of {digest[:12]} wrote no files into its tmp_dir")
            self._fault("hashed")
            created = time.time()
            meta = ObjectMeta(
                format=FORMAT,
                digest=digest,
                key=json.loads(key_json),
                files=files,
                size=size,
                created=created,
                build_seconds=build_seconds,
            )
            write_synced(work / META_NAME, encode_meta(meta))
            # The lease file names its publication, so a lease taken through a stale Entry can
            # tell a rebuilt object of the same key from the one the Entry describes.
            write_synced(work / LEASE_NAME, lease_token(created))
            fsync_dir(work)
            self._fault("before_rename")
            os.rename(work, obj)  # the commit point
            published = True
            fsync_dir(layout.objects)
            self._fault("after_rename")
            row = Row(
                digest=digest,
                key_json=key_json,
                size=size,
                files_json=msgspec.json.encode(files).decode(),
                created=created,
                last_used=created,
                build_seconds=build_seconds,
            )
            self._index.upsert(row)
            self._fault("indexed")
        finally:
            if not published:
                remove_tree(work)
        return self._entry(row)

    # ---- reconciliation between index and disk ----------------------------------------------

    def _adopt(self, digest: str) -> Row | None:
        """Index an object found on disk. None if it vanished; MetaError if it is damaged."""
        meta = self._layout.read_meta(digest)
        obj = self._layout.object_dir(digest)
        try:
            mtime = os.stat(obj / LEASE_NAME).st_mtime
        except FileNotFoundError:
            if obj.exists():
                raise MetaError(f"{LEASE_NAME} is missing") from None
            return None
        row = Row(
            digest=digest,
            key_json=canonical_json(meta.key),
            size=meta.size,
            files_json=msgspec.json.encode(meta.files).decode(),
            created=meta.created,
            last_used=max(meta.created, mtime),
            build_seconds=meta.build_seconds,
        )
        self._index.upsert(row)
        if not obj.exists():  # evicted while we were adopting it
            self._index.delete(digest)
            return None
        return row

    def _reconcile(self) -> None:
        """Make the index match objects/. Rows are read BEFORE listing the directory: an
        object published in between is then merely adopted twice (harmless upsert)."""
        rows = self._index.digests()
        disk = self._layout.list_objects()
        for digest in rows - disk:
            if not self._layout.object_dir(digest).exists():
                self._index.delete(digest)
        for digest in disk - rows:
            try:
                self._adopt(digest)
            except MetaError:
                # Unservable and it would block a rebuild of its key: move it out.
                self._evict_object(digest)

    def _clean_tmp(self) -> None:
        """Remove leftovers of crashed builds and evictions (never a live build's dir)."""
        try:
            names = os.listdir(self._layout.tmp)
        except FileNotFoundError:
            return
        for name in names:
            path = self._layout.tmp / name
            if name.startswith(TRASH_PREFIX):
                remove_tree(path)  # already invisible; whoever renamed it only deletes it
            elif name.startswith(BUILD_PREFIX):
                digest = name[len(BUILD_PREFIX) :].split(".", 1)[0]
                if not is_digest_prefix(digest):
                    continue
                lock = FileLock(self._layout.build_lock(digest))
                try:
                    lock.acquire(blocking=False)
                except Timeout:
                    continue  # a live process is building this key
                try:
                    remove_tree(path)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._layout.build_lock(digest))  # see _drop_build_lock
                finally:
                    lock.release()

    def _drop_build_lock(self, digest: str) -> None:
        # Lock files would otherwise pile up, one per key ever built. Unlinking while holding
        # the lock is safe: filelock notices a won lock on an unlinked inode and retries.
        path = self._layout.build_lock(digest)
        lock = FileLock(path)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        finally:
            lock.release()

    # ---- eviction ----------------------------------------------------------------------------

    def _evict_object(self, digest: str) -> _Outcome:
        obj = self._layout.object_dir(digest)
        fd: int | None = None
        try:
            fd = try_exclusive(obj)
            if fd is None:
                return "leased"
        except FileNotFoundError:
            if not obj.exists():
                self._index.delete(digest)
                return "gone"
            # An object without its .lease file cannot be leased by anyone: just remove it.
        try:
            trash = self._layout.new_trash_dir(digest)
            try:
                os.rename(obj, trash)  # disappears atomically, however large it is
            except FileNotFoundError:
                self._index.delete(digest)
                return "gone"
            fsync_dir(self._layout.objects)
            self._index.delete(digest)
        finally:
            if fd is not None:
                os.close(fd)
        remove_tree(trash)
        self._drop_build_lock(digest)
        return "evicted"

    def _resolve(self, selector: Mapping[str, object] | str) -> str:
        if isinstance(selector, Mapping):
            digest = key_digest(selector)
            if self._lookup(digest, touch=False) is None:
                raise EntryNotFound(f"no entry for key {digest[:12]}")
            return digest
        if not isinstance(selector, str):
            raise InvalidSelector(
                f"evict takes a key mapping or a digest prefix, not {type(selector).__name__}"
            )
        prefix = selector.strip().lower()
        if len(prefix) < 4 or not is_digest_prefix(prefix):
            raise InvalidSelector(
                f"{selector!r} is not a digest prefix (4 to 64 hex digits) or a key"
            )
        self._reconcile()
        matches = self._index.match_prefix(prefix)
        if not matches:
            raise EntryNotFound(f"no entry with digest prefix {prefix}")
        if len(matches) > 1:
            shown = ", ".join(m[:12] for m in matches[:5])
            raise AmbiguousPrefix(
                f"prefix {prefix} matches {len(matches)} entries: {shown}", matches
            )
        return matches[0]

    def evict(self, selector: Mapping[str, object] | str) -> EvictionReport:
        """Evict one entry named by its key or a unique digest prefix (>= 4 hex digits).

        Raises `EntryNotFound`, `AmbiguousPrefix`, `InvalidSelector`, or `EntryLeased` if a
        live process holds a lease on it.
        """
        digest = self._resolve(selector)
        row = self._index.get(digest)
        before = self._index.totals()[1]
        outcome = self._evict_object(digest)
        if outcome == "leased":
            raise EntryLeased(f"entry {digest[:12]} is leased by a live process")
        size = row.size if row is not None and outcome == "evicted" else 0
        return EvictionReport(
            evicted=[digest] if outcome == "evicted" else [],
            freed_bytes=size,
            skipped_leased=[],
            before_bytes=before,
            after_bytes=self._index.totals()[1],
            budget_bytes=self.budget_bytes,
        )

    def gc(
        self, budget: int | None = None, *, keep: frozenset[str] | set[str] = frozenset()
    ) -> EvictionReport:
        """Evict least-recently-used unleased entries until the total is <= `budget`
        (default: the cache's `budget_bytes`). Entries in `keep` are never evicted."""
        limit = self.budget_bytes if budget is None else check_budget(budget)
        with FileLock(self._layout.gc_lock, poll_interval=self._poll):
            self._reconcile()
            rows = self._index.rows_lru()
            before = total = sum(r.size for r in rows)
            evicted: list[str] = []
            skipped: list[str] = []
            for row in rows:
                if limit is None or total <= limit:
                    break
                if row.digest in keep:
                    continue
                outcome = self._evict_object(row.digest)
                if outcome == "leased":
                    skipped.append(row.digest)
                    continue
                if outcome == "evicted":
                    evicted.append(row.digest)
                total -= row.size
        return EvictionReport(evicted, before - total, skipped, before, total, limit)

    def _make_room(self, keep: set[str]) -> bool:
        """After a build the full disk stopped (its partial tree already removed): `gc` down
        to a budget that frees twice the space that was not enough, and at least the largest
        entry's size. True when anything was evicted; the caller then builds once more."""
        rows = self._index.rows_lru()
        total = sum(r.size for r in rows)
        free = shutil.disk_usage(self._layout.objects).free
        shortfall = max(2 * free, max((r.size for r in rows), default=0)) - free
        return bool(self.gc(max(0, total - shortfall), keep=keep).evicted)

    def clear(self) -> EvictionReport:
        """Evict every unleased entry and remove leftovers of dead builds."""
        report = self.gc(0)
        self._clean_tmp()
        return report

    # ---- inspection ---------------------------------------------------------------------------

    def ls(self) -> list[Entry]:
        """All entries, most recently used first."""
        self._reconcile()
        return [self._entry(r) for r in reversed(self._index.rows_lru())]

    def du(self) -> Usage:
        self._reconcile()
        count, total = self._index.totals()
        return Usage(self.root, count, total, self.budget_bytes, dir_size(self._layout.tmp))

    def total_bytes(self) -> int:
        """Bytes of every indexed entry (one index query: cheap enough after each build)."""
        return self._index.totals()[1]

    def is_leased(self, entry: Entry | str) -> bool:
        """Whether some live process (this one included) holds a lease on the entry."""
        digest = entry.digest if isinstance(entry, Entry) else entry
        return is_leased(self._layout.object_dir(digest))

    def verify(self) -> VerifyReport:
        """Re-hash every entry against its manifest; evict the corrupt ones (unless leased)."""
        self._reconcile()
        checked = 0
        corrupt: list[CorruptEntry] = []
        for row in self._index.rows_lru():
            reasons = self._check(row)
            if reasons is None:
                continue  # evicted while we looked
            checked += 1
            if reasons:
                outcome = self._evict_object(row.digest)
                corrupt.append(CorruptEntry(row.digest, reasons, evicted=outcome != "leased"))
        return VerifyReport(checked=checked, ok=checked - len(corrupt), corrupt=corrupt)

    def _check(self, row: Row) -> list[str] | None:
        obj = self._layout.object_dir(row.digest)
        if not obj.exists():
            return None
        reasons: list[str] = []
        try:
            meta = self._layout.read_meta(row.digest)
            expected, created = meta.files, meta.created
            files_json = msgspec.json.encode(meta.files).decode()
            if (meta.size, files_json, meta.created) != (row.size, row.files_json, row.created):
                with contextlib.suppress(MetaError):  # reported below via the token
                    self._adopt(row.digest)  # the object is authoritative: re-index it
        except MetaError as e:
            reasons.append(str(e))
            expected, created = _files_decoder.decode(row.files_json), row.created
        token = read_token(obj)
        if token is None:
            reasons.append(f"{LEASE_NAME} is missing")
        elif token != lease_token(created):
            reasons.append(f"{LEASE_NAME} does not match the entry's creation time")
        try:
            actual, _size = scan_tree(obj / DATA_NAME)
        except TreeError as e:
            return reasons + [str(e)]
        except FileNotFoundError:
            return None if not obj.exists() else reasons + [f"{DATA_NAME}/ is missing"]
        for name in sorted(expected.keys() - actual.keys()):
            reasons.append(f"missing file {name}")
        for name in sorted(actual.keys() - expected.keys()):
            reasons.append(f"unexpected file {name}")
        for name in sorted(expected.keys() & actual.keys()):
            if expected[name] != actual[name]:
                reasons.append(f"content changed: {name}")
        return reasons
