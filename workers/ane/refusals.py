"""What a Core ML worker's LOADED declares it refuses of the loaded model whatever the items
(`LOADED.refuses`), so a host serving the model on two lanes sends those requests to the
other lane instead of to an ERR.

The rule, the same `AneEngine.encode` applies to each ENCODE:
- a graph with no token outputs at all (a family or head without them): every output;
- no admitted shape (a LOAD with none; every shape of a graph with token outputs gives them,
  packed or not): every output that needs a prediction, which is all of them but an
  inference-free sparse query side (it weighs its ids alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from formats.owned.manifest import Manifest
from workers.ane.shapes import Shape
from workers.ane.token_heads import token_refusal
from workers.heads import sparse
from workers.protocol import messages as m

NO_TOKEN_SHAPE = "no admitted shape gives token-level outputs (ADMIT_SHAPE one first)"


def refusals(manifest: Manifest, shapes: Sequence[Shape], heads: dict[str, Any]) -> list[m.Refusal]:
    why = token_refusal(manifest)
    if why is not None:
        return [m.Refusal(output=k, reason=why) for k in m.OUTPUT_KINDS]
    if shapes:
        return []
    out = []
    for kind in m.OUTPUT_KINDS:
        head = heads.get("sparse") if kind == "sparse" else None
        if head is not None and isinstance(head.for_route("query"), sparse.StaticSparseHead):
            out.append(m.Refusal(output=kind, side="document", reason=NO_TOKEN_SHAPE))
        else:
            out.append(m.Refusal(output=kind, reason=NO_TOKEN_SHAPE))
    return out
