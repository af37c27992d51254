"""Placing sequences into admitted shapes and building the int32 feeds (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.ane.packing import Chunk, NoShapeFits, feeds_for, gather_rows, plan
from workers.ane.shapes import Shape

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

U128, U512 = Shape(4, 128), Shape(2, 512)
P256 = Shape(2, 256, True, 4)


def test_unpacked_first_fit_by_length() -> None:
    chunks = plan([10, 300, 128, 129, 5], [U512, U128])
    placed = {c.shape: [i for row in c.rows for i in row] for c in chunks}
    assert sorted(placed[U128]) == [0, 2, 4]
    assert sorted(placed[U512]) == [1, 3]
    assert all(len(row) == 1 for c in chunks for row in c.rows)


def test_packed_rows_share_and_respect_segments_and_tokens() -> None:
    lengths = [100, 100, 60, 10, 10, 10, 10, 10]
    chunks = plan(lengths, [P256, U512])
    rows = [row for c in chunks if c.shape == P256 for row in c.rows]
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    for row in rows:
        assert len(row) <= P256.max_segments
        assert sum(lengths[i] for i in row) <= P256.seq_len
    # First-fit decreasing: the fourth segment closes row 0 although tokens would still fit.
    assert rows == [[0, 1, 3, 4], [2, 5, 6, 7]]


def test_long_items_prefer_unpacked_but_fall_back_to_packed() -> None:
    # 200 > 256 // 2: an unpacked 512 row is preferred; without one, the packed row takes it.
    assert [c.shape for c in plan([200], [P256, U512])] == [U512]
    assert [c.shape for c in plan([200], [P256])] == [P256]


@pytest.mark.parametrize(
    ("n", "shapes", "expected"),
    [
        # ~290-token rerank pairs: three share a 1024-token row at 341 positions each, an
        # unpacked 320-token row spends 320 on one.
        (285, [Shape(1, 1024, True, 4), Shape(1, 320)], Shape(1, 320)),
        # The same pairs against an unpacked 512-token row: packing is cheaper.
        (285, [Shape(1, 1024, True, 4), Shape(1, 512)], Shape(1, 1024, True, 4)),
        # Short inputs: eight to a 128-token row at 16 positions each, against 128.
        (16, [Shape(8, 128, True, 8), Shape(8, 128)], Shape(8, 128, True, 8)),
        # max_segments bounds the share: 4 of 10 tokens in a 256-token row cost 64 each.
        (10, [Shape(1, 256, True, 4), Shape(1, 32)], Shape(1, 32)),
        # A tie packs (the positions are the same).
        (40, [Shape(1, 256, True, 4), Shape(1, 64)], Shape(1, 256, True, 4)),
    ],
)
def test_packs_only_when_a_row_share_costs_no_more_than_the_fitting_unpacked_row(
    n: int, shapes: list[Shape], expected: Shape
) -> None:
    assert {c.shape for c in plan([n, n, n, n], shapes)} == {expected}


def test_no_shape_fits() -> None:
    with pytest.raises(NoShapeFits) as e:
        plan([5, 600], [U512, P256])
    assert e.value.index == 1 and e.value.length == 600


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=40))
def test_every_item_placed_exactly_once(lengths: list[int]) -> None:
    chunks = plan(lengths, [U128, U512, P256])
    seen = sorted(i for c in chunks for row in c.rows for i in row)
    assert seen == list(range(len(lengths)))
    for c in chunks:
        assert 1 <= len(c.rows) <= c.shape.rows
        for row in c.rows:
            assert sum(lengths[i] for i in row) <= c.shape.seq_len
            assert len(row) <= c.shape.max_segments


def test_packed_feeds_restart_positions_and_number_segments() -> None:
    seqs = [np.array([101, 7, 102]), np.array([101, 8, 9, 102]), np.array([101, 102])]
    types = [np.array([0, 0, 1]), np.zeros(4, int), np.zeros(2, int)]
    chunk = Chunk(Shape(2, 8, True, 3), [[0, 1], [2]])
    f = feeds_for(chunk, seqs, types, pad_id=0)
    assert f["input_ids"].dtype == np.int32
    assert f["input_ids"][0].tolist() == [101, 7, 102, 101, 8, 9, 102, 0]
    assert f["segment_ids"][0].tolist() == [1, 1, 1, 2, 2, 2, 2, 0]
    assert f["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert f["token_type_ids"][0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert f["segment_ids"][1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    out = np.arange(2 * 3 * 1).reshape(2, 3, 1)
    assert [(i, v.tolist()) for i, v in gather_rows(chunk, out)] == [(0, [0]), (1, [1]), (2, [3])]


def test_unpacked_feeds_mask_padding() -> None:
    chunk = Chunk(Shape(3, 4), [[1], [0]])
    seqs = [np.array([101, 102]), np.array([101, 5, 6, 102])]
    f = feeds_for(chunk, seqs, [np.zeros(2, int), np.ones(4, int)], pad_id=0)
    assert f["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert f["token_type_ids"][0].tolist() == [1, 1, 1, 1]
    assert set(f) == {"input_ids", "token_type_ids", "attention_mask"}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(1, 1024),
    st.integers(1, 64),
    st.booleans(),
    st.sampled_from([30522, 250002, 700]),
)
def test_splade_vocab_chunks_keep_the_memory_bound(
    rows: int, seq_len: int, segments: int, max_pooling: bool, vocab: int
) -> None:
    """A SPLADE vocabulary chunk's largest tensor, its logits or (max pooling, packed) those
    logits once per segment, never exceeds VOCAB_CHUNK_ELEMENTS: the chunk narrows below the
    32-entry alignment when it must, and the engine refuses a packed shape where even one
    entry would not fit (rows x seq_len x max_segments over the bound)."""
    from workers.ane.token_heads import VOCAB_CHUNK_ELEMENTS, vocab_chunk

    packed = segments > 1 and segments <= seq_len
    shape = Shape(rows, seq_len, packed, segments if packed else 1)
    chunk = vocab_chunk(shape, vocab, max_pooling)
    alive = rows * seq_len * chunk * (shape.max_segments if max_pooling else 1)
    assert 1 <= chunk <= vocab
    assert alive <= VOCAB_CHUNK_ELEMENTS or chunk == 1
    assert vocab_chunk(Shape(8, 128, True, 8), 30522, True) == 256
