"""batch.rows: every format, every row rule, resuming mid-file; real files, no model."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from batch.errors import BatchUsageError
from batch.rows import InputSpec, count_records, read_rows
from batch.windows import plan_batches


def rows_of(path, **kw):
    return list(read_rows(InputSpec(str(path), **kw)))


def test_jsonl_rows_and_every_bad_row_rule(tmp_path):
    lines = [
        json.dumps({"id": "a", "text": "hello"}),
        json.dumps({"text": "no id: the line number is the id"}),
        "not json {",
        "[1, 2]",
        json.dumps({"id": "m"}),
        json.dumps({"id": "n", "text": None}),
        json.dumps({"id": "s", "text": 42}),
        json.dumps({"id": "e", "text": "   "}),
        json.dumps({"id": {"x": 1}, "text": "bad id"}),
        "",  # a blank line is not a record, but it is a line
        '{"id": "\\ud800", "text": "a lone surrogate cannot be written out as an id"}',
        json.dumps({"id": 7, "text": "integer id"}),
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = rows_of(path)
    got = [(r.line, r.id, r.error_code) for r in rows]
    assert got == [
        (1, "a", None),
        (2, "2", None),
        (3, "3", "invalid_json"),
        (4, "4", "invalid_json"),
        (5, "m", "missing_field"),
        (6, "n", "missing_field"),
        (7, "s", "not_a_string"),
        (8, "e", "empty_text"),
        (9, None, "invalid_id"),
        (11, None, "invalid_id"),
        (12, "7", None),
    ]
    assert rows[0].text == "hello" and "is a JSON list" in rows[3].error_message
    assert [r.line for r in read_rows(InputSpec(str(path)), start_line=6)][0] == 6
    assert count_records(InputSpec(str(path))) == 12


def test_custom_fields_and_invalid_utf8(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"key": "k1", "body": "caf\xc3 ok"}\n')
    [row] = rows_of(path, text_field="body", id_field="key")
    assert row.ok and row.id == "k1" and "\ufffd" in row.text


def test_txt_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(b"first\r\n\nthird")
    rows = rows_of(path)
    assert [(r.line, r.id, r.text, r.error_code) for r in rows] == [
        (1, "1", "first", None),
        (2, "2", None, "empty_text"),
        (3, "3", "third", None),
    ]
    assert count_records(InputSpec(str(path))) == 3


def test_parquet_and_csv_columns_by_name(tmp_path):
    table = pa.table(
        {"doc": ["x1", "x2", None, "x4"], "text": ["a", "", "c", None], "n": [1, 2, 3, 4]}
    )
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=2)
    rows = rows_of(tmp_path / "c.parquet", id_field="doc")
    assert [(r.line, r.id, r.error_code) for r in rows] == [
        (1, "x1", None),
        (2, "x2", "empty_text"),
        (3, "3", None),
        (4, "x4", "missing_field"),
    ]
    assert [r.line for r in read_rows(InputSpec(str(tmp_path / "c.parquet")), 3)] == [3, 4]
    pcsv.write_csv(table, tmp_path / "c.csv")
    rows = rows_of(tmp_path / "c.csv", id_field="n")
    assert [(r.id, r.text) for r in rows[:1]] == [("1", "a")]
    assert count_records(InputSpec(str(tmp_path / "c.csv"))) == 4


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("c.xml", b"<x/>", "unknown rows format"),
        ("c.parquet", b"this is not parquet", "not a readable parquet file"),
        ("nope.jsonl", None, "does not exist"),
    ],
)
def test_file_level_problems_are_usage_errors(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(BatchUsageError, match=match):
        InputSpec(str(path)).check()


def test_missing_or_mistyped_text_column_is_a_usage_error(tmp_path):
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "a.parquet")
    with pytest.raises(BatchUsageError, match="no column 'text'.*--text-field"):
        InputSpec(str(tmp_path / "a.parquet")).check()
    pq.write_table(pa.table({"text": [1]}), tmp_path / "b.parquet")
    with pytest.raises(BatchUsageError, match="is int64, expected string"):
        InputSpec(str(tmp_path / "b.parquet")).check()
    (tmp_path / "c.csv").write_text("body\nx\n")
    with pytest.raises(BatchUsageError, match="no column 'text'"):
        InputSpec(str(tmp_path / "c.csv")).check()


def test_plan_batches_groups_by_length_within_budgets():
    lengths = [5, 300, 7, 250, 6, 260, 600]
    batches = plan_batches(lengths, max_tokens=512, max_items=2)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [6]  # over the budget alone: a batch of its own
    for b in batches:
        assert len(b) <= 2 and (len(b) == 1 or sum(lengths[i] for i in b) <= 512)
    assert [lengths[b[0]] for b in batches] == sorted(
        (lengths[b[0]] for b in batches), reverse=True
    )


def test_an_invalid_utf8_byte_in_one_csv_row_follows_the_sanitization_rule(tmp_path):
    # One bad byte deep in the file: Arrow's string reading failed the whole block (and the
    # job, mid-way, with exit 2); now it is U+FFFD like in JSONL, and every row is read.
    lines = [b"id,text"] + [b"r%d,row number %d" % (i, i) for i in range(1, 10_001)]
    lines[7_000] = b"r7000,caf\xc3 bad byte"
    (tmp_path / "c.csv").write_bytes(b"\n".join(lines) + b"\n")
    rows = rows_of(tmp_path / "c.csv")
    assert len(rows) == 10_000 and all(r.ok for r in rows)
    assert rows[6_999].id == "r7000" and "\ufffd" in rows[6_999].text


def test_a_csv_row_with_the_wrong_number_of_fields_is_one_error_record(tmp_path):
    # Arrow's reader failed the whole file here; now the row is an error and the rest is read,
    # numbered as if nothing had happened (blank lines are not rows; a quoted field may hold a
    # newline; a byte-order mark is not part of the first column's name).
    path = tmp_path / "c.csv"
    path.write_bytes(
        b"\xef\xbb\xbfid,text\n"
        b"a,first\n"
        b"b,second,extra\n"
        b"\n"
        b'c,"third, with a comma\nand a newline"\n'
        b"d\n"
        b"e,fifth\n"
    )
    rows = rows_of(path)
    assert [(r.line, r.id, r.error_code) for r in rows] == [
        (1, "a", None),
        (2, None, "malformed_row"),
        (3, "c", None),
        (4, None, "malformed_row"),
        (5, "e", None),
    ]
    assert rows[1].error_message == "row 2 has 3 fields, the header 2"
    assert rows[2].text == "third, with a comma\nand a newline"
    assert [r.line for r in read_rows(InputSpec(str(path)), 3)] == [3, 4, 5]  # resuming


def test_csv_columns_other_than_text_and_id_are_never_parsed(tmp_path):
    # A column whose values change type deep in the file failed the job mid-way under Arrow's
    # type inference ("CSV conversion error to int64"); a field past 128 KiB ended the file
    # under the reader's default cap. Neither is the text's business.
    lines = ["n,id,text"] + [f"{i},r{i},row {i}" for i in range(1, 100_001)]  # over 1 MiB
    lines += ["abc,late,a late row", "1,big," + "word " * 300_000]
    (tmp_path / "c.csv").write_text("\n".join(lines) + "\n")
    rows = rows_of(tmp_path / "c.csv")
    assert len(rows) == 100_002 and all(r.ok for r in rows)
    assert rows[-2].id == "late" and len(rows[-1].text) == 1_500_000


def test_an_empty_csv_file_is_a_usage_error(tmp_path):
    (tmp_path / "c.csv").write_bytes(b"")
    with pytest.raises(BatchUsageError, match="not a readable csv file: no header row"):
        InputSpec(str(tmp_path / "c.csv")).check()


def test_csv_count_is_the_readers_record_count_not_its_lines(tmp_path):
    # Quoted fields spanning lines, an escaped quote, a literal quote in an unquoted field
    # and blank lines: the ETA's count is what the job will read, not the newlines.
    path = tmp_path / "m.csv"
    path.write_bytes(
        b'id,text\r\n1,"first line\nsecond line"\r\n\r\n2,"say ""hi""\n\nbye"\r\n'
        b'3,5" tall\r\n4,"last\nfield without newline"'
    )
    rows = rows_of(path)
    assert [(r.id, r.error_code) for r in rows] == [
        ("1", None),
        ("2", None),
        ("3", None),
        ("4", None),
    ]
    assert rows[1].text == 'say "hi"\n\nbye' and rows[2].text == '5" tall'
    assert count_records(InputSpec(str(path))) == len(rows) == 4
    path.write_bytes(b"id,text\n")
    assert count_records(InputSpec(str(path))) == 0


def test_the_document_field_in_every_format(tmp_path):
    """--doc-field: a string or an integer (as its string); missing or another type is a row
    error; a row bad for its text still carries its document; a table without the column is
    a usage error."""
    lines = [
        {"id": "a", "text": "one", "doc": "d1"},
        {"id": "b", "text": "two", "doc": 7},
        {"id": "c", "text": "three"},
        {"id": "d", "text": "four", "doc": True},
        {"id": "e", "text": "", "doc": "d1"},
    ]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = rows_of(tmp_path / "r.jsonl", doc_field="doc")
    assert [(r.doc, r.error_code) for r in got] == [
        ("d1", None),
        ("7", None),
        (None, "missing_field"),
        (None, "invalid_doc"),
        ("d1", "empty_text"),
    ]
    table = pa.table({"text": ["x", "y"], "doc": [3, 4]})
    pq.write_table(table, tmp_path / "r.parquet")
    pcsv.write_csv(table, tmp_path / "r.csv")
    for name in ("r.parquet", "r.csv"):
        assert [r.doc for r in rows_of(tmp_path / name, doc_field="doc")] == ["3", "4"]
        with pytest.raises(BatchUsageError, match="--doc-field"):
            InputSpec(str(tmp_path / name), doc_field="chapter").check()
