"""Embed and rerank decodes through llama.cpp's low-level batch API: packed sequences in one
llama_batch, pooled outputs read per sequence, decodes spread over the model's contexts.

The request is validated before it gets here (engine.py); which sequences share a decode is
decided in decode_plan.py.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, wait

import llama_cpp
import numpy as np

from workers.engine import Progress
from workers.llama import native
from workers.llama.decode_plan import plan_decodes, wide_decode
from workers.llama.native import TOKEN_NULL, LoadedModel, Slot

# Small decodes come fast: report PROGRESS (the watchdog's heartbeat, one host wakeup each) at
# most this often rather than per decode, so the host does not steal the cores per decode.
_PROGRESS_EVERY_S = 0.25


class _ProgressThrottle:
    """PROGRESS at most every _PROGRESS_EVERY_S (the watchdog's heartbeat, one host wakeup
    each) rather than per decode, so the host does not steal the cores per decode."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.reported, self.total = progress, 0, 0
        self.last = time.monotonic()

    def done(self, n: int) -> None:
        self.done_total(self.total + n)

    def done_total(self, total: int) -> None:
        self.total = total
        if time.monotonic() - self.last >= _PROGRESS_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.total > self.reported:
            self.progress.advance("inference", self.total - self.reported)
            self.reported, self.last = self.total, time.monotonic()


def encode(
    mdl: LoadedModel,
    seqs: list[np.ndarray],
    progress: Progress,
    decode_tokens: int,
    types: list[np.ndarray] | None = None,
) -> np.ndarray:
    """Pooled output (n_embd per seq, or n_cls_out for rank) for each sequence.

    How sequences are packed can change the numbers, by float rounding; which slot runs a
    decode cannot (see `run_decodes`).
    `decode_tokens`: the packing target (decode_plan.decode_tokens_for the build).
    `types`: per-sequence token types, fed as input embeddings (`mdl.typed` models).
    """
    width = mdl.n_cls_out if mdl.pooling == "rank" else mdl.n_embd
    out = np.empty((len(seqs), width), dtype=np.float32)
    lengths = [len(s) for s in seqs]
    budget = min(mdl.n_batch, mdl.n_ubatch)
    groups = plan_decodes(lengths, budget, mdl.n_seq_max, decode_tokens, len(mdl.slots))
    run_decodes(
        mdl,
        mdl.slots,
        groups,
        lengths,
        lambda slot, group: _encode_group(mdl, slot, seqs, group, out, types),
        progress,
    )
    return out


def run_decodes(
    mdl: LoadedModel,
    slots: list[Slot],
    groups: list[list[int]],
    lengths: list[int],
    decode: Callable[[Slot, list[int]], None],
    progress: Progress,
) -> None:
    """`decode(slot, group)` for every group. With several slots, each slot's thread takes the
    next decode off a shared queue (llama_decode releases the GIL), so one request's decodes
    run on every core; the calling thread only reports PROGRESS and collects failures. A
    request of one decode runs on the first slot with every thread (`wide_decode`)."""
    if mdl.pool is None or len(slots) == 1 or len(groups) <= 1:
        slot = slots[0]
        wide = bool(groups) and wide_decode(len(slots), [lengths[i] for i in groups[0]])
        if wide:
            llama_cpp.llama_set_n_threads(slot.ctx, *mdl.all_threads)
        try:
            reporter = _ProgressThrottle(progress)
            for group in groups:
                decode(slot, group)
                reporter.done(1)
            reporter.flush()
        finally:
            if wide:
                llama_cpp.llama_set_n_threads(slot.ctx, *mdl.stream_threads)
        return
    todo: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
    for group in groups:
        todo.put(group)
    finished = [0] * len(slots)
    failed = threading.Event()

    def drain(i: int, slot: Slot) -> None:
        while not failed.is_set():
            try:
                group = todo.get_nowait()
            except queue.Empty:
                return
            try:
                decode(slot, group)
            except BaseException:
                failed.set()  # the other slots stop after their current decode
                raise
            finished[i] += 1

    futures = [mdl.pool.submit(drain, i, slot) for i, slot in enumerate(slots)]
    reporter = _ProgressThrottle(progress)
    pending = set(futures)
    while pending:
        _, pending = wait(pending, timeout=_PROGRESS_EVERY_S, return_when=FIRST_EXCEPTION)
        reporter.done_total(sum(finished))
        if failed.is_set():
            wait(pending)
            break
    for fut in futures:
        fut.result()  # re-raise the first failure, typed as the slot raised it
    reporter.flush()


def _encode_group(
    mdl: LoadedModel,
    slot: Slot,
    seqs: list[np.ndarray],
    group: list[int],
    out: np.ndarray,
    types: list[np.ndarray] | None = None,
) -> None:
    """One decode of `group`'s sequences on `slot`, pooled rows written to `out`; with
    `types`, as input embeddings that carry each token's type (see typed_pairs)."""
    native.clear_memory(slot)  # decoder-as-embedder: drop the previous decode's cache
    typed = slot.typed if types is not None else None  # a slot has it iff the model does
    if types is not None and typed is None:
        raise RuntimeError("token types given for a model without typed input")
    batch, pos, nsid, outs = (
        (typed.batch, typed.pos, typed.nsid, typed.out)
        if typed
        else (slot.batch, slot.pos, slot.nsid, slot.out)
    )
    n = 0
    sid = batch.seq_id
    for seq_id, idx in enumerate(group):
        s = seqs[idx]
        k = len(s)
        if n + k > slot.capacity:  # unsafe mode only: never write past the batch
            k = slot.capacity - n
        if typed is not None:
            assert mdl.typed is not None and types is not None  # typed slots exist only then
            typed.embd[n : n + k] = mdl.typed.embeddings(s[:k], types[idx][:k])
        else:
            slot.tok[n : n + k] = s[:k]
        pos[n : n + k] = np.arange(k, dtype=np.int32)
        nsid[n : n + k] = 1
        outs[n : n + k] = 1  # pooled embeddings need every token as an output
        for j in range(n, n + k):
            sid[j][0] = seq_id
        n += k
    batch.n_tokens = n
    native.decode(slot, batch)  # looked up per call: a test watches the decodes here
    width = out.shape[1]
    for seq_id, idx in enumerate(group):
        ptr = llama_cpp.llama_get_embeddings_seq(slot.ctx, seq_id)
        if not ptr:
            raise RuntimeError(f"llama.cpp returned no pooled output for seq {seq_id}")
        out[idx] = np.ctypeslib.as_array(ptr, shape=(width,))


def pair_template(mdl: LoadedModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix, middle, suffix) token arrays of a rerank pair; see `LlamaEngine.rerank`."""
    v = mdl.vocab
    bos = int(llama_cpp.llama_vocab_bos(v))
    eos = int(llama_cpp.llama_vocab_eos(v))
    sep = int(llama_cpp.llama_vocab_sep(v))
    if eos == TOKEN_NULL:
        eos = sep
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(v)) and bos != TOKEN_NULL
    add_eos = bool(llama_cpp.llama_vocab_get_add_eos(v)) and eos != TOKEN_NULL
    add_sep = bool(llama_cpp.llama_vocab_get_add_sep(v)) and sep != TOKEN_NULL
    pre = [bos] if add_bos else []
    mid = ([eos] if add_eos else []) + ([sep] if add_sep else [])
    post = [eos] if add_eos else []
    return (np.array(pre, np.int32), np.array(mid, np.int32), np.array(post, np.int32))
