"""Splitting tokenized inputs into EMBED_BATCH-sized chunks.

A chunk never exceeds `max_tokens` ids, `max_items` items, nor — since one raw frame carries
all its ids and one carries all its vectors — `max_frame` bytes either way. An item that alone
exceeds `max_tokens` still gets a chunk of its own (the tokenizer's limit, not the batch
budget, decides whether an item is too long). Order is preserved.
"""

from __future__ import annotations


def plan_chunks(
    lengths: list[int], max_tokens: int, max_items: int, max_frame: int, dims: int
) -> list[range]:
    """Consecutive index ranges covering `lengths`."""
    if max_tokens < 1 or max_items < 1:
        raise ValueError("budgets must be positive")
    max_items = min(max_items, max(1, max_frame // max(1, dims * 4)))
    max_tokens = min(max_tokens, max_frame // 4)
    chunks: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        count = i - start
        if count and (tokens + n > max_tokens or count >= max_items):
            chunks.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        chunks.append(range(start, len(lengths)))
    return chunks
