"""Module-side tokenization over HF `tokenizers`, with an explicit per-request length policy.

The library's own padding and truncation are switched OFF (a tokenizer.json may carry them:
MiniLM's pads to 128): nothing is padded on the wire, and length is decided here, per request:

- `truncate=True`: a sequence longer than the limit is cut to exactly the limit, keeping the
  special tokens the model's template adds (BERT: `[CLS]` ... `[SEP]`, the final `[SEP]`
  survives; a GGUF vocab with an EOS keeps it);
- `truncate=False`: any sequence over the limit is an `InvalidRequest` naming the item.

`direction` says which end is cut: "right" (the default, what sentence-transformers does)
drops the end of the text, "left" its beginning (TEI's `truncation_direction`: the end of a
long text is what matters, as in a chat history). Either way the template's special tokens
survive, and a model's prompt is never cut away by a left cut: it is the instruction the
model was trained to see first, so the text after it loses its beginning instead.

Every text goes through `host.sanitize.sanitize` first (the single documented rule), and a
model's prompt (`encode(prompt=...)`), sanitized too, is prepended to it. Special
tokens written in user text (`"[SEP]"`, `"<start_of_turn>"`) are by default tokenized as plain
text (`parse_special=False`, llama.cpp's `special=False`): caller text is data, not control.

Limits: `max_tokens` is the default limit (MiniLM: 256, sentence-transformers'
`max_seq_length`); `hard_limit` is what the model can physically take (BERT: 512 positions). A
request may ask for a smaller or larger limit, never above `hard_limit`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from common.errors import ArtifactInvalid, InvalidRequest
from formats.hf_config import HfConfig
from formats.st_layout import LayoutError, read_layout
from host.errors import ConfigInvalid
from host.sanitize import sanitize


@dataclass(frozen=True)
class Encoded:
    """One tokenized sequence per input text, special tokens included, unpadded."""

    ids: list[np.ndarray]  # int32
    n_tokens: list[int]  # == len(ids[i]): what is sent and billed
    truncated: list[bool]

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


@dataclass(frozen=True)
class EncodedPairs:
    """Composed cross-encoder sequences `[CLS] query [SEP] doc [SEP]` with token types."""

    ids: list[np.ndarray]  # int32
    token_type_ids: list[np.ndarray]  # int32
    n_tokens: list[int]
    n_first: list[int]  # tokens of segment A incl. its specials (token type 0): RERANK_SEQUENCES
    truncated: list[bool]

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


@dataclass(frozen=True)
class RerankSegments:
    """Query and documents tokenized separately WITHOUT special tokens (llama.cpp rerank).

    The worker composes each pair as `BOS q EOS/SEP d EOS` itself, so `n_tokens[i]` counts the
    composed sequence: len(query) + len(docs[i]) + `n_special`.
    """

    query: np.ndarray  # int32
    docs: list[np.ndarray]  # int32
    n_special: int
    n_tokens: list[int]
    truncated: list[bool]

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


@dataclass(frozen=True)
class Tokenized:
    """One text's tokens for inspection (`Tokenizer.tokenize`): nothing is cut."""

    text: str  # what was tokenized: sanitized, the prompt first
    ids: list[int]
    tokens: list[str]  # the vocabulary's strings ("##ing", "[CLS]")
    offsets: list[tuple[int, int] | None]  # [start, stop) in `text`; None: added by the template
    special: list[bool]  # added by the template (a "[SEP]" the caller wrote is text)


class Tokenizer:
    """Owns `tok`: its padding/truncation are switched off and its special-token parsing set."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        max_tokens: int,
        hard_limit: int | None = None,
        parse_special: bool = False,
    ) -> None:
        hard = max_tokens if hard_limit is None else hard_limit
        if not 0 < max_tokens <= hard:
            raise ConfigInvalid(f"need 0 < max_tokens ({max_tokens}) <= hard_limit ({hard})")
        tok.no_padding()
        tok.no_truncation()
        # HF's flag means "do not split special tokens out of the text".
        tok.encode_special_tokens = not parse_special
        self._tok = tok
        self.max_tokens = max_tokens
        self.hard_limit = hard
        self.parse_special = parse_special
        self.n_special_single = tok.num_special_tokens_to_add(False)
        self.n_special_pair = tok.num_special_tokens_to_add(True)
        if self.n_special_pair + 2 > hard:
            raise ConfigInvalid(f"hard_limit {hard} leaves no room for text")

    @classmethod
    def from_file(
        cls,
        tokenizer_json: str | Path,
        *,
        max_tokens: int,
        hard_limit: int | None = None,
        parse_special: bool = False,
    ) -> Tokenizer:
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        return cls(tok, max_tokens=max_tokens, hard_limit=hard_limit, parse_special=parse_special)

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, *, max_tokens: int | None = None, parse_special: bool = False
    ) -> Tokenizer:
        """A HF/sentence-transformers model directory: limits from its own config files."""
        d = Path(model_dir)
        hard, default = model_limits(d)
        return cls.from_file(
            d / "tokenizer.json",
            max_tokens=default if max_tokens is None else max_tokens,
            hard_limit=hard,
            parse_special=parse_special,
        )

    # -- single sequences -------------------------------------------------------------------

    def encode(
        self,
        texts: Sequence[str | bytes],
        truncate: bool,
        max_tokens: int | None = None,
        prompt: str = "",
        direction: str = "right",
        special_tokens: bool = True,
    ) -> Encoded:
        """`prompt` is prepended to every text before it is tokenized, as sentence-transformers
        does: its tokens count against the limit, and an input over it is cut (at the end, or
        with `direction="left"` at the start of the text after the prompt).
        `special_tokens=False`: the text's own tokens only (an inference-free sparse query)."""
        limit = self._limit(max_tokens)
        _check_direction(direction)
        clean = _sanitize_all(texts)
        if not clean:
            return Encoded(ids=[], n_tokens=[], truncated=[])
        head = sanitize(prompt) if prompt else ""
        if head:
            clean = [head + text for text in clean]
        # One call with the template's special tokens: for an input that fits, that is the
        # same ids as encoding bare and post-processing (the template adds a fixed
        # n_special_single), and it is what almost every request is, so the serving path
        # pays for one tokenizer call per text, not two. Only an input over the limit is
        # encoded again bare, cut, and post-processed, so the template's tokens survive.
        if not special_tokens:
            return self._encode_bare(clean, truncate, limit, direction)
        ids, counts, cut = [], [], []
        with_specials = self._tok.encode_batch_fast(clean, add_special_tokens=True)
        for i, enc in enumerate(with_specials):
            tokens = enc.ids
            over = len(tokens) > limit
            if over and not truncate:
                raise InvalidRequest(
                    f"input {i} has {len(tokens)} tokens, over the limit of {limit}; "
                    "shorten it or pass truncate=true",
                    index=i,
                    n_tokens=len(tokens),
                    max_tokens=limit,
                )
            if over:
                tokens = self._truncated(
                    clean[i], limit - self.n_special_single, direction, len(head)
                )
            ids.append(np.asarray(tokens, dtype=np.int32))
            counts.append(len(tokens))
            cut.append(over)
        return Encoded(ids=ids, n_tokens=counts, truncated=cut)

    def _encode_bare(self, clean: list[str], truncate: bool, limit: int, direction: str) -> Encoded:
        ids, counts, cut = [], [], []
        for i, enc in enumerate(self._encode_raw(clean)):
            over = len(enc.ids) > limit
            if over and not truncate:
                raise InvalidRequest(
                    f"input {i} has {len(enc.ids)} tokens, over the limit of {limit}; "
                    "shorten it or pass truncate=true",
                    index=i,
                    n_tokens=len(enc.ids),
                    max_tokens=limit,
                )
            kept = enc.ids[:limit] if direction == "right" else enc.ids[len(enc.ids) - limit :]
            ids.append(np.asarray(kept if over else enc.ids, dtype=np.int32))
            counts.append(len(ids[-1]))
            cut.append(over)
        return Encoded(ids=ids, n_tokens=counts, truncated=cut)

    def _truncated(self, text: str, budget: int, direction: str, prompt_chars: int) -> list[int]:
        """`text`'s ids cut to `budget` before the template's special tokens are added; a left
        cut keeps the tokens of the first `prompt_chars` characters (the prompt)."""
        if direction == "right":
            bare = self._encode_raw([text])[0]
            bare.truncate(budget)
            return self._tok.post_process(bare, None, add_special_tokens=True).ids
        # With offsets (the fast call has none): they say which tokens are the prompt's.
        bare = self._tok.encode_batch([text], add_special_tokens=False)[0]
        n_prompt = sum(1 for start, _ in bare.offsets if start < prompt_chars)
        if n_prompt >= budget:  # the prompt alone fills the limit: as a right cut would
            bare.truncate(budget)
            return self._tok.post_process(bare, None, add_special_tokens=True).ids
        # `truncate` consumes an Encoding: the prompt and the tail come from two copies.
        tail = tokenizers.Encoding.merge([bare], growing_offsets=False)
        tail.truncate(budget - n_prompt, direction="left")
        if n_prompt:
            bare.truncate(n_prompt)
            tail = tokenizers.Encoding.merge([bare, tail], growing_offsets=False)
        return self._tok.post_process(tail, None, add_special_tokens=True).ids

    # -- cross-encoder pairs ----------------------------------------------------------------

    def encode_pair(
        self, query: str | bytes, doc: str | bytes, truncate: bool, max_tokens: int | None = None
    ) -> EncodedPairs:
        return self.encode_pairs(query, [doc], truncate, max_tokens)

    def encode_pairs(
        self,
        query: str | bytes,
        docs: Sequence[str | bytes],
        truncate: bool,
        max_tokens: int | None = None,
        direction: str = "right",
        max_doc_tokens: int | None = None,
    ) -> EncodedPairs:
        """Pairs through the model's pair template (token types 0 for the query, 1 for docs).

        Over the limit with `truncate=True`, the document is cut first; only if the query alone
        leaves no room is the query cut too, to max(budget - len(doc), budget // 2) tokens so
        the document keeps at least the other half. Special tokens always survive. Each cut
        is at the `direction` end. `max_doc_tokens` caps every document first (Cohere's
        `max_tokens_per_doc`: always a cut, whatever `truncate` says).
        """
        limit = self._limit(max_tokens)
        _check_direction(direction)
        q_text = sanitize(query)
        d_texts = _sanitize_all(docs)
        raw = self._encode_raw([q_text, *d_texts])
        q_len = len(raw[0].ids)
        budget = limit - self.n_special_pair
        out_ids, out_types, counts, firsts, cut = [], [], [], [], []
        for i, d_enc in enumerate(raw[1:]):
            # `truncate`/`post_process` consume an Encoding: give each pair its own copy.
            q_enc = tokenizers.Encoding.merge([raw[0]], growing_offsets=False)
            capped = max_doc_tokens is not None and len(d_enc.ids) > max_doc_tokens
            if capped and max_doc_tokens is not None:
                d_enc.truncate(max_doc_tokens, direction=direction)
            over = q_len + len(d_enc.ids) > budget
            if over and not truncate:
                raise InvalidRequest(
                    f"pair {i} has {q_len + len(d_enc.ids) + self.n_special_pair} tokens, over "
                    f"the limit of {limit}; shorten it or pass truncate=true",
                    index=i,
                    n_tokens=q_len + len(d_enc.ids) + self.n_special_pair,
                    max_tokens=limit,
                )
            if over:
                q_keep, d_keep = _split_budget(q_len, len(d_enc.ids), budget)
                q_enc.truncate(q_keep, direction=direction)
                d_enc.truncate(d_keep, direction=direction)
            final = self._tok.post_process(q_enc, d_enc, add_special_tokens=True)
            types = np.asarray(final.type_ids, dtype=np.int32)
            out_ids.append(np.asarray(final.ids, dtype=np.int32))
            out_types.append(types)
            counts.append(len(types))
            firsts.append(int(np.count_nonzero(types == 0)))
            cut.append(over or capped)
        return EncodedPairs(out_ids, out_types, counts, firsts, cut)

    # -- llama.cpp-style rerank -------------------------------------------------------------

    def rerank_segments(
        self,
        query: str | bytes,
        docs: Sequence[str | bytes],
        truncate: bool,
        max_tokens: int | None = None,
        direction: str = "right",
        max_doc_tokens: int | None = None,
    ) -> RerankSegments:
        """Query and docs WITHOUT special tokens; the worker adds `n_special` per pair.

        The limit applies to the composed pair. With `truncate=True` the document is cut
        first; a query that alone leaves no room is an error either way, because it is sent
        once and shared by every pair (cutting it per pair is not expressible on the wire).
        Documents are cut at the `direction` end; `max_doc_tokens` caps each one first.
        """
        limit = self._limit(max_tokens)
        _check_direction(direction)
        raw = self._encode_raw([sanitize(query), *_sanitize_all(docs)])
        query_ids = np.asarray(raw[0].ids, dtype=np.int32)
        budget = limit - self.n_special_pair - len(query_ids)
        if budget < 1:
            raise InvalidRequest(
                f"query has {len(query_ids)} tokens and leaves no room for a document within "
                f"the limit of {limit}",
                n_tokens=len(query_ids),
                max_tokens=limit,
            )
        docs_ids, counts, cut = [], [], []
        for i, enc in enumerate(raw[1:]):
            doc = enc.ids
            capped = max_doc_tokens is not None and len(doc) > max_doc_tokens
            if capped and max_doc_tokens is not None:
                doc = _cut(doc, max_doc_tokens, direction)
            over = len(doc) > budget
            if over and not truncate:
                n = len(query_ids) + len(doc) + self.n_special_pair
                raise InvalidRequest(
                    f"pair {i} has {n} tokens, over the limit of {limit}; shorten it or pass "
                    "truncate=true",
                    index=i,
                    n_tokens=n,
                    max_tokens=limit,
                )
            d = np.asarray(_cut(doc, budget, direction) if over else doc, dtype=np.int32)
            docs_ids.append(d)
            counts.append(len(query_ids) + len(d) + self.n_special_pair)
            cut.append(over or capped)
        return RerankSegments(query_ids, docs_ids, self.n_special_pair, counts, cut)

    # -- inspection -------------------------------------------------------------------------

    def tokenize(
        self, texts: Sequence[str | bytes], add_special_tokens: bool = True, prompt: str = ""
    ) -> list[Tokenized]:
        """Each text as the model sees it (sanitized, `prompt` first), never cut: ids, the
        vocabulary's token strings, character offsets into that text (None for a special
        token the template added) and which tokens the template added."""
        clean = _sanitize_all(texts)
        head = sanitize(prompt) if prompt else ""
        clean = [head + text for text in clean]
        if not clean:
            return []
        out = []
        for text, enc in zip(
            clean,
            self._tok.encode_batch(clean, add_special_tokens=add_special_tokens),
            strict=True,
        ):
            special = [bool(x) for x in enc.special_tokens_mask]
            offsets = [
                None if sp else (int(a), int(b))
                for sp, (a, b) in zip(special, enc.offsets, strict=True)
            ]
            out.append(Tokenized(text, list(enc.ids), list(enc.tokens), offsets, special))
        return out

    # -- one long text in windows -----------------------------------------------------------

    def document_windows(
        self, text: str, prompt: str, window: int, step: int
    ) -> tuple[list[tuple[int, int] | None], list[tuple[np.ndarray, int, int, int]]]:
        """`prompt + text` (sanitized, as `encode` reads it) cut into windows of at most
        `window` tokens with the template's special tokens around each, consecutive windows
        `step` tokens apart (so they overlap by `window - step`). Returns the bare tokens'
        character offsets into `prompt + text`, and per window (ids with specials, first bare
        token, end, where the bare tokens start in the ids)."""
        full = sanitize(prompt) + sanitize(text)
        bare = self._tok.encode_batch([full], add_special_tokens=False)[0]
        offsets: list[tuple[int, int] | None] = [(int(a), int(b)) for a, b in bare.offsets]
        n = len(bare.ids)
        starts = list(range(0, max(1, n - window + step), step)) if n > window else [0]
        windows = []
        for a in starts:
            b = min(n, a + window)
            piece = tokenizers.Encoding.merge([bare], growing_offsets=False)
            piece.truncate(b, direction="right")
            piece.truncate(b - a, direction="left")
            done = self._tok.post_process(piece, None, add_special_tokens=True)
            mask = done.special_tokens_mask
            first = next((i for i, sp in enumerate(mask) if not sp), 0)
            windows.append((np.asarray(done.ids, np.int32), a, b, first))
        return offsets, windows

    # -- misc -------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _limit(self, max_tokens: int | None) -> int:
        limit = self.max_tokens if max_tokens is None else max_tokens
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise InvalidRequest(f"max_tokens must be an integer, got {limit!r}")
        if not self.n_special_pair + 2 <= limit <= self.hard_limit:
            raise InvalidRequest(
                f"max_tokens {limit} outside [{self.n_special_pair + 2}, {self.hard_limit}]",
                max_tokens=limit,
            )
        return limit

    def _encode_raw(self, texts: list[str]) -> list[tokenizers.Encoding]:
        if not texts:
            return []
        return self._tok.encode_batch_fast(texts, add_special_tokens=False)


def model_limits(model_dir: str | Path) -> tuple[int, int]:
    """(hard_limit, default max_tokens) from a HF / sentence-transformers model directory.

    hard: `max_position_embeddings` (minus RoBERTa's padding offset), capped by the tokenizer's
    `model_max_length`; default: sentence-transformers' `max_seq_length` when present (either
    layout: see formats/st_layout.py).
    """
    d = Path(model_dir)
    try:
        cfg = HfConfig.read(d, missing_ok=True)  # a bare tokenizer directory has none
        hard = cfg.positive_int("max_position_embeddings")
        if cfg.model_type in ("roberta", "xlm-roberta", "camembert"):
            # positions start after the pad index
            hard -= _token_id(cfg.value("pad_token_id"), cfg) + 1
    except ArtifactInvalid as e:
        raise ConfigInvalid(f"{d}: {e.message}") from None
    tok_cfg = _read_json(d / "tokenizer_config.json")
    model_max = tok_cfg.get("model_max_length")
    if isinstance(model_max, int) and 0 < model_max < hard:
        hard = model_max
    try:
        default = read_layout(d).max_seq_length or hard
    except LayoutError as e:
        raise ConfigInvalid(f"{d}: {e}") from None
    return hard, min(default, hard)


def _token_id(value: object, cfg: HfConfig) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigInvalid(f"{cfg.path}: pad_token_id {value!r} is not a token id")
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _sanitize_all(texts: Sequence[str | bytes]) -> list[str]:
    if isinstance(texts, (str, bytes, bytearray)) or not isinstance(texts, Sequence):
        raise InvalidRequest("expected a list of texts")
    out = []
    for i, text in enumerate(texts):
        try:
            out.append(sanitize(text))
        except InvalidRequest as exc:
            raise InvalidRequest(f"input {i}: {exc.message}", index=i) from None
    return out


DIRECTIONS = ("right", "left")


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise InvalidRequest(
            f"truncation_direction must be 'right' or 'left', got {direction!r}",
            param="truncation_direction",
        )


def _cut(ids: list[int], keep: int, direction: str) -> list[int]:
    return ids[:keep] if direction == "right" else ids[len(ids) - keep :]


def _split_budget(q_len: int, d_len: int, budget: int) -> tuple[int, int]:
    """How many query / document tokens to keep so that together they fit `budget`."""
    if q_len < budget:
        return q_len, min(d_len, budget - q_len)
    q_keep = min(q_len, max(budget - d_len, budget // 2))
    return q_keep, min(d_len, budget - q_keep)
