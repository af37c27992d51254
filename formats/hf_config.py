"""The one reader of a Hugging Face model directory's `config.json`.

Every module that needs a fact of the model's configuration (the family converters to GGUF,
the owned Core ML manifest, the certification references, the host's token limits) reads it
here, so the same key gives the same value everywhere: one parse, one error type, one table of
defaults. A key a config omits (or sets to null) takes the value transformers computes with
for that `model_type` (`TRANSFORMERS_DEFAULTS`), the reference every lane is certified
against; a key with no default there is required.

A config.json that is missing, unreadable or not a JSON object, and a key whose value has the
wrong type, are a typed `HfConfigInvalid` (code `artifact_invalid`) naming the file and key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.errors import ArtifactInvalid

CONFIG_NAME = "config.json"

# What transformers' config classes compute with when config.json omits a key, per model_type,
# for the keys our readers have a default for (tests/test_hf_config.py checks each one
# against the installed transformers). A key absent from its family's table is required.
_BERT_LIKE = {
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
}
TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": _BERT_LIKE | {"pad_token_id": 0},
    # RoBERTa's family numbers positions from pad_token_id + 1.
    "roberta": _BERT_LIKE | {"pad_token_id": 1},
    "xlm-roberta": _BERT_LIKE | {"pad_token_id": 1},
    "camembert": _BERT_LIKE | {"pad_token_id": 1},
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": 10_000.0,
    },
    "gemma3_text": {
        "head_dim": 256,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131_072,
    },
    "nomic_bert": {
        "max_position_embeddings": 2048,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "hidden_act": "silu",
        "rope_theta": 1000.0,
    },
    "modernbert": {
        "hidden_activation": "gelu",
        "norm_eps": 1e-5,
        "global_attn_every_n_layers": 3,
        "classifier_pooling": "cls",
        "classifier_activation": "gelu",
        "global_rope_theta": 160_000.0,
        "local_rope_theta": 10_000.0,
    },
}
# BERT checkpoints of old omit model_type; transformers' own fallback reads them as BERT.
DEFAULT_MODEL_TYPE = "bert"
# PretrainedConfig's label count when a config names neither id2label nor num_labels.
DEFAULT_NUM_LABELS = 2
# PretrainedConfig's allowed `problem_type` values (null: decided by the label count).
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
# The sizes every transformer's converter needs stated (or defaulted) as positive integers.
SIZE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "vocab_size",
)

_REQUIRED = object()


class HfConfigInvalid(ArtifactInvalid):
    """config.json is missing, unreadable or not a JSON object, or one of its keys holds a
    value of the wrong type; the message names the file and the key."""


class HfConfig:
    """A parsed config.json: typed accessors over its keys, defaults from the family's table."""

    def __init__(self, data: Mapping[str, Any], path: Path | str = CONFIG_NAME) -> None:
        self.path = Path(path)
        if not isinstance(data, Mapping):
            raise HfConfigInvalid(f"{self.path}: expected a JSON object, got {type(data).__name__}")
        self._data = dict(data)
        model_type = self._data.get("model_type")
        if model_type is None:
            model_type = DEFAULT_MODEL_TYPE
        if not isinstance(model_type, str):
            raise self._wrong("model_type", model_type, "a string")
        self.model_type: str = model_type

    @classmethod
    def read(cls, model_dir: str | Path, *, missing_ok: bool = False) -> HfConfig:
        """`model_dir`/config.json, parsed once. `missing_ok`: an absent file reads as an
        empty config (every key its default), for callers that work without one."""
        path = Path(model_dir) / CONFIG_NAME
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            if missing_ok:
                return cls({}, path)
            raise HfConfigInvalid(f"missing {CONFIG_NAME} in {path.parent}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise HfConfigInvalid(f"unreadable {path}: {e}") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HfConfigInvalid(f"unreadable {path}: not JSON: {e}") from e
        return cls(data, path)  # which refuses anything but an object

    # ---- raw access ---------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def get(self, key: str, default: Any = None) -> Any:
        """The key's value as written (no family default)."""
        return self._data.get(key, default)

    def as_dict(self) -> dict[str, Any]:
        """A copy of every key as written."""
        return dict(self._data)

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        """The key's value, or (absent or null) the family's default, else `default`; a
        required key that is absent is refused."""
        return self._value_or_missing(key, default, "a value")

    # ---- typed access ---------------------------------------------------------------------

    def positive_int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self._value_or_missing(key, default, "a positive integer")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self._wrong(key, value, "a positive integer")
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, positive: bool = True) -> float:
        """A real number (an int is one too); positive unless `positive=False`."""
        kind = "a positive number" if positive else "a number"
        return self._real(key, self._value_or_missing(key, default, kind), positive)

    def string(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._value_or_missing(key, default, "a string")
        if not isinstance(value, str):
            raise self._wrong(key, value, "a string")
        return value

    def flag(self, key: str) -> bool:
        """A boolean switch; absent or null is off."""
        value = self._data.get(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self._wrong(key, value, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        """An object-valued key; absent or null is empty."""
        value = self._data.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self._wrong(key, value, "an object")
        return value

    @property
    def architectures(self) -> list[str]:
        """The architectures the config names ([] when it names none)."""
        value = self._data.get("architectures")
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise self._wrong("architectures", value, "a list of class names")
        return list(value)

    def architecture(self, default: str) -> str:
        """The one architecture the config names, `default` when it names none."""
        archs = self.architectures or [default]
        if len(archs) != 1:
            raise HfConfigInvalid(f"{self.path}: expected one architecture, got {archs}")
        return archs[0]

    # ---- facts derived as transformers derives them ----------------------------------------

    def labels(self) -> list[str]:
        """A classifier's label names, by id, as PretrainedConfig reads them: `id2label`'s,
        unless `num_labels` says another count (then that many generic names, as transformers
        makes them), else `num_labels` generic names, else two."""
        id2label = self._data.get("id2label")
        count = self._data.get("num_labels")
        if count is not None:
            count = self.positive_int("num_labels")
        if id2label is not None and count not in (None, len(id2label)):
            id2label = None  # transformers rebuilds the map for the count it was given
        if id2label is not None:
            if not isinstance(id2label, dict) or not id2label:
                raise self._wrong("id2label", id2label, "an object of id -> label")
            try:
                items = sorted((int(k), str(v)) for k, v in id2label.items())
            except ValueError as e:
                raise self._wrong("id2label", id2label, "an object of id -> label") from e
            if [i for i, _ in items] != list(range(len(items))):
                raise self._wrong("id2label", id2label, "labels numbered 0..n-1")
            return [label for _, label in items]
        n = self.positive_int("num_labels", DEFAULT_NUM_LABELS)
        return [f"LABEL_{i}" for i in range(n)]

    def problem_type(self) -> str | None:
        """A classifier's `problem_type` (which activation its scores take), or None when the
        config leaves it to the label count; any other value is refused, as transformers'
        PretrainedConfig refuses it."""
        value = self._data.get("problem_type")
        if value is not None and value not in PROBLEM_TYPES:
            raise self._wrong("problem_type", value, f"one of {', '.join(PROBLEM_TYPES)}")
        return value

    def kv_heads(self) -> int:
        """Grouped K/V heads: `num_key_value_heads`; null means one per attention head."""
        if "num_key_value_heads" in self._data and self._data["num_key_value_heads"] is None:
            return self.positive_int("num_attention_heads")
        return self.positive_int("num_key_value_heads")

    def head_dim(self) -> int:
        """The attention head size: `head_dim`; null means hidden_size / num_attention_heads."""
        if "head_dim" in self._data and self._data["head_dim"] is None:
            return self.positive_int("hidden_size") // self.positive_int("num_attention_heads")
        return self.positive_int("head_dim")

    def rope(self) -> tuple[str, float]:
        """(rope type, base) of a single-RoPE decoder, in either format: transformers 5's
        `rope_parameters`, or 4.x's top-level `rope_theta` and `rope_scaling`."""
        params = self.mapping("rope_parameters")
        scaling = self.mapping("rope_scaling")
        kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type"))) or "default"
        theta = params.get("rope_theta")
        if theta is None:
            return str(kind), self.number("rope_theta")
        return str(kind), self._real("rope_parameters.rope_theta", theta, positive=True)

    # ---- errors ---------------------------------------------------------------------------

    def _real(self, key: str, value: Any, positive: bool) -> float:
        kind = "a positive number" if positive else "a number"
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or value != value  # NaN
            or (positive and value <= 0)
        ):
            raise self._wrong(key, value, kind)
        return float(value)

    def _value_or_missing(self, key: str, default: Any, kind: str) -> Any:
        value = self._data.get(key)
        if value is not None:
            return value
        # transformers' default for this model_type, else the caller's
        value = TRANSFORMERS_DEFAULTS.get(self.model_type, {}).get(key, _REQUIRED)
        if value is _REQUIRED:
            value = default
        if value is _REQUIRED:
            raise HfConfigInvalid(f"{self.path}: {key} missing (expected {kind})")
        return value

    def _wrong(self, key: str, value: Any, kind: str) -> HfConfigInvalid:
        return HfConfigInvalid(f"{self.path}: {key} {value!r} is not {kind}")
