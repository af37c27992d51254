"""The head of a causal LM reranker (Qwen3-Reranker, or any sentence-transformers CrossEncoder
whose modules end in LogitScore): the raw score is `logit[true] - logit[false]` at the last
token, the true and false tokens being `yes` and `no` unless the checkpoint or the user names
others.

What decides it, read from the source directory (standard library and numpy only):

- the tokens: explicit ones (token strings or ids, both named) win; else a CrossEncoder's
  LogitScore config (its `true_token_id` / `false_token_id`); else, for a directory that says
  it is a Qwen3-Reranker (its README heading or its name, as llama.cpp's converter decides),
  the tokenizer's single tokens `yes` and `no`, looked up as transformers'
  `convert_tokens_to_ids` does (the vocabulary entry of exactly that string). A token the
  vocabulary lacks is refused, named: scoring with another token's logit would be silently
  wrong.
- the row: only the two LM-head rows the score reads are kept, as their difference
  (`score_row`). A full-vocabulary head would cost a vocabulary-wide projection per pair for
  two numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from formats.owned.model import Head, ManifestError, UnsupportedModel, read_json
from formats.st_layout import module_kind

# The owned tensor holding the score's one row, (1, hidden): the name transformers gives a
# one-label Qwen3ForSequenceClassification's head, which computes the same function.
SCORE_WEIGHT = "score.weight"
DEFAULT_TOKENS = ("yes", "no")
# What llama.cpp's converter (conversion/qwen.py) reads as "this is a Qwen3 reranker".
_README_HEADINGS = ("# qwen3-reranker", "# qwen3-vl-reranker")
_NAME_HINTS = ("qwen3-reranker", "qwen3-vl-reranker")


class RankTokens(NamedTuple):
    true_id: int
    false_id: int | None  # None: the score is the true token's logit alone


def vocabulary(src: Path) -> dict[str, int]:
    """token string -> id over tokenizer.json's added tokens and vocabulary (a string in both
    holds the same id in every tokenizer transformers writes; the vocabulary's is kept)."""
    tok = read_json(src / "tokenizer.json")
    if not isinstance(tok, dict):
        raise ManifestError("tokenizer.json: expected a JSON object")
    ids: dict[str, int] = {}
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str):
            ids[added["content"]] = int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict):  # a Unigram vocabulary is a list: no string lookup here
        ids.update(vocab)
    return ids


def _token_id(vocab: dict[str, int], token: str | int, role: str) -> int:
    if isinstance(token, int) and not isinstance(token, bool):
        return token
    if not isinstance(token, str) or token not in vocab:
        raise UnsupportedModel(
            f"the tokenizer has no single token {token!r} for the {role} answer: the score "
            "compares two tokens' logits (name the true and false tokens explicitly)"
        )
    return vocab[token]


def _logit_score(src: Path) -> RankTokens | None:
    """A sentence-transformers CrossEncoder's LogitScore ids; None for any other directory."""
    modules_path = src / "modules.json"
    if not modules_path.is_file():
        return None
    modules = read_json(modules_path)
    if not isinstance(modules, list):
        raise ManifestError("modules.json: expected a list of modules")
    kinds = [module_kind(str(m.get("type", ""))) if isinstance(m, dict) else "" for m in modules]
    if "LogitScore" not in kinds:
        return None
    if kinds != ["Transformer", "LogitScore"]:
        # The graph computes the causal LM's last-token logits and one difference of two:
        # any module before or after would be left out silently.
        raise UnsupportedModel(f"CrossEncoder modules {kinds}: Transformer + LogitScore only")
    cfg = read_json(src / str(modules[1].get("path", "")) / "config.json")
    if not isinstance(cfg, dict):
        raise ManifestError("LogitScore config.json: expected a JSON object")
    if cfg.get("module_input_name", "causal_logits") != "causal_logits":
        raise UnsupportedModel(
            f"LogitScore reads {cfg['module_input_name']!r}: the causal LM's logits only"
        )
    true_id, false_id = cfg.get("true_token_id"), cfg.get("false_token_id")
    for name, value in (("true_token_id", true_id), ("false_token_id", false_id)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ManifestError(f"LogitScore {name} {value!r} is not a token id")
    if true_id is None:
        raise ManifestError("LogitScore config.json names no true_token_id")
    return RankTokens(true_id, false_id)


def says_qwen3_reranker(src: Path, name_or_path: str = "") -> bool:
    """llama.cpp's converter's test: a README heading `# Qwen3-Reranker`, or the directory's
    name or config.json's `_name_or_path` (`name_or_path`)."""
    readme = src / "README.md"
    try:
        text = readme.read_text(encoding="utf-8").lower() if readme.is_file() else ""
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"README.md: {e}") from e
    if any(h in text for h in _README_HEADINGS):
        return True
    hints = [src.absolute().name, name_or_path]
    return any(n in h.lower() for h in hints for n in _NAME_HINTS)


def says_reranker(src: Path, name_or_path: str = "") -> bool:
    """Whether `src` says itself that it is a causal LM reranker (no tokens named)."""
    return _logit_score(src) is not None or says_qwen3_reranker(src, name_or_path)


def rank_tokens(
    src: Path,
    name_or_path: str,
    vocab_size: int,
    true_token: str | int | None = None,
    false_token: str | int | None = None,
) -> RankTokens | None:
    """The reranker's (true, false) ids, or None when `src` is not a causal LM reranker."""
    if (true_token is None) != (false_token is None):
        raise ManifestError("name both the true and the false token, or neither")
    if true_token is not None and false_token is not None:
        vocab = vocabulary(src)
        found = RankTokens(
            _token_id(vocab, true_token, "true"), _token_id(vocab, false_token, "false")
        )
    else:
        declared = _logit_score(src)
        if declared is not None:
            found = declared
        elif says_qwen3_reranker(src, name_or_path):
            vocab = vocabulary(src)
            found = RankTokens(
                _token_id(vocab, DEFAULT_TOKENS[0], "true"),
                _token_id(vocab, DEFAULT_TOKENS[1], "false"),
            )
        else:
            return None
    for role, tid in (("true", found.true_id), ("false", found.false_id)):
        if tid is not None and not 0 <= tid < vocab_size:
            raise ManifestError(
                f"the {role} token id {tid} is outside the vocabulary ({vocab_size} ids)"
            )
    if found.true_id == found.false_id:
        raise UnsupportedModel(f"the true and false tokens are the same token ({found.true_id})")
    return found


def rank_head(tokens: RankTokens | None) -> Head:
    """The owned head of a causal LM reranker (`tokens` None: a GGUF, whose ids are gone)."""
    return Head(
        type="rank_last",
        pooling="last",
        normalize=False,
        num_labels=1,
        true_token_id=tokens.true_id if tokens else None,
        false_token_id=tokens.false_id if tokens else None,
    )


def score_row(true_row: np.ndarray, false_row: np.ndarray | None) -> np.ndarray:
    """The score's one row, (1, hidden) float32: `w_true - w_false`.

    Stored as one row, not two: `(w_true - w_false) . h` is `w_true . h - w_false . h`
    exactly, so the score is one 1x1 conv output channel instead of two and a subtraction.
    It is also what fp16 can carry: the two logits of a real reranker reach |20| and more,
    where fp16 rounds each by ~1e-2, so their difference would keep that error however small
    the score; one dot product with the difference row rounds at the score's own magnitude.
    The subtraction is done once here, in float64, and rounded once to float32."""
    row = np.asarray(true_row, np.float64)
    if false_row is not None:
        row = row - np.asarray(false_row, np.float64)
    return np.ascontiguousarray(row.astype(np.float32).reshape(1, -1))
