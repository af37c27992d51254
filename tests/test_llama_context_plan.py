"""workers.llama.context_plan: the contexts' shape, decided without llama.cpp.

The engine tests load real models with these plans (and llama.cpp aborts at LOAD on a bad
one); here every branch of the arithmetic is checked directly, and hypothesis checks that any
plan returned keeps the rules llama.cpp asserts on, and that the defaults are never refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine import EngineError
from workers.llama.config import RuntimeConfig
from workers.llama.context_plan import (
    ENC_BATCH_MAX,
    ENC_BATCH_MIN,
    GEN_BATCH,
    GEN_CTX,
    ContextPlan,
    encode_streams,
    flash_attention,
    plan_context,
    reserve_tokens,
)

MAX_SEQ = 256  # llama_max_parallel_sequences() of the llama.cpp we vendor


DEFAULTS = RuntimeConfig()


def _plan(
    cfg: RuntimeConfig = DEFAULTS,
    *,
    encoder: bool = True,
    causal: bool = False,
    offloaded: bool = False,
    n_ctx_train: int = 512,
    max_seq: int = MAX_SEQ,
    cpu_count: int = 2,
) -> ContextPlan:
    return plan_context(
        cfg,
        encoder=encoder,
        causal=causal,
        offloaded=offloaded,
        n_ctx_train=n_ctx_train,
        max_parallel_sequences=max_seq,
        cpu_count=cpu_count,
    )


def _refusal(cfg: RuntimeConfig, **kw: object) -> str:
    with pytest.raises(EngineError) as e:
        _plan(cfg, **kw)
    assert e.value.code == "config_invalid"
    return e.value.msg


# ---- reserve_tokens: llama-context.cpp's reservation ------------------------------------------


def test_reserve_pads_n_ctx_to_256_and_clamps_to_the_micro_batch() -> None:
    assert reserve_tokens(100, 100, 100, 1, unified=True, causal=False) == 100
    assert reserve_tokens(100, 512, 512, 1, unified=True, causal=False) == 256  # padded n_ctx
    assert reserve_tokens(512, 512, 64, 1, unified=True, causal=False) == 64  # n_ubatch rules
    # Causal: n_batch is clamped to the n_ctx asked for, before padding (1000, not 1024).
    assert reserve_tokens(1000, 2048, 2048, 1, unified=True, causal=True) == 1000
    assert reserve_tokens(1000, 2048, 2048, 1, unified=True, causal=False) == 1024
    # Not unified: each sequence's share is padded to 256 on its own.
    assert reserve_tokens(512, 4096, 4096, 4, unified=False, causal=False) == 1024
    assert reserve_tokens(512, 4096, 4096, 4, unified=True, causal=False) == 512


# ---- encoders -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_ctx_train", "batch"),
    [(128, ENC_BATCH_MIN), (512, 512), (1024, 1024), (8192, ENC_BATCH_MAX)],
)
def test_encoder_defaults_follow_the_trained_context_within_bounds(n_ctx_train, batch) -> None:
    plan = _plan(n_ctx_train=n_ctx_train)
    assert (plan.n_ctx, plan.n_batch, plan.n_ubatch, plan.n_seq_max) == (batch, batch, batch, 64)


def test_encoder_default_n_seq_max_divides_the_reservation() -> None:
    # 100 tokens: 64 does not divide them, 50 is the largest divisor up to 64.
    assert _plan(RuntimeConfig(n_batch=100)).n_seq_max == 50
    # A decoder served as an embedder reserves min(n_ctx, n_batch) = 1000 tokens (llama.cpp
    # clamps the 2048 asked for to n_ctx, as the engine test reads back).
    plan = _plan(RuntimeConfig(n_ctx=1000), causal=True, n_ctx_train=32768)
    assert (plan.n_ctx, plan.n_batch, plan.n_seq_max) == (1000, 2048, 50)
    assert _plan(RuntimeConfig(n_ctx=1000), causal=False, n_ctx_train=32768).n_seq_max == 64
    assert _plan(RuntimeConfig(n_batch=97)).n_seq_max == 1  # a prime: one sequence a decode
    assert _plan(max_seq=8).n_seq_max == 8  # llama.cpp's own limit caps the default


def test_encoder_n_ubatch_alone_raises_the_default_batch() -> None:
    plan = _plan(RuntimeConfig(n_ubatch=1024))
    assert (plan.n_batch, plan.n_ubatch, plan.n_ctx) == (1024, 1024, 1024)


def test_encoder_refusals_name_every_problem() -> None:
    msg = _refusal(RuntimeConfig(n_batch=100, n_ubatch=200, n_seq_max=300))
    assert "n_ubatch 200 > n_batch 100" in msg and f"n_seq_max above {MAX_SEQ}" in msg
    assert "must divide" in _refusal(RuntimeConfig(n_batch=100, n_seq_max=64))
    # An encoder's n_ctx may exceed n_batch and its trained context: it is a per-item limit.
    assert _plan(RuntimeConfig(n_ctx=4096, n_batch=512), n_ctx_train=512).n_ctx == 4096


def test_encoder_streams_and_threads() -> None:
    plan = _plan(cpu_count=2)
    assert plan.streams == 2 and plan.stream_threads == (1, 1) and plan.all_threads == (2, 2)
    plan = _plan(RuntimeConfig(n_threads=4, n_threads_batch=8))
    assert plan.streams == 4 and plan.stream_threads == (1, 2) and plan.all_threads == (4, 8)
    plan = _plan(RuntimeConfig(n_threads=4, encode_streams=2))
    assert plan.streams == 2 and plan.stream_threads == (2, 2)
    assert _plan(RuntimeConfig(n_threads=2, encode_streams=8)).streams == 2  # capped at threads
    assert _plan(RuntimeConfig(n_threads=4), offloaded=True).streams == 1  # one device queue
    assert _plan(RuntimeConfig(n_threads=4, encode_streams=3), offloaded=True).streams == 3


# ---- generators ---------------------------------------------------------------------------------


def test_generator_defaults() -> None:
    plan = _plan(encoder=False, causal=True, n_ctx_train=32768, cpu_count=2)
    assert (plan.n_ctx, plan.n_batch, plan.n_ubatch, plan.n_seq_max) == (
        GEN_CTX,
        GEN_BATCH,
        GEN_BATCH,
        1,
    )
    assert plan.streams == 1 and plan.stream_threads == plan.all_threads == (2, 2)
    small = _plan(encoder=False, causal=True, n_ctx_train=256)
    assert (small.n_ctx, small.n_batch) == (256, 256)  # never past the trained context


def test_generator_refusals() -> None:
    gen = {"encoder": False, "causal": True, "n_ctx_train": 2048}
    assert "n_batch 1024 > n_ctx 512" in _refusal(RuntimeConfig(n_ctx=512, n_batch=1024), **gen)
    assert "trained context 2048" in _refusal(RuntimeConfig(n_ctx=4096), **gen)
    assert "n_seq_max must be 1" in _refusal(RuntimeConfig(n_seq_max=2), **gen)
    assert "embed/rerank only" in _refusal(RuntimeConfig(encode_streams=2), **gen)
    assert _plan(RuntimeConfig(encode_streams=1), **gen).streams == 1


def test_encode_streams_alone() -> None:
    assert encode_streams(RuntimeConfig(), encoder=True, offloaded=False, threads=3) == 3
    assert encode_streams(RuntimeConfig(), encoder=False, offloaded=False, threads=3) == 1
    with pytest.raises(EngineError, match="embed/rerank only"):
        encode_streams(RuntimeConfig(encode_streams=2), encoder=False, offloaded=False, threads=3)


# ---- properties ---------------------------------------------------------------------------------

sizes = st.one_of(st.none(), st.integers(1, 5000))
configs = st.builds(
    RuntimeConfig,
    n_ctx=sizes,
    n_batch=sizes,
    n_ubatch=sizes,
    n_seq_max=st.one_of(st.none(), st.integers(1, 300)),
    n_threads=st.one_of(st.none(), st.integers(1, 64)),
    n_threads_batch=st.one_of(st.none(), st.integers(1, 64)),
    encode_streams=st.one_of(st.none(), st.integers(1, 64)),
)
facts = {
    "encoder": st.booleans(),
    "causal": st.booleans(),
    "offloaded": st.booleans(),
    "n_ctx_train": st.integers(1, 40000),
    "max_seq": st.integers(1, 256),
    "cpu_count": st.integers(1, 64),
}


@settings(max_examples=400, deadline=None)
@given(cfg=configs, **facts)
def test_a_plan_keeps_llama_cpp_s_rules_or_is_refused(
    cfg, encoder, causal, offloaded, n_ctx_train, max_seq, cpu_count
) -> None:
    try:
        plan = _plan(
            cfg,
            encoder=encoder,
            causal=causal,
            offloaded=offloaded,
            n_ctx_train=n_ctx_train,
            max_seq=max_seq,
            cpu_count=cpu_count,
        )
    except EngineError as e:
        assert e.code == "config_invalid"
        return
    # Explicit values are kept, never adjusted.
    for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
        if getattr(cfg, name) is not None:
            assert getattr(plan, name) == getattr(cfg, name)
    assert plan.n_ubatch <= plan.n_batch
    assert 1 <= plan.n_seq_max <= max_seq
    reserve = reserve_tokens(
        plan.n_ctx, plan.n_batch, plan.n_ubatch, plan.n_seq_max, unified=encoder, causal=causal
    )
    assert reserve % plan.n_seq_max == 0
    if not encoder:
        assert plan.n_seq_max == 1 and plan.streams == 1
        assert plan.n_batch <= plan.n_ctx <= n_ctx_train
    threads = cfg.n_threads or cpu_count
    assert 1 <= plan.streams <= threads
    assert plan.all_threads == (threads, cfg.n_threads_batch or threads)
    assert plan.stream_threads[0] * plan.streams <= threads  # no core is oversubscribed
    assert min(plan.stream_threads) >= 1


@settings(max_examples=300, deadline=None)
@given(**facts)
def test_the_defaults_are_never_refused(
    encoder, causal, offloaded, n_ctx_train, max_seq, cpu_count
) -> None:
    causal = causal or not encoder  # a generator is causal (model_kind refuses the rest)
    plan = _plan(
        encoder=encoder,
        causal=causal,
        offloaded=offloaded,
        n_ctx_train=n_ctx_train,
        max_seq=max_seq,
        cpu_count=cpu_count,
    )
    if encoder:
        assert plan.n_batch == min(max(n_ctx_train, ENC_BATCH_MIN), ENC_BATCH_MAX)
        assert plan.streams == (1 if offloaded else cpu_count)
    else:
        assert plan.n_ctx == min(GEN_CTX, n_ctx_train)


def test_an_encoder_reranker_on_the_cpu_decodes_without_flash_attention():
    # Its raw logit would carry llama.cpp's f16 K/V cast (measured in RuntimeConfig's docs).
    assert flash_attention(None, "rerank", offloaded=False) is False
    # A decoder reranker's pairs attend to a shared prefix in the KV cache: flash attention
    # skips the masked cells the plain path multiplies (measured in flash_attention's docs).
    assert flash_attention(None, "rerank", offloaded=False, last_token=True) is True
    assert flash_attention(False, "rerank", offloaded=False, last_token=True) is False
    assert flash_attention(None, "rerank", offloaded=True) is True
    assert flash_attention(None, "embed", offloaded=False) is True
    assert flash_attention(None, "generate", offloaded=False) is True
    assert flash_attention(True, "rerank", offloaded=False) is True  # an explicit setting wins
    assert flash_attention(False, "embed", offloaded=False) is False
