"""How many CPUs this process may use, on any OS.

Linux narrows the machine's cores by affinity (taskset, cgroup cpusets in containers), so a
worker must not start one thread per core it cannot run on; `os.sched_getaffinity` exists
only there. Elsewhere (macOS has no affinity API) the core count is the honest answer.
"""

from __future__ import annotations

import os


def usable_cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
