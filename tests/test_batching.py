from hypothesis import given
from hypothesis import strategies as st

from host.batching import plan_chunks


@given(
    lengths=st.lists(st.integers(1, 600), max_size=200),
    max_tokens=st.integers(1, 5000),
    max_items=st.integers(1, 300),
)
def test_chunks_cover_in_order_and_respect_budgets(lengths, max_tokens, max_items):
    chunks = plan_chunks(lengths, max_tokens, max_items, max_frame=1 << 20, dims=384)
    assert [i for c in chunks for i in c] == list(range(len(lengths)))
    for c in chunks:
        assert len(c) <= max_items
        assert sum(lengths[i] for i in c) <= max_tokens or len(c) == 1


def test_max_frame_caps_items_by_vector_bytes():
    chunks = plan_chunks([1] * 100, 10_000, 1000, max_frame=384 * 4 * 10, dims=384)
    assert all(len(c) <= 10 for c in chunks)
