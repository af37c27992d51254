"""Which sequences of an embed/rerank request share one encoder decode, and when a lone
decode runs with every thread. Pure: index arithmetic over token counts, no llama.cpp."""

from __future__ import annotations

# Tokens per encoder decode: packed sequences see each other only through the attention mask,
# and ggml's CPU flash attention still walks every masked key, so attention costs n_tokens²
# per decode while the matmuls cost n_tokens. Measured on MiniLM f32, 2 threads, interleaved
# in-process runs of bench.embed's sentences: 128-token decodes of similar lengths (see
# `plan_decodes`) 2.2x faster than filling 512 on this shared, overloaded machine; 64 0.96x
# and 256 0.85x of 128. A perf profile (load-independent view) puts flash attention at 0.35
# of the matmul time with 512-token decodes and 0.24 with 128.
ENC_DECODE_TOKENS = 128
# With a BLAS backend (scripts/llama_wheel.py builds with OpenBLAS on Linux, Accelerate on
# macOS) the matmuls go to its sgemm, which gains more from taller matrices than attention
# loses: MiniLM f32, 2 single-threaded streams, OpenBLAS, same sentences: 128 -> 64-69,
# 256 -> 79.5, 384 -> 80.6, 512 -> 67-77 sentences/s (not measured on a Mac).
ENC_DECODE_TOKENS_BLAS = 256
# Token-state decodes (sparse, multi-vector, token outputs) run without flash attention, whose
# CPU kernel skips the masked pairs of packed sequences: their attention is the whole decode
# squared, so they pack smaller. 32 short texts, 2 single-threaded streams, OpenBLAS, CPU
# seconds: bge-m3 at e5-small shape (384 wide) 128 -> 1.26-1.32, 256 -> 1.43-1.57, 512 -> 1.66;
# bert-base (768 wide, attention a smaller share) 128 and 256 alike (2.28).
# Why it is a trade: each decode's matmuls go to OpenBLAS, which packs every weight matrix once
# a call (a cost per decode, whatever its rows), while the attention over the packed sequences
# costs n_tokens² a decode. The total, decodes x packing + tokens a decode x all tokens x
# attention, is least near sqrt(packing / attention) tokens a decode, which grows as
# sqrt(width). A perf profile of the e5-small-shape bge-m3 request (32 texts, 871 tokens,
# 128-token decodes) puts 98 % of the worker's CPU in llama_decode: OpenBLAS sgemm 62 % (its
# kernel 45, packing the weights 14), the packed attention (ggml's f32 KQ dot products, KQV,
# soft_max) 17.5 %, ggml's GELU 10.6 %, add / norm / copies 4.6 %; the numpy heads 1 %.
# Re-measured there (interleaved, CPU seconds): 96 -> 1.30, 112 -> 1.29, 128 -> 1.27,
# 144 -> 1.23, 176 -> 1.34: flat from 112 to 144.
TOKEN_STATES_DECODE_TOKENS = 128
# A request that is one decode (a lone input, at concurrency 1) would leave every stream but one
# idle, so it runs with all the threads when it is long enough to gain from them. Measured on
# MiniLM f32, 2 cores, one decode in-process, 2 threads against 1: 8 tokens 1.77x the time,
# 16 1.38-1.49x (a barrier per op costs more than it splits), 32 0.75-0.84x, 64 0.70x,
# 128 0.66x, 256 0.64x, 510 0.62-0.71x.
WIDE_DECODE_MIN_TOKENS = 32


def decode_tokens_for(backends: list[str]) -> int:
    """Tokens per encoder decode on a build with these ggml backends (see the measurements
    above: a BLAS backend gains from taller matrices)."""
    return ENC_DECODE_TOKENS_BLAS if "BLAS" in backends else ENC_DECODE_TOKENS


def plan_decodes(
    lengths: list[int],
    max_tokens: int,
    max_seqs: int,
    decode_tokens: int = ENC_DECODE_TOKENS,
    streams: int = 1,
) -> list[list[int]]:
    """Encoder decodes: shortest sequences first, so similar lengths share a decode, packed
    to `decode_tokens` (an item longer than that, up to `max_tokens`, goes alone). With
    several streams, the decodes come in whole rounds of one per stream, evenly filled, so
    no stream idles while another finishes a last decode: a 256-token batch runs as 2 x 128
    at once, a 768-token one as 4 x 192 rather than 3 x 256 (whose third decode ran alone:
    16-token inputs, 2 streams: 48 at once measured 0.7x the rate of 32 at once)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    budget = min(max_tokens, decode_tokens)
    if streams > 1 and lengths:
        total = sum(lengths)
        decodes = streams * -(-total // (streams * budget))
        # Greedy packing closes a decode only when the next item would overflow it, so each
        # closed one holds >= budget - longest + 1 tokens: this budget makes <= `decodes`.
        budget = min(budget, -(-total // decodes) + max(lengths) - 1)
    groups = pack([lengths[i] for i in order], budget, max_seqs)
    return [[order[j] for j in group] for group in groups]


def wide_decode(n_streams: int, lengths: list[int]) -> bool:
    """Whether a request that is this one decode runs with all the model's threads on its first
    context: only when the other `n_streams - 1` contexts would idle and it has enough tokens
    to gain (see WIDE_DECODE_MIN_TOKENS)."""
    return n_streams > 1 and sum(lengths) >= WIDE_DECODE_MIN_TOKENS


def pack(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Group item indices, in order, into decodes of <= max_tokens tokens and <= max_seqs items.

    An item longer than `max_tokens` still gets a group of its own (only reachable with
    validation off, where it is meant to reach llama.cpp).
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and (used + n > max_tokens or len(cur) >= max_seqs):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups
