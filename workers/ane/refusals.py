"""What a Core ML worker's LOADED declares it refuses of the loaded model whatever the items
(`LOADED.refuses`), so a host serving the model on two lanes sends those requests to the
other lane instead of to an ERR.

The rule, the same `AneEngine.encode` applies to each ENCODE:
- a graph with no token outputs at all (a family or head without them): every output;
- no admitted shape whose graph gives token outputs (`has_token_outputs`; LOAD's shapes are
  all it admits): every output that needs a prediction, which is all of them but an
  inference-free sparse query side (it weighs its ids alone).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from formats.owned.manifest import Manifest
from workers.ane.shapes import Shape
from workers.ane.token_heads import has_token_outputs, token_refusal
from workers.heads import sparse
from workers.protocol import messages as m

NO_TOKEN_SHAPE = (
    "token-level outputs run on unpacked shapes, and only packed ones are admitted "
    "(ADMIT_SHAPE one with packed=false)"
)


def refusals(manifest: Manifest, shapes: Iterable[Shape], heads: dict[str, Any]) -> list[m.Refusal]:
    why = token_refusal(manifest)
    if why is not None:
        return [m.Refusal(output=k, reason=why) for k in m.OUTPUT_KINDS]
    if any(has_token_outputs(manifest, s) for s in shapes):
        return []
    out = []
    for kind in m.OUTPUT_KINDS:
        head = heads.get("sparse") if kind == "sparse" else None
        if head is not None and isinstance(head.for_route("query"), sparse.StaticSparseHead):
            out.append(m.Refusal(output=kind, side="document", reason=NO_TOKEN_SHAPE))
        else:
            out.append(m.Refusal(output=kind, reason=NO_TOKEN_SHAPE))
    return out
