"""Sparse heads: one `SparseVector` per sequence from its final token states and ids,
computed as the reference computes it (the formulas are stated on each class).

Memory stays bounded: a SPLADE head never holds T x V logits; it runs a chunk of tokens
through the vocabulary projection at a time (about 32 MB of logits: 256 tokens of BERT's
30522 entries, 32 of XLM-RoBERTa's 250002) and keeps one running max (or sum) per vocabulary
entry, so its peak is one chunk whatever the sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.sparse_head import HeadSpec, SparseHeads, read_spec, read_tensors
from workers.engine import EngineError

# One chunk's logits (tokens x vocabulary, f32) are kept near this size.
CHUNK_BYTES = 32 << 20
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_ERF = np.frompyfunc(math.erf, 1, 1)


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
    """transformers' ACT2FN[name] in float64: `gelu` is the erf form x * Phi(x) (numpy has no
    erf: the C library's, element by element, over H values per token); the `gelu_new` family
    is the tanh approximation."""
    if name == "gelu":
        return 0.5 * x * (1.0 + np.asarray(_ERF(x / math.sqrt(2.0)), np.float64))
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    if name == "relu":
        return np.maximum(x, 0.0)
    raise EngineError("artifact_invalid", f"hidden_act {name!r} is not computed")


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
        """Tokens per chunk: as many as keep one chunk's logits near CHUNK_BYTES (256 for
        BERT's 30522 entries, 32 for XLM-RoBERTa's 250002), at least 16."""
        return max(16, min(256, CHUNK_BYTES // (4 * self.spec.vocab_size)))

    def pooled_many(
        self, states: list[np.ndarray], chunk_tokens: int | None = None
    ) -> Iterator[np.ndarray]:
        """Each sequence's pooled (V,) vector before the top-k cut, in order. The sequences'
        tokens run through the vocabulary projection together, a chunk at a time across
        sequence boundaries: the (V, H) matrix is read once per chunk, not once per sequence
        (short texts would otherwise spend their time streaming it), and at most one chunk's
        logits and one running vector are alive.

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
        flat = np.concatenate(states)
        ends = np.cumsum([s.shape[0] for s in states])
        seq, running = 0, None
        for start in range(0, flat.shape[0], step):
            stop = min(start + step, flat.shape[0])
            if is_max:
                scores = self.transform(flat[start:stop]) @ self._dec_w.T
            else:
                scores = self.token_scores(flat[start:stop])
            # The chunk's rows split where sequences end inside it. Part k continues (k = 0)
            # or starts (k > 0) sequence `seq`; every part but the last ends its sequence, the
            # last one only where the sequence ends with the chunk.
            cuts = [start, *(int(e) for e in ends[seq:] if start < e < stop), stop]
            for k in range(len(cuts) - 1):
                part = scores[cuts[k] - start : cuts[k + 1] - start]
                row = part.max(axis=0) if is_max else part.sum(axis=0)
                running = row if running is None else reduce(running, row)
                if k < len(cuts) - 2 or ends[seq] == stop:
                    yield self._activate(running + self._dec_b) if is_max else running
                    seq, running = seq + 1, None
            del scores  # one chunk alive at a time

    def pooled(self, states: np.ndarray, chunk_tokens: int | None = None) -> np.ndarray:
        """One sequence's pooled (V,) vector before the top-k cut."""
        return next(self.pooled_many([states], chunk_tokens))

    def apply(
        self, states: np.ndarray, ids: np.ndarray, chunk_tokens: int | None = None
    ) -> SparseVector:
        return self.apply_many([states], [ids], chunk_tokens)[0]

    def apply_many(
        self, states: list[np.ndarray], ids: list[np.ndarray], chunk_tokens: int | None = None
    ) -> list[SparseVector]:
        """One vector per sequence (states (T_i, H) and ids (T_i,) each), computed together."""
        if len(states) != len(ids):
            raise EngineError("invalid_request", f"{len(states)} state sets for {len(ids)} ids")
        for h, i in zip(states, ids, strict=True):
            _check_states(h, i, self.spec.hidden_size, self.spec.vocab_size)
        return [self.from_pooled(v) for v in self.pooled_many(states, chunk_tokens)]

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
