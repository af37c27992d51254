"""The Module's token-level calls: several outputs of one forward pass (`encode_outputs`,
`encode_token_ids`), late chunking (`late_chunk`) and a multi-vector model's MaxSim rerank
(`late_interaction`), each sent as ENCODE to the lane the Module picks.

The Module keeps the public methods (and their model residency) and delegates here; this
module imports nothing of host.module: it is given the Module as a `TokenHost` and the
protocol budgets a request is planned under. What an output is lives in host.token_outputs,
the late-chunking rule in host.late_chunking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from common.errors import InvalidRequest
from host.admission import Admission
from host.call_args import check_prompt_args, check_served, renamed, resolve_prompt
from host.lane_router import Ask
from host.late_chunking import chunk_bounds, pick_windows, pool_chunks
from host.late_chunking import token_states as late_token_states
from host.results import EmbedResult, Usage
from host.sanitize import sanitize
from host.token_outputs import (
    TokenOutputs,
    check_outputs,
    maxsim,
    reply_width,
    request_outputs,
)
from host.tokenization import Encoded
from ingest.store import DEFAULT_EMBED, ModelRecord
from workers.protocol import messages as m

if TYPE_CHECKING:
    from host.routed_lanes import RoutedLanes
    from host.served import Served

Side = Literal["query", "document"]

# What late chunking and a multi-vector rerank ask of a lane (host.lane_router.Ask): a routed
# model sends them only to a lane that serves them.
LATE_ASK = Ask(("tokens",), ("document",))
MAXSIM_ASK = Ask(("multivector",), ("query", "document"))  # both sides on one lane


def late_interaction(record: ModelRecord) -> bool:
    """Whether `record`'s model reranks by MaxSim of its multi-vectors."""
    return "multivector" in record.manifest.heads


class TokenHost(Protocol):
    """What the token-level calls need of the Module (host.module.Module is one)."""

    admission: Admission
    routing: RoutedLanes

    async def _load_for_call(
        self,
        name: str | None,
        default: str,
        kind: str | None = None,
        lane: str | None = None,
        items: int = 1,
        ask: Ask | None = None,
        longest: int = 0,
    ) -> Served: ...


class TokenCalls:
    def __init__(self, host: TokenHost, budgets: tuple[int, int, int]) -> None:
        self.host = host
        # (ids a request, items a request, bytes a frame): what one ENCODE may carry.
        self.budgets = budgets

    async def encode_outputs(
        self,
        texts: str | bytes | Sequence[str | bytes],
        outputs: Sequence[str],
        model: str | None,
        normalize: bool,
        truncate: bool,
        deadline_s: float | None,
        lane: str | None,
        side: Side,
        prompt_name: str | None,
        prompt: str | None,
        truncation_direction: str,
    ) -> TokenOutputs:
        """Module.encode_outputs."""
        kinds = check_outputs(outputs)
        batch = [texts] if isinstance(texts, str | bytes) else list(texts)
        check_prompt_args(prompt_name, prompt)
        admission = self.host.admission
        admission.check_inputs(batch)
        ask = Ask(tuple(kinds), (side,))
        served = await self.host._load_for_call(
            model, DEFAULT_EMBED, "embed", lane, len(batch), ask
        )
        check_served(served.record, kinds)  # before tokenizing
        text_prompt = resolve_prompt(served.record, prompt_name, prompt)
        sparse_head = served.record.manifest.heads.get("sparse")
        bare = side == "query" and sparse_head is not None and sparse_head.bare_query
        if bare and kinds != ["sparse"]:
            raise InvalidRequest(
                f"model {served.record.name!r} weighs queries by their ids alone (no forward "
                "pass): its query side gives the sparse output only",
                param="outputs",
            )
        encoded = served.tokenizer.encode(
            batch,
            truncate=truncate,
            prompt=text_prompt,
            direction=truncation_direction,
            special_tokens=not bare,
        )
        with admission.reserve(encoded.total_tokens):
            got = await self.request(served, encoded.ids, kinds, side, normalize, deadline_s)
        usage = Usage(prompt_tokens=encoded.total_tokens, total_tokens=encoded.total_tokens)
        return TokenOutputs(
            model=served.record.name,
            usage=usage,
            n_tokens=encoded.n_tokens,
            truncated=encoded.truncated,
            prompt=text_prompt,
            lane=served.lane_kind,
            dense=np.stack(got["dense"]) if "dense" in got else None,
            tokens=got.get("tokens"),
            sparse=got.get("sparse"),
            multivector=got.get("multivector"),
            token_ids=list(encoded.ids),
        )

    async def encode_token_ids(
        self,
        ids: list[np.ndarray],
        outputs: Sequence[str],
        model: str | None,
        normalize: bool,
        deadline_s: float | None,
        lane: str | None,
        side: Side,
    ) -> dict[str, list]:
        """Module.encode_token_ids."""
        kinds = check_outputs(outputs)
        ask = Ask(tuple(kinds), (side,))
        longest = max((len(x) for x in ids), default=0)
        served = await self.host._load_for_call(
            model, DEFAULT_EMBED, "embed", lane, len(ids), ask, longest
        )
        return await self.request(served, ids, kinds, side, normalize, deadline_s)

    async def late_chunk(
        self,
        chunks: Sequence[str | bytes],
        model: str | None,
        normalize: bool,
        deadline_s: float | None,
        lane: str | None,
        prompt_name: str | None,
        prompt: str | None,
    ) -> EmbedResult:
        """Module.late_chunk."""
        if not chunks:
            raise InvalidRequest("late chunking needs the document's chunks", param="input")
        check_prompt_args(prompt_name, prompt)
        admission = self.host.admission
        admission.check_inputs(list(chunks))
        served = await self.host._load_for_call(model, DEFAULT_EMBED, "embed", lane, 1, LATE_ASK)
        pooling = served.record.manifest.pooling or "mean"
        if pooling != "mean":
            raise InvalidRequest(
                f"late chunking pools a chunk's tokens by their mean; model "
                f"{served.record.name!r} pools by {pooling}",
                param="late_chunking",
            )
        clean = [sanitize(c) for c in chunks]
        head = sanitize(resolve_prompt(served.record, prompt_name, prompt))
        tok = served.tokenizer
        window = tok.max_tokens - tok.n_special_single
        offsets, windows = tok.document_windows("".join(clean), head, window, max(1, window // 2))
        picked = pick_windows(len(offsets), windows)
        total = sum(len(ids) for ids in picked.ids)
        with admission.reserve(total):
            got = await self.request(served, picked.ids, ["tokens"], "document", False, deadline_s)
        states = late_token_states(picked, got["tokens"])
        vectors, counts = pool_chunks(states, offsets, chunk_bounds(clean, len(head)), normalize)
        return EmbedResult(
            vectors,
            Usage(prompt_tokens=total, total_tokens=total),
            served.record.name,
            [False] * len(clean),
            head,
            counts,
            served.lane_kind,
        )

    async def late_interaction(
        self, served: Served, query, docs, cut: tuple, deadline_s: float | None
    ) -> tuple[np.ndarray, Encoded, int]:
        """A multi-vector model's score: raw MaxSim, the sum over the query's vectors of
        their best dot product with the document's (not a sigmoid, not divided by the query's
        length), the query through the model's query side and each document its document
        side. (scores, the documents' encoding, tokens)."""
        truncate, direction, _ = cut
        tok = served.tokenizer
        try:
            q = tok.encode([query], truncate, direction=direction)
        except InvalidRequest as exc:
            raise renamed(exc, "input 0", "the query", "query") from None
        try:
            d = tok.encode(docs, truncate, direction=direction)
        except InvalidRequest as exc:
            raise renamed(exc, "input ", "document ", "documents") from None
        tokens = q.total_tokens + d.total_tokens
        with self.host.admission.reserve(tokens):
            qv = await self.request(served, q.ids, ["multivector"], "query", True, deadline_s)
            dv = await self.request(served, d.ids, ["multivector"], "document", True, deadline_s)
        scores = np.array([maxsim(qv["multivector"][0], v) for v in dv["multivector"]])
        return scores.astype(np.float32), d, tokens

    async def request(
        self,
        served: Served,
        ids: list[np.ndarray],
        kinds: list[m.OutputKind],
        side: Side,
        normalize: bool,
        deadline_s: float | None,
    ) -> dict[str, list]:
        """ENCODE `ids` on `served`'s worker in protocol-sized requests: per kind, per item."""
        check_served(served.record, kinds)
        longest = max((len(x) for x in ids), default=1)
        width = reply_width(kinds, served.dims, longest, served.record.manifest.heads)
        with self.host.routing.in_flight(served.lane, len(ids)):  # what the router sees
            return await request_outputs(
                served.lane,
                served.record.name,
                ids,
                kinds,
                side,
                normalize,
                self.budgets,
                width,
                deadline_s,
            )
