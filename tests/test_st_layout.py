"""formats/st_layout.py: both sentence-transformers layouts read the same, on files written
the way each version writes them (legacy <= 5, native 6), and bad files are typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from formats.st_layout import LayoutError, module_kind, pooling_modes, read_layout

LEGACY = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]
NATIVE = [
    {
        "idx": 0,
        "name": "0",
        "path": "",
        "type": "sentence_transformers.base.modules.transformer.Transformer",
    },
    {
        "idx": 1,
        "name": "1",
        "path": "1_Pooling",
        "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    },
    {
        "idx": 2,
        "name": "2",
        "path": "2_Dense",
        "type": "sentence_transformers.base.modules.dense.Dense",
    },
    {
        "idx": 3,
        "name": "3",
        "path": "3_Normalize",
        "type": "sentence_transformers.base.modules.normalize.Normalize",
    },
]


def write(d: Path, files: dict[str, object]) -> Path:
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(data))
    return d


def test_the_legacy_layout(tmp_path):
    d = write(
        tmp_path,
        {
            "modules.json": LEGACY,
            "1_Pooling/config.json": {
                "word_embedding_dimension": 384,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_cls_token": False,
            },
            "sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": False},
            "tokenizer_config.json": {"model_max_length": 512},
        },
    )
    layout = read_layout(d)
    assert layout.pooling == "mean" and layout.normalize and not layout.native
    assert layout.max_seq_length == 256  # sentence_bert_config, not the tokenizer's 512
    assert layout.prompts == {} and layout.default_prompt_name is None


def test_the_native_layout_of_sentence_transformers_6(tmp_path):
    d = write(
        tmp_path,
        {
            "modules.json": NATIVE,
            "1_Pooling/config.json": {
                "embedding_dimension": 1024,
                "pooling_mode": "lasttoken",
                "include_prompt": True,
            },
            "sentence_bert_config.json": {
                "transformer_task": "feature-extraction",
                "modality_config": {"text": {}},
            },
            "tokenizer_config.json": {"model_max_length": 8192},
            "config_sentence_transformers.json": {
                "prompts": {"query": "Instruct: search\nQuery: ", "document": ""},
                "default_prompt_name": None,
                "model_type": "SentenceTransformer",
            },
        },
    )
    layout = read_layout(d)
    assert layout.native and layout.pooling == "lasttoken" and layout.normalize
    assert layout.max_seq_length == 8192  # version 6 keeps the limit in the tokenizer
    assert layout.dense_dirs == (d / "2_Dense",)
    assert layout.prompts["query"].startswith("Instruct:")


def test_pooling_modes_of_either_spelling():
    assert pooling_modes({"pooling_mode": "cls"}) == ("cls",)
    assert pooling_modes({"pooling_mode": ["cls", "mean"]}) == ("cls", "mean")
    assert pooling_modes({"pooling_mode_lasttoken": True}) == ("lasttoken",)
    assert pooling_modes({"pooling_mode_cls_token": False}) == ("mean",)  # ST's default
    assert pooling_modes({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}) == (
        "cls",
        "mean",
    )  # ST's concatenation order
    assert (
        module_kind("sentence_transformers.sentence_transformer.modules.pooling.Pooling")
        == module_kind("sentence_transformers.models.Pooling")
        == "Pooling"
    )


def test_a_plain_hugging_face_directory_declares_nothing(tmp_path):
    layout = read_layout(write(tmp_path, {"config.json": {"model_type": "bert"}}))
    assert layout.pooling is None and not layout.normalize and layout.max_seq_length is None


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"modules.json": {"not": "a list"}}, "expected a list"),
        ({"modules.json": [{"path": ""}]}, "without a type"),
        (
            {"modules.json": LEGACY, "1_Pooling/config.json": {"pooling_mode": "sum"}},
            "unknown pooling mode 'sum'",
        ),
        (
            {"modules.json": LEGACY, "1_Pooling/config.json": {"pooling_mode": 3}},
            "expected a mode name",
        ),
        ({"sentence_bert_config.json": {"max_seq_length": -1}}, "not a positive integer"),
        ({"config_sentence_transformers.json": {"prompts": {"q": 1}}}, "map names to text"),
        (
            {
                "config_sentence_transformers.json": {
                    "prompts": {"q": "x"},
                    "default_prompt_name": "d",
                }
            },
            "not one of",
        ),
    ],
)
def test_bad_files_are_layout_errors(tmp_path, files, match):
    with pytest.raises(LayoutError, match=match):
        read_layout(write(tmp_path, files))


def test_concatenated_modes_are_refused_by_name(tmp_path):
    d = write(
        tmp_path,
        {"modules.json": LEGACY, "1_Pooling/config.json": {"pooling_mode": ["cls", "mean"]}},
    )
    with pytest.raises(LayoutError, match="concatenated"):
        _ = read_layout(d).pooling


def test_the_unlimited_tokenizer_sentinel_is_no_limit(tmp_path):
    d = write(
        tmp_path, {"modules.json": NATIVE, "tokenizer_config.json": {"model_max_length": 1e30}}
    )
    assert read_layout(d).max_seq_length is None
