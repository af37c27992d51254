"""The LLM reranker's head: the two LM-head rows its score reads, applied in numpy to the
final hidden state llama.cpp pools at each sequence's last token.

An LLM reranker (Qwen3-Reranker: a causal decoder asked whether the document answers the
query) scores `logit[true] - logit[false]` at the last position, as sentence-transformers'
`LogitScore` does. Both logits are rows of the LM head times the final hidden state `h`
(after the output norm), so the score is `(W[true] - W[false]) . h`: one dot product per
pair, never the full vocabulary head. The worker decodes with LAST pooling (llama.cpp's
per-sequence final hidden state after the output norm, before the LM head) and applies it.

The rows come from `cls.output.weight`, ordered by `classifier.output_labels` (true first):
what llama.cpp's converter writes for Qwen3 rerankers (the two rows of the LM head, or of the
tied token embedding), and what our converter writes of a Hugging Face directory. llama.cpp's
own RANK pooling softmaxes the two rows; the raw difference is kept here (log P(true) -
log P(false)), since a logit recovered from a rounded probability loses precision past |10|.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from formats.gguf_header import GGUFHeader

CLS_OUT = "cls.output.weight"


def has_two_rows(hdr: GGUFHeader) -> bool:
    """Whether the GGUF's classifier head is two rows of the hidden width (an LLM reranker's)."""
    t = next((t for t in hdr.tensors if t.name == CLS_OUT), None)
    width = hdr.arch_get("embedding_length")
    return t is not None and len(t.shape) == 2 and t.shape[1] == 2 and t.shape[0] == width


def score_direction(path: str | Path, hdr: GGUFHeader) -> np.ndarray:
    """`W[true] - W[false]` in float64 (n_embd,), widened from the file's type (f32, f16,
    bf16 or a quantized type, as llama.cpp's `get_rows` widens them)."""
    t = next(t for t in hdr.tensors if t.name == CLS_OUT)
    raw = np.memmap(path, np.uint8, "r", hdr.data_offset + t.offset, (2, t.nbytes // 2))
    rows = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(t.type))
    rows = np.asarray(rows, np.float64).reshape(2, int(t.shape[0]))
    return rows[0] - rows[1]


def scores(hidden: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """One raw score per row of `hidden` (n, n_embd), float32."""
    return (np.asarray(hidden, np.float64) @ direction).astype(np.float32)
