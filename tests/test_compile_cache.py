"""compile_cache with real processes and real files: races, SIGKILL at every publish step,
corruption, budgets and leases, index loss.

Children are started with the "spawn" context (what macOS uses) and only import this module
and compile_cache. A child that must be killed at a precise point blocks in `fault_hook` (or
in its build) after touching a marker file; the parent waits for the marker, then SIGKILLs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from compile_cache import (
    HOOK_POINTS,
    BuildFailed,
    CompileCache,
    EntryEvicted,
    EntryLeased,
    EntryNotFound,
    InvalidArgument,
    InvalidKey,
    InvalidRoot,
    InvalidSize,
    LockTimeout,
    key_digest,
)

CTX = mp.get_context("spawn")
KEY = {
    "manifest_digest": "ab" * 32,
    "kernel_revision": "k1",
    "shape": [1, 128, False],
    "precision": "fp16",
    "deployment_target": "macOS15",
    "coremltools_version": "9.0",
}


def key_n(n: int) -> dict[str, object]:
    return {**KEY, "shape": [1, 128 * (n + 1), False]}


def _count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _make_build(count_file: str, size: int = 4096, delay: float = 0.0):
    """A build that records each run (one line per call, O_APPEND is atomic across processes)
    and writes a small .mlpackage-like tree."""

    def build(tmp: Path) -> None:
        with open(count_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        if delay:
            time.sleep(delay)
        pkg = tmp / "model.mlpackage"
        (pkg / "Data").mkdir(parents=True)
        (pkg / "Manifest.json").write_text('{"v": 1}')
        (pkg / "Data" / "weights.bin").write_bytes(os.urandom(size))

    return build


def _wait_for(path: Path, proc: mp.process.BaseProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if not proc.is_alive():
            raise AssertionError(f"child exited with {proc.exitcode} before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"child never reached {path.name}")
        time.sleep(0.01)


def _kill(proc: mp.process.BaseProcess) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def _index_digests(root: Path) -> set[str]:
    conn = sqlite3.connect(root / "index.sqlite")
    try:
        return {r[0] for r in conn.execute("SELECT digest FROM entries")}
    finally:
        conn.close()


def _disk_digests(root: Path) -> set[str]:
    return set(os.listdir(root / "objects"))


# ---- children (module level so "spawn" can import them) ------------------------------------


def _race_child(root: str, count_file: str, barrier, out) -> None:  # type: ignore[no-untyped-def]
    cache = CompileCache(root)
    barrier.wait()
    e = cache.get_or_build(KEY, _make_build(count_file, delay=0.3))
    out.put((e.digest, e.created, str(e.path), e.files))


def _blocked_child(root: str, count_file: str, marker: str, point: str) -> None:
    def hook(name: str) -> None:
        if name == point:
            Path(marker).touch()
            time.sleep(120)

    inner = _make_build(count_file, size=1 << 16)

    def build(tmp: Path) -> None:
        inner(tmp)
        if point == "in_build":  # half-written artifact, then stuck compiling
            (tmp / "model.mlpackage" / "partial.bin").write_bytes(b"\0" * 1000)
            Path(marker).touch()
            time.sleep(120)

    CompileCache(root, fault_hook=hook).get_or_build(KEY, build)


def _lease_child(root: str, key: dict[str, object], marker: str) -> None:
    # Its lookup records no use: with the default 1 s touch interval, a child that starts more
    # than a second after the build (a loaded machine) made the entry the most recently used,
    # and the LRU order the test arranged was gone.
    entry = CompileCache(root, touch_interval=3600).get(key)
    assert entry is not None
    with entry.lease():
        Path(marker).touch()
        time.sleep(120)


# ---- tests ------------------------------------------------------------------------------------


def test_four_processes_race_one_key_build_runs_once(tmp_path: Path) -> None:
    root, count = tmp_path / "c", tmp_path / "count"
    barrier, out = CTX.Barrier(4), CTX.Queue()
    procs = [
        CTX.Process(target=_race_child, args=(str(root), str(count), barrier, out))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert _count(count) == 1
    assert len(set(map(str, results))) == 1  # same digest, created, path, manifest
    digest, _created, path, files = results[0]
    assert digest == key_digest(KEY)
    assert Path(path).is_dir() and set(files) == {
        "model.mlpackage/Manifest.json",
        "model.mlpackage/Data/weights.bin",
    }
    assert os.listdir(root / "tmp") == []


def test_hit_reuses_and_updates_last_use(tmp_path: Path) -> None:
    count = tmp_path / "count"
    cache = CompileCache(tmp_path / "c", touch_interval=0)
    first = cache.get_or_build(KEY, _make_build(str(count)))
    again = cache.get_or_build({**KEY, "shape": (1, 128, False)}, _make_build(str(count)))
    assert again == first and _count(count) == 1  # tuple == list in keys
    hit = cache.get(KEY)
    assert hit is not None and hit.last_used >= again.last_used > first.created - 1
    assert (first.path / "model.mlpackage" / "Manifest.json").read_text() == '{"v": 1}'
    assert first.artifact == first.path / "model.mlpackage"
    assert cache.get(key_n(5)) is None


@pytest.mark.parametrize("point", ["in_build", "built", "hashed", "before_rename"])
def test_sigkill_before_publish_leaves_nothing_visible(tmp_path: Path, point: str) -> None:
    assert point == "in_build" or point in HOOK_POINTS
    root, count, marker = tmp_path / "c", tmp_path / "count", tmp_path / "marker"
    CompileCache(root).close()
    proc = CTX.Process(target=_blocked_child, args=(str(root), str(count), str(marker), point))
    proc.start()
    try:
        _wait_for(marker, proc)
        # While the builder is alive: its temp dir is protected, the key is locked.
        observer = CompileCache(root)
        leftovers = os.listdir(root / "tmp")
        assert len(leftovers) == 1 and leftovers[0].startswith("b.")
        with pytest.raises(LockTimeout):
            observer.get_or_build(KEY, _make_build(str(count)), timeout=0.05)
        assert observer.get(KEY) is None
    finally:
        _kill(proc)
    assert observer.get(KEY) is None and _disk_digests(root) == set()
    assert os.listdir(root / "tmp") == leftovers  # nobody cleaned yet
    cache = CompileCache(root)  # the next open cleans the dead build's leftovers
    assert os.listdir(root / "tmp") == []
    assert cache.get(KEY) is None
    entry = cache.get_or_build(KEY, _make_build(str(count)))
    assert _count(count) == 2  # the killed build, then the rebuild
    assert "model.mlpackage/partial.bin" not in entry.files
    assert cache.verify().corrupt == []


def test_sigkill_after_rename_is_adopted_not_rebuilt(tmp_path: Path) -> None:
    root, count, marker = tmp_path / "c", tmp_path / "count", tmp_path / "marker"
    CompileCache(root).close()
    args = (str(root), str(count), str(marker), "after_rename")
    proc = CTX.Process(target=_blocked_child, args=args)
    proc.start()
    try:
        _wait_for(marker, proc)
    finally:
        _kill(proc)
    digest = key_digest(KEY)
    assert _disk_digests(root) == {digest} and _index_digests(root) == set()
    cache = CompileCache(root)
    assert _index_digests(root) == {digest}  # open reconciled the index with the disk
    entry = cache.get_or_build(KEY, _make_build(str(count)))
    assert entry.digest == digest and _count(count) == 1
    assert cache.verify().corrupt == []


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "c")

    def boom(tmp: Path) -> None:
        (tmp / "half").write_bytes(b"x")
        raise RuntimeError("compiler said no")

    with pytest.raises(BuildFailed) as info:
        cache.get_or_build(KEY, boom)
    assert info.value.code == "build_failed" and isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(BuildFailed, match="no files"):
        cache.get_or_build(KEY, lambda tmp: None)

    def with_symlink(tmp: Path) -> None:
        (tmp / "a").write_text("a")
        (tmp / "b").symlink_to(tmp / "a")

    with pytest.raises(BuildFailed, match="symlink"):
        cache.get_or_build(KEY, with_symlink)
    assert cache.ls() == [] and os.listdir(tmp_path / "c" / "tmp") == []


def test_flipped_byte_is_reported_evicted_and_rebuilt(tmp_path: Path) -> None:
    count = tmp_path / "count"
    cache = CompileCache(tmp_path / "c")
    bad = cache.get_or_build(KEY, _make_build(str(count)))
    good = cache.get_or_build(key_n(1), _make_build(str(count)))
    weights = bad.path / "model.mlpackage" / "Data" / "weights.bin"
    weights.chmod(0o644)  # entries are published read-only
    with open(weights, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))

    report = cache.verify()
    assert report.checked == 2 and report.ok == 1
    assert [c.digest for c in report.corrupt] == [bad.digest]
    assert report.corrupt[0].evicted
    assert report.corrupt[0].reasons == ["content changed: model.mlpackage/Data/weights.bin"]
    assert cache.get(KEY) is None and cache.get(key_n(1)) == good
    assert _index_digests(cache.root) == _disk_digests(cache.root) == {good.digest}

    rebuilt = cache.get_or_build(KEY, _make_build(str(count)))
    assert _count(count) == 3 and rebuilt.digest == bad.digest
    assert cache.verify().corrupt == []


def test_verify_names_missing_and_unexpected_files(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "c")
    e = cache.get_or_build(KEY, _make_build(str(tmp_path / "count")))
    (e.path / "model.mlpackage" / "Manifest.json").unlink()
    (e.path / "stray.txt").write_text("?")
    (corrupt,) = cache.verify().corrupt
    assert corrupt.reasons == [
        "missing file model.mlpackage/Manifest.json",
        "unexpected file stray.txt",
    ]


def test_gc_evicts_lru_but_never_a_leased_entry(tmp_path: Path) -> None:
    root, count, marker = tmp_path / "c", tmp_path / "count", tmp_path / "leased"
    cache = CompileCache(root, budget_bytes=None, touch_interval=0)
    entries = [cache.get_or_build(key_n(i), _make_build(str(count), size=1000)) for i in range(4)]
    size = entries[0].size
    assert cache.get(key_n(0)) is not None  # LRU order is now 1, 2, 3, 0
    proc = CTX.Process(target=_lease_child, args=(str(root), key_n(1), str(marker)))
    proc.start()
    try:
        _wait_for(marker, proc)
        assert cache.is_leased(entries[1]) and not cache.is_leased(entries[2])
        report = cache.gc(2 * size)
        assert report.evicted == [entries[2].digest, entries[3].digest]
        assert report.skipped_leased == [entries[1].digest]
        assert report.after_bytes == 2 * size and report.freed_bytes == 2 * size
        remaining = {entries[0].digest, entries[1].digest}
        assert {e.digest for e in cache.ls()} == remaining
        assert _index_digests(root) == _disk_digests(root) == remaining
        with pytest.raises(EntryLeased):
            cache.evict(entries[1].digest[:8])
        assert cache.gc(0).evicted == [entries[0].digest]  # the lease still holds
    finally:
        _kill(proc)
    # The kernel dropped the dead holder's lease: now it can go.
    report = cache.gc(0)
    assert report.evicted == [entries[1].digest] and report.after_bytes == 0
    assert _index_digests(root) == _disk_digests(root) == set()


def test_budget_is_enforced_after_each_build(tmp_path: Path) -> None:
    count = tmp_path / "count"
    probe = CompileCache(tmp_path / "probe").get_or_build(KEY, _make_build(str(count), 1000))
    cache = CompileCache(tmp_path / "c", budget_bytes=2 * probe.size + 10, touch_interval=0)
    a = cache.get_or_build(key_n(0), _make_build(str(count), 1000))
    b = cache.get_or_build(key_n(1), _make_build(str(count), 1000))
    cache.get(key_n(0))  # b is now least recently used
    c = cache.get_or_build(key_n(2), _make_build(str(count), 1000))
    assert {e.digest for e in cache.ls()} == {a.digest, c.digest}
    assert cache.du().total_bytes <= cache.budget_bytes  # type: ignore[operator]
    assert cache.get(key_n(1)) is None and b.digest not in _disk_digests(cache.root)


def test_lease_context_and_evict(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "c")
    build = _make_build(str(tmp_path / "count"))
    with cache.lease(KEY, build) as entry:
        assert cache.is_leased(entry)
        assert cache.clear().skipped_leased == [entry.digest]
    assert not cache.is_leased(entry)
    with pytest.raises(EntryNotFound):
        cache.evict(key_n(3))
    report = cache.evict(KEY)
    assert report.evicted == [entry.digest] and report.freed_bytes == entry.size
    with pytest.raises(EntryNotFound):
        with cache.lease(KEY):
            pass


def _snapshot(cache: CompileCache) -> list[tuple[object, ...]]:
    return [(e.digest, e.size, e.key, e.files, e.created) for e in cache.ls()]


@pytest.mark.parametrize("damage", ["delete", "garbage", "garbage_after_header"])
def test_lost_or_corrupt_index_is_rebuilt_from_disk(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "c"
    cache = CompileCache(root, touch_interval=0)
    for i in range(3):
        cache.get_or_build(key_n(i), _make_build(str(tmp_path / "count"), size=100 * (i + 1)))
    cache.get(key_n(0))
    before = _snapshot(cache)
    cache.close()
    db = root / "index.sqlite"
    if damage == "delete":
        for p in root.glob("index.sqlite*"):
            p.unlink()
    elif damage == "garbage":
        db.write_bytes(os.urandom(8192))
    else:
        data = bytearray(db.read_bytes())
        data[100:] = os.urandom(len(data) - 100)
        db.write_bytes(bytes(data))

    reopened = CompileCache(root)
    assert reopened.index_rebuilt
    assert _snapshot(reopened) == before  # same entries, same LRU order
    assert _index_digests(root) == _disk_digests(root)
    if damage != "delete":
        assert (root / "index.sqlite.corrupt").exists()
    assert reopened.get_or_build(key_n(1), _make_build(str(tmp_path / "count"))) is not None
    assert _count(tmp_path / "count") == 3  # nothing was rebuilt


def test_index_deleted_while_open_is_rebuilt(tmp_path: Path) -> None:
    root = tmp_path / "c"
    cache = CompileCache(root)
    e = cache.get_or_build(KEY, _make_build(str(tmp_path / "count")))
    for p in root.glob("index.sqlite*"):
        p.unlink()
    assert cache.get(KEY) == e
    assert _index_digests(root) == {e.digest}


def test_bad_key_is_a_typed_error_before_any_build(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "c")
    calls: list[Path] = []
    with pytest.raises(InvalidKey, match="'shape'\\[1\\]: bytes"):
        cache.get_or_build({**KEY, "shape": [1, b"128"]}, calls.append)
    with pytest.raises(InvalidKey, match="None is not allowed"):
        cache.get({**KEY, "precision": None})
    assert calls == []


def test_bad_arguments_and_roots_are_typed_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(InvalidRoot) as info:
        CompileCache(tmp_path / "file")
    assert info.value.code == "invalid_root"
    with pytest.raises(InvalidSize):
        CompileCache(tmp_path / "c", budget_bytes=-1)
    with pytest.raises(InvalidArgument):
        CompileCache(tmp_path / "c", touch_interval=float("nan"))
    with pytest.raises(InvalidArgument):
        CompileCache(tmp_path / "c").get_or_build(KEY, lambda tmp: None, timeout=-1)


def test_cache_dir_deleted_under_a_running_process(tmp_path: Path) -> None:
    root = tmp_path / "c"
    cache = CompileCache(root)
    first = cache.get_or_build(KEY, _make_build(str(tmp_path / "count")))
    shutil.rmtree(root)
    assert cache.get(KEY) is None
    again = cache.get_or_build(KEY, _make_build(str(tmp_path / "count")))
    assert again.digest == first.digest and _count(tmp_path / "count") == 2
    assert _index_digests(root) == _disk_digests(root) == {first.digest}


def test_lease_through_a_stale_entry_never_pins_its_replacement(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "c")
    count = str(tmp_path / "count")
    old = cache.get_or_build(KEY, _make_build(count))
    cache.evict(KEY)
    new = cache.get_or_build(KEY, _make_build(count))  # same key, different bytes
    assert new.digest == old.digest and new.files != old.files
    with pytest.raises(EntryEvicted, match="rebuilt"):
        old.lease().acquire()
    with new.lease() as leased:
        assert leased.files == new.files and cache.is_leased(new)


def test_index_row_that_disagrees_with_disk_is_repaired(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "c")
    e = cache.get_or_build(KEY, _make_build(str(tmp_path / "count")))
    conn = sqlite3.connect(cache.root / "index.sqlite")
    conn.execute("UPDATE entries SET created = 1.0, size = 7")
    conn.commit()
    conn.close()
    with cache.lease(KEY) as leased:  # the stale row is re-read from the object
        assert leased.created == e.created and leased.size == e.size
    assert cache.verify().corrupt == []
