"""Cutting the row stream into windows, tokenizing them, and length-aware batching.

A window is the job's unit of commit: `rows` consecutive input records, tokenized together,
embedded in batches, written as one row group. Inside a window, rows are grouped by token
length (similar lengths together) into batches of at most the lane's token budget and item
cap, so no batch pays for padding or one long straggler; results go back to input order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from batch.errors import TOO_LONG
from batch.rows import InputSpec, Row, read_rows
from host.tokenization import Tokenizer


@dataclass
class Window:
    index: int
    next_line: int  # where the input continues after this window
    rows: list[Row]  # the rows to embed, input order
    ids: list[np.ndarray]
    truncated: list[bool]
    errors: list[dict]  # error records of this window's bad rows
    batches: list[list[int]] = field(default_factory=list)  # indices into rows

    @property
    def n_tokens(self) -> list[int]:
        return [len(x) for x in self.ids]


def error_record(row: Row, code: str | None = None, message: str | None = None) -> dict:
    return {
        "line": row.line,
        "id": row.id,
        "error": {"code": code or row.error_code, "message": message or row.error_message},
    }


def plan_batches(lengths: list[int], max_tokens: int, max_items: int) -> list[list[int]]:
    """Indices grouped by length (longest first), each group <= max_tokens tokens and
    <= max_items items; an item longer than the budget gets a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and (used + lengths[i] > max_tokens or len(cur) >= max_items):
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        batches.append(cur)
    return batches


def tokenize_window(
    index: int,
    rows: list[Row],
    next_line: int,
    tokenizer: Tokenizer,
    truncate: bool,
    max_tokens: int,
    max_items: int,
    prompt: str = "",
) -> Window:
    """`prompt` is prepended to every row's text (tokens and limit as `Tokenizer.encode`)."""
    good = [r for r in rows if r.ok]
    errors = [error_record(r) for r in rows if not r.ok]
    texts = cast("list[str | bytes]", [r.text for r in good])  # an ok row carries its text
    enc = tokenizer.encode(texts, truncate=True, prompt=prompt) if good else None
    ids = enc.ids if enc else []
    cut = enc.truncated if enc else []
    if not truncate and any(cut):
        keep = [i for i, c in enumerate(cut) if not c]
        errors += [
            error_record(
                good[i],
                TOO_LONG,
                f"the text is over the model's limit of {tokenizer.max_tokens} tokens "
                f"and --no-truncate is set",
            )
            for i, c in enumerate(cut)
            if c
        ]
        errors.sort(key=lambda e: e["line"])
        good = [good[i] for i in keep]
        ids = [ids[i] for i in keep]
        cut = [False] * len(keep)
    window = Window(index, next_line, good, ids, list(cut), errors)
    window.batches = plan_batches(window.n_tokens, max_tokens, max_items)
    return window


def windows(
    spec: InputSpec,
    start_line: int,
    window_rows: int,
    tokenizer: Tokenizer,
    truncate: bool,
    max_tokens: int,
    max_items: int,
    first_index: int = 0,
    prompt: str = "",
) -> Iterator[Window]:
    buf: list[Row] = []
    index = first_index
    for row in read_rows(spec, start_line):
        buf.append(row)
        if len(buf) >= window_rows:
            yield tokenize_window(
                index, buf, row.line + 1, tokenizer, truncate, max_tokens, max_items, prompt
            )
            buf, index = [], index + 1
    if buf:
        yield tokenize_window(
            index, buf, buf[-1].line + 1, tokenizer, truncate, max_tokens, max_items, prompt
        )
