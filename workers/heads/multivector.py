"""The multi-vector (late interaction) head: one vector per token from the engine's final token
states, numpy only (workers have no torch), as each kind's reference computes it.

**ColBERT** (`kind == "colbert"`): sentence-transformers 6 `MultiVectorEncoder`
(`sentence_transformers/multi_vector_encoder/model.py`, its `MultiVectorMask`, the backbone
`Transformer.preprocess`):

- the input: the side's prompt ("[Q] ", "[unused0] "...) is prepended to the text as any
  sentence-transformers prompt is; a prefix that is one (special) token lands right after
  [CLS]. Each side is cut to its length (`query_length` / `document_length`) keeping the
  closing [SEP]. With query expansion, a query is padded up to `length` tokens with the mask
  token placed *after* [SEP] ("fixed" also cuts longer queries to `length`). `prepare_ids` does
  all of this to the ids of the bare text, so llama.cpp reads the tokens the transformer read.
- attention: with `attend=True` the expansion tokens are ordinary tokens of the sequence. With
  `attend=False` (classic ColBERT, PyLate's default) their attention-mask entry is 0: every
  position, themselves included, is blind to them, while their own states are still computed
  and scored. llama.cpp's attention cannot hide a token from itself, so such queries need an
  engine that owns its mask: `needs_owned_mask("query")` says so, and `apply` refuses them
  unless its caller says it built that mask (`owned_mask=True`) rather than approximate.
- the head: each `Dense` layer (`linear`, bias if it has one, then its activation; ColBERT
  checkpoints use Identity) on every token state, then the scoring mask: on the skiplist sides
  (documents by default) tokens whose id is in the skiplist (punctuation) are dropped; every
  other token is kept, [CLS], the prefix, [SEP] and the expansion tokens included. Then
  token-level `Normalize` (torch's `F.normalize`: x / max(|x|, 1e-12)). The vectors come out in
  token order.

**bge-m3** (`kind == "bge-m3"`): FlagEmbedding's `BGEM3FlagModel` `colbert_vecs`
(FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py `_colbert_embedding`:
`colbert_linear(last_hidden_state[:, 1:]) * mask[:, 1:]`, then `F.normalize` in
`EncoderOnlyEmbedderM3ModelForInference.forward` as `normalize_embeddings=True` by default;
FlagEmbedding/inference/embedder/encoder_only/m3.py `_process_colbert_vecs` keeps the first
`sum(attention_mask) - 1`): one vector per token but the first (CLS), the closing </s> kept.

**Scores**: `maxsim` is the sum over query vectors of the best dot product with any document
vector (sentence-transformers' `maxsim`, a `MultiVectorEncoder`'s default similarity): what
rerank with a multi-vector model returns. `mean_maxsim` divides it by the number of query
vectors: sentence-transformers' `meanmaxsim` and bge-m3's `colbert_score`
(`M3Embedder.colbert_score` divides by `q_reps.size(0)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import ArtifactInvalid
from formats.multivector_head import SIDES, Layer, MultiVectorSpec, Side, read_head
from formats.multivector_head import maxsim as maxsim  # the score, beside the head it scores
from formats.multivector_head import mean_maxsim as mean_maxsim
from workers.engine import EngineError

# torch.nn.functional.normalize's default eps.
_NORM_EPS = 1e-12
# sentence-transformers' score for a document with no scoreable vector (below any real score).


def _activation(layer: Layer, x: np.ndarray) -> np.ndarray:
    if layer.activation == "tanh":
        return np.tanh(x)
    if layer.activation == "relu":
        return np.maximum(x, 0.0)
    return x


@dataclass(frozen=True)
class ColbertHead:
    """One model's multi-vector head (either kind), loaded from what ingest wrote."""

    spec: MultiVectorSpec
    layers: tuple[tuple[np.ndarray, np.ndarray | None], ...]

    def _side(self, side: str) -> Side:
        if side not in SIDES:
            raise EngineError("invalid_request", f"side {side!r}: expected 'query' or 'document'")
        return side  # type: ignore[return-value]

    def needs_owned_mask(self, side: str) -> bool:
        """Whether this side's inputs need an attention mask that hides the query expansion
        tokens from every position, themselves included: an engine whose attention cannot
        express that (llama.cpp) must refuse the side instead of approximating it."""
        exp = self.spec.expansion
        return self._side(side) == "query" and exp is not None and not exp.attend

    def prepare_ids(
        self,
        ids: np.ndarray | list[int],
        side: str,
        limit: int | None = None,
        *,
        prompt_applied: bool = False,
    ) -> np.ndarray:
        return self.prepare(ids, side, limit, prompt_applied=prompt_applied)[0]

    def prepare(
        self,
        ids: np.ndarray | list[int],
        side: str,
        limit: int | None = None,
        *,
        prompt_applied: bool = False,
    ) -> tuple[np.ndarray, int]:
        """`prepare_ids`, and how many of its leading ids precede the query expansion (all of
        them when nothing was appended): the positions an attention mask that hides the
        expansion (`needs_owned_mask`) leaves visible."""
        """The ids the reference's transformer reads for a text whose tokenizer encoding (with
        its special tokens, without the prompt) is `ids`: the side's prefix inserted after the
        leading special token(s), cut to the side's length (and to `limit`, the model's own
        token limit, as the reference cuts prompt + text) keeping the closing special
        token(s), and (queries) padded with the expansion token. i32.

        `prompt_applied`: `ids` already encode the side's prompt + the text (the caller
        prepended the prompt before tokenizing), so nothing is inserted. Needed when the
        prompt's ids cannot simply be inserted (`spec.prefix_insertable` false); with a legacy
        marker the host's tokenizer does not hold as one token, only insertion is exact."""
        s = self.spec
        which = self._side(side)
        out = np.asarray(ids, dtype=np.int64).reshape(-1)
        lead, close = s.leading_specials, s.closing_specials
        if out.size < lead + close:
            raise EngineError(
                "invalid_request",
                f"{out.size} ids: a tokenized text has at least {lead + close} special tokens",
            )
        prefix = s.query_prefix_ids if which == "query" else s.document_prefix_ids
        if prefix and not prompt_applied:
            if not s.prefix_insertable:
                raise EngineError(
                    "unsupported",
                    "this model's prompt does not tokenize to ids inserted after the leading "
                    "special token: prepend the prompt text before tokenizing",
                )
            out = np.concatenate([out[:lead], np.asarray(prefix, np.int64), out[lead:]])
        exp = s.expansion if which == "query" else None
        cap = s.query_length if which == "query" else s.document_length
        if exp is not None and exp.strategy == "fixed":
            cap = exp.length
        elif exp is not None and cap is not None:
            cap = max(cap, exp.length)
        if limit is not None and not (exp is not None and exp.strategy == "fixed"):
            cap = limit if cap is None else min(cap, limit)
        if cap is not None and out.size > cap:
            if cap < lead + close:
                raise EngineError("invalid_request", f"a length cap of {cap} tokens")
            out = np.concatenate([out[: cap - close], out[out.size - close :]])
        attended = int(out.size)
        if exp is not None and out.size < exp.length:
            pad = np.full(exp.length - out.size, exp.token_id, np.int64)
            out = np.concatenate([out, pad])
        return out.astype(np.int32), attended

    def apply(
        self,
        states: np.ndarray,
        ids: np.ndarray | list[int],
        side: str,
        *,
        owned_mask: bool = False,
    ) -> np.ndarray:
        """The output vectors (T', dim) f32, in token order, of one sequence whose final token
        states are `states` (T, hidden) for the ids `ids` (T,) the engine read (what
        `prepare_ids` returned, special tokens included). `owned_mask`: the caller's engine
        built the attention mask `needs_owned_mask` asks for; without it such a side is
        refused, never served approximately."""
        return self.apply_many([states], [ids], side, owned_mask=owned_mask)[0]

    def apply_many(
        self,
        states: Sequence[np.ndarray],
        ids: Sequence[np.ndarray | list[int]],
        side: str,
        *,
        owned_mask: bool = False,
    ) -> list[np.ndarray]:
        """`apply` of each sequence, their kept rows through the layers as one matrix (one
        matmul a layer instead of one a sequence: short texts spent their time in the calls)."""
        s = self.spec
        kept = []
        for h, i in zip(states, ids, strict=True):
            rows = np.asarray(h, dtype=np.float32)
            tok = np.asarray(i).reshape(-1)
            keep = self.kept(tok, side, owned_mask=owned_mask, rows=rows, width=s.hidden)
            kept.append(rows[keep])
        if not kept:
            return []
        x = np.concatenate(kept) if len(kept) > 1 else kept[0]
        for layer, (w, b) in zip(s.layers, self.layers, strict=True):
            x = x @ w.T
            if b is not None:
                x = x + b
            x = _activation(layer, x)
        x = self._normalized(x)
        return np.split(x, np.cumsum([k.shape[0] for k in kept])[:-1])

    def select(
        self,
        projected: np.ndarray,
        ids: np.ndarray | list[int],
        side: str,
        *,
        owned_mask: bool = False,
    ) -> np.ndarray:
        """`apply` for an engine that ran the projection (and its normalization) itself on
        every token, as the Core ML graph does: the same tokens kept, in token order, and
        normalized again in float32 (an fp16 norm is 1 only to ~1e-3)."""
        tok = np.asarray(ids).reshape(-1)
        x = np.asarray(projected, dtype=np.float32)
        keep = self.kept(tok, side, owned_mask=owned_mask, rows=x, width=self.spec.dim)
        return self._normalized(x[keep])

    def kept(
        self,
        tok: np.ndarray,
        side: str,
        *,
        owned_mask: bool,
        rows: np.ndarray,
        width: int,
    ) -> np.ndarray:
        """Which of a sequence's tokens have a vector: every one but [CLS] for bge-m3, and not
        the skiplist's on its sides; `rows` (T, width) are checked against the ids. A side
        whose mask the engine did not build is refused here, never approximated."""
        s = self.spec
        which = self._side(side)
        if self.needs_owned_mask(which) and not owned_mask:
            raise EngineError(
                "unsupported",
                "this model's query expansion hides the expansion tokens from every position, "
                "themselves included; this engine's attention cannot express that mask",
            )
        if rows.ndim != 2 or rows.shape[1] != width or rows.shape[0] != tok.size:
            raise EngineError(
                "invalid_request",
                f"states {rows.shape} for {tok.size} ids: expected ({tok.size}, {width})",
            )
        keep = np.ones(tok.size, dtype=bool)
        if s.drop_first:
            keep[:1] = False
        if s.skiplist_ids and which in s.skiplist_sides:
            keep &= ~np.isin(tok, np.asarray(s.skiplist_ids, dtype=tok.dtype))
        return keep

    def _normalized(self, x: np.ndarray) -> np.ndarray:
        if self.spec.normalize:
            norms = np.linalg.norm(x, axis=1, keepdims=True)
            x = x / np.maximum(norms, _NORM_EPS)
        return np.ascontiguousarray(x, dtype=np.float32)


def load(head: Path) -> ColbertHead:
    """The head ingest wrote: `<model>/heads`, or its spec file `heads/multivector.json` (the
    file the manifest names and digests); a missing or inconsistent file is the worker's
    `artifact_invalid`."""
    try:
        spec, layers = read_head(Path(head))
    except ArtifactInvalid as e:
        raise EngineError("artifact_invalid", e.message) from e
    return ColbertHead(spec=spec, layers=tuple(layers))
