"""The shape of a model's llama_contexts: n_ctx, n_batch, n_ubatch, n_seq_max, how many
contexts decode in parallel and on how many threads each.

Pure arithmetic over the runtime config and a few facts about the model and the build (its
trained context, llama.cpp's sequence limit, the CPU count): nothing here calls llama.cpp, so
every decision is checked directly. A plan this module returns is one llama.cpp accepts
without a GGML_ASSERT at context creation; anything else is refused `config_invalid`.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine import EngineError
from workers.llama.config import RuntimeConfig

# Encoder defaults: one decode packs up to n_ctx_train tokens (clamped to 512..2048) from up
# to 64 sequences. Measured on MiniLM (2 cores): 512 and 2048 run equally fast, but the
# 2048-token compute buffer costs ~330 MB RSS against ~120 MB.
ENC_BATCH_MIN, ENC_BATCH_MAX = 512, 2048
ENC_SEQ_MAX = 64
# Generation defaults: prompts are short here, so a 2k context and 512-token prompt chunks
# (llama-cpp-python's own defaults for n_batch/n_ubatch).
GEN_CTX = 2048
GEN_BATCH = 512


@dataclass(frozen=True)
class ContextPlan:
    """What every llama_context of one model is created with."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    streams: int  # llama_contexts decoding in parallel (see `encode_streams`)
    # (n_threads, n_threads_batch): each context's own, and all of them (a lone wide decode).
    stream_threads: tuple[int, int]
    all_threads: tuple[int, int]


def reserve_tokens(
    n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int, *, unified: bool, causal: bool
) -> int:
    """Token count of llama.cpp's worst-case graph reservation (llama_context::sched_reserve).

    Mirrors llama-context.cpp: causal contexts clamp n_batch to the n_ctx asked for (before
    padding), n_ubatch is clamped to n_batch, and n_ctx is padded to 256 (per sequence when not
    unified).
    """
    batch = min(n_ctx, n_batch) if causal else n_batch
    ctx = -(-n_ctx // 256) * 256
    if not unified:
        ctx = -(-(ctx // n_seq_max) // 256) * 256 * n_seq_max
    return min(ctx, min(batch, n_ubatch))


def encode_streams(cfg: RuntimeConfig, encoder: bool, offloaded: bool, threads: int) -> int:
    """How many llama_contexts an encoder decodes with in parallel, each on threads/streams
    threads. Default on the CPU: one per thread. ggml splits every op of a small BERT decode
    across its threads and meets them at a barrier after each op; separate single-threaded
    contexts never wait for each other. Measured on MiniLM f32 (bench.embed's 512 sentences,
    2 cores, in-process): two single-threaded contexts 1.26x one two-threaded context with
    ggml's own kernels (51.5 vs 40.9 sentences/s), 1.6x with OpenBLAS (75.0 vs 46.1).
    One stream on a GPU (one device queue) and for generation (one sequence at a time)."""
    if cfg.encode_streams is not None:
        if not encoder and cfg.encode_streams > 1:
            raise EngineError("config_invalid", "encode_streams > 1 applies to embed/rerank only")
        return min(cfg.encode_streams, threads) if encoder else 1
    return threads if encoder and not offloaded else 1


def plan_context(
    cfg: RuntimeConfig,
    *,
    encoder: bool,
    causal: bool,
    offloaded: bool,
    n_ctx_train: int,
    max_parallel_sequences: int,
    cpu_count: int,
) -> ContextPlan:
    """The contexts' shape for an encoder (embed/rerank) or a generator, from the config's
    explicit values and the defaults above; `causal` is whether llama.cpp runs the model
    causally (a decoder served as an embedder stays causal), which changes its reservation.
    Every inconsistency is named in one `config_invalid` refusal."""
    max_seq = max_parallel_sequences
    if encoder:
        default_batch = min(max(n_ctx_train, ENC_BATCH_MIN), ENC_BATCH_MAX)
        n_batch = cfg.n_batch or max(default_batch, cfg.n_ubatch or 0)
        n_ubatch = cfg.n_ubatch or n_batch
        n_ctx = cfg.n_ctx or n_batch
        # Default: the most sequences per decode that llama.cpp's reservation accepts.
        reserve = reserve_tokens(n_ctx, n_batch, n_ubatch, 1, unified=True, causal=causal)
        n_seq_max = cfg.n_seq_max or max(
            d for d in range(1, min(ENC_SEQ_MAX, max_seq) + 1) if reserve % d == 0
        )
    else:
        n_ctx = cfg.n_ctx or min(GEN_CTX, n_ctx_train)
        n_batch = cfg.n_batch or min(GEN_BATCH, n_ctx)
        n_ubatch = cfg.n_ubatch or n_batch
        n_seq_max = cfg.n_seq_max or 1
    problems = []
    if n_ubatch > n_batch:
        problems.append(f"n_ubatch {n_ubatch} > n_batch {n_batch}")
    if n_seq_max > max_seq:
        problems.append(f"n_seq_max above {max_seq}")
    if not encoder and n_batch > n_ctx:
        problems.append(f"n_batch {n_batch} > n_ctx {n_ctx}")
    if not encoder and n_ctx > n_ctx_train:
        problems.append(f"n_ctx {n_ctx} > the model's trained context {n_ctx_train}")
    if not encoder and n_seq_max != 1:
        # Generation decodes one sequence; llama.cpp would give it n_ctx / n_seq_max
        # cells while the prompt is checked against n_ctx (a 507 instead of a 400).
        problems.append("generation serves one sequence: n_seq_max must be 1")
    # Encoders keep no KV cache and are created with a unified layout (see native.py).
    reserve = reserve_tokens(n_ctx, n_batch, n_ubatch, n_seq_max, unified=encoder, causal=causal)
    if reserve % n_seq_max:
        # llama.cpp reserves its worst-case graph with `reserve` tokens split evenly over
        # n_seq_max sequences; otherwise GGML_ASSERT(ggml_can_mul_mat) aborts at LOAD.
        problems.append(
            f"n_seq_max {n_seq_max} must divide min(n_ctx padded to 256, n_ubatch) = {reserve}"
        )
    if problems:
        raise EngineError("config_invalid", "; ".join(problems))

    threads = cfg.n_threads or cpu_count
    streams = encode_streams(cfg, encoder, offloaded, threads)
    return ContextPlan(
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        n_seq_max=n_seq_max,
        streams=streams,
        stream_threads=(
            max(1, threads // streams),
            max(1, (cfg.n_threads_batch or threads) // streams),
        ),
        all_threads=(threads, cfg.n_threads_batch or threads),
    )


def flash_attention(
    setting: bool | None, kind: str, offloaded: bool, *, last_token: bool = False
) -> bool:
    """Whether a model's contexts use flash attention: `setting` when the runtime config gives
    one, else on except for an encoder reranker on the CPU.

    llama.cpp's CPU flash attention casts f32 K and V to f16 (llama-graph.cpp: an encoder keeps
    no KV cache, and a decoder's f32 cache is cast too), and a reranker's raw logit, unbounded
    and read as it is, carries that rounding: on a tiny bge-reranker-v2-m3-style model it
    tripled the error against sentence-transformers (see RuntimeConfig.flash_attn). Encoder
    decodes are packed to 128-256 tokens (decode_plan), so the plain attention's n_tokens x
    n_tokens scores stay small. An embedder's normalized vector, and a GPU lane (f16 weights
    already), keep flash attention.

    A decoder reranker (`last_token`: an LLM reranker or decoder classifier, one output per
    sequence, last_token.py) keeps it too: its pairs attend to a shared prefix in the KV
    cache, and without flash attention ggml multiplies every query by all the cache cells in
    use rounded up to 256 (masked or not), one f32 dot product at a time; the tiled flash
    kernel skips fully masked tiles. At Qwen3-Reranker-0.6B's shape (16 pairs of ~285 tokens,
    2 single-threaded contexts, in process) it cut the CPU seconds by a fifth (88.3 -> 71.7)
    for a max raw-score change of 4.6e-4 against sentence-transformers (scores 0.5..1.5;
    the certification bar is 2e-2); 64 pairs of ~324 tokens through the module (bench.rerank_llm)
    363 -> 313 CPU seconds, where sentence-transformers' CrossEncoder took 527.
    """
    if setting is not None:
        return setting
    return not (kind == "rerank" and not offloaded and not last_token)
