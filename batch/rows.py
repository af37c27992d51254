"""Reading a corpus as a stream of rows, whatever its format; never the whole file at once.

Formats (by the file's extension; `-` is JSONL on stdin):
- `.jsonl` / `.ndjson`: one JSON object a line; the text in `text_field`, the id in
  `id_field`, else the line number. Blank lines are not records (they still count as lines).
- `.txt`: one text a line; the id is the line number.
- `.parquet`, `.csv`: columns by name; the "line" is the 1-based row number (CSV: after the
  header; blank lines are not rows). A missing text column is a usage error for the whole
  file. CSV is read with the standard library's reader, row by row: quoted fields may span
  lines, a UTF-8 byte-order mark is dropped, and columns other than text and id are never
  parsed, so nothing in them can fail the file.

Row rules (a bad row is an error record, never the end of the job):
- `invalid_json`: the line is not a JSON object;
- `missing_field`: the text field is absent or null;
- `not_a_string`: the text is not a string;
- `empty_text`: the text is empty or only whitespace;
- `invalid_id`: the id is neither a string nor an integer, or a string that is not valid
  Unicode (a lone surrogate from a JSON `\\ud800` escape: it could not be written out);
- `malformed_row`: a CSV row whose number of fields is not the header's (its fields cannot
  be told apart, so neither its text nor its id is read).
Invalid UTF-8 bytes in a text or an id (any format) become U+FFFD, the project's one
sanitization rule (host/sanitize.py), so one bad byte never fails a file.
Ids are always strings in the output (an integer id 7 becomes "7"), so one column type holds
every input.

With a document field (`--late-chunking --doc-field F`) every row also carries its document:
the value of F, a string or an integer (compared as its string), else `missing_field` /
`invalid_doc`. A Parquet or CSV input without column F is a usage error for the whole file.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from batch.errors import BatchUsageError
from host.sanitize import is_utf8_encodable

FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "txt",
    ".parquet": "parquet",
    ".csv": "csv",
}
_ARROW_BATCH = 4096  # rows per Parquet read batch: bounded memory


@dataclass(frozen=True, slots=True)
class Row:
    line: int  # 1-based position in the input (line, or row for Parquet/CSV)
    id: str | None  # None only on error rows whose id could not be read
    text: str | None  # None on error rows
    error_code: str | None = None
    error_message: str | None = None
    doc: str | None = None  # the row's document (a document field was named), else None

    @property
    def ok(self) -> bool:
        return self.error_code is None


@dataclass(frozen=True)
class InputSpec:
    path: str  # "-" for stdin
    text_field: str = "text"
    id_field: str = "id"
    doc_field: str | None = None  # late chunking: the field naming each row's document

    @property
    def format(self) -> str:
        if self.path == "-":
            return "jsonl"
        fmt = FORMATS.get(Path(self.path).suffix.lower())
        if fmt is None:
            raise BatchUsageError(
                f"{self.path}: unknown rows format {Path(self.path).suffix or '(no extension)'!r};"
                f" expected one of {', '.join(sorted(FORMATS))} or '-' for JSONL on stdin"
            )
        return fmt

    def check(self) -> None:
        """Fail before any work: a missing file or an unknown format is a usage error."""
        fmt = self.format
        if self.path == "-":
            return
        p = Path(self.path)
        if not p.exists():
            raise BatchUsageError(f"input {self.path} does not exist")
        if not p.is_file():
            raise BatchUsageError(f"input {self.path} is not a file")
        try:
            with open(p, "rb"):
                pass
        except OSError as exc:
            raise BatchUsageError(f"cannot read input {self.path}: {exc.strerror}") from None
        if fmt in ("parquet", "csv"):
            next(iter(read_rows(self, start_line=1, limit_lines=0)), None)  # schema check

    def identity(self) -> dict:
        """What a checkpoint remembers of the input, to refuse resuming on a changed one."""
        if self.path == "-":
            return {"path": "-"}
        st = Path(self.path).stat()
        return {
            "path": str(Path(self.path).resolve()),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
        }


def read_rows(
    spec: InputSpec, start_line: int = 1, limit_lines: int | None = None
) -> Iterator[Row]:
    """Rows with `line >= start_line`, in input order. `limit_lines=0` only opens the file
    (and checks its schema)."""
    fmt = spec.format
    if fmt in ("jsonl", "txt"):
        if spec.path == "-":
            yield from _lines(sys.stdin.buffer, spec, fmt, start_line, limit_lines)
            return
        with open(spec.path, "rb") as f:
            yield from _lines(f, spec, fmt, start_line, limit_lines)
        return
    if fmt == "csv":
        yield from _csv_rows(spec, start_line, limit_lines)
        return
    yield from _parquet_rows(spec, start_line, limit_lines)


def _lines(
    f: BinaryIO, spec: InputSpec, fmt: str, start_line: int, limit: int | None
) -> Iterator[Row]:
    if limit == 0:
        return
    for line_no, raw in enumerate(f, 1):
        if line_no < start_line:
            continue  # resuming: these were committed already
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if fmt == "txt":
            yield _check_text(line_no, str(line_no), text)
        elif text.strip():
            row = parse_json_line(line_no, text, spec.text_field, spec.id_field)
            if spec.doc_field is not None and row.error_code != "invalid_json":
                obj = json.loads(text)  # parsed once more only for a document field
                row = with_doc(row, obj.get(spec.doc_field, _MISSING), spec.doc_field)
            yield row


def parse_json_line(line: int, text: str, text_field: str, id_field: str) -> Row:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return Row(line, str(line), None, "invalid_json", f"line {line} is not JSON: {exc}")
    if not isinstance(obj, dict):
        return Row(
            line,
            str(line),
            None,
            "invalid_json",
            f"line {line} is a JSON {type(obj).__name__}, expected an object",
        )
    return _row_from(
        line, obj.get(text_field, _MISSING), obj.get(id_field, _MISSING), text_field, id_field
    )


def with_doc(row: Row, value: object, doc_field: str | None) -> Row:
    """`row` with its document (rows.py's document rule). An already bad row stays bad, and
    carries its document when the field reads (it belongs to that document)."""
    if doc_field is None:
        return row
    if not row.ok:
        if isinstance(value, str | int) and not isinstance(value, bool):
            return Row(row.line, row.id, None, row.error_code, row.error_message, str(value))
        return row
    if value is _MISSING or value is None:
        return Row(row.line, row.id, None, "missing_field", f"no {doc_field!r} field")
    if isinstance(value, bool) or not isinstance(value, str | int):
        return Row(
            row.line,
            row.id,
            None,
            "invalid_doc",
            f"{doc_field!r} is {type(value).__name__}; documents are strings or integers",
        )
    return Row(row.line, row.id, row.text, doc=str(value))


_MISSING = object()


def _row_from(line: int, text: object, rid: object, text_field: str, id_field: str) -> Row:
    if rid is _MISSING or rid is None:
        row_id = str(line)
    elif isinstance(rid, bool) or not isinstance(rid, str | int):
        return Row(
            line,
            None,
            None,
            "invalid_id",
            f"{id_field!r} is {type(rid).__name__}; ids are strings or integers",
        )
    else:
        row_id = str(rid)
        if not is_utf8_encodable(row_id):
            return Row(
                line,
                None,
                None,
                "invalid_id",
                f"{id_field!r} is not valid Unicode (it holds a lone surrogate)",
            )
    if text is _MISSING or text is None:
        return Row(line, row_id, None, "missing_field", f"no {text_field!r} field")
    if not isinstance(text, str):
        return Row(
            line,
            row_id,
            None,
            "not_a_string",
            f"{text_field!r} is {type(text).__name__}, expected a string",
        )
    return _check_text(line, row_id, text)


def _check_text(line: int, row_id: str, text: str) -> Row:
    if not text.strip():
        return Row(line, row_id, None, "empty_text", "the text is empty")
    return Row(line, row_id, text)


def _csv_rows(spec: InputSpec, start_line: int, limit: int | None) -> Iterator[Row]:
    try:
        f = _open_csv(spec.path)
    except OSError as exc:
        raise BatchUsageError(f"{spec.path}: not a readable csv file: {exc.strerror}") from None
    with f:
        reader = csv.reader(f)
        line = 0
        try:
            header = next(reader, None)
            if header is None:
                raise BatchUsageError(f"{spec.path}: not a readable csv file: no header row")
            _require_column(spec, header)
            if limit == 0:
                return
            text_at = header.index(spec.text_field)
            id_at = header.index(spec.id_field) if spec.id_field in header else None
            doc_at = header.index(spec.doc_field) if spec.doc_field is not None else None
            for fields in reader:
                if not fields:
                    continue  # a blank line is not a row
                line += 1
                if line < start_line:
                    continue  # resuming: committed already
                if len(fields) != len(header):
                    yield Row(
                        line,
                        None,
                        None,
                        "malformed_row",
                        f"row {line} has {len(fields)} fields, the header {len(header)}",
                    )
                    continue
                rid = fields[id_at] if id_at is not None else _MISSING
                row = _row_from(line, fields[text_at], rid, spec.text_field, spec.id_field)
                doc = fields[doc_at] if doc_at is not None else None
                yield with_doc(row, doc, spec.doc_field)
        except csv.Error as exc:  # the reader is lenient: hardly anything gets here
            raise BatchUsageError(f"{spec.path}: malformed csv after row {line}: {exc}") from None


_CSV_FIELD_LIMIT = 2**31 - 1  # the largest the reader takes on every platform (a C long)


def _open_csv(path: str):
    """A CSV file opened as the job reads it (and counts it): BOM dropped, undecodable bytes
    replaced, newlines left to the reader. Any field length: an over-long text is the
    admission's to refuse, as a row error (the reader's default cap of 128 KiB would end the
    file there instead)."""
    csv.field_size_limit(_CSV_FIELD_LIMIT)
    return open(path, encoding="utf-8-sig", errors="replace", newline="")


def _parquet_rows(spec: InputSpec, start_line: int, limit: int | None) -> Iterator[Row]:
    import pyarrow as pa

    batches = _parquet_batches(spec)
    first = next(batches, None)
    if first is None or limit == 0:
        return
    line = 0
    pending: Iterator[pa.RecordBatch] = _chain(first, batches)
    for batch in pending:
        n = batch.num_rows
        if line + n < start_line:  # a whole batch already committed
            line += n
            continue
        texts = batch.column(spec.text_field).to_pylist()
        ids = (
            batch.column(spec.id_field).to_pylist()
            if spec.id_field in batch.schema.names
            else [None] * n
        )
        docs = (
            batch.column(spec.doc_field).to_pylist() if spec.doc_field is not None else [None] * n
        )
        for text, rid, doc in zip(texts, ids, docs, strict=True):
            line += 1
            if line >= start_line:
                row = _row_from(line, _utf8(text), _utf8(rid), spec.text_field, spec.id_field)
                yield with_doc(row, _utf8(doc), spec.doc_field)


def _utf8(value: object) -> object:
    """A binary Parquet column (an id may be one) decodes by the sanitization rule."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _chain(first, rest):
    yield first
    yield from rest


def _parquet_batches(spec: InputSpec):
    """Record batches with the text (and, if present, id) columns; schema errors are usage
    errors raised before the first batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(spec.path)
        names = pf.schema_arrow.names
        _require_column(spec, names)
        _require_string(spec, pf.schema_arrow.field(spec.text_field).type)
        cols = [spec.text_field] + ([spec.id_field] if spec.id_field in names else [])
        cols += [spec.doc_field] if spec.doc_field is not None else []
        batches = pf.iter_batches(batch_size=_ARROW_BATCH, columns=cols)
    except (pa.ArrowInvalid, OSError) as exc:
        raise BatchUsageError(f"{spec.path}: not a readable parquet file: {exc}") from None
    try:
        yield from batches
    except pa.ArrowInvalid as exc:  # e.g. a corrupt page
        raise BatchUsageError(f"{spec.path}: malformed parquet: {exc}") from None


def _require_column(spec: InputSpec, names: list[str]) -> None:
    if spec.text_field not in names:
        raise BatchUsageError(
            f"{spec.path}: no column {spec.text_field!r} (columns: {', '.join(names)}); "
            f"name the text column with --text-field"
        )
    if spec.doc_field is not None and spec.doc_field not in names:
        raise BatchUsageError(
            f"{spec.path}: no column {spec.doc_field!r} (columns: {', '.join(names)}); "
            f"name the document column with --doc-field"
        )


def _require_string(spec: InputSpec, typ) -> None:
    import pyarrow as pa

    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise BatchUsageError(f"{spec.path}: column {spec.text_field!r} is {typ}, expected string")


def count_records(spec: InputSpec) -> int | None:
    """How many records the input holds (for the ETA), or None when it cannot tell cheaply
    (stdin) or at all (a CSV the reader stops on: reading it says why). Parquet reads its
    footer. JSONL and text count newlines in 1 MiB reads (JSON escapes its own). CSV is counted
    by the reader the job reads it with, as the job skips blank lines: a quoted field may span
    lines, so its newlines are no count (measured ~290 MB/s, against ~2 GB/s for newlines)."""
    if spec.path == "-":
        return None
    fmt = spec.format
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(spec.path).metadata.num_rows
    if fmt == "csv":
        return _count_csv_records(spec)
    n = 0
    last = b"\n"
    with open(spec.path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    n += last != b"\n"  # a last line without its newline
    return n


def _count_csv_records(spec: InputSpec) -> int | None:
    try:
        with _open_csv(spec.path) as f:
            records = sum(1 for fields in csv.reader(f) if fields)
    except (OSError, csv.Error):
        return None
    return max(0, records - 1)  # the header is no record
