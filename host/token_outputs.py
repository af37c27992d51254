"""Outputs built on every token's final state, from one forward pass: the pooled vector,
token embeddings, learned sparse vectors and multi-vectors (ENCODE on the wire).

The host splits the items into protocol-sized requests as for embeddings; a reply's width per
item depends on its tokens, so a chunk is bounded by its widest possible item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from common.errors import InvalidRequest
from formats.multivector_head import maxsim as maxsim  # re-exported for Module.rerank
from host.batching import plan_chunks
from ingest.store import HeadSpec
from workers.protocol import messages as m
from workers.protocol import payloads

OUTPUT_KINDS: tuple[str, ...] = m.OUTPUT_KINDS

SparseVector = tuple[np.ndarray, np.ndarray]  # (int32 vocabulary indices, float32 values)


@dataclass(frozen=True)
class TokenOutputs:
    """What ENCODE returned for each input, in input order; a kind not asked is None."""

    model: str
    usage: msgspec.Struct  # host.module.Usage (which imports this module)
    n_tokens: Sequence[int]
    truncated: Sequence[bool]
    prompt: str = ""
    lane: str = ""
    dense: np.ndarray | None = None  # (n, dims)
    tokens: list[np.ndarray] | None = None  # per input (n_tokens, n_embd)
    sparse: list[SparseVector] | None = None  # per input, indices ascending
    multivector: list[np.ndarray] | None = None  # per input (k, dims)
    token_ids: list[np.ndarray] = field(default_factory=list)  # what was encoded, per input


def check_outputs(outputs: Sequence[str]) -> list[m.OutputKind]:
    """The rule: at least one output, each a known kind, none twice."""
    got = list(outputs)
    if not got:
        raise InvalidRequest("ask for at least one output", param="outputs")
    unknown = [k for k in got if k not in OUTPUT_KINDS]
    if unknown:
        raise InvalidRequest(
            f"unknown output {unknown[0]!r}; one of {', '.join(OUTPUT_KINDS)}", param="outputs"
        )
    if len(set(got)) != len(got):
        raise InvalidRequest("each output may be asked once", param="outputs")
    return got  # type: ignore[return-value]


def reply_width(
    outputs: Sequence[str], n_embd: int, longest: int, heads: Mapping[str, HeadSpec]
) -> int:
    """f32 words one item's reply can take at most: what bounds a chunk under max_frame."""
    width = 0
    for kind in outputs:
        if kind == "dense":
            width += n_embd
        elif kind == "tokens":
            width += longest * n_embd
        elif kind == "multivector":
            head = heads.get("multivector")
            width += multivector_rows(head, longest) * (head.dims if head else n_embd)
        elif kind == "sparse":  # an index and a value per active entry
            width += 2 * sparse_entries(heads.get("sparse"), longest)
    return max(1, width)


def multivector_rows(head: HeadSpec | None, longest: int) -> int:
    """The most vectors an item of `longest` ids can have: one per id, plus the prefix ids
    the worker inserts, or the length a query is padded to, whichever is more."""
    if head is None:
        return longest
    return max(longest + head.prefix_rows, head.expansion_rows)


def sparse_entries(head: HeadSpec | None, longest: int) -> int:
    """The most entries an item of `longest` ids can have in its sparse vector: the vocabulary,
    cut to one per token where the head keeps one weight per token id, and to the model's
    top-k where it has one."""
    if head is None or not head.dims:
        return longest
    bound = head.dims
    if head.entries_per_token:
        bound = min(bound, longest)
    if head.max_active:
        bound = min(bound, head.max_active)
    return bound


async def request_outputs(
    lane,
    model_ref: str,
    ids: list[np.ndarray],
    outputs: list[m.OutputKind],
    side: m.Side,
    normalize: bool,
    budgets: tuple[int, int, int],
    width: int,
    deadline_s: float | None,
) -> dict[str, list]:
    """Send the items in chunks; per kind, per item: dense rows, token/multi-vector arrays,
    sparse (indices, values)."""
    lengths = [len(x) for x in ids]
    max_tokens, max_items, max_frame = budgets
    # `width` bounds the longest item's reply. A reply over the agreed frame is a protocol
    # violation that costs the worker its life and the lane a strike, so the module refuses
    # such an item here, before anything is sent.
    if width * 4 > max_frame:
        widest = max(range(len(lengths)), key=lengths.__getitem__)
        raise InvalidRequest(
            f"item {widest} ({lengths[widest]} tokens): its {', '.join(outputs)} output may "
            f"take {width * 4} bytes, over the {max_frame}-byte protocol frame; ask for fewer "
            "outputs or send a shorter text"
        )
    got: dict[str, list] = {k: [] for k in outputs}
    for chunk in plan_chunks(lengths, max_tokens, max_items, max_frame, width):
        req = m.ENCODE(
            req_id=0,
            model_ref=model_ref,
            items=[m.EmbedItem(id=i, n_tokens=lengths[i]) for i in chunk],
            outputs=outputs,
            side=side,
            normalize=normalize,
        )
        reply, raw = await lane.request(req, np.concatenate([ids[i] for i in chunk]), deadline_s)
        assert isinstance(reply, m.ENCODED) and raw is not None
        views = payloads.encoded_sections(reply, raw)
        for section, view in zip(reply.sections, views, strict=True):
            got[section.kind].extend(_per_item(section, view))
    return got


def _per_item(section: m.OutputSection, view) -> list:
    if section.kind == "dense":
        return [row.copy() for row in view]
    bounds = np.cumsum([0, *section.counts])
    if section.kind == "sparse":
        idx, val = view
        return [
            (idx[a:b].copy(), val[a:b].copy()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    return [view[a:b].copy() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
