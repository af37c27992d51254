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
from batch.late import (
    DOCUMENT_INCOMPLETE,
    DOCUMENT_TOO_LONG,
    Document,
    document_record,
    over_bounds,
    plan_document,
)
from batch.rows import InputSpec, Row, read_rows
from common.errors import InvalidRequest
from host.admission import Budgets
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
    # Late chunking (batch/late.py): `ids` are the documents' forward windows, not one per
    # row; `seq_ref[i]` is (document, its window) of ids[i]; `row_tokens` each chunk's tokens.
    docs: list[Document] = field(default_factory=list)
    seq_ref: list[tuple[int, int]] = field(default_factory=list)
    row_tokens: list[int] | None = None

    @property
    def n_tokens(self) -> list[int]:
        return [len(x) for x in self.ids]

    @property
    def late(self) -> bool:
        return self.row_tokens is not None


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


@dataclass
class OpenDocument:
    """A document's rows as they are read; once over a bound its rows are only counted."""

    first: Row
    rows: list[Row] = field(default_factory=list)
    n_rows: int = 0
    n_bytes: int = 0
    last_line: int = 0
    too_long: str | None = None

    def add(self, row: Row, budgets: Budgets) -> None:
        self.n_rows += 1
        self.last_line = row.line
        size = len((row.text or "").encode("utf-8", "replace"))
        self.n_bytes += size
        if self.too_long is None:
            self.too_long = over_bounds(self.n_rows, self.n_bytes, size, budgets)
            self.rows.append(row)
        if self.too_long is not None:
            self.rows = []  # bounded memory, whatever the document's length


@dataclass
class LateGroup:
    """One late-chunking window's rows as read, before any tokenization: its documents in
    input order and the rows that belong to none. Where a window is cut depends on the rows
    alone, so a reader without the model (a Ray read task) cuts exactly the local job's
    windows, and whoever holds the tokenizer plans them (`plan_late_window`)."""

    docs: list[OpenDocument] = field(default_factory=list)
    loose: list[Row] = field(default_factory=list)  # rows whose document field is unreadable
    n_rows: int = 0
    last_line: int = 0  # the window's last input line: it continues at the next one

    def add_doc(self, doc: OpenDocument) -> None:
        self.docs.append(doc)
        self.n_rows += doc.n_rows
        self.last_line = max(self.last_line, doc.last_line)

    def add_loose(self, row: Row) -> None:
        self.loose.append(row)
        self.n_rows += 1
        self.last_line = row.line


def late_groups(
    spec: InputSpec, start_line: int, window_rows: int, budgets: Budgets
) -> Iterator[LateGroup]:
    """Windows of whole documents (batch/late.py states the document rules): a window closes
    at the first document boundary at or past `window_rows` rows, so a document longer than
    a window keeps its rows together, and a resumed job starts at a document's first row."""
    group = LateGroup()
    cur: OpenDocument | None = None
    for row in read_rows(spec, start_line):
        if cur is not None and row.doc is not None and row.doc == cur.first.doc:
            cur.add(row, budgets)
            continue
        if cur is not None:
            group.add_doc(cur)
            cur = None
            if group.n_rows >= window_rows:
                yield group
                group = LateGroup()
        if row.doc is None:  # its document field could not be read: a row error, no document
            group.add_loose(row)
            if group.n_rows >= window_rows:
                yield group
                group = LateGroup()
        else:
            cur = OpenDocument(row)
            cur.add(row, budgets)
    if cur is not None:
        group.add_doc(cur)
    if group.n_rows:
        yield group


def late_windows(
    spec: InputSpec,
    start_line: int,
    window_rows: int,
    tokenizer: Tokenizer,
    max_tokens: int,
    max_items: int,
    budgets: Budgets,
    first_index: int = 0,
    prompt: str = "",
) -> Iterator[Window]:
    """`late_groups`' windows, each planned as it is read."""
    for index, group in enumerate(late_groups(spec, start_line, window_rows, budgets), first_index):
        yield plan_late_window(index, group, tokenizer, max_tokens, max_items, budgets, prompt)


def plan_late_window(
    index: int,
    group: LateGroup,
    tokenizer: Tokenizer,
    max_tokens: int,
    max_items: int,
    budgets: Budgets,
    prompt: str = "",
) -> Window:
    """The window's documents planned (batch/late.py) and batched; a document that cannot be
    embedded becomes its error record."""
    docs: list[Document] = []
    errors = [error_record(r) for r in group.loose]
    for doc in group.docs:
        planned = _plan(doc, tokenizer, budgets, prompt, errors)
        if planned is not None:
            docs.append(planned)
    errors.sort(key=lambda e: e["line"])
    rows = [r for d in docs for r in d.rows]
    window = Window(
        index,
        group.last_line + 1,
        rows,
        [s for d in docs for s in d.seqs],
        [False] * len(rows),
        errors,
        docs=docs,
        seq_ref=[(i, w) for i, d in enumerate(docs) for w in range(len(d.seqs))],
        row_tokens=[int(c) for d in docs for c in d.counts],
    )
    window.batches = plan_batches(window.n_tokens, max_tokens, max_items)
    return window


def _plan(
    doc: OpenDocument, tokenizer: Tokenizer, budgets: Budgets, prompt: str, errors: list[dict]
) -> Document | None:
    """The document planned, or None with its error records appended to `errors`."""
    name = cast("str", doc.first.doc)
    if doc.too_long is not None:
        errors.append(
            document_record(
                doc.first,
                name,
                doc.last_line,
                doc.n_rows,
                DOCUMENT_TOO_LONG,
                f"document {name!r} has {doc.too_long}, over the bound of one "
                f"late-chunking request; its {doc.n_rows} rows were not embedded",
            )
        )
        return None
    bad = [r for r in doc.rows if not r.ok]
    good = [r for r in doc.rows if r.ok]
    errors += [error_record(r) for r in bad]
    if bad:
        if good:
            lines = ", ".join(str(r.line) for r in bad[:10])
            errors.append(
                document_record(
                    good[0],
                    name,
                    doc.last_line,
                    len(good),
                    DOCUMENT_INCOMPLETE,
                    f"document {name!r} has bad rows (line {lines}); its other "
                    f"{len(good)} rows were not embedded",
                )
            )
        return None
    try:
        planned = plan_document(good, tokenizer, prompt)
    except InvalidRequest as exc:
        errors.append(
            document_record(good[0], name, doc.last_line, len(good), exc.code, exc.message)
        )
        return None
    if planned.tokens_read > budgets.max_inflight_tokens:
        errors.append(
            document_record(
                good[0],
                name,
                doc.last_line,
                len(good),
                DOCUMENT_TOO_LONG,
                f"document {name!r} reads {planned.tokens_read} tokens, more than "
                f"{budgets.max_inflight_tokens} (one late-chunking request's bound); its "
                f"{len(good)} rows were not embedded",
            )
        )
        return None
    return planned
