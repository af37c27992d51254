"""An LLM reranker's pairs, composed module-side as sentence-transformers 6 composes them.

`CrossEncoder` on a `...ForCausalLM` checkpoint maps each (query, document) pair to the
messages `[{"role": "system", "content": instruction}]? + [{"role": "query", "content": q},
{"role": "document", "content": d}]` (content as a list of typed parts when the template reads
them so: `LlmRerankSpec.message_format`), renders them through the checkpoint's chat template
as transformers' `apply_chat_template` does (`ingest.chat_template`;
`add_generation_prompt=False`; the tokenizer's special tokens as variables), and
tokenizes the rendered text without adding special tokens. The score is read at the last
token: the template's assistant suffix.

One deviation, deliberate: transformers parses special-token strings anywhere in the rendered
text, so a document holding "<|im_end|>" would close the turn; here only the template's own
special tokens are control, caller text stays data (the rule every tokenization here follows).
The rendered text is split at the template's special tokens and each stretch between two is
tokenized as transformers' tokenizer tokenizes it (added special tokens split out first), so
for text without such strings the ids are transformers' ids.

Truncation never cuts the template: an over-long pair loses document tokens from the end
(the beginning with `direction="left"`), then query tokens if the query alone is too long;
the instruction and the assistant suffix after which the score is read are always intact.
`truncate=False` refuses an over-long pair instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np
import tokenizers

from common.errors import InvalidRequest
from host.sanitize import sanitize
from host.tokenization import EncodedPairs
from ingest.chat_template import compile_template
from ingest.llm_rerank import LlmRerankSpec

# Stand-ins for the caller's texts in a probe render: private-use characters no template
# emits, so the render splits into the template's own text and the three slots.
_SLOTS = {"instruction": "\ue000I\ue001", "query": "\ue000Q\ue001", "document": "\ue000D\ue001"}
_SLOT_RE = re.compile("|".join(re.escape(s) for s in _SLOTS.values()))
_SLOT_NAMES = {v: k for k, v in _SLOTS.items()}


@dataclass(frozen=True)
class _Piece:
    text: str | None  # a stretch of text (template text and caller text), or
    special: int | None = None  # one of the template's special tokens


class ChatPairs:
    """Composes one model's pairs; built once per loaded model."""

    def __init__(self, spec: LlmRerankSpec, tokenizer_json: str) -> None:
        self.spec = spec
        self._template = compile_template(spec.chat_template)
        tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        tok.no_padding()
        tok.no_truncation()
        tok.encode_special_tokens = True  # special strings are split out here, not by it
        self._tok = tok
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._specials = specials
        self._names = {i: t for t, i in specials.items()}
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )

    # -- rendering ---------------------------------------------------------------------------

    def _content(self, text: str) -> Any:
        if self.spec.message_format == "structured":
            return [{"type": "text", "text": text}]
        return text

    def render(self, query: str, document: str, instruction: str | None) -> str:
        messages = []
        if instruction is not None:
            messages.append({"role": "system", "content": self._content(instruction)})
        messages.append({"role": "query", "content": self._content(query)})
        messages.append({"role": "document", "content": self._content(document)})
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=False,
                **self.spec.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the model's chat template refused the pair: {e}") from e

    def _pieces(self, query: str, document: str, instruction: str | None) -> list[_Piece]:
        """The rendered pair as text stretches and template special tokens (module doc)."""
        probe = self.render(
            _SLOTS["query"],
            _SLOTS["document"],
            None if instruction is None else _SLOTS["instruction"],
        )
        values = {"query": query, "document": document, "instruction": instruction or ""}
        pieces: list[_Piece] = []
        text: list[str] = []
        pos = 0
        for m in [*_SLOT_RE.finditer(probe), None]:
            end = m.start() if m is not None else len(probe)
            chunk = probe[pos:end]
            last = 0
            if self._special_re is not None:
                for s in self._special_re.finditer(chunk):
                    text.append(chunk[last : s.start()])
                    pieces.append(_Piece("".join(text), None))
                    text = []
                    pieces.append(_Piece(None, self._specials[s.group()]))
                    last = s.end()
            text.append(chunk[last:])
            if m is None:
                break
            text.append(values[_SLOT_NAMES[m.group()]])
            pos = m.end()
        pieces.append(_Piece("".join(text), None))
        rebuilt = "".join(self._piece_text(p) for p in pieces)
        real = self.render(query, document, instruction)
        if rebuilt != real:
            # The template transforms the caller's text (a filter on the content): tokenize
            # what it rendered, as transformers does.
            return [_Piece(real, None)] if self._special_re is None else self._split_real(real)
        return [p for p in pieces if p.special is not None or p.text]

    def _piece_text(self, p: _Piece) -> str:
        if p.text is not None:
            return p.text
        assert p.special is not None
        return self._names[p.special]

    def _split_real(self, real: str) -> list[_Piece]:
        assert self._special_re is not None
        out: list[_Piece] = []
        last = 0
        for s in self._special_re.finditer(real):
            out.append(_Piece(real[last : s.start()], None))
            out.append(_Piece(None, self._specials[s.group()]))
            last = s.end()
        out.append(_Piece(real[last:], None))
        return [p for p in out if p.special is not None or p.text]

    def ids(self, query: str, document: str, instruction: str | None) -> list[int]:
        """The token ids of one rendered pair."""
        pieces = self._pieces(query, document, instruction)
        texts = [p.text for p in pieces if p.text is not None]
        encoded = (
            iter(self._tok.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
        )
        out: list[int] = []
        for p in pieces:
            if p.special is not None:
                out.append(p.special)
            else:
                out.extend(next(encoded).ids)
        return out

    # -- composing with a length limit ---------------------------------------------------------

    def _cut(self, text: str, keep: int, direction: str) -> str:
        """`text` cut to its first (or last) `keep` tokens, at token boundaries."""
        enc = self._tok.encode(text, add_special_tokens=False)
        if keep >= len(enc.ids):
            return text
        if keep <= 0:
            return ""
        if direction == "left":
            return text[enc.offsets[len(enc.ids) - keep][0] :]
        return text[: enc.offsets[keep - 1][1]]

    def _n_tokens(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def fit(
        self, query: str, doc: str, instruction: str | None, limit: int, direction: str = "right"
    ) -> tuple[list[int], bool, str, str]:
        """The pair's ids within `limit` (document tokens go first, then query tokens), whether
        it was cut, and the query and document texts those ids render."""
        ids = self.ids(query, doc, instruction)
        if len(ids) <= limit:
            return ids, False, query, doc
        texts = {"query": query, "document": doc}
        for field in ("document", "query"):
            whole = texts[field]
            keep = self._n_tokens(whole)
            while keep > 0 and len(ids) > limit:
                # Cutting k tokens of the text removes about k tokens of the pair; a merge at
                # the cut may cost one more round.
                keep = max(0, min(keep - 1, keep - (len(ids) - limit)))
                texts[field] = self._cut(whole, keep, direction)
                ids = self.ids(texts["query"], texts["document"], instruction)
            if len(ids) <= limit:
                return ids, True, texts["query"], texts["document"]
        raise InvalidRequest(
            f"the chat template alone ({len(ids)} tokens with an empty query and document) "
            f"exceeds the limit of {limit} tokens"
        )

    def compose(
        self,
        query: str | bytes,
        documents: Sequence[str | bytes],
        instruction: str | bytes | None,
        *,
        limit: int,
        truncate: bool,
        direction: str = "right",
        max_doc_tokens: int | None = None,
    ) -> EncodedPairs:
        q = sanitize(query)
        instr = None if instruction is None else sanitize(instruction)
        all_ids: list[np.ndarray] = []
        truncated: list[bool] = []
        for i, d in enumerate(documents):
            doc = sanitize(d)
            capped = False
            if max_doc_tokens is not None and self._n_tokens(doc) > max_doc_tokens:
                doc, capped = self._cut(doc, max_doc_tokens, direction), True
            if truncate:
                ids, cut, _, _ = self.fit(q, doc, instr, limit, direction)
            else:
                ids, cut = self.ids(q, doc, instr), False
                if len(ids) > limit:
                    raise InvalidRequest(
                        f"pair {i} has {len(ids)} tokens (rendered through the chat template), "
                        f"over the limit of {limit}; shorten it or pass truncate=true",
                        index=i,
                        n_tokens=len(ids),
                        max_tokens=limit,
                    )
            all_ids.append(np.asarray(ids, dtype=np.int32))
            truncated.append(cut or capped)
        n = [len(x) for x in all_ids]
        return EncodedPairs(
            ids=all_ids,
            token_type_ids=[np.zeros(k, np.int32) for k in n],
            n_tokens=n,
            n_first=n,  # a causal decoder has no token types: all of it is "segment A"
            truncated=truncated,
        )
