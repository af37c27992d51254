"""Late chunking in a bulk job: a document's rows are its chunks, planned as `Module.late_chunk`
plans one document and pooled by its rule (host/late_chunking.py), so each row gets the vector
`late_chunk` returns for that chunk of that document.

The one difference is when the pooling happens: a job pools each forward window of a document
as soon as its token states come back (summing, in float64, the states of the tokens that
window owns into their chunks) and drops the states, so a window of thousands of documents
never holds their token states at once. The sums (float64, as `late_chunk`'s mean) are
divided and normalized as it does, so from the same token states the vectors agree to float32
rounding. The states themselves are the same only when the document's windows run in a batch
of their own, as `late_chunk` runs them: the job's batches mix documents' windows for speed,
and llama.cpp's results move by ~1e-4 with a batch's shape (cos >= 0.9999).

Documents (`--doc-field F`):
- consecutive rows with the same value of F are one document's chunks, in input order. A value
  that comes back after another document's rows starts a NEW document: a streaming job cannot
  remember every document it has seen, so group each document's rows together in the input;
- a document is bounded as one late-chunking request to the service is: at most `max_inputs`
  chunks (2048) of at most `max_input_bytes` each (1 MiB), `max_request_bytes` of text
  (16 MiB) and `max_inflight_tokens` tokens read
  (262144, window overlaps included). A document over a bound is not embedded: it gets ONE
  error record, `document_too_long`, for all its rows (its bad rows too), and the job goes on;
- a document with a bad row (an empty text, a text that is not a string...) is not embedded:
  the bad row keeps its own error record and the document's other rows get one
  `document_incomplete` record, since late-chunking the rest without it would give vectors
  for a document the input does not hold. A row whose document field cannot be read belongs
  to no document: it ends the document before it;
- a chunk that owns no token (host/late_chunking.py) refuses its document the same way, with
  `invalid_request`, as `late_chunk` refuses the request.
A document's error record: `line`/`id` of its first row (`document_incomplete`: of its first
good row), `doc`, `last_line`, `rows` (the rows it stands for), `error`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batch.rows import Row
from common.errors import InvalidRequest
from host.admission import Budgets
from host.late_chunking import chunk_bounds, pick_windows
from host.sanitize import sanitize
from host.tokenization import Tokenizer

DOCUMENT_TOO_LONG = "document_too_long"
DOCUMENT_INCOMPLETE = "document_incomplete"


@dataclass
class Document:
    rows: list[Row]  # its chunks, in order
    seqs: list[np.ndarray]  # the forward windows' ids (with the template's specials)
    span: list[tuple[int, int, int]]  # per window: first bare token, end, offset in its ids
    owner: np.ndarray  # per bare token, the window its state comes from
    chunk_of: np.ndarray  # per bare token, its chunk (-1: the prompt's)
    counts: np.ndarray  # tokens per chunk

    @property
    def tokens_read(self) -> int:
        return sum(len(s) for s in self.seqs)


def document_record(rows_first: Row, doc: str, last_line: int, n_rows: int, code: str, msg: str):
    return {
        "line": rows_first.line,
        "id": rows_first.id,
        "doc": doc,
        "last_line": last_line,
        "rows": n_rows,
        "error": {"code": code, "message": msg},
    }


def plan_document(rows: list[Row], tokenizer: Tokenizer, prompt: str) -> Document:
    """The document's windows and token -> chunk map, as `Module.late_chunk` cuts them.
    Raises InvalidRequest naming a chunk that owns no token."""
    clean = [sanitize(r.text or "") for r in rows]
    head = sanitize(prompt)
    window = tokenizer.max_tokens - tokenizer.n_special_single
    offsets, windows = tokenizer.document_windows("".join(clean), head, window, max(1, window // 2))
    picked = pick_windows(len(offsets), windows)
    starts = np.array([o[0] if o is not None else -1 for o in offsets], np.int64)
    chunk_of = np.full(len(offsets), -1, np.int64)
    counts = np.zeros(len(rows), np.int64)
    for i, (a, b) in enumerate(chunk_bounds(clean, len(head))):
        mine = (starts >= a) & (starts < b)
        counts[i] = int(mine.sum())
        if counts[i] == 0:
            raise InvalidRequest(
                f"chunk {i} (line {rows[i].line}) owns no token (empty, or inside a token that "
                "starts in the chunk before it): late chunking has nothing to pool for it",
                param="input",
                index=i,
            )
        chunk_of[mine] = i
    return Document(rows, picked.ids, picked.span, picked.owner, chunk_of, counts)


class Pool:
    """A document's chunk vectors, summed window by window as the states come back."""

    def __init__(self, doc: Document, dims: int) -> None:
        self.doc = doc
        self.sums = np.zeros((len(doc.rows), dims), np.float64)
        self.left = len(doc.seqs)
        self.failed: str | None = None  # an engine crash on one of its windows

    def add(self, w: int, states: np.ndarray) -> None:
        a, b, first = self.doc.span[w]
        mine = np.nonzero(self.doc.owner[a:b] == w)[0]
        chunks = self.doc.chunk_of[a + mine]
        keep = chunks >= 0
        # Unbuffered adds: a chunk's tokens in token order within a window. Windows may come
        # back in any order, so a chunk spread over two windows may sum in another order than
        # late_chunk's mean: float64 sums, equal once rounded to float32 (within an ulp).
        np.add.at(self.sums, chunks[keep], states[first + mine[keep]].astype(np.float64))
        self.left -= 1

    def vectors(self, normalize: bool) -> np.ndarray:
        out = (self.sums / self.doc.counts[:, None]).astype(np.float32)
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out


def over_bounds(n_rows: int, n_bytes: int, row_bytes: int, budgets: Budgets) -> str | None:
    """Why a document's rows so far (`row_bytes`: its latest row's) exceed a bound, else None."""
    if row_bytes > budgets.max_input_bytes:
        return f"a chunk of {row_bytes} bytes, more than {budgets.max_input_bytes}"
    if n_rows > budgets.max_inputs:
        return f"more than {budgets.max_inputs} chunks"
    if n_bytes > budgets.max_request_bytes:
        return f"more than {budgets.max_request_bytes} bytes of text"
    return None
