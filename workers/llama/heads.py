"""The heads a llama.cpp embedder carries on its token states, loaded with the model, and
what each needs of the decode: the ids it reads (a multi-vector model's prefix and query
expansion) and whether llama.cpp's attention can give it its states at all.

A head's files are checked against the digest the host sends before they are read: a head
that does not match what ingest wrote is refused as the model's artifact would be.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from formats.digest import sha256_file
from formats.sparse_head import SPARSE_CONFIG, SPARSE_WEIGHTS
from workers.engine import EngineError, Section, sparse_section
from workers.heads import multivector, sparse
from workers.llama.config import HeadFile
from workers.llama.native import LoadedModel


def load_heads(files: Mapping[Any, HeadFile]) -> dict[str, Any]:
    """Every head named in the LOAD's runtime_config, by output kind."""
    heads: dict[str, Any] = {}
    for kind, head in files.items():
        path = Path(head.path)
        if head.digest:
            try:
                got = _digest(kind, path)
            except OSError as e:
                raise EngineError("artifact_invalid", f"cannot read {path}: {e}") from e
            if got != head.digest.lower().removeprefix("sha256:"):
                raise EngineError("artifact_invalid", f"{path}: sha256 {got} != {head.digest}")
        if kind == "multivector":
            heads[kind] = multivector.load(path)
        elif kind == "sparse":
            heads[kind] = sparse.load(path.parent)
        else:
            raise EngineError("config_invalid", f"no {kind} head on this engine")
    return heads


def _digest(kind: str, path: Path) -> str:
    """What ingest recorded: a multi-vector head's spec file (it names its weights' digest);
    a sparse head's spec then weights, as one stream."""
    if kind != "sparse":
        return sha256_file(str(path))
    h = hashlib.sha256()
    for name in (SPARSE_CONFIG, SPARSE_WEIGHTS):
        with open(path.parent / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


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
        raise EngineError(
            "unsupported",
            f"this model's {side} expansion tokens are hidden from every position, themselves "
            "included; llama.cpp's attention cannot express that mask (serve the model's "
            "queries on the Core ML lane, whose graph builds it)",
        )
    return [head.prepare_ids(s, side, limit) for s in seqs]
