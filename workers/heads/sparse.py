"""Sparse heads: one `SparseVector` per sequence from its final token states and ids,
computed as the reference computes it (the formulas are stated on each class).

Memory stays bounded: a SPLADE head never holds T x V logits; it runs chunks of tokens
through the vocabulary projection (about 32 MB of logits each: 256 tokens of BERT's 30522
entries, 32 of XLM-RoBERTa's 250002), one per thread at a time, and keeps one running max (or
sum) per vocabulary entry, so its peak is a few chunks whatever the sequence length
(`working_bytes` states the bound).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.sparse_head import HeadSpec, SparseHeads, read_spec, read_tensors
from workers.engine import EngineError
from workers.heads import erf

# One chunk's logits (tokens x vocabulary, f32) are kept near this size.
CHUNK_BYTES = 32 << 20
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True, slots=True)
class SparseVector:
    """The non-zero entries of one vocabulary-sized vector: `indices` int32 ascending,
    `values` float32."""

    indices: np.ndarray
    values: np.ndarray

    def to_dense(self, size: int) -> np.ndarray:
        out = np.zeros(size, np.float32)
        out[self.indices] = self.values
        return out


def _sparse(dense_or_ids: np.ndarray, values: np.ndarray, top_k: int | None) -> SparseVector:
    """The non-zero `values` at `dense_or_ids` (ascending ids), cut to the `top_k` largest by
    absolute value as sentence-transformers' `select_max_active_dims` cuts them (`topk` of
    `abs`; a tie at the cut, which torch leaves unspecified, keeps the lower id)."""
    keep = values != 0
    ids, vals = dense_or_ids[keep], values[keep]
    if top_k is not None and ids.size > top_k:
        order = np.lexsort((ids, -np.abs(vals)))[:top_k]
        order.sort()  # ids ascend already; the kept positions stay in that order
        ids, vals = ids[order], vals[order]
    return SparseVector(ids.astype(np.int32), vals.astype(np.float32))


def _check_states(states: np.ndarray, ids: np.ndarray, hidden: int, vocab: int) -> None:
    if states.ndim != 2 or states.shape[1] != hidden:
        raise EngineError("invalid_request", f"token states {states.shape}, expected (T, {hidden})")
    _check_ids(ids, vocab, states.shape[0])


def _check_ids(ids: np.ndarray, vocab: int, count: int | None = None) -> None:
    if ids.ndim != 1 or (count is not None and ids.shape[0] != count):
        raise EngineError("invalid_request", f"token ids {ids.shape}, expected ({count},)")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise EngineError("invalid_request", f"a token id is outside the vocabulary of {vocab}")


def _activation(x: np.ndarray, name: str) -> np.ndarray:
    """transformers' ACT2FN[name] in float64: `gelu` is the erf form x * Phi(x) (erf.py); the
    `gelu_new` family is the tanh approximation."""
    if name == "gelu":
        return erf.gelu(x)
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    if name == "relu":
        return np.maximum(x, 0.0)
    raise EngineError("artifact_invalid", f"hidden_act {name!r} is not computed")


def working_bytes(vocab: int, hidden: int, tokens: int, threads: int, chunk_tokens: int) -> int:
    """An upper bound of what `SpladeHead.apply_many` allocates beyond its inputs for `tokens`
    tokens in all, on `threads` threads: per chunk in flight (`threads` of them, plus one being
    folded in) its float32 logits, one float32 row per sequence it touches (at most one a
    token) and its float64 transform (a few H-wide arrays a token); one running vector and
    the yielded ones' sparse copies (V each)."""
    step = max(1, min(tokens, chunk_tokens))
    per_chunk = 2 * step * vocab * 4 + 6 * step * hidden * 8
    return (max(1, threads) + 1) * per_chunk + 3 * vocab * 8


def splade_request_bytes(vocab: int, hidden: int, tokens: int, threads: int) -> int:
    """What a SPLADE request of `tokens` tokens adds to a worker that has already decoded its
    longest input once (its contexts' buffers are then grown): the float32 token states the
    decodes hand over (one copy) and the head's `working_bytes` at its default chunk."""
    return tokens * hidden * 4 + working_bytes(
        vocab, hidden, tokens, threads, default_chunk_tokens(vocab)
    )


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: as many as keep one chunk's logits near CHUNK_BYTES (256 for BERT's
    30522 entries, 32 for XLM-RoBERTa's 250002), at least 16."""
    return max(16, min(256, CHUNK_BYTES // (4 * vocab)))


class SpladeHead:
    """sentence-transformers' `Transformer(fill-mask)` + `SpladePooling`, per sequence:

        logits_t = W_dec . LayerNorm(act(W_d h_t + b_d)) + b_dec          (the MLM head)
        v        = pool_t log1p(relu(logits_t))     (log1p twice for `log1p_relu`)

    pooled by max or sum over every token the model attended (special tokens included:
    SpladePooling masks only padding, and a sequence here has none)."""

    def __init__(self, spec: HeadSpec, tensors: dict[str, np.ndarray], top_k: int | None):
        self.spec, self.top_k = spec, top_k
        self.tensors = tensors  # f32, as the file holds them (an engine's graph reads them)
        self._dense_w = np.asarray(tensors["dense.weight"], np.float64)
        self._dense_b = np.asarray(tensors["dense.bias"], np.float64)
        self._norm_w = np.asarray(tensors["norm.weight"], np.float64)
        self._norm_b = np.asarray(tensors["norm.bias"], np.float64)
        self._dec_w = tensors["decoder.weight"]  # (V, H) f32, a view of the file's map
        self._dec_b = tensors["decoder.bias"]

    def transform(self, states: np.ndarray) -> np.ndarray:
        """The MLM head's transform (dense -> activation -> LayerNorm) of a few tokens, in
        float64 (H values each), rounded once to float32 for the vocabulary projection."""
        x = np.asarray(states, np.float64) @ self._dense_w.T + self._dense_b
        x = _activation(x, self.spec.hidden_act)
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        x = (x - mean) / np.sqrt(var + self.spec.layer_norm_eps) * self._norm_w + self._norm_b
        return x.astype(np.float32)

    def _activate(self, logits: np.ndarray) -> np.ndarray:
        """log1p(relu(.)) in place (twice log1p for `log1p_relu`)."""
        np.maximum(logits, 0.0, out=logits)
        np.log1p(logits, out=logits)
        if self.spec.activation == "log1p_relu":
            np.log1p(logits, out=logits)
        return logits

    def token_scores(self, states: np.ndarray) -> np.ndarray:
        """log1p(relu(logits)) of a few tokens, (n, V) float32: one chunk's worth."""
        logits = self.transform(states) @ self._dec_w.T
        logits += self._dec_b
        return self._activate(logits)

    def chunk_tokens(self) -> int:
        """Tokens per chunk (`default_chunk_tokens`)."""
        return default_chunk_tokens(self.spec.vocab_size)

    def _chunk_parts(
        self, states: list[np.ndarray], ends: np.ndarray, start: int, stop: int
    ) -> list[tuple[int, np.ndarray, bool]]:
        """Tokens [start, stop) of the sequences laid end to end, through the vocabulary
        projection: for each sequence the chunk touches, (its index, the max (or sum) of its
        rows here, whether it ends here). Only this chunk's rows are gathered: the sequences
        are never copied whole."""
        first = int(np.searchsorted(ends, start, side="right"))
        pieces, spans = [], []
        seq = first
        while seq < len(states) and (ends[seq] - states[seq].shape[0]) < stop:
            begin = int(ends[seq]) - states[seq].shape[0]
            lo, hi = max(start, begin), min(stop, int(ends[seq]))
            pieces.append(states[seq][lo - begin : hi - begin])
            spans.append((seq, lo - start, hi - start, hi == int(ends[seq])))
            seq += 1
        rows = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        is_max = self.spec.pooling == "max"
        if is_max:  # raw logits: the bias and activation come after the max (pooled_many)
            scores = self.transform(rows) @ self._dec_w.T
        else:
            scores = self.token_scores(rows)
        return [
            (i, scores[a:b].max(axis=0) if is_max else scores[a:b].sum(axis=0), done)
            for i, a, b, done in spans
        ]

    def pooled_many(
        self, states: list[np.ndarray], chunk_tokens: int | None = None, threads: int = 1
    ) -> Iterator[np.ndarray]:
        """Each sequence's pooled (V,) vector before the top-k cut, in order. The sequences'
        tokens run through the vocabulary projection together, a chunk at a time across
        sequence boundaries: the (V, H) matrix is read once per chunk, not once per sequence
        (short texts would otherwise spend their time streaming it).

        `threads` chunks run at once (numpy's matmul and ufuncs release the GIL; each chunk's
        matmul is one BLAS call, so the worker's cores share the head without touching the
        BLAS library's own thread count). Memory is bounded by `working_bytes`: at most
        `threads` chunks in flight plus one being folded in, each its logits and one row per
        sequence it touches (never more rows than its tokens), and one running vector.

        Max pooling takes the max of the raw logits and then adds the bias and applies
        log1p(relu(.)): those are non-decreasing in the logit, in float32 as in exact
        arithmetic, so this is the same float as the max of the transformed logits, for V
        operations per sequence instead of T x V."""
        if any(s.shape[0] == 0 for s in states):
            raise EngineError("invalid_request", "a sequence of no tokens has no sparse vector")
        if not states:
            return
        step = chunk_tokens or self.chunk_tokens()
        is_max = self.spec.pooling == "max"
        reduce = np.maximum if is_max else np.add
        ends = np.cumsum([s.shape[0] for s in states])
        chunks = ((a, min(a + step, int(ends[-1]))) for a in range(0, int(ends[-1]), step))
        running: np.ndarray | None = None
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        try:
            pending: deque[Future[list[tuple[int, np.ndarray, bool]]]] = deque()

            def submit() -> None:
                chunk = next(chunks, None)
                if chunk is not None and pool is not None:
                    pending.append(pool.submit(self._chunk_parts, states, ends, *chunk))
                elif chunk is not None:
                    done: Future[list[tuple[int, np.ndarray, bool]]] = Future()
                    done.set_result(self._chunk_parts(states, ends, *chunk))
                    pending.append(done)

            for _ in range(max(1, threads)):
                submit()
            while pending:
                parts = pending.popleft().result()
                submit()  # keeps `threads` chunks in flight while this one is folded in
                for _, row, ends_here in parts:
                    running = row if running is None else reduce(running, row, out=running)
                    if ends_here:
                        yield self._activate(running + self._dec_b) if is_max else running
                        running = None
                del parts
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def pooled(self, states: np.ndarray, chunk_tokens: int | None = None) -> np.ndarray:
        """One sequence's pooled (V,) vector before the top-k cut."""
        return next(self.pooled_many([states], chunk_tokens))

    def apply(
        self, states: np.ndarray, ids: np.ndarray, chunk_tokens: int | None = None
    ) -> SparseVector:
        return self.apply_many([states], [ids], chunk_tokens)[0]

    def apply_many(
        self,
        states: list[np.ndarray],
        ids: list[np.ndarray],
        chunk_tokens: int | None = None,
        threads: int = 1,
    ) -> list[SparseVector]:
        """One vector per sequence (states (T_i, H) and ids (T_i,) each), computed together
        on `threads` threads."""
        if len(states) != len(ids):
            raise EngineError("invalid_request", f"{len(states)} state sets for {len(ids)} ids")
        for h, i in zip(states, ids, strict=True):
            _check_states(h, i, self.spec.hidden_size, self.spec.vocab_size)
        return [self.from_pooled(v) for v in self.pooled_many(states, chunk_tokens, threads)]

    def from_pooled(self, pooled: np.ndarray) -> SparseVector:
        """The vector of one sequence's pooled (V,) scores (this head's or an engine's that
        pooled them itself, as the Core ML graph does): its non-zero entries, top-k cut."""
        return _sparse(np.arange(self.spec.vocab_size), np.asarray(pooled), self.top_k)


class StaticSparseHead:
    """`SparseStaticEmbedding` (inference-free SPLADE's query side): no transformer. Its
    forward scatters the attention mask into a presence vector at the input ids, so each
    distinct id counts once, and multiplies by the per-vocabulary weight: `v[i] = weight[i]`
    for every id `i` in the text. Its tokenizer adds no special tokens; ids given here are
    taken as they are."""

    def __init__(self, spec: HeadSpec, tensors: dict[str, np.ndarray], top_k: int | None):
        self.spec, self.top_k = spec, top_k
        self._weight = tensors["weight"]

    def apply(self, ids: np.ndarray) -> SparseVector:
        _check_ids(ids, self.spec.vocab_size)
        present = np.unique(ids)
        return _sparse(present, self._weight[present], self.top_k)


class TokenWeightHead:
    """bge-m3's lexical weights as FlagEmbedding's `BGEM3FlagModel.encode(return_sparse=True)`
    computes them (FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py,
    `EncoderOnlyEmbedderM3Model._sparse_embedding` with `return_embedding=False`; then
    FlagEmbedding/inference/embedder/encoder_only/m3.py, `_process_token_weights`):

        w_t = relu(sparse_linear(h_t))                      (Linear(H, 1) on the last state)
        v[i] = max { w_t : ids_t == i, w_t > 0 }   for i not in {cls, eos, pad, unk} ids

    (the unused ids are the tokenizer's `special_tokens_map` entries of those four names; a
    token id none of whose weights is positive is absent)."""

    def __init__(self, spec: HeadSpec, tensors: dict[str, np.ndarray], top_k: int | None):
        self.spec, self.top_k = spec, top_k
        self.tensors = tensors  # f32, as the file holds them (an engine's graph reads them)
        self._w = np.asarray(tensors["weight"][0], np.float32)
        self._b = np.float32(tensors["bias"][0])
        self._dropped = np.asarray(spec.dropped_ids, np.int64)

    def token_weights(self, states: np.ndarray) -> np.ndarray:
        w = np.asarray(states, np.float32) @ self._w + self._b
        return np.maximum(w, np.float32(0.0))

    def apply(self, states: np.ndarray, ids: np.ndarray) -> SparseVector:
        _check_states(states, ids, self.spec.hidden_size, self.spec.vocab_size)
        return self.from_weights(self.token_weights(states), ids)

    def from_weights(self, weights: np.ndarray, ids: np.ndarray) -> SparseVector:
        """The vector of one sequence's per-token weights `relu(w . h_t + b)` (this head's, or
        an engine's that computed them itself, as the Core ML graph does) at its ids: the
        largest per id, the dropped ids left out."""
        weights = np.asarray(weights, np.float32)
        if weights.shape != ids.shape:
            raise EngineError("invalid_request", f"{weights.shape} weights for {ids.shape} ids")
        _check_ids(ids, self.spec.vocab_size)
        keep = ~np.isin(ids, self._dropped)
        ids, weights = ids[keep].astype(np.int64), weights[keep]
        if ids.size == 0:
            return _sparse(ids, weights, None)
        order = np.argsort(ids, kind="stable")
        unique, starts = np.unique(ids[order], return_index=True)
        return _sparse(unique, np.maximum.reduceat(weights[order], starts), self.top_k)


Head = SpladeHead | StaticSparseHead | TokenWeightHead


@dataclass(frozen=True)
class LoadedSparseHeads:
    """A model's sparse heads by route ("query", "document"); a symmetric model's two routes
    are the same object."""

    spec: SparseHeads
    routes: dict[str, Head]

    def for_route(self, route: str | None) -> Head:
        """The head of `route`, or of the default route when the request names none."""
        name = route if route is not None else self.spec.default_route
        if name is None or name not in self.routes:
            raise EngineError(
                "invalid_request",
                f"sparse route {route!r}: this model's routes are {sorted(self.routes)}"
                + ("" if self.spec.default_route else " and it has no default"),
            )
        return self.routes[name]

    @property
    def query_needs_forward(self) -> bool:
        return not isinstance(self.routes["query"], StaticSparseHead)


_KINDS: dict[str, type[Head]] = {
    "splade": SpladeHead,
    "static": StaticSparseHead,
    "token_weights": TokenWeightHead,
}


def load(head_dir: Path) -> LoadedSparseHeads:
    """The heads ingest wrote to `head_dir` (`heads/sparse.json` + `sparse.safetensors`);
    `SparseHeadInvalid` (artifact_invalid) when they are missing or inconsistent."""
    spec = read_spec(head_dir)
    tensors = read_tensors(head_dir, spec)
    by_prefix: dict[str, Head] = {}
    routes: dict[str, Head] = {}
    for name, head in spec.routes.items():
        if head.prefix not in by_prefix:
            by_prefix[head.prefix] = _KINDS[head.kind](
                head, tensors[head.prefix], spec.max_active_dims
            )
        routes[name] = by_prefix[head.prefix]
    return LoadedSparseHeads(spec, routes)
