"""Placing sequences into admitted shapes, and the int32 feeds of one run.

Placement (`plan`), deterministic, first fit by length:
- items are taken longest first;
- an item goes to a PACKED shape when it fits one and at least two items of its length could
  share a row at no more token positions each than the unpacked shape that fits it (`_packs`),
  or when no unpacked shape fits it: the first open row of the smallest such packed shape
  with room for its tokens and one more segment (first-fit decreasing);
- otherwise to the UNPACKED shape with the smallest seq_len >= n (most rows on a tie);
- an item no admitted shape can hold raises `NoShapeFits`.
Rows are then cut into chunks of `shape.rows`; the last chunk of a shape is padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from workers.ane.shapes import Shape


class NoShapeFits(Exception):
    def __init__(self, index: int, length: int, longest: int) -> None:
        super().__init__(
            f"item {index} has {length} tokens; the longest admitted shape takes {longest}"
        )
        self.index = index
        self.length = length


@dataclass
class Chunk:
    shape: Shape
    rows: list[list[int]] = field(default_factory=list)  # item indices per row, in order


@dataclass
class _OpenRow:
    items: list[int]
    used: int


def plan(lengths: Sequence[int], shapes: Sequence[Shape]) -> list[Chunk]:
    unpacked = sorted((s for s in shapes if not s.packed), key=lambda s: (s.seq_len, -s.rows))
    packed = sorted((s for s in shapes if s.packed), key=lambda s: (s.seq_len, -s.rows))
    longest = max((s.seq_len for s in shapes), default=0)
    rows_of: dict[Shape, list[_OpenRow]] = {s: [] for s in shapes}
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        fit_u = next((s for s in unpacked if s.seq_len >= n), None)
        fit_p = next((s for s in packed if _packs(s, n, fit_u)), None)
        if fit_p is not None:
            rows = rows_of[fit_p]
            row = next(
                (
                    r
                    for r in rows
                    if r.used + n <= fit_p.seq_len and len(r.items) < fit_p.max_segments
                ),
                None,
            )
            if row is None:
                rows.append(_OpenRow([i], n))
            else:
                row.items.append(i)
                row.used += n
        elif fit_u is not None:
            rows_of[fit_u].append(_OpenRow([i], n))
        else:
            raise NoShapeFits(i, n, longest)
    chunks: list[Chunk] = []
    for shape in unpacked + packed:
        item_rows = [r.items for r in rows_of[shape]]
        for start in range(0, len(item_rows), shape.rows):
            chunks.append(Chunk(shape, item_rows[start : start + shape.rows]))
    return chunks


def _packs(shape: Shape, n: int, fit_u: Shape | None) -> bool:
    """Whether an item of `n` tokens goes to packed `shape`: it fits, and either no unpacked
    shape holds it or items of its length share a row (two or more) at no more token
    positions each than the unpacked shape that fits it spends on one. A row's cost is its
    length whatever it holds, so ~290-token pairs packed three to a 1024-token row cost 341
    positions each against 320 in an unpacked 320-token row (measured at Qwen3-Reranker's
    width: 0.65x the items/s), while 16-token inputs packed eight to a 128-token row cost 16
    each against 128."""
    if shape.seq_len < n:
        return False
    if fit_u is None:
        return True
    share = min(shape.max_segments, shape.seq_len // n)
    return share >= 2 and shape.seq_len / share <= fit_u.seq_len


def feeds_for(
    chunk: Chunk, seqs: Sequence[np.ndarray], types: Sequence[np.ndarray], pad_id: int = 0
) -> dict[str, np.ndarray]:
    """The int32 inputs of one run of `chunk.shape` (padding: pad id, type 0, mask/segment 0)."""
    s = chunk.shape
    ids = np.full((s.rows, s.seq_len), pad_id, dtype=np.int32)
    tts = np.zeros((s.rows, s.seq_len), dtype=np.int32)
    if not s.packed:
        mask = np.zeros((s.rows, s.seq_len), dtype=np.int32)
        for r, (i,) in enumerate(chunk.rows):
            n = len(seqs[i])
            ids[r, :n] = seqs[i]
            tts[r, :n] = types[i]
            mask[r, :n] = 1
        return {"input_ids": ids, "token_type_ids": tts, "attention_mask": mask}
    seg = np.zeros((s.rows, s.seq_len), dtype=np.int32)
    pos = np.zeros((s.rows, s.seq_len), dtype=np.int32)
    for r, items in enumerate(chunk.rows):
        at = 0
        for k, i in enumerate(items):
            n = len(seqs[i])
            ids[r, at : at + n] = seqs[i]
            tts[r, at : at + n] = types[i]
            seg[r, at : at + n] = k + 1  # segments are 1-based: 0 marks padding
            pos[r, at : at + n] = np.arange(n, dtype=np.int32)  # positions restart per segment
            at += n
    return {"input_ids": ids, "token_type_ids": tts, "segment_ids": seg, "position_ids": pos}


def gather_rows(chunk: Chunk, output: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(item index, its output vector) for every item of a run: output is (rows, C) unpacked,
    (rows, max_segments, C) packed."""
    out: list[tuple[int, np.ndarray]] = []
    for r, items in enumerate(chunk.rows):
        if chunk.shape.packed:
            out.extend((i, output[r, k]) for k, i in enumerate(items))
        else:
            out.append((items[0], output[r]))
    return out
