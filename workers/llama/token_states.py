"""Every token's final hidden state from llama.cpp, for the outputs built on token states:
token embeddings, the pooled vector computed from the same states, and the heads (sparse,
multi-vector) that run in the worker.

llama.cpp fixes a context's pooling when it is created, and a pooled context returns one row
a sequence. So an embedder gets a second context, with pooling NONE, made on the first
request that needs token states (it shares the model's weights: only its compute buffers are
new). Its decodes are planned as the pooled ones are (`decode_plan`, within
min(n_batch, n_ubatch) tokens a decode), so "input too large, increase the physical batch
size" cannot happen: an item over `item_limit` is refused before it gets here.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from workers.engine import EngineError, Progress
from workers.llama import native
from workers.llama.decode_plan import plan_decodes
from workers.llama.native import LoadedModel, Slot


def token_states(
    mdl: LoadedModel, seqs: list[np.ndarray], progress: Progress, decode_tokens: int
) -> list[np.ndarray]:
    """(len(seq), n_embd) float32 final states for each sequence, special tokens included."""
    slot = token_slot(mdl)
    budget = min(mdl.n_batch, mdl.n_ubatch)
    out: list[np.ndarray] = [np.zeros((0, mdl.n_embd), np.float32)] * len(seqs)
    for group in plan_decodes([len(s) for s in seqs], budget, mdl.n_seq_max, decode_tokens):
        _decode_group(mdl, slot, seqs, group, out)
        progress.advance("inference")
    return out


def token_slot(mdl: LoadedModel) -> Slot:
    """The model's pooling-NONE context, made once."""
    if mdl.token_slot is None:
        if mdl.token_cparams is None:
            raise EngineError("unsupported", f"{mdl.ref} gives no token states (not an embedder)")
        slot = native.make_slot(mdl.model, mdl.token_cparams)
        # One context, so every core: the pooled contexts split them between streams.
        llama_cpp.llama_set_n_threads(slot.ctx, *mdl.all_threads)
        mdl.token_slot = slot
    return mdl.token_slot


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
