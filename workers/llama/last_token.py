"""Decodes for a head on each sequence's last token (llm_head.py: an LLM reranker, a decoder
sequence classifier): only the last token of each sequence is an output, its final state read
from the graph (last_states.py), and the tokens every sequence of the request starts with are
decoded once per context and shared through the KV cache.

The pairs of an LLM reranker all begin with the same rendered template, instruction and query
(about 90 tokens of Qwen3-Reranker's ~260 at 190 document tokens). A causal decoder's states
at those positions depend on those tokens alone, so each context decodes that prefix once on
sequence 0 and every pair's sequence borrows its cells (`llama_memory_seq_cp` on a unified
cache adds the sequence to the cells, it copies nothing); each decode then runs only the pairs'
own tokens, at positions after the prefix. The scores are those of whole-pair decodes up to
the float rounding of another batch shape, as any repacking gives.
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from workers.engine import Progress
from workers.llama import native
from workers.llama.decode_plan import plan_decodes
from workers.llama.encode import run_decodes
from workers.llama.native import LoadedModel, Slot

# A prefix shorter than this is decoded with each sequence: sharing it costs a decode per
# context and saves little.
MIN_SHARED_PREFIX = 16
# Sequences per decode, at most: the outputs are that many rows of the LM head's matmul, which
# a BLAS backend takes from 32 rows up (ggml-blas' min_batch) into a split of its own that
# last_states cannot stop; below that it stays in the split the capture ends.
MAX_OUTPUTS_PER_DECODE = 31
PREFIX_SEQ = 0


def shared_prefix(seqs: list[np.ndarray]) -> int:
    """Tokens every sequence starts with, leaving each at least one token of its own (the
    scored one); 0 for a lone sequence or a prefix under MIN_SHARED_PREFIX."""
    if len(seqs) < 2:
        return 0
    limit = min(len(s) for s in seqs) - 1
    if limit < MIN_SHARED_PREFIX:
        return 0
    first = seqs[0][:limit]
    n = limit
    for s in seqs[1:]:
        diff = np.flatnonzero(s[:n] != first[:n])
        if diff.size:
            n = int(diff[0])
            if n < MIN_SHARED_PREFIX:
                return 0
    return n


def encode_last(
    mdl: LoadedModel, seqs: list[np.ndarray], progress: Progress, decode_tokens: int
) -> np.ndarray:
    """(n_seqs, n_embd) float32: the final state at each sequence's last token."""
    out = np.empty((len(seqs), mdl.n_embd), dtype=np.float32)
    if not seqs:
        return out
    p = shared_prefix(seqs)
    prefix = seqs[0][:p]
    own = [s[p:] for s in seqs]
    lengths = [len(s) for s in own]
    # The prefix holds p cells of the context's cache while the pairs' tokens decode.
    budget = min(mdl.n_batch, mdl.n_ubatch, mdl.n_ctx - p)
    max_seqs = min(mdl.n_seq_max - (1 if p else 0), MAX_OUTPUTS_PER_DECODE)
    groups = plan_decodes(lengths, budget, max_seqs, decode_tokens, len(mdl.slots))
    ready: set[int] = set()  # contexts whose cache holds the prefix (each adds only its own)

    def decode(slot: Slot, group: list[int]) -> None:
        mem = llama_cpp.llama_get_memory(slot.ctx)
        if p and id(slot) not in ready:
            _clear(mem)
            _decode(slot, [prefix], [PREFIX_SEQ], 0, outputs=False)
            ready.add(id(slot))
        elif not p:
            _clear(mem)
        sids = [i + 1 if p else i for i in range(len(group))]
        for sid in sids if p else ():
            llama_cpp.llama_memory_seq_cp(mem, PREFIX_SEQ, sid, 0, p)
        try:
            out[group] = _decode(slot, [own[i] for i in group], sids, p, outputs=True)
        finally:
            for sid in sids if p else ():
                llama_cpp.llama_memory_seq_rm(mem, sid, -1, -1)

    run_decodes(mdl, mdl.slots, groups, lengths, decode, progress)
    return out


def _clear(mem: llama_cpp.llama_memory_t) -> None:
    """Drop every cell. Metadata only: a freed cell is masked out of attention, so its stale
    (finite) K and V need no zeroing, which would write the whole cache per decode."""
    if mem:
        llama_cpp.llama_memory_clear(mem, False)


def _decode(
    slot: Slot, seqs: list[np.ndarray], sids: list[int], start: int, *, outputs: bool
) -> np.ndarray:
    """One llama_decode of `seqs` (sequence ids `sids`, positions from `start`), each one's last
    token an output when `outputs`; their final states (len(seqs), n_embd)."""
    last = slot.last
    assert last is not None  # a slot of a last-token model always has one
    batch = slot.batch
    sid = batch.seq_id
    n = 0
    for s, seq_id in zip(seqs, sids, strict=True):
        k = len(s)
        if n + k > slot.capacity:  # unsafe mode only: never write past the batch
            k = slot.capacity - n
        slot.tok[n : n + k] = s[:k]
        slot.pos[n : n + k] = np.arange(start, start + k, dtype=np.int32)
        slot.nsid[n : n + k] = 1
        slot.out[n : n + k] = 0
        if outputs and k:
            slot.out[n + k - 1] = 1
        for j in range(n, n + k):
            sid[j][0] = seq_id
        n += k
    batch.n_tokens = n
    last.discard()
    native.decode(slot, batch)  # looked up per call: a test watches the decodes here
    return last.take(len(seqs) if outputs else 0)
