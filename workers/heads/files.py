"""The head files a worker is given at LOAD (`runtime_config.heads`), checked against the
digest ingest recorded before they are read, and loaded by output kind: the same for every
engine that runs the heads (llama.cpp on its token states, the Core ML graph in its program).

A head that does not match what ingest wrote is refused as the model's artifact would be.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from formats.digest import sha256_file
from formats.sparse_head import SPARSE_CONFIG, SPARSE_WEIGHTS
from workers.engine import EngineError
from workers.heads import multivector, sparse


class HeadFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A head on the token states: its weights file and that file's sha256 ("" = unchecked)."""

    path: str
    digest: str = ""
    # The model's token limit the head cuts its own inputs to (a prefix it inserts counts).
    limit: int | None = None


def load_heads(files: Mapping[Any, HeadFile]) -> dict[str, Any]:
    """Every head named in the LOAD's runtime_config, by output kind."""
    heads: dict[str, Any] = {}
    for kind, head in files.items():
        path = Path(head.path)
        if head.digest:
            try:
                got = head_digest(kind, path)
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


def head_digest(kind: str, path: Path) -> str:
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
