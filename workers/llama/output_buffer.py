"""Give back the memory of the logits an embedding context never writes.

llama.cpp sizes a context's output buffer for logits on every decode, embedder or not
(`llama_context::output_reserve`: `has_logits` is always true), and zero-fills the whole buffer
each time it grows. An encoder's decode of n tokens with every token an output (the token
states of a SPLADE or bge-m3 request) so makes n x n_vocab floats resident that nothing reads:
62.5 MB a context for a 512-token decode of BERT's 30522 entries, 256 MB for a 256-token one of
XLM-RoBERTa's 250002. An encoder's graph (BERT, XLM-RoBERTa, ModernBERT...: the non-causal
models) has no logits tensor, so nothing writes that region, and after a decode its pages can
go back to the kernel: `madvise(MADV_DONTNEED)` on private anonymous memory drops the pages and
reads them back as zeros, which is what the zero-fill left there.

The region is [llama_get_logits, llama_get_embeddings): the buffer starts with the logits and
the embeddings follow them (same function). Only whole pages inside it are released, so the
embeddings' first page is never touched. Linux only: elsewhere MADV_DONTNEED may keep the old
contents or not free at all, and this does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

import llama_cpp

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_MADVISE = _madvise()


def release_logits(ctx: ctypes.c_void_p) -> int:
    """Release the unused logits pages of an embedding context after a decode; the bytes
    released (0 when there is nothing to release, or off Linux)."""
    if _MADVISE is None:
        return 0
    lo = ctypes.cast(llama_cpp.llama_get_logits(ctx), ctypes.c_void_p).value
    hi = ctypes.cast(llama_cpp.llama_get_embeddings(ctx), ctypes.c_void_p).value
    if not lo or not hi or hi <= lo:
        return 0
    page = mmap.PAGESIZE
    start, end = -(-lo // page) * page, hi // page * page
    if end <= start:
        return 0
    if _MADVISE(start, end - start, _MADV_DONTNEED) != 0:
        return 0  # nothing lost: the pages stay as they were
    return end - start
