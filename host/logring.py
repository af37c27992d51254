"""A size-capped ring of a worker's tagged output lines.

Worker stdout/stderr are kept here (never unbounded in memory); `tail(n)` gives the last
n bytes for `engine_crashed` details. Lines over the cap are cut, not dropped, so a worker that
prints one enormous line still leaves its end visible.
"""

from __future__ import annotations

from collections import deque


class LogRing:
    def __init__(self, tag: str, capacity: int = 256 * 1024) -> None:
        self.tag = tag
        self.capacity = capacity
        self._lines: deque[str] = deque()
        self._size = 0
        self.dropped_bytes = 0

    def append(self, stream: str, text: str) -> None:
        line = f"[{self.tag} {stream}] {text.rstrip(chr(10))}\n"
        if len(line) > self.capacity:
            line = line[-self.capacity :]
        self._lines.append(line)
        self._size += len(line)
        while self._size > self.capacity:
            old = self._lines.popleft()
            self._size -= len(old)
            self.dropped_bytes += len(old)

    def tail(self, nbytes: int = 8192) -> str:
        out: list[str] = []
        size = 0
        for line in reversed(self._lines):
            if size + len(line) > nbytes:
                if not out:  # always show the end of the last line
                    out.append(line[-nbytes:])
                break
            out.append(line)
            size += len(line)
        return "".join(reversed(out))

    @property
    def size(self) -> int:
        return self._size
