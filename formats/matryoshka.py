"""The Matryoshka widths a model's own files declare, read at ingest.

Two places say them, each written by a tool rather than by hand:

- `config.json`'s `matryoshka_dimensions` (jina-embeddings-v3 lists the widths it was trained
  at there);
- the model card (`README.md`) sentence-transformers generates after training: each training
  dataset's loss is printed with its parameters as a JSON block, and `MatryoshkaLoss` /
  `Matryoshka2dLoss` name their widths in it (`"matryoshka_dims": [768, 512, ...]`).

A card that states different widths for different datasets, or a config and a card that
disagree, say nothing certain: that is refused with the reason (ingest's own
`--matryoshka-dims` settles it). Prose such as "you may truncate to 256" is not read: only a
tool's record counts. Standard library only.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

# A fenced JSON block, indented as the card's list items indent it.
_JSON_BLOCK = re.compile(r"^([ \t]*)```json[ \t]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)


class MatryoshkaError(ValueError):
    """The model's files state Matryoshka widths that cannot be taken as they are."""


def declared_widths(model_dir: str | Path) -> list[int]:
    """The widths the directory's files declare, widest first; [] when they declare none."""
    d = Path(model_dir)
    found: dict[str, list[int]] = {}
    config = _config_widths(d / "config.json")
    if config:
        found["config.json's matryoshka_dimensions"] = config
    card = _card_widths(d / "README.md")
    if card:
        found["the model card's MatryoshkaLoss parameters"] = card
    distinct = {tuple(w) for w in found.values()}
    if len(distinct) > 1:
        said = "; ".join(f"{where}: {w}" for where, w in found.items())
        raise MatryoshkaError(f"the model's files disagree on its Matryoshka widths ({said})")
    return list(distinct.pop()) if distinct else []


def _config_widths(path: Path) -> list[int]:
    if not path.is_file():
        return []
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # the config's own reader names what is wrong with it
    if not isinstance(config, dict) or config.get("matryoshka_dimensions") is None:
        return []
    return _widths(config["matryoshka_dimensions"], f"{path.name}'s matryoshka_dimensions")


def _card_widths(path: Path) -> list[int]:
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    seen: list[list[int]] = []
    for m in _JSON_BLOCK.finditer(text):
        try:
            params = json.loads(textwrap.dedent(m[2]))
        except ValueError:
            continue  # another JSON example of the card, not a loss's parameters
        if isinstance(params, dict) and "matryoshka_dims" in params:
            seen.append(_widths(params["matryoshka_dims"], "the model card's matryoshka_dims"))
    distinct = {tuple(w) for w in seen}
    if len(distinct) > 1:
        raise MatryoshkaError(
            "the model card trained different Matryoshka widths per dataset "
            f"({', '.join(str(list(w)) for w in sorted(distinct))})"
        )
    return list(distinct.pop()) if distinct else []


def _widths(value: object, where: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value)
    ):
        raise MatryoshkaError(f"{where} must be a list of positive widths, not {value!r}")
    if len(set(value)) != len(value):
        raise MatryoshkaError(f"{where} {value} names a width twice")
    return sorted(value, reverse=True)
