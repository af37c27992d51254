"""The one reader of a Hugging Face config.json (formats/hf_config.py): typed errors naming the
file and key, the defaults transformers computes with (checked against the installed
transformers, key by key), and the converter and the owned Core ML manifest taking the same
value for the same key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from certification.reference.bert import BertConfig as ReferenceBertConfig
from certification.reference.cross_encoder import build_test_cross_encoder
from common.errors import ArtifactInvalid
from formats.hf_config import (
    DEFAULT_NUM_LABELS,
    TRANSFORMERS_DEFAULTS,
    HfConfig,
    HfConfigInvalid,
)
from formats.owned.manifest import build_body
from formats.owned.model import ManifestError
from host.tokenization import model_limits
from ingest.bert_to_gguf import convert_bert_dir
from ingest.model_packages import minilm_dir


def _transformers():
    import transformers  # here, not at the top: every test process collects this module

    return transformers


def _dir(tmp_path: Path, text: str | bytes) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    path = d / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return d


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "missing config.json in"),
        ("{not json", "not JSON"),
        (b"\xff\xfe{}", "unreadable"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"model_type": 3}', "model_type 3 is not a string"),
    ],
)
def test_an_unusable_file_is_a_typed_error_naming_it(tmp_path, content, says):
    d = tmp_path / "m"
    d.mkdir()
    if content is not None:
        _dir(tmp_path, content)
    with pytest.raises(HfConfigInvalid, match=says) as e:
        HfConfig.read(d)
    assert isinstance(e.value, ArtifactInvalid) and e.value.code == "artifact_invalid"
    assert str(d) in e.value.message


def test_a_missing_file_may_read_as_empty_where_the_caller_says_so(tmp_path):
    cfg = HfConfig.read(tmp_path, missing_ok=True)
    assert cfg.model_type == "bert" and cfg.positive_int("max_position_embeddings") == 512
    with pytest.raises(HfConfigInvalid, match="hidden_size missing"):
        cfg.positive_int("hidden_size")


@pytest.mark.parametrize(
    ("data", "call", "says"),
    [
        ({"hidden_size": "384"}, lambda c: c.positive_int("hidden_size"), "hidden_size '384'"),
        ({"hidden_size": True}, lambda c: c.positive_int("hidden_size"), "hidden_size True"),
        ({"hidden_size": 0}, lambda c: c.positive_int("hidden_size"), "positive integer"),
        ({"layer_norm_eps": "1e-12"}, lambda c: c.number("layer_norm_eps"), "layer_norm_eps"),
        ({"layer_norm_eps": -1.0}, lambda c: c.number("layer_norm_eps"), "positive number"),
        ({"hidden_act": 7}, lambda c: c.string("hidden_act"), "hidden_act 7 is not a string"),
        ({"attention_bias": "yes"}, lambda c: c.flag("attention_bias"), "true or false"),
        ({"architectures": "BertModel"}, lambda c: c.architectures, "list of class names"),
        ({"architectures": ["A", "B"]}, lambda c: c.architecture("A"), "one architecture"),
        ({"id2label": {"x": "a"}}, lambda c: c.labels(), "id2label"),
        ({"id2label": {"1": "a"}}, lambda c: c.labels(), "numbered 0..n-1"),
        ({"rope_scaling": [1]}, lambda c: c.rope(), "rope_scaling"),
    ],
)
def test_a_key_of_the_wrong_type_is_a_typed_error_naming_file_and_key(tmp_path, data, call, says):
    cfg = HfConfig.read(_dir(tmp_path, json.dumps(data)))
    with pytest.raises(HfConfigInvalid, match=says) as e:
        call(cfg)
    assert str(tmp_path / "m" / "config.json") in e.value.message


def test_null_reads_as_absent_and_a_written_value_wins():
    cfg = HfConfig({"model_type": "xlm-roberta", "pad_token_id": None, "type_vocab_size": 1})
    assert cfg.value("pad_token_id") == 1 and cfg.positive_int("type_vocab_size") == 1
    assert HfConfig({}).value("pad_token_id") == 0  # BERT's
    assert HfConfig({"model_type": "qwen3", "num_attention_heads": 4}).kv_heads() == 32
    nulls = {
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "hidden_size": 64,
        "num_key_value_heads": None,
        "head_dim": None,
    }
    assert (HfConfig(nulls).kv_heads(), HfConfig(nulls).head_dim()) == (4, 16)


# transformers 5 dropped these attributes from its config classes (it reads them into
# rope_parameters or keeps them private); where it still computes with them, `_theirs` says.
_NOT_ATTRIBUTES = {
    ("gemma3_text", "sliding_window_pattern"),
    ("modernbert", "global_attn_every_n_layers"),
    ("modernbert", "global_rope_theta"),
    ("modernbert", "local_rope_theta"),
}
_CLASSES = {
    "bert": "BertConfig",
    "roberta": "RobertaConfig",
    "xlm-roberta": "XLMRobertaConfig",
    "camembert": "CamembertConfig",
    "qwen3": "Qwen3Config",
    "gemma3_text": "Gemma3TextConfig",
    "modernbert": "ModernBertConfig",
    "nomic_bert": "NomicBertConfig",
}


def _theirs(model_type: str, key: str):
    config = getattr(_transformers(), _CLASSES[model_type]).from_dict({})
    if model_type in ("qwen3", "nomic_bert") and key == "rope_theta":
        return config.rope_parameters["rope_theta"]
    if model_type == "modernbert" and key in ("global_rope_theta", "local_rope_theta"):
        kind = "full_attention" if key == "global_rope_theta" else "sliding_attention"
        return config.rope_parameters[kind]["rope_theta"]
    if (model_type, key) in _NOT_ATTRIBUTES:
        assert not hasattr(config, key), f"{key} is an attribute again: compare it"
        return None
    if key == "position_embedding_type":  # transformers 5 computes absolute positions only
        return getattr(config, key, None) or "absolute"
    return getattr(config, key)


@pytest.mark.parametrize(
    ("model_type", "key"),
    [(t, k) for t, table in sorted(TRANSFORMERS_DEFAULTS.items()) for k in sorted(table)],
)
def test_every_default_is_the_one_transformers_computes_with(model_type, key):
    ours = HfConfig({"model_type": model_type}).value(key)
    theirs = _theirs(model_type, key)
    if theirs is not None:
        assert ours == theirs and type(ours) is type(theirs), (ours, theirs)


def test_labels_are_read_as_transformers_reads_them():
    def theirs(data: dict) -> int:
        return _transformers().BertConfig.from_dict(data).num_labels

    for data in (
        {},
        {"num_labels": 3},
        {"id2label": {"0": "a"}},
        {"id2label": {"0": "a"}, "num_labels": 3},
        {"id2label": {"0": "a", "1": "b"}, "num_labels": 2},
    ):
        assert HfConfig(data).labels() == list(
            _transformers().BertConfig.from_dict(data).id2label.values()
        ), data
        assert len(HfConfig(data).labels()) == theirs(data), data
    assert HfConfig({}).labels() == ["LABEL_0", "LABEL_1"] and DEFAULT_NUM_LABELS == 2
    assert HfConfig({"id2label": {"1": "b", "0": "a"}}).labels() == ["a", "b"]


def _minilm_without(tmp_path: Path, *keys: str) -> Path:
    d = tmp_path / "minilm"
    shutil.copytree(minilm_dir(), d)
    cfg = json.loads((d / "config.json").read_text())
    for key in keys:
        cfg.pop(key)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_every_reader_takes_transformers_position_count_when_config_omits_it(tmp_path):
    # The GGUF converter used to refuse this config while the Core ML manifest, the reference
    # and the host's limits took 512: now all four take transformers' 512.
    d = _minilm_without(tmp_path, "max_position_embeddings")
    assert _transformers().BertConfig.from_dict({}).max_position_embeddings == 512
    assert convert_bert_dir(d, tmp_path / "m.gguf", "f32").n_ctx_train == 512
    assert build_body(d)[0].config.max_positions == 512
    assert ReferenceBertConfig.from_hf(HfConfig.read(d)).max_positions == 512
    assert model_limits(d)[0] == 512


def test_the_converter_and_the_manifest_count_a_cross_encoders_labels_alike(tmp_path):
    # A num_labels that disagrees with id2label wins, as in transformers: the GGUF converter
    # used to count id2label (1 here) where the manifest and the reference took num_labels.
    # The checkpoint has one classifier row, so every reader now refuses the config alike.
    d = build_test_cross_encoder(tmp_path / "xenc")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_labels": 2}))
    assert _transformers().BertConfig.from_dict(cfg | {"num_labels": 2}).num_labels == 2
    assert len(HfConfig.read(d).labels()) == 2
    with pytest.raises(ArtifactInvalid, match="shape"):
        convert_bert_dir(d, tmp_path / "x.gguf", "f32")
    with pytest.raises(ManifestError, match="classifier.weight: shape"):
        build_body(d)
    assert ReferenceBertConfig.from_hf(HfConfig.read(d)).num_labels == 2
    (d / "config.json").write_text(json.dumps(cfg | {"num_labels": 1}))
    assert convert_bert_dir(d, tmp_path / "x.gguf", "f32").n_labels == 1
    assert build_body(d)[0].head.num_labels == 1
