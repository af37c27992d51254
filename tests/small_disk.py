"""A real small filesystem for disk-full tests.

A tmpfs of a chosen size is mounted over a directory inside a private user + mount namespace
(`unshare --user --map-root-user --mount`): no root needed, nothing outside the namespace sees
it, and it goes away with the command. Writes past its size fail as on a full disk (ENOSPC).
Linux only; where namespaces or mounts are not allowed, tests skip and say why.
"""

from __future__ import annotations

import errno
import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def unavailable() -> str | None:
    """Why a small disk cannot be had here, or None."""
    if sys.platform != "linux":
        return "needs Linux mount namespaces (unshare) for a small real filesystem"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare for a small real filesystem"
    with tempfile.TemporaryDirectory() as d:
        probe = run_on_small_disk(Path(d), "1M", 'touch "$DISK/x"', timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs here: {probe.stderr.strip()[-300:]}"
    return None


def run_on_small_disk(
    mount_point: Path, size: str, script: str, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run the bash `script` with a `size` tmpfs mounted on `mount_point` (as `$DISK`) and the
    project's interpreter as `$PY`. The script may `remount SIZE` to grow or shrink it."""
    prelude = (
        f"set -e\nexport DISK={shlex.quote(str(mount_point))} PY={shlex.quote(sys.executable)}\n"
        'remount() { mount -o "remount,size=$1" tmpfs "$DISK"; }\n'
        f'mount -t tmpfs -o size={shlex.quote(size)} tmpfs "$DISK"\n'
    )
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", prelude + script],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- inside the scripts: another writer taking the space ------------------------------------


def fill_disk(disk: str | Path) -> Path:
    """Take every free byte of `disk` with one file, returned (unlink it to give them back)."""
    path = Path(disk) / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))  # short near the end; the next write is ENOSPC
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return path


def fill_disk_when(disk: str | Path, ready: Callable[[], bool]) -> threading.Thread:
    """A started thread that waits until `ready()` (say, a build made its temp dir), then
    fills `disk`; join it before looking at the result."""

    def run() -> None:
        while not ready():
            time.sleep(0.001)
        fill_disk(disk)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


_FILL_WHEN_APPEARS = """
import os, signal, sys, time
from pathlib import Path
from tests.small_disk import fill_disk
disk, parent, prefix, builder = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
print("ready", flush=True)
while not any(p.is_dir() and p.name.startswith(prefix) for p in parent.iterdir()):
    time.sleep(0.001)
os.kill(builder, signal.SIGSTOP)  # the build stands still while the space goes
try:
    fill_disk(disk)
finally:
    os.kill(builder, signal.SIGCONT)
"""


def fill_disk_when_dir_appears(disk: str | Path, parent: Path, prefix: str) -> subprocess.Popen:
    """A started process that waits until a directory named `prefix...` appears in `parent`
    (say, a build's temp dir), then stops this process (SIGSTOP), fills `disk` and lets it go
    on (SIGCONT); wait for it before looking at the result. Returns once it is watching.
    A process, not a thread: a build running in this process can hold the GIL for the whole of
    one large write. The stop makes the outcome certain: left running, a build on a fast disk
    can write all it needs before the filler has taken the space."""
    root = str(Path(__file__).resolve().parents[1])
    filler = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _FILL_WHEN_APPEARS,
            str(disk),
            str(parent),
            prefix,
            str(os.getpid()),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert filler.stdout is not None
    line = filler.stdout.readline()  # the build may start: the filler is watching
    assert line == "ready\n", f"the filler did not start: {line!r}"
    return filler
