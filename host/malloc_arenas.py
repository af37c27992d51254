"""Cap glibc's malloc arenas in a long-running host process, so its memory does not creep.

glibc gives a thread that finds the main heap locked an arena of its own, up to 8 per core,
and an arena keeps its high-water mark: freed memory inside it is reused by that arena but
rarely returned to the system. The serving host runs tokenizers and large frame writes on
executor threads (and the tokenizers library runs its own thread pool), so each burst of
concurrent requests can leave a new arena at a new peak. Under a steady mixed load that showed
as host RSS climbing in steps of 2-4 MB over ten minutes (107.8 -> 113.9 MB); with two arenas
it stayed flat (101.9 -> 101.7 MB). Two arenas is what long-running Python servers are
commonly given (gunicorn's and glibc's own advice); the host's threads spend their time in
the tokenizer and in sendall, not in malloc, so they do not contend on it.

`mallopt(M_ARENA_MAX)` only affects arenas created afterwards, so this runs before the server
starts any thread. A `MALLOC_ARENA_MAX` the user set wins (glibc read it at process start).
Other C libraries (macOS's libmalloc, musl) have no such arenas: nothing to do there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger("synapse.host")

M_ARENA_MAX = -8  # glibc's malloc.h
HOST_ARENAS = 2


def limit_malloc_arenas(arenas: int = HOST_ARENAS) -> bool:
    """Cap this process's malloc arenas at `arenas`; True when the cap was set here."""
    if arenas < 1:
        raise ValueError(f"a process needs at least one malloc arena, not {arenas}")
    if "MALLOC_ARENA_MAX" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.mallopt(M_ARENA_MAX, arenas) != 1:  # mallopt returns 1 on success
        log.warning("mallopt(M_ARENA_MAX, %d) failed; malloc arenas stay uncapped", arenas)
        return False
    return True
