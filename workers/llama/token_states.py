"""Every token's final hidden state from llama.cpp, for the outputs built on token states:
token embeddings, the pooled vector computed from the same states, and the heads (sparse,
multi-vector) that run in the worker.

llama.cpp fixes a context's pooling when it is created, and a pooled context returns one row
a sequence. So an embedder gets second contexts, with pooling NONE, one per encode stream,
made on the first request that needs token states (they share the model's weights: only their
compute buffers are new). Its decodes are planned as the pooled ones are (`decode_plan`, within
min(n_batch, n_ubatch) tokens a decode), so "input too large, increase the physical batch
size" cannot happen: an item over `item_limit` is refused before it gets here.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from workers.engine import EngineError, Progress
from workers.llama import native, output_buffer
from workers.llama.decode_plan import TOKEN_STATES_DECODE_TOKENS, plan_decodes
from workers.llama.encode import run_decodes
from workers.llama.native import LoadedModel, Slot


def token_states(
    mdl: LoadedModel, seqs: list[np.ndarray], progress: Progress, decode_tokens: int
) -> list[np.ndarray]:
    """(len(seq), n_embd) float32 final states for each sequence, special tokens included.
    Decoded as the pooled outputs are (encode.run_decodes): one pooling-NONE context per encode
    stream, so one request's decodes run on every core (on this 2-core machine two 1-thread
    streams ran 3x the rate of one 2-thread context)."""
    slots = token_slots(mdl)
    lengths = [len(s) for s in seqs]
    budget = min(mdl.n_batch, mdl.n_ubatch)
    packed = min(decode_tokens, TOKEN_STATES_DECODE_TOKENS)  # no flash attention: see there
    groups = plan_decodes(lengths, budget, mdl.n_seq_max, packed, len(slots))
    out: list[np.ndarray] = [np.zeros((0, mdl.n_embd), np.float32)] * len(seqs)
    run_decodes(
        mdl,
        slots,
        groups,
        lengths,
        lambda slot, g: _decode_group(mdl, slot, seqs, g, out),
        progress,
    )
    return out


def token_slots(mdl: LoadedModel) -> list[Slot]:
    """The model's pooling-NONE contexts, one per encode stream, made once."""
    if not mdl.token_slots:
        if mdl.token_cparams is None:
            raise EngineError("unsupported", f"{mdl.ref} gives no token states (not an embedder)")
        slots: list[Slot] = []
        try:
            for _ in range(len(mdl.slots)):
                slots.append(native.make_slot(mdl.model, mdl.token_cparams))
        except BaseException:
            for slot in slots:
                slot.free()
            raise
        mdl.token_slots = slots
    return mdl.token_slots


def _decode_group(
    mdl: LoadedModel, slot: Slot, seqs: list[np.ndarray], group: list[int], out: list[np.ndarray]
) -> None:
    native.clear_memory(slot)
    n = 0
    sid = slot.batch.seq_id
    for seq_id, idx in enumerate(group):
        s = seqs[idx]
        k = len(s)
        slot.tok[n : n + k] = s
        slot.pos[n : n + k] = np.arange(k, dtype=np.int32)
        slot.nsid[n : n + k] = 1
        slot.out[n : n + k] = 1  # every token is an output: its state is what is asked
        for j in range(n, n + k):
            sid[j][0] = seq_id
        n += k
    slot.batch.n_tokens = n
    native.decode(slot, slot.batch)
    ptr = llama_cpp.llama_get_embeddings(slot.ctx)
    if not ptr:
        raise RuntimeError("llama.cpp returned no token states")
    # Outputs come in batch order (every token is one): copy out before the next decode.
    states = np.ctypeslib.as_array(
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n, mdl.n_embd)
    ).copy()
    if not mdl.causal:  # an encoder's logits region is never written (output_buffer.py)
        output_buffer.release_logits(slot.ctx)
    start = 0
    for idx in group:
        k = len(seqs[idx])
        out[idx] = states[start : start + k]
        start += k


def pool(states: np.ndarray, pooling: str) -> np.ndarray:
    """The pooled vector llama.cpp's own pooling gives, from a sequence's token states."""
    if pooling == "mean":
        return states.mean(axis=0, dtype=np.float64).astype(np.float32)
    if pooling == "cls":
        return states[0]
    if pooling == "last":
        return states[-1]
    raise EngineError("unsupported", f"no pooled vector for pooling {pooling!r}")
