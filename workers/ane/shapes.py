"""Compiled shapes: `(rows, seq_len)` unpacked or `(rows, seq_len, max_segments)` packed.

Every dimension is static: the Neural Engine compiles a fixed-shape program, so each shape the
host admits is its own compiled package (compiled once, kept in the compile cache). A shape
id is what the wire carries (`SHAPE_ADMITTED.shape_id`, `EVICT.shape_id`):

    "<rows>x<seq_len>"              unpacked, e.g. "8x128"
    "<rows>x<seq_len>p<segments>"   packed,   e.g. "4x256p16"
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ID = re.compile(r"^(\d+)x(\d+)(?:p(\d+))?$")


@dataclass(frozen=True, order=True)
class Shape:
    rows: int
    seq_len: int
    packed: bool = False
    max_segments: int = 1  # sequences per row; 1 when unpacked

    def __post_init__(self) -> None:
        if self.rows < 1 or self.seq_len < 1 or self.max_segments < 1:
            raise ValueError(f"shape dimensions must be >= 1: {self}")
        if not self.packed and self.max_segments != 1:
            raise ValueError("an unpacked shape has exactly one segment per row")
        if self.packed and self.max_segments > self.seq_len:
            raise ValueError("a packed row cannot hold more segments than tokens")

    @property
    def id(self) -> str:
        base = f"{self.rows}x{self.seq_len}"
        return f"{base}p{self.max_segments}" if self.packed else base

    @property
    def dims(self) -> list[int]:
        """The dims a compile-cache key records."""
        return (
            [self.rows, self.seq_len, self.max_segments]
            if self.packed
            else [self.rows, self.seq_len]
        )

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len

    @classmethod
    def parse(cls, shape_id: str) -> Shape:
        m = _ID.match(shape_id)
        if m is None:
            raise ValueError(f"not a shape id: {shape_id!r} (expected e.g. '8x128' or '4x256p16')")
        rows, seq, seg = m.groups()
        if seg is None:
            return cls(int(rows), int(seq))
        return cls(int(rows), int(seq), packed=True, max_segments=int(seg))
