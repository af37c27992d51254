"""tests/session_share.py: what two xdist processes ask for at once is built once, in the run's
own temp root; a build that fails leaves nothing, and the next asker builds it."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tests.session_share import build_once, session_root


class _Factory:
    """The one method of pytest's TempPathFactory that build_once reads."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _build_in_worker(run_root: str, worker: str, queue) -> None:
    os.environ["PYTEST_XDIST_WORKER"] = worker

    def build(out: Path) -> None:
        time.sleep(0.5)  # long enough for the other process to ask meanwhile
        (out / "builder").write_text(worker)
        with open(Path(run_root) / "builds.log", "a") as log:
            log.write(worker + "\n")

    base = Path(run_root) / f"popen-{worker}"
    base.mkdir()
    out = build_once(_Factory(base), "artifact", build)  # type: ignore[arg-type]
    queue.put((str(out), (out / "builder").read_text()))


def test_two_processes_asking_at_once_build_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_build_in_worker, args=(str(tmp_path), w, queue)) for w in ("gw0", "gw1")
    ]
    for p in procs:
        p.start()
    got = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert (tmp_path / "builds.log").read_text().count("\n") == 1  # one build
    (out_a, by_a), (out_b, by_b) = got
    assert out_a == out_b == str(tmp_path / "session-shared" / "artifact") and by_a == by_b


def test_a_failed_build_leaves_nothing_and_the_next_asker_builds(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    factory = _Factory(tmp_path)
    assert session_root(factory) == tmp_path  # type: ignore[arg-type]  # no xdist: its own

    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        build_once(factory, "artifact", broken)  # type: ignore[arg-type]
    assert not (tmp_path / "session-shared" / "artifact").exists()
    out = build_once(factory, "artifact", lambda d: (d / "whole").write_text("y"))  # type: ignore
    assert sorted(p.name for p in out.iterdir()) == [".built", "whole"]
