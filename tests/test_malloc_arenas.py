"""host.malloc_arenas: the cap holds for threads started after it, and a user's setting wins.

Counted in a fresh interpreter per case (arenas are per process and never go away), with
glibc's own report of its heaps (`malloc_info`), while eight threads allocate at once."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from host.malloc_arenas import limit_malloc_arenas

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's; other libcs have none"
)

_COUNT_ARENAS = r"""
import ctypes, ctypes.util, sys, tempfile, threading
from host.malloc_arenas import limit_malloc_arenas
print(limit_malloc_arenas(), file=sys.stderr)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
start = threading.Barrier(8)
done = threading.Barrier(8)

def work():
    start.wait()  # all eight allocate at once, so each finds the others' arenas busy
    ptrs = [libc.malloc(4096) for _ in range(2000)]
    done.wait()
    for p in ptrs:
        libc.free(p)

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
with tempfile.NamedTemporaryFile("r", suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(f.read().count("<heap nr="))
"""


def _arenas(env: dict[str, str]) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_ARENAS], env=env, capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip()), out.stderr.strip()


def test_the_cap_holds_for_threads_started_after_it_and_a_users_setting_wins() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped, set_here = _arenas(env)
    assert set_here == "True"
    assert capped <= 2
    # The user's MALLOC_ARENA_MAX is left alone: here it allows more arenas than our cap, and
    # the eight threads get them, which also shows the count would exceed the cap uncapped.
    more, set_here = _arenas({**env, "MALLOC_ARENA_MAX": "8"})
    assert set_here == "False"
    assert more > 2


def test_a_process_needs_one_arena() -> None:
    with pytest.raises(ValueError, match="at least one"):
        limit_malloc_arenas(0)
