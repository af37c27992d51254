"""A clock the test moves: what a component times (a lane's quarantine, its health's age) is
read from it, so a test never sleeps through a window or bounds a duration by the wall clock."""

from __future__ import annotations


class Clock:
    """Seconds on a monotonic scale, moved only by `advance`; pass it as `Lane(clock=...)`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
