"""Execution permits per device: an inference holds one while the worker computes.

The ANE runs one inference at a time, so does the GPU llama.cpp offloads to (`gpu`, one
shared device on Apple silicon); CPU permits match the cores. A Module's lanes share one
set. Compilation and other control requests take none: they compute nothing on the device
an inference would wait for.

A lane whose engine uses two devices names both, joined by "+" ("ane+gpu": Core ML with
compute units that include the GPU): it holds both permits, always taken in one global order
(sorted by name), so two such lanes can never each hold one and wait for the other.
"""

from __future__ import annotations

import asyncio


class JointPermit:
    """Several devices' permits taken together, with the Semaphore calls the lane uses."""

    def __init__(self, sems: list[asyncio.Semaphore]) -> None:
        self._sems = sems

    def locked(self) -> bool:
        return any(s.locked() for s in self._sems)

    async def acquire(self) -> bool:
        taken: list[asyncio.Semaphore] = []
        try:
            for sem in self._sems:
                await sem.acquire()
                taken.append(sem)
        except BaseException:
            for sem in reversed(taken):  # cancelled halfway: give back what was taken
                sem.release()
            raise
        return True

    def release(self) -> None:
        for sem in reversed(self._sems):
            sem.release()

    async def __aenter__(self) -> JointPermit:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


Permit = asyncio.Semaphore | JointPermit


class DevicePermits:
    def __init__(self, counts: dict[str, int]) -> None:
        self._sems = {device: asyncio.Semaphore(n) for device, n in counts.items()}
        self._joint: dict[str, JointPermit] = {}
        self.counts = dict(counts)

    def for_device(self, device: str) -> Permit:
        """The permit of `device`, or of every device of "a+b" together."""
        if "+" in device:
            joint = self._joint.get(device)
            if joint is None:
                joint = JointPermit([self._one(d) for d in sorted(device.split("+"))])
                self._joint[device] = joint
            return joint
        return self._one(device)

    def _one(self, device: str) -> asyncio.Semaphore:
        sem = self._sems.get(device)
        if sem is None:
            raise KeyError(f"no execution permits configured for device {device!r}")
        return sem
