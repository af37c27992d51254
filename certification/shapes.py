"""The compiled shapes a Core ML certificate names, in their command-line spelling
(`--shapes 8x128,4x256p,2x512p/16`, and the `shapes` of a certificate's key)."""

from __future__ import annotations


def parse_shapes(text: str | None) -> list[dict] | None:
    """ "8x128,4x256p,2x512p/16" -> [{rows, seq_len, packed?, max_segments?}, ...]."""
    if not text:
        return None
    shapes = []
    for part in text.split(","):
        spec, _, segs = part.strip().partition("/")
        packed = spec.endswith("p")
        rows, sep, seq = spec.rstrip("p").partition("x")
        if not sep or not rows.isdigit() or not seq.isdigit() or (segs and not segs.isdigit()):
            raise ValueError(f"shape {part!r}: expected ROWSxSEQ, ROWSxSEQp or ROWSxSEQp/SEGS")
        shape: dict = {"rows": int(rows), "seq_len": int(seq)}
        if packed:
            shape["packed"] = True
            if segs:
                shape["max_segments"] = int(segs)
        elif segs:
            raise ValueError(f"shape {part!r}: /SEGS needs a packed shape (p)")
        shapes.append(shape)
    return shapes
