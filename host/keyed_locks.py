"""One asyncio lock per key, kept only while a task holds or waits for it.

The Module serialises the load of a (model, lane) and the lane choice of a model by name, and
the name comes from the caller: a request for a model that does not exist takes the lock before
the store says so. A table that kept every name ever asked for would grow with each new one,
for the life of the server; this one holds an entry only while it is in use, so its size is
the number of keys being loaded or chosen now.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class KeyedLocks:
    def __init__(self) -> None:
        # key -> the lock and how many tasks hold or wait for it (the entry goes at 0: nobody
        # can then be inside, so a later caller's new lock excludes as the old one did).
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[key]

    def __len__(self) -> int:
        """Keys held or waited for now."""
        return len(self._locks)
