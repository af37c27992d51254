"""How many CPUs this process should plan threads for, on any OS.

- Linux narrows the machine's cores by affinity (taskset, cgroup cpusets in containers), so a
  worker must not start one thread per core it cannot run on; `os.sched_getaffinity` exists
  only there.
- Apple silicon mixes performance and efficiency cores, and `os.cpu_count()` counts both:
  llama.cpp's threads barrier-sync after every op, so a stream that lands on an efficiency
  core makes every other thread wait for it. Threads and encode streams are planned for the
  performance cores (`sysctl hw.perflevel0.physicalcpu`); where that key is missing (Intel
  Macs, older macOS) the core count is the answer, as everywhere else.

Standard library only: the host plans threads and CPU permits with it, and the workers size
their contexts with it.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

PERFORMANCE_CORES_SYSCTL = "hw.perflevel0.physicalcpu"


def performance_cores(sysctl_output: str | None) -> int | None:
    """The performance-core count `sysctl -n hw.perflevel0.physicalcpu` printed; None when it
    printed nothing usable (the key does not exist on this Mac)."""
    text = (sysctl_output or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


@functools.cache
def _macos_performance_cores() -> int | None:
    try:
        out = subprocess.run(
            ["sysctl", "-n", PERFORMANCE_CORES_SYSCTL], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return performance_cores(out.stdout) if out.returncode == 0 else None


def usable_cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    if sys.platform == "darwin":
        perf = _macos_performance_cores()
        if perf is not None:
            return perf
    return os.cpu_count() or 1
