"""The owned model format: ingest, digests, and typed refusals of damaged or foreign models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from formats.owned.manifest import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    digest_of,
    ingest_owned,
    load_manifest,
)
from formats.owned.model import ManifestError, UnsupportedModel, WeightDigestMismatch
from ingest.model_packages import minilm_dir
from tests import test_ane_helpers as h

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker


def test_minilm_manifest() -> None:
    man = h.minilm()
    assert len(man.digest) == 64 and man.digest == digest_of(man.body)
    assert man.head.type == "embed_mean" and man.head.pooling == "mean"
    assert man.head.normalize is True  # modules.json has sentence-transformers' Normalize
    cfg = man.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.max_seq_length) == (384, 6, 12, 256)
    # The tensors the graph uses, nothing else (no pooler for an embedder, no position_ids).
    assert len(man.body.tensors) == 5 + 16 * cfg.num_layers
    assert not any(n.startswith("pooler") for n in man.body.tensors)
    doc = json.loads((Path(man.dir) / MANIFEST_NAME).read_text())
    assert doc["manifest_digest"] == man.digest
    assert doc["tokenizer"]["file"] == TOKENIZER_NAME


def test_ingest_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    again = ingest_owned(minilm_dir(), tmp_path / "a")
    assert again.digest == h.minilm().digest
    assert ingest_owned(minilm_dir(), tmp_path / "a").digest == again.digest  # reuse
    h.cross_encoder()  # writes the cross-encoder's HF directory
    with pytest.raises(ManifestError):  # a different artifact already there
        ingest_owned(h.ROOT / "cross-encoder-src", tmp_path / "a")


def test_cross_encoder_manifest() -> None:
    man = h.cross_encoder()
    assert man.head.type == "cross_encoder" and man.head.num_labels == 1
    assert {"pooler.dense.weight", "classifier.weight"} <= set(man.body.tensors)
    assert not any(n.startswith("bert.") for n in man.body.tensors)  # canonical names
    assert man.digest != h.minilm().digest


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(h.minilm().dir, dst)
    return dst


def test_tampered_tensor_is_named(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    weights = d / WEIGHTS_NAME
    # safetensors: u64 header length, JSON header with each tensor's byte range, then data.
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    name = "encoder.layer.3.output.dense.weight"
    start = 8 + header_len + header[name]["data_offsets"][0] + 1000
    with open(weights, "r+b") as f:
        f.seek(start)
        byte = f.read(1)
        f.seek(start)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(WeightDigestMismatch) as e:
        load_manifest(d)
    assert e.value.tensor == name and e.value.code == "artifact_invalid"
    assert load_manifest(d, verify_weights=False).digest == h.minilm().digest  # body intact


def test_tampered_manifest_and_tokenizer(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["config"]["layer_norm_eps"] = 1e-5
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="does not match its body"):
        load_manifest(d, verify_weights=False)
    d2 = tmp_path / "copy2"
    shutil.copytree(h.minilm().dir, d2)
    with open(d2 / TOKENIZER_NAME, "a") as f:
        f.write(" ")
    with pytest.raises(ManifestError, match="tokenizer"):
        load_manifest(d2, verify_weights=False)
    with pytest.raises(ManifestError):
        load_manifest(tmp_path / "nothing-here")


def _hf_variant(tmp_path: Path, **changes: object) -> Path:
    src = minilm_dir()
    d = tmp_path / "variant"
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    for name in ("model.safetensors", "tokenizer.json", "modules.json"):
        (d / name).symlink_to(src / name)
    shutil.copytree(src / "1_Pooling", d / "1_Pooling")
    return d


@pytest.mark.parametrize(
    "changes",
    [
        {"hidden_act": "relu"},
        {"type_vocab_size": 3},
        {"position_embedding_type": "relative_key"},
        {"architectures": ["BertForTokenClassification"]},
        {"model_type": "roberta"},
    ],
)
def test_models_the_builder_does_not_implement_are_refused(tmp_path: Path, changes) -> None:
    with pytest.raises(UnsupportedModel) as e:
        ingest_owned(_hf_variant(tmp_path, **changes), tmp_path / "out")
    assert e.value.code == "unsupported"
    assert not (tmp_path / "out").exists()


def test_cls_pooling_embedders_are_built_and_other_poolings_refused(tmp_path: Path) -> None:
    d = _hf_variant(tmp_path)
    pooling = d / "1_Pooling" / "config.json"
    pooling.write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    head = ingest_owned(d, tmp_path / "cls").head
    assert (head.type, head.pooling) == ("embed_cls", "cls")
    pooling.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(UnsupportedModel, match="pooling"):
        ingest_owned(d, tmp_path / "out")
    # What the graph does not compute after pooling is refused, not dropped.
    pooling.write_text(json.dumps({"pooling_mode_mean_tokens": True, "include_prompt": False}))
    with pytest.raises(UnsupportedModel, match="include_prompt"):
        ingest_owned(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_manifest_that_is_not_an_object_or_an_unreadable_tokenizer_is_typed(
    tmp_path: Path,
) -> None:
    d = _copy(tmp_path)
    (d / MANIFEST_NAME).write_text("[]")
    with pytest.raises(ManifestError, match="expected a JSON object"):  # was a TypeError
        load_manifest(d, verify_weights=False)
    d2 = tmp_path / "copy2"
    shutil.copytree(h.minilm().dir, d2)
    (d2 / TOKENIZER_NAME).unlink()
    (d2 / TOKENIZER_NAME).mkdir()  # exists, cannot be hashed: was an IsADirectoryError
    with pytest.raises(ManifestError, match="tokenizer"):
        load_manifest(d2, verify_weights=False)
