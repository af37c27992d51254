"""What the Core ML encoder graph computes per token besides its pooled vector, importable
without coremltools (the engine checks a compiled shape's outputs by these names, and the
compile-cache key names the heads built in).

A BERT or XLM-RoBERTa embedder's graph, on unpacked and packed shapes alike, also outputs:

    token_states   (rows, H, S)   every token's final hidden state, channels-first as the
                                  graph holds it (the worker transposes each item's columns)
    multivector    (rows, dim, S) the multi-vector head's projection (ColBERT's Dense
                                  layers, bge-m3's colbert_linear) of every token, L2-normalized
                                  per token when the head normalizes
    sparse_pooled  (rows, V)      SPLADE: the MLM head's vocabulary logits, `log1p(relu(.))`,
                   (rows, K, V)   pooled (max or sum) over the attended tokens of the row
                                  (unpacked) or of each of its K segments (packed), computed a
                                  vocabulary chunk at a time (`vocab_chunk`)
    token_weights  (rows, S)      bge-m3's lexical weight `relu(w . h_t + b)` of every token

A packed row's per-token outputs hold its segments side by side: the worker slices each item's
columns at its offset in the row. Its `attention_mask` input is a KEY mask on top of the
segments' block-diagonal one (0 hides a token from every query of its segment, itself
included: a multi-vector query's unattended expansion), and the per-segment pooling reads it
too.

What is per token stays per token: which tokens a multi-vector side keeps (skiplist, bge-m3's
CLS), bge-m3's largest weight per id and its dropped special ids, and SPLADE's top-k cut are
the worker's, with the same code the llama.cpp lane runs (`workers.heads`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from formats.owned.manifest import Manifest
from workers.ane.placement import MAX_ANE_DIM
from workers.ane.shapes import Shape
from workers.engine import EngineError
from workers.heads.multivector import ColbertHead
from workers.heads.sparse import LoadedSparseHeads, SpladeHead, StaticSparseHead, TokenWeightHead

TOKEN_STATES = "token_states"
MULTIVECTOR = "multivector"
SPARSE_POOLED = "sparse_pooled"
TOKEN_WEIGHTS = "token_weights"

# The graphs that give token outputs: BERT's, which XLM-RoBERTa shares, for embedders.
TOKEN_FAMILIES = ("bert", "xlm-roberta")
TOKEN_HEADS = ("embed_mean", "embed_cls")

# One vocabulary chunk's largest tensor stays within this many elements: 4 MB in fp16 on the
# device, 8 MB as the reference executor's float32. That tensor is the chunk's logits
# (rows x chunk x seq_len), except for max pooling on a packed shape, where each logit is
# compared once per segment of its row (rows x chunk x max_segments x seq_len: a max has no
# matmul form, so the segment axis is a broadcast). The vocabulary projection of a whole shape
# is never alive at once (bert-base's 30522 entries over 8 x 128 tokens would be 250M
# elements).
VOCAB_CHUNK_ELEMENTS = 1 << 21
# Chunks are whole multiples of this many vocabulary entries (a 64-byte-aligned row of fp16
# channels), at least one multiple.
VOCAB_CHUNK_ALIGN = 32


# Nor is a chunk wider than the Neural Engine's largest tensor dimension: a wider one would
# send the vocabulary projection, the head's costliest op, to the CPU on a small shape.
VOCAB_CHUNK_MAX = MAX_ANE_DIM


def vocab_chunk(shape: Shape, vocab: int, max_pooling: bool = False) -> int:
    """Vocabulary entries per chunk of SPLADE's projection at `shape`: 2048 at 8 x 128 tokens,
    512 at 8 x 512, at most 16384; with `max_pooling` on a packed shape, `max_segments` times
    fewer (256 at 8 x 128 with 8 segments). A multiple of 32 entries when 32 fit the bound,
    else as many as fit (at least one; the engine refuses a shape where one does not)."""
    per_entry = shape.rows * shape.seq_len
    if max_pooling and shape.packed:
        per_entry *= shape.max_segments
    per = VOCAB_CHUNK_ELEMENTS // max(1, per_entry)
    if per >= VOCAB_CHUNK_ALIGN:
        per = per // VOCAB_CHUNK_ALIGN * VOCAB_CHUNK_ALIGN
    return min(vocab, max(1, per), VOCAB_CHUNK_MAX)


def has_token_outputs(manifest: Manifest) -> bool:
    """Whether `manifest`'s graphs give token states (and its heads' outputs): an embedder of
    a token family's, on packed and unpacked shapes alike."""
    return manifest.config.family in TOKEN_FAMILIES and manifest.head.type in TOKEN_HEADS


def token_refusal(manifest: Manifest) -> str | None:
    """Why `manifest`'s graphs give no token outputs at all, None when they do."""
    if manifest.config.family not in TOKEN_FAMILIES:
        return (
            f"the Core ML {manifest.config.family} graph has no token outputs "
            f"(only {' and '.join(TOKEN_FAMILIES)} embedders have them)"
        )
    if manifest.head.type not in TOKEN_HEADS:
        return f"a {manifest.head.type} model has no token outputs (an embedder's graph has)"
    return None


@dataclass(frozen=True)
class GraphHeads:
    """The heads built into the graph, from the files LOAD named (loaded by
    `workers.heads.files`). At most one sparse head reads token states: an inference-free
    model's query route weighs ids alone and needs no graph."""

    multivector: ColbertHead | None = None
    splade: SpladeHead | None = None
    token_weights: TokenWeightHead | None = None
    key: dict[str, str] = field(default_factory=dict)  # hashed once: see `head_digests`

    @classmethod
    def of(cls, heads: dict[str, Any], hidden: int) -> GraphHeads:
        mv: ColbertHead | None = heads.get("multivector")
        sp: LoadedSparseHeads | None = heads.get("sparse")
        if mv is not None and mv.spec.hidden != hidden:
            raise EngineError(
                "artifact_invalid",
                f"the multi-vector head reads {mv.spec.hidden} dims, not {hidden}",
            )
        splade = weights = None
        if sp is not None:
            graphed = {id(h): h for h in sp.routes.values() if not isinstance(h, StaticSparseHead)}
            if len(graphed) > 1:
                raise EngineError(
                    "unsupported", "two sparse heads read token states; the graph builds one"
                )
            for h in graphed.values():
                if h.spec.hidden_size != hidden:
                    raise EngineError(
                        "artifact_invalid",
                        f"the sparse head reads {h.spec.hidden_size} dims, not {hidden}",
                    )
                if isinstance(h, SpladeHead):
                    splade = h
                elif isinstance(h, TokenWeightHead):
                    weights = h
        made = cls(mv, splade, weights)
        return cls(mv, splade, weights, made.head_digests())

    def output_names(self) -> list[str]:
        names = [TOKEN_STATES]
        if self.multivector is not None:
            names.append(MULTIVECTOR)
        if self.splade is not None:
            names.append(SPARSE_POOLED)
        if self.token_weights is not None:
            names.append(TOKEN_WEIGHTS)
        return names

    def key_fields(self) -> dict[str, str]:
        return dict(self.key)

    def head_digests(self) -> dict[str, str]:
        """What the compile-cache key adds: a digest per head built in (nothing without one),
        of what the graph reads of it: weights, activations, pooling. Checkpoints that differ
        only in what the worker does around the graph (prefixes, query expansion, skiplist,
        top-k, an inference-free query side) share compiled shapes."""
        fields: dict[str, str] = {}
        if self.multivector is not None:
            mv = self.multivector.spec
            graph = [mv.weights_sha256, msgspec.to_builtins(mv.layers), mv.normalize]
            fields["multivector_head"] = _digest(graph, {})
        sparse_head = self.splade or self.token_weights
        if sparse_head is not None:
            sp = msgspec.structs.replace(sparse_head.spec, prefix="", dropped_ids=())
            fields["sparse_head"] = _digest(msgspec.to_builtins(sp), sparse_head.tensors)
        return fields


def _digest(meta: object, tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name], dtype=np.float32)
        h.update(f"{name}{list(arr.shape)}".encode())
        h.update(arr.data.cast("B"))
    return h.hexdigest()
