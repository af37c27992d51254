"""workers.llama.decode_plan: which sequences share an encoder decode, checked as properties
(the engine tests check the same plans against real decodes and PROGRESS counts)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.llama.decode_plan import (
    ENC_DECODE_TOKENS,
    ENC_DECODE_TOKENS_BLAS,
    WIDE_DECODE_MIN_TOKENS,
    decode_tokens_for,
    pack,
    plan_decodes,
    wide_decode,
)

lengths_st = st.lists(st.integers(1, 600), max_size=80)


@settings(max_examples=400, deadline=None)
@given(lengths=lengths_st, max_tokens=st.integers(1, 1000), max_seqs=st.integers(1, 70))
def test_pack_cuts_in_order_within_both_limits_and_greedily(lengths, max_tokens, max_seqs):
    groups = pack(lengths, max_tokens, max_seqs)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for g in groups:
        assert 1 <= len(g) <= max_seqs
        assert len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens  # oversize goes alone
    for prev, nxt in zip(groups, groups[1:], strict=False):  # a group closes only when full
        assert sum(lengths[i] for i in prev) + lengths[nxt[0]] > max_tokens or len(prev) == max_seqs


@settings(max_examples=400, deadline=None)
@given(
    lengths=lengths_st,
    max_tokens=st.integers(1, 2048),
    max_seqs=st.integers(1, 70),
    decode_tokens=st.sampled_from([64, ENC_DECODE_TOKENS, ENC_DECODE_TOKENS_BLAS, 10**6]),
    streams=st.integers(1, 4),
)
def test_plan_decodes_partitions_by_length_within_the_budget(
    lengths, max_tokens, max_seqs, decode_tokens, streams
):
    groups = plan_decodes(lengths, max_tokens, max_seqs, decode_tokens, streams)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    budget = min(max_tokens, decode_tokens)
    for g in groups:
        assert 1 <= len(g) <= max_seqs
        assert len(g) == 1 or sum(lengths[i] for i in g) <= budget
    # Shortest first: similar lengths share a decode.
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)


@settings(max_examples=400, deadline=None)
@given(lengths=st.lists(st.integers(1, 256), min_size=1, max_size=80), streams=st.integers(2, 4))
def test_several_streams_get_whole_rounds(lengths, streams):
    # No sequence limit in the way: at most as many decodes as whole rounds of one decode per
    # stream need, so no stream finishes a last decode alone. The guarantee holds while an
    # even share plus the longest item fits the decode budget (greedy packing closes a decode
    # only once the next item would overflow it); [1, 47, 209, 209] on 2 streams does not
    # fit that, and takes 3 decodes where 2 could hold it.
    groups = plan_decodes(lengths, 512, 10**6, 256, streams)
    decodes = streams * -(-sum(lengths) // (streams * 256))
    if -(-sum(lengths) // decodes) + max(lengths) - 1 <= 256:
        assert len(groups) <= decodes
    else:
        assert len(groups) == len(pack(sorted(lengths), 256, 10**6))  # as one stream packs


def test_one_stream_fills_each_decode() -> None:
    assert plan_decodes([16] * 16, 512, 64, 256) == [list(range(16))]
    assert [len(g) for g in plan_decodes([16] * 16, 512, 64, 256, streams=2)] == [8, 8]


def test_wide_decode_needs_idle_streams_and_enough_tokens() -> None:
    assert wide_decode(2, [WIDE_DECODE_MIN_TOKENS])
    assert wide_decode(3, [10, WIDE_DECODE_MIN_TOKENS - 10])
    assert not wide_decode(2, [WIDE_DECODE_MIN_TOKENS - 1])
    assert not wide_decode(1, [10**4])  # one context: nothing idles


def test_decode_tokens_follow_a_blas_backend() -> None:
    assert decode_tokens_for(["CPU"]) == ENC_DECODE_TOKENS
    assert decode_tokens_for(["BLAS", "CPU"]) == ENC_DECODE_TOKENS_BLAS
