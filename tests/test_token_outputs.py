"""How wide one item's reply can be (host/token_outputs.reply_width): the bound that sizes the
host's ENCODE requests under the agreed frame limit, so a reply never outgrows it."""

from __future__ import annotations

import pytest

from host.token_outputs import multivector_rows, reply_width, sparse_entries
from ingest.store import HeadSpec

VOCAB = 250_002
SPLADE = HeadSpec(file="heads/sparse.json", dims=VOCAB)
LEXICAL = HeadSpec(file="heads/sparse.json", dims=VOCAB, entries_per_token=True)
TOP_K = HeadSpec(file="heads/sparse.json", dims=VOCAB, max_active=64)
COLBERT = HeadSpec(file="heads/colbert.safetensors", dims=128)
# A ColBERT whose worker inserts a one-id prefix and pads queries to 32 ids.
EXPANDING = HeadSpec(file="heads/colbert.safetensors", dims=128, prefix_rows=1, expansion_rows=32)


@pytest.mark.parametrize(
    ("head", "longest", "entries"),
    [
        (SPLADE, 20, VOCAB),  # any vocabulary entry may be active, whatever the length
        (LEXICAL, 20, 20),  # one weight per distinct token id: never more than the tokens
        (LEXICAL, VOCAB + 5, VOCAB),  # and never more than the vocabulary
        (TOP_K, 20, 64),  # the model's top-k cuts a SPLADE vector
        (HeadSpec(file="x", dims=VOCAB, entries_per_token=True, max_active=8), 20, 8),
        (None, 20, 20),  # no head: what the old manifests' absent bound meant
    ],
)
def test_a_sparse_vector_holds_at_most(head, longest, entries):
    assert sparse_entries(head, longest) == entries


def test_each_output_adds_its_widest_reply():
    heads = {"sparse": LEXICAL, "multivector": COLBERT}
    assert reply_width(["dense"], 384, 30, heads) == 384
    assert reply_width(["tokens"], 384, 30, heads) == 30 * 384
    assert reply_width(["multivector"], 384, 30, heads) == 30 * 128
    assert reply_width(["multivector"], 384, 30, {}) == 30 * 384  # a ColBERT-less model's states
    assert reply_width(["sparse"], 384, 30, heads) == 2 * 30  # an index and a value each
    assert reply_width(["sparse"], 384, 30, {"sparse": SPLADE}) == 2 * VOCAB
    assert reply_width(["dense", "sparse", "multivector"], 384, 30, heads) == 384 + 60 + 3840


@pytest.mark.parametrize(
    ("head", "longest", "rows"),
    [
        (None, 20, 20),  # a model's token states: one per id
        (COLBERT, 20, 20),
        (EXPANDING, 5, 32),  # a short query padded to its expansion length
        (EXPANDING, 40, 41),  # a long text with the prefix id inserted
    ],
)
def test_a_multi_vector_reply_holds_at_most(head, longest, rows):
    assert multivector_rows(head, longest) == rows
    if head is not None:
        assert reply_width(["multivector"], 384, longest, {"multivector": head}) == rows * 128
