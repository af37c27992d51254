"""Execution permits per device: an inference holds one while the worker computes.

The ANE runs one inference at a time, so does the GPU llama.cpp offloads to (`gpu`, one
shared device on Apple silicon); CPU permits match the cores. A Module's lanes share one
set. Compilation and other control requests take none (DESIGN section 3).
"""

from __future__ import annotations

import asyncio


class DevicePermits:
    def __init__(self, counts: dict[str, int]) -> None:
        self._sems = {device: asyncio.Semaphore(n) for device, n in counts.items()}
        self.counts = dict(counts)

    def for_device(self, device: str) -> asyncio.Semaphore:
        sem = self._sems.get(device)
        if sem is None:
            raise KeyError(f"no execution permits configured for device {device!r}")
        return sem
