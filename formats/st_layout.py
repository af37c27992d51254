"""What a sentence-transformers model directory declares, in either of its two layouts.

One reader for every side (ingest, the host's tokenizer limits, the Core ML manifest), since
each must agree on the same facts:

- legacy (sentence-transformers <= 5): module types `sentence_transformers.models.Pooling`
  (`.Normalize`, `.Dense`, `.Transformer`); `1_Pooling/config.json` with one boolean per mode
  (`pooling_mode_mean_tokens`...); `max_seq_length` in `sentence_bert_config.json`.
- native (sentence-transformers 6): module types such as
  `sentence_transformers.sentence_transformer.modules.pooling.Pooling` and
  `sentence_transformers.base.modules.normalize.Normalize`; the pooling config says
  `"pooling_mode": "mean"` (or a list); the limit lives in the tokenizer
  (`tokenizer_config.json`'s `model_max_length`, which sentence-transformers 6 reads as
  `max_seq_length`). A directory that states no limit of its own (a plain transformers
  model, a cross-encoder) is cut where the tokenizer says, as CrossEncoder and transformers
  cut it.

A module's kind is the last component of its type (`Pooling`, `Normalize`, `Dense`...), so
both spellings read the same. A legacy pooling config with no mode set means mean pooling, as
sentence-transformers itself decides. Prompts come from `config_sentence_transformers.json`.
Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# sentence-transformers' legacy boolean keys, in its own concatenation order.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_MODES = frozenset(LEGACY_POOLING_KEYS.values())


class LayoutError(ValueError):
    """A sentence-transformers file is unreadable or says something impossible."""


@dataclass(frozen=True)
class Layout:
    """The sentence-transformers facts of one directory (all empty for a plain HF model)."""

    # Pooling modes in order (e.g. ("mean",)); () when the directory has no Pooling module.
    pooling_modes: tuple[str, ...] = ()
    include_prompt: bool = True
    normalize: bool = False
    dense_dirs: tuple[Path, ...] = ()  # Dense modules, in pipeline order
    # The default truncation, from sentence_bert_config.json or (native) the tokenizer.
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    native: bool = False  # written by sentence-transformers 6

    @property
    def pooling(self) -> str | None:
        """The single pooling mode, None when there is no Pooling module; LayoutError for a
        concatenation of modes (no engine here computes one)."""
        if not self.pooling_modes:
            return None
        if len(self.pooling_modes) > 1:
            raise LayoutError(
                f"pooling modes {list(self.pooling_modes)} concatenated: only one mode is supported"
            )
        return self.pooling_modes[0]


def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(f"unreadable {path}: {e}") from e


def _optional_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = _json(path)
    if not isinstance(data, dict):
        raise LayoutError(f"{path}: expected a JSON object")
    return data


def module_kind(type_name: str) -> str:
    """ "Pooling" for both `sentence_transformers.models.Pooling` and
    `sentence_transformers.sentence_transformer.modules.pooling.Pooling`."""
    return type_name.rsplit(".", 1)[-1]


def pooling_modes(config: dict) -> tuple[str, ...]:
    """The modes a Pooling config.json declares, in either layout."""
    if "pooling_mode" in config:
        raw = config["pooling_mode"]
        modes = (raw,) if isinstance(raw, str) else tuple(raw) if isinstance(raw, list) else None
        if not modes or not all(isinstance(m, str) for m in modes):
            raise LayoutError(f"pooling_mode {raw!r}: expected a mode name or a list of them")
    else:
        modes = tuple(mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key))
        modes = modes or ("mean",)  # sentence-transformers' own default
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise LayoutError(f"unknown pooling mode {unknown[0]!r} (known: {sorted(POOLING_MODES)})")
    return modes


def read_layout(model_dir: str | Path) -> Layout:
    d = Path(model_dir)
    modules_path = d / "modules.json"
    kinds: list[tuple[str, Path, str]] = []
    if modules_path.is_file():
        modules = _json(modules_path)
        if not isinstance(modules, list):
            raise LayoutError(f"{modules_path}: expected a list of modules")
        for mod in modules:
            if not isinstance(mod, dict) or not isinstance(mod.get("type"), str):
                raise LayoutError(f"{modules_path}: a module without a type: {mod!r}")
            kinds.append((module_kind(mod["type"]), d / str(mod.get("path", "")), mod["type"]))
    elif (d / "1_Pooling" / "config.json").is_file():  # modules.json lost: the usual layout
        kinds.append(("Pooling", d / "1_Pooling", "sentence_transformers.models.Pooling"))
    native = any(not t.startswith("sentence_transformers.models.") for _, _, t in kinds)
    pooling: tuple[str, ...] = ()
    include_prompt = True
    for kind, path, _ in kinds:
        if kind == "Pooling" and not pooling:
            cfg = _optional_json(path / "config.json")
            pooling = pooling_modes(cfg)
            include_prompt = bool(cfg.get("include_prompt", True))
    st_cfg = _optional_json(d / "sentence_bert_config.json")
    max_seq = st_cfg.get("max_seq_length")
    if max_seq is None:  # what sentence-transformers, CrossEncoder and transformers cut at
        max_seq = _optional_json(d / "tokenizer_config.json").get("model_max_length")
    if isinstance(max_seq, (int, float)) and not isinstance(max_seq, bool) and max_seq > 1 << 20:
        max_seq = None  # transformers' "no limit" sentinel (1e30)
    if max_seq is not None and (
        not isinstance(max_seq, int) or isinstance(max_seq, bool) or max_seq <= 0
    ):
        raise LayoutError(f"{d}: max_seq_length {max_seq!r} is not a positive integer")
    st = _optional_json(d / "config_sentence_transformers.json")
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise LayoutError("config_sentence_transformers.json: prompts must map names to text")
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise LayoutError(
            f"default_prompt_name {default!r} is not one of the prompts {sorted(prompts)}"
        )
    return Layout(
        pooling_modes=pooling,
        include_prompt=include_prompt,
        normalize=any(kind == "Normalize" for kind, _, _ in kinds),
        dense_dirs=tuple(path for kind, path, _ in kinds if kind == "Dense"),
        max_seq_length=max_seq,
        prompts=dict(prompts),
        default_prompt_name=default,
        native=native,
    )
