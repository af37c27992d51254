"""Heads on a causal decoder's last-token state, applied in numpy to the final hidden state
(after the output norm) at each sequence's last token, which last_states.py reads from
llama.cpp's graph (last_token.py decodes for it).

Two kinds of checkpoint give one:

- An LLM reranker (Qwen3-Reranker: a causal decoder asked whether the document answers the
  query) scores `logit[true] - logit[false]` at the last position, as sentence-transformers'
  `LogitScore` does. Both logits are rows of the LM head times the final hidden state `h`, so
  the score is `(W[true] - W[false]) . h`: one dot product per pair, never the full
  vocabulary head. The rows come from `cls.output.weight`, ordered by
  `classifier.output_labels` (true first): what llama.cpp's converter writes for Qwen3
  rerankers (the two rows of the LM head, or of the tied token embedding), and what our
  converter writes of a Hugging Face directory. llama.cpp's Gemma 3 graph loads no
  `cls.output` (a file with one does not load), so a Gemma 3 reranker's rows are read from
  the LM head llama.cpp itself uses, at the labels' token ids. llama.cpp's own RANK pooling
  softmaxes the two rows; the raw difference is kept here (log P(true) - log P(false)),
  since a logit recovered from a rounded probability loses precision past |10|.
- A decoder sequence classifier (`Qwen3ForSequenceClassification`: transformers'
  `GenericForSequenceClassification`) scores `score.weight @ h` (N labels, no bias) at the
  rightmost token whose id is not the config's `pad_token_id` (the last token when it has
  none). Our converter writes `score.weight` as `cls.output.weight` and that id under
  `SEQ_CLS_PAD` (-1: none), the key that marks the head; llama.cpp's RANK pooling would
  softmax a Qwen3 head (one label: always 1.0), so the raw rows are applied here. In a causal
  decoder the state at a position sees nothing after it, so reading the rightmost non-pad
  token is decoding the sequence without its trailing pad ids (`strip_pads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from formats.gguf_header import SEQ_CLS_PAD_KEY as SEQ_CLS_PAD
from formats.gguf_header import ArrayInfo, GGUFHeader, read_gguf_header

CLS_OUT = "cls.output.weight"
# Decoders whose llama.cpp graph loads no `cls.output`: an LLM reranker's two rows are read
# from the LM head at the labels' token ids.
_ROWS_FROM_LM_HEAD = frozenset({"gemma3"})


@dataclass(frozen=True)
class DecoderHead:
    """`rows` (k, n_embd) float64 applied to the last state: k = 1 for an LLM reranker (the
    direction W[true] - W[false]), N labels for a sequence classifier."""

    kind: Literal["llm-rerank", "classifier"]
    rows: np.ndarray
    pad_id: int | None = None

    def apply(self, hidden: np.ndarray) -> np.ndarray:
        """(n, k) float32 raw scores for the last states `hidden` (n, n_embd)."""
        return (np.asarray(hidden, np.float64) @ self.rows.T).astype(np.float32)

    def strip_pads(self, seq: np.ndarray) -> np.ndarray:
        """`seq` up to its rightmost non-pad token (transformers' pooled position; its first
        token when every one is the pad id, where its argmax lands)."""
        if self.pad_id is None:
            return seq
        real = np.flatnonzero(seq != self.pad_id)
        return seq[: int(real[-1]) + 1 if real.size else 1]


def is_sequence_classifier(hdr: GGUFHeader) -> bool:
    return SEQ_CLS_PAD in hdr.kv


def _head_tensor(hdr: GGUFHeader):
    return next((t for t in hdr.tensors if t.name == CLS_OUT), None)


def has_rows(hdr: GGUFHeader, n: int) -> bool:
    """Whether the classifier head is `n` rows of the hidden width."""
    t = _head_tensor(hdr)
    width = hdr.arch_get("embedding_length")
    return t is not None and len(t.shape) == 2 and t.shape[1] == n and t.shape[0] == width


def _lm_head(hdr: GGUFHeader):
    """The LM head llama.cpp computes logits with: `output.weight`, else the token embedding
    it ties to (what llama.cpp's loaders duplicate when the file has no output)."""
    by_name = {t.name: t for t in hdr.tensors}
    return by_name.get("output.weight") or by_name.get("token_embd.weight")


def has_two_rows(hdr: GGUFHeader) -> bool:
    """Whether the GGUF's classifier head is two rows of the hidden width (an LLM reranker's),
    or, for a graph that loads no `cls.output` (Gemma 3), whether it names two labels whose
    rows the LM head holds."""
    if _head_tensor(hdr) is None and hdr.architecture in _ROWS_FROM_LM_HEAD:
        labels = hdr.arch_get("classifier.output_labels")
        head = _lm_head(hdr)
        width = hdr.arch_get("embedding_length")
        n = labels.length if isinstance(labels, ArrayInfo) else None
        return n == 2 and head is not None and head.shape[0] == width
    return has_rows(hdr, 2)


def _lm_head_rows(path: str | Path, hdr: GGUFHeader) -> np.ndarray:
    """The two labels' rows of the LM head, float64 (2, n_embd); the labels are looked up in
    the GGUF's vocabulary (first occurrence, as ingest picked them)."""
    arch = hdr.architecture
    full = read_gguf_header(
        path, want_arrays=frozenset({f"{arch}.classifier.output_labels", "tokenizer.ggml.tokens"})
    )
    labels = full.arch_get("classifier.output_labels")
    tokens = full.kv.get("tokenizer.ggml.tokens")
    if not isinstance(labels, list) or not isinstance(tokens, list):
        raise ValueError("no classifier.output_labels / tokenizer.ggml.tokens to find the rows")
    index = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    missing = [label for label in labels if label not in index]
    if missing:
        raise ValueError(f"label {missing[0]!r} is not a token of the vocabulary")
    t = _lm_head(hdr)
    assert t is not None
    n_vocab = int(t.shape[1])
    row_bytes = t.nbytes // n_vocab
    out = []
    for label in labels:
        start = hdr.data_offset + t.offset + index[label] * row_bytes
        raw = np.memmap(path, np.uint8, "r", start, (1, row_bytes))
        row = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(t.type))
        out.append(np.asarray(row, np.float64).reshape(int(t.shape[0])))
    return np.stack(out)


def head_rows(path: str | Path, hdr: GGUFHeader) -> np.ndarray:
    """Every row of `cls.output.weight` in float64 (n_rows, n_embd), widened from the file's
    type (f32, f16, bf16 or a quantized type, as llama.cpp's `get_rows` widens them)."""
    t = _head_tensor(hdr)
    assert t is not None
    n_rows = int(t.shape[1])
    raw = np.memmap(path, np.uint8, "r", hdr.data_offset + t.offset, (n_rows, t.nbytes // n_rows))
    rows = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(t.type))
    return np.asarray(rows, np.float64).reshape(n_rows, int(t.shape[0]))


def score_direction(path: str | Path, hdr: GGUFHeader) -> np.ndarray:
    """`W[true] - W[false]` in float64 (n_embd,): `cls.output.weight`'s rows, or the LM
    head's for a graph that loads no `cls.output` (Gemma 3)."""
    rows = head_rows(path, hdr) if _head_tensor(hdr) is not None else _lm_head_rows(path, hdr)
    return rows[0] - rows[1]


def load_head(path: str | Path, hdr: GGUFHeader) -> DecoderHead:
    """The head of an LLM reranker or decoder sequence classifier GGUF (model_kind decided
    which it is)."""
    if is_sequence_classifier(hdr):
        pad = hdr.kv[SEQ_CLS_PAD]
        if not isinstance(pad, int) or pad < -1:
            raise ValueError(f"{SEQ_CLS_PAD} {pad!r} is not a token id or -1")
        return DecoderHead("classifier", head_rows(path, hdr), None if pad == -1 else pad)
    return DecoderHead("llm-rerank", score_direction(path, hdr)[None, :])


def scores(hidden: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """One raw score per row of `hidden` (n, n_embd), float32."""
    return (np.asarray(hidden, np.float64) @ direction).astype(np.float32)
