"""formats.gguf_header: the one GGUF scanner, checked against the gguf package's own reader
on the session's real artifacts, and refusing malformed files with a typed error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader

from formats.gguf_header import ArrayInfo, GGUFFormatError, read_gguf_header

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

VOCAB = "tokenizer.ggml.tokens"


@pytest.fixture(scope="module")
def minilm_gguf(store_root) -> Path:
    return Path(store_root) / "minilm-l6-v2" / "model.gguf"


def _reader_scalars(path: Path) -> dict:
    reader = GGUFReader(path)
    out = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if len(fld.types) == 1:  # scalars and strings; arrays are compared apart
            out[name] = fld.contents()
    return out, reader


def test_agrees_with_gguf_reader_on_a_real_model(minilm_gguf):
    hdr = read_gguf_header(minilm_gguf, want_arrays=frozenset({VOCAB}))
    scalars, reader = _reader_scalars(minilm_gguf)
    ours = {k: v for k, v in hdr.kv.items() if not isinstance(v, (list, ArrayInfo))}
    assert ours.keys() == scalars.keys()
    for key, value in scalars.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value
    assert hdr.kv[VOCAB] == reader.fields[VOCAB].contents()
    assert [(t.name, t.nbytes, t.offset) for t in hdr.tensors] == [
        (t.name, int(t.n_bytes), int(t.data_offset) - reader.data_offset) for t in reader.tensors
    ]
    assert hdr.data_offset == reader.data_offset


def test_skipped_arrays_report_type_and_length(minilm_gguf):
    skipped = read_gguf_header(minilm_gguf).kv[VOCAB]
    full = read_gguf_header(minilm_gguf, want_arrays=frozenset({VOCAB})).kv[VOCAB]
    assert isinstance(skipped, ArrayInfo) and skipped.length == len(full) > 1000


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b"GGUX" + b[4:], "bad magic"),
        (lambda b: b[:16], "too short"),
        (lambda b: b[:4096], "truncated"),
        (lambda b: b[: len(b) - 1024], "outside the file"),
        (lambda b: b[:4] + (99).to_bytes(4, "little") + b[8:], "unsupported GGUF version"),
    ],
    ids=["magic", "tiny", "header-cut", "data-cut", "version"],
)
def test_malformed_files_are_a_typed_error(minilm_gguf, tmp_path, mutate, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(minilm_gguf.read_bytes()))
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf_header(bad)


def test_an_intact_copy_parses(minilm_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(minilm_gguf, copy)
    assert read_gguf_header(copy).architecture == "bert"
