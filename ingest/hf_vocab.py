"""A GGUF vocabulary written from a directory's `tokenizer.json`, so llama.cpp loads the model.

The module tokenizes with the directory's own tokenizer.json (ids are the model's); the GGUF
still needs a vocabulary llama.cpp accepts for its type, with the special ids it composes
rerank pairs from (`BOS q EOS SEP d EOS`). Written the way llama.cpp's converter writes them:
- Unigram ("t5", XLM-RoBERTa): pieces, scores, the precompiled character map;
- byte-level BPE ("gpt2": Qwen3, ModernBERT): tokens as stored, merges as "left right";
- rows of the embedding table beyond the tokenizer are `[PAD{i}]`, type UNUSED.
Token types: special added tokens are CONTROL, other added tokens USER_DEFINED, the unknown
piece UNKNOWN.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import gguf

from common.errors import ArtifactInvalid

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = (
    int(gguf.TokenType.NORMAL),
    int(gguf.TokenType.UNKNOWN),
    int(gguf.TokenType.CONTROL),
    int(gguf.TokenType.USER_DEFINED),
    int(gguf.TokenType.UNUSED),
)


@dataclass
class Vocab:
    """What `add_to` writes; `ids` maps each token's text to its id."""

    model: str  # tokenizer.ggml.model
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    charsmap: bytes | None = None
    ids: dict[str, int] = field(default_factory=dict)

    def add_to(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        if self.charsmap is not None:
            w.add_precompiled_charsmap(self.charsmap)

    def id_of(self, text: str, role: str) -> int:
        if text not in self.ids:
            raise ArtifactInvalid(f"tokenizer.json has no {role} token {text!r}")
        return self.ids[text]


def _model(tok: dict, want: str) -> dict:
    model = tok.get("model") or {}
    if model.get("type") != want:
        raise ArtifactInvalid(f"tokenizer.json model is {model.get('type')!r}, not {want}")
    return model


def _table(n_vocab: int, pieces: dict[str, int]) -> tuple[list[str], list[int]]:
    if not pieces or max(pieces.values()) >= n_vocab or min(pieces.values()) < 0:
        raise ArtifactInvalid(f"tokenizer ids do not fit the embedding table ({n_vocab} rows)")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [UNUSED] * n_vocab
    for text, i in pieces.items():
        tokens[i], types[i] = text, NORMAL
    return tokens, types


def _mark_added(tok: dict, tokens: list[str], types: list[int], ids: dict[str, int]) -> None:
    for added in tok.get("added_tokens", []):
        i = added.get("id")
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            raise ArtifactInvalid(
                f"added token {added.get('content')!r} has id {i!r} outside "
                f"the embedding table ({len(tokens)} rows)"
            )
        tokens[i] = added["content"]
        types[i] = CONTROL if added.get("special") else USER_DEFINED
        ids[added["content"]] = i


def unigram_vocab(tok: dict, n_vocab: int) -> Vocab:
    model = _model(tok, "Unigram")
    pieces = model.get("vocab") or []
    ids = {piece: i for i, (piece, _) in enumerate(pieces)}
    tokens, types = _table(n_vocab, ids)
    scores = [0.0] * n_vocab
    for i, (_, score) in enumerate(pieces):
        scores[i] = float(score)
    if isinstance(model.get("unk_id"), int) and 0 <= model["unk_id"] < n_vocab:
        types[model["unk_id"]] = UNKNOWN
    _mark_added(tok, tokens, types, ids)
    return Vocab("t5", "default", tokens, types, scores=scores, charsmap=_charsmap(tok), ids=ids)


def _charsmap(tok: dict) -> bytes | None:
    norm = tok.get("normalizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    for step in steps:
        if step and step.get("type") == "Precompiled" and step.get("precompiled_charsmap"):
            return base64.b64decode(step["precompiled_charsmap"])
    return None


def byte_bpe_vocab(tok: dict, n_vocab: int, pre: str) -> Vocab:
    model = _model(tok, "BPE")
    ids = dict(model.get("vocab") or {})
    tokens, types = _table(n_vocab, ids)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    _mark_added(tok, tokens, types, ids)
    return Vocab("gpt2", pre, tokens, types, merges=merges, ids=ids)


def spm_vocab(tok: dict, n_vocab: int) -> Vocab:
    """A SentencePiece-style ("llama") vocabulary from a tokenizer.json BPE with byte fallback
    (Gemma's: SentencePiece BPE converted by transformers), as llama.cpp's converter writes
    one from tokenizer.model: pieces as stored (`▁` for a space), `<0xNN>` byte pieces typed
    BYTE, and scores that make llama.cpp's SentencePiece merging pick the merges the BPE
    picks. llama.cpp merges the adjacent pair whose concatenation scores highest, BPE the
    pair of lowest rank, so a piece scores minus the rank of the first merge that makes it;
    pieces no merge makes (characters, bytes) score below every merged one."""
    model = _model(tok, "BPE")
    if not model.get("byte_fallback"):
        raise ArtifactInvalid(
            "tokenizer.json BPE has no byte fallback: not a SentencePiece-style "
            "vocabulary llama.cpp's 'llama' tokenizer reads"
        )
    ids = dict(model.get("vocab") or {})
    tokens, types = _table(n_vocab, ids)
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges") or []]
    made: dict[int, int] = {}
    for rank, (left, right) in enumerate(merges):
        i = ids.get(left + right)
        if i is not None:
            made.setdefault(i, rank)
    scores = [float(-made[i]) if i in made else float(-(len(merges) + i)) for i in range(n_vocab)]
    byte = int(gguf.TokenType.BYTE)
    for text, i in ids.items():
        if (
            len(text) == 6
            and text.startswith("<0x")
            and text.endswith(">")
            and all(c in "0123456789ABCDEF" for c in text[3:5])
        ):
            types[i] = byte
    unk = model.get("unk_token")
    if isinstance(unk, str) and unk in ids:
        types[ids[unk]] = UNKNOWN
    _mark_added(tok, tokens, types, ids)
    for added in tok.get("added_tokens", []):
        # As llama.cpp's converter: added pieces score -1000, and a user-defined one is stored
        # with real spaces, since llama.cpp matches those against the raw text.
        scores[added["id"]] = -1000.0
        if not added.get("special"):
            tokens[added["id"]] = added["content"].replace("\u2581", " ")
    return Vocab("llama", "default", tokens, types, scores=scores, ids=ids)
