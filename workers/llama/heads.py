"""The heads a llama.cpp embedder carries on its token states, loaded with the model
(`workers.heads.files`, digests checked first), and what each needs of the decode: the ids it
reads (a multi-vector model's prefix and query expansion) and whether llama.cpp's attention
can give it its states at all.
"""

from __future__ import annotations

import numpy as np

from workers.engine import EngineError, Section, sparse_section
from workers.heads import multivector, sparse
from workers.heads.files import load_heads as load_heads  # loaded with the model
from workers.llama.native import LoadedModel
from workers.protocol import messages as m


def sparse_needs_states(mdl: LoadedModel, side: str) -> bool:
    """Whether this side's sparse vector is read off token states (an inference-free query
    side weighs its ids alone: no forward pass)."""
    return not isinstance(mdl.heads["sparse"].for_route(side), sparse.StaticSparseHead)


def sparse_outputs(
    mdl: LoadedModel, states: list[np.ndarray] | None, seqs: list[np.ndarray], side: str
) -> Section:
    """The sparse section: the side's head on each item's states (or on its ids alone)."""
    loaded = mdl.heads["sparse"]
    head = loaded.for_route(side)
    if isinstance(head, sparse.StaticSparseHead):
        vecs = [head.apply(ids) for ids in seqs]
    elif isinstance(head, sparse.SpladeHead):  # the vocabulary matrix read once a chunk
        assert states is not None
        # The head runs after the decodes: the cores they used are free for its chunks.
        vecs = head.apply_many(states, seqs, threads=max(mdl.all_threads))
    else:
        assert states is not None
        vecs = [head.apply(h, ids) for h, ids in zip(states, seqs, strict=True)]
    return sparse_section([(v.indices, v.values) for v in vecs], head.spec.vocab_size)


def multivector_inputs(
    head: multivector.ColbertHead, seqs: list[np.ndarray], side: str, limit: int
) -> list[np.ndarray]:
    """The ids the model's transformer reads for a multi-vector output (its prefix inserted,
    its side's cut, a query's expansion). llama.cpp attends to every position of a sequence,
    so a side whose expansion tokens must be hidden even from themselves is refused."""
    if head.needs_owned_mask(side):
        raise EngineError("unsupported", _owned_mask_reason(side))
    return [head.prepare_ids(s, side, limit) for s in seqs]


def _owned_mask_reason(side: str) -> str:
    return (
        f"this model's {side} expansion tokens are hidden from every position, themselves "
        "included; llama.cpp's attention cannot express that mask (serve the model's "
        "queries on the Core ML lane, whose graph builds it)"
    )


def refusals(loaded: dict) -> list[m.Refusal]:
    """What LOADED declares this engine refuses of the model's heads whatever the items: a
    multi-vector side that needs the owned attention mask (`multivector_inputs` refuses it
    with the same reason)."""
    head = loaded.get("multivector")
    if not isinstance(head, multivector.ColbertHead):
        return []
    return [
        m.Refusal(output="multivector", side=side, reason=_owned_mask_reason(side))
        for side in m.SIDES
        if head.needs_owned_mask(side)
    ]
