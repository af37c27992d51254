"""Late chunking: one vector per chunk of a document, each from token states that saw the
whole document (as far as the context allows) rather than the chunk alone.

The rule:
- The document is its chunks concatenated as given, in order, with no separator (split it
  without dropping characters: keep a chunk's whitespace with it). The model's prompt, if
  any, comes before the first chunk; its tokens belong to no chunk.
- The document is read once: every token's final state from one forward pass.
- A chunk's vector is the model's mean pooling over the states of the tokens whose character
  offsets start inside the chunk, then normalized (if asked). A chunk that owns no token (an
  empty chunk, or one inside another chunk's token) is refused: it has nothing to pool.
- A document longer than the context is read in windows of the context's size (the template's
  special tokens around each) that overlap by half a window; a token's state comes from the
  window where it has the most context on both sides (the document's own ends count as
  unlimited context).
- Only mean pooling is defined here: a CLS or last-token model pools one position, which a
  chunk in the middle of a document does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.errors import InvalidRequest


@dataclass(frozen=True)
class Windows:
    """The document's windows and, for every bare token, the window its state comes from."""

    ids: list[np.ndarray]  # per window, with the template's specials
    span: list[tuple[int, int, int]]  # per window: first bare token, end, offset in its ids
    owner: np.ndarray  # per bare token, the window index


def pick_windows(n_tokens: int, windows: Sequence[tuple[np.ndarray, int, int, int]]) -> Windows:
    """For each token, the window where it is furthest from a cut edge."""
    owner = np.zeros(n_tokens, np.int64)
    best = np.full(n_tokens, -1.0)
    t = np.arange(n_tokens)
    for w, (_, a, b, _) in enumerate(windows):
        inside = (t >= a) & (t < b)
        left = np.where(a == 0, np.inf, t - a)
        right = np.where(b == n_tokens, np.inf, b - 1 - t)
        room = np.where(inside, np.minimum(left, right), -1.0)
        better = room > best
        owner[better], best[better] = w, room[better]
    return Windows([w[0] for w in windows], [(a, b, f) for _, a, b, f in windows], owner)


def token_states(picked: Windows, states: Sequence[np.ndarray]) -> np.ndarray:
    """(n_tokens, dims): each bare token's state from its window's forward pass."""
    dims = states[0].shape[1]
    out = np.empty((len(picked.owner), dims), np.float32)
    for w, (a, b, first) in enumerate(picked.span):
        mine = np.nonzero(picked.owner[a:b] == w)[0]
        out[a + mine] = states[w][first + mine]
    return out


def chunk_bounds(chunks: Sequence[str], prompt_chars: int) -> list[tuple[int, int]]:
    """Each chunk's [start, end) in `prompt + "".join(chunks)`."""
    bounds, at = [], prompt_chars
    for c in chunks:
        bounds.append((at, at + len(c)))
        at += len(c)
    return bounds


def pool_chunks(
    states: np.ndarray,
    offsets: Sequence[tuple[int, int] | None],
    bounds: Sequence[tuple[int, int]],
    normalize: bool,
) -> tuple[np.ndarray, list[int]]:
    """(vector per chunk, tokens per chunk): mean of the states of the tokens that start in
    it. Raises InvalidRequest naming a chunk that owns no token."""
    starts = np.array([o[0] if o is not None else -1 for o in offsets])
    vectors, counts = [], []
    for i, (a, b) in enumerate(bounds):
        mine = (starts >= a) & (starts < b)
        k = int(mine.sum())
        if k == 0:
            raise InvalidRequest(
                f"chunk {i} owns no token (empty, or inside a token that starts in the chunk "
                "before it): late chunking has nothing to pool for it",
                param="input",
                index=i,
            )
        vectors.append(states[mine].mean(axis=0, dtype=np.float64).astype(np.float32))
        counts.append(k)
    out = np.stack(vectors)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out, counts
