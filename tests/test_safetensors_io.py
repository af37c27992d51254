"""The one safetensors reader (formats/safetensors_io.py): what it reads (F32, F16, BF16 widened,
integers; single files and shards), and that every damaged file is a typed error naming it, on
both sides that read weights (the host's converters and the Core ML lane's artifact)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from common.errors import ArtifactInvalid
from formats.owned.manifest import WEIGHTS_NAME, build_body, load_manifest
from formats.owned.model import ManifestError
from formats.safetensors_io import (
    SafetensorsInvalid,
    read_model_weights,
    read_safetensors,
    tensor_shapes,
    weight_elements,
    weight_files,
)
from ingest.bert_to_gguf import convert_bert_dir
from ingest.model_packages import minilm_dir
from tests import test_ane_helpers as h


def _write_raw(path: Path, header: dict, data: bytes) -> Path:
    """A safetensors file spelled byte by byte: u64 header length, JSON header, data."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_what_the_library_writes_is_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.f32": rng.standard_normal((3, 4)).astype(np.float32),
        "b.f16": rng.standard_normal((5,)).astype(np.float16),
        "c.i64": np.arange(7, dtype=np.int64),
        "d.f64": rng.standard_normal((2, 2)),
        "e.u8": np.arange(4, dtype=np.uint8),
        "f.bool": np.array([True, False]),
        "g.empty": np.zeros((0, 3), np.float32),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"))
    got = read_safetensors(tmp_path / "t.safetensors")
    assert set(got) == set(tensors)
    for name, arr in tensors.items():
        assert got[name].dtype == arr.dtype and np.array_equal(got[name], arr), name
    assert tensor_shapes(tmp_path / "t.safetensors")["a.f32"] == (3, 4)


def test_bf16_is_widened_to_its_float32_value(tmp_path):
    values = np.array([1.0, -2.5, 3.140625, 65280.0], np.float32)  # exact in bf16
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    path = _write_raw(
        tmp_path / "bf16.safetensors",
        {"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}},
        bits.tobytes(),
    )
    w = read_safetensors(path)["w"]
    assert w.dtype == np.float32 and np.array_equal(w, values.reshape(2, 2))


def test_garbage_bytes_are_a_typed_error(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(np.random.default_rng(1).bytes(4096))
    with pytest.raises(SafetensorsInvalid, match="garbage.safetensors") as e:
        read_safetensors(path)
    assert isinstance(e.value, ArtifactInvalid) and e.value.code == "artifact_invalid"
    path.write_bytes(b"\xff" * 64)  # a header length no file holds
    with pytest.raises(SafetensorsInvalid, match="header length .* out of bounds"):
        read_safetensors(path)


def test_a_truncated_file_is_a_typed_error(tmp_path):
    src = minilm_dir() / "model.safetensors"
    data = src.read_bytes()
    path = tmp_path / "model.safetensors"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SafetensorsInvalid, match="data out of bounds"):
        read_safetensors(path)
    with pytest.raises(SafetensorsInvalid, match="data out of bounds"):
        weight_elements(tmp_path)  # the header alone is checked against the file's size
    path.write_bytes(data[:5])
    with pytest.raises(SafetensorsInvalid, match="too short"):
        read_safetensors(path)
    path.write_bytes(b"")
    with pytest.raises(SafetensorsInvalid, match="cannot read"):
        read_safetensors(path)


@pytest.mark.parametrize(
    ("header", "data", "says"),
    [
        (None, b"", "header is not JSON"),
        ([1, 2], b"", "header is not an object"),
        ({"w": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "bad entry"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "bad entry"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, "out of"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "negative"),
    ],
)
def test_a_damaged_header_is_a_typed_error_naming_the_file(tmp_path, header, data, says):
    path = tmp_path / "bad.safetensors"
    if header is None:
        raw = b"{not json"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    else:
        _write_raw(path, header, data)
    with pytest.raises(SafetensorsInvalid, match=says) as e:
        read_safetensors(path)
    assert str(path) in e.value.message


def test_shards_are_read_through_their_index(tmp_path):
    a, b = np.ones((2, 2), np.float32), np.arange(3, dtype=np.float32)
    save_file({"a": a}, str(tmp_path / "s1.safetensors"))
    save_file({"b": b}, str(tmp_path / "s2.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    assert weight_files(tmp_path) == [tmp_path / "s1.safetensors", tmp_path / "s2.safetensors"]
    got = read_model_weights(tmp_path)
    assert np.array_equal(got["a"], a) and np.array_equal(got["b"], b)
    assert weight_elements(tmp_path) == 7
    save_file({"a": a}, str(tmp_path / "s2.safetensors"))  # the same tensor in two shards
    with pytest.raises(SafetensorsInvalid, match="'a' is in another shard"):
        read_model_weights(tmp_path)
    index.write_text("{")
    with pytest.raises(SafetensorsInvalid, match="not JSON"):
        weight_files(tmp_path)
    index.write_text(json.dumps({"shards": []}))
    with pytest.raises(SafetensorsInvalid, match="weight_map"):
        weight_files(tmp_path)
    index.unlink()
    with pytest.raises(SafetensorsInvalid, match="no model.safetensors"):
        weight_files(tmp_path)


def _corrupt_copy(tmp_path: Path) -> Path:
    d = tmp_path / "minilm"
    shutil.copytree(minilm_dir(), d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])
    return d


def test_both_sides_refuse_the_same_corrupt_checkpoint_with_the_same_error(tmp_path):
    d = _corrupt_copy(tmp_path)
    with pytest.raises(SafetensorsInvalid, match="data out of bounds"):
        convert_bert_dir(d, tmp_path / "out.gguf")  # the host's converter
    with pytest.raises(SafetensorsInvalid, match="data out of bounds"):
        build_body(d)  # the Core ML lane's artifact build


def test_damaged_artifact_weights_are_a_manifest_error(tmp_path):
    # The worker answers a LOAD's ManifestError with its code; damaged weights are one.
    d = tmp_path / "owned"
    shutil.copytree(h.minilm().dir, d)
    data = (d / WEIGHTS_NAME).read_bytes()
    (d / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ManifestError, match="out of bounds") as e:
        load_manifest(d)
    assert e.value.code == "artifact_invalid"
