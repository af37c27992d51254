"""What a Core ML worker declares it refuses at LOAD (workers/ane/refusals.py): the rule alone,
on the two manifest fields it reads. Each case is what `AneEngine.encode` would answer with an
ERR, so the host can route the request elsewhere instead."""

from __future__ import annotations

from types import SimpleNamespace

from workers.ane.refusals import NO_TOKEN_SHAPE, refusals
from workers.ane.shapes import Shape
from workers.protocol import messages as m


def _manifest(family: str, head: str) -> SimpleNamespace:
    # refusals() reads the family and the head type, nothing else of a manifest
    return SimpleNamespace(config=SimpleNamespace(family=family), head=SimpleNamespace(type=head))


UNPACKED = Shape(rows=2, seq_len=64)
PACKED = Shape(rows=2, seq_len=64, packed=True, max_segments=4)


def test_an_embedder_of_a_token_family_refuses_nothing_on_packed_or_unpacked_shapes():
    for family in ("bert", "xlm-roberta"):
        assert refusals(_manifest(family, "embed_mean"), [PACKED], {}) == []
        assert refusals(_manifest(family, "embed_cls"), [UNPACKED, PACKED], {}) == []


def test_a_graph_without_token_outputs_refuses_every_output_with_its_reason():
    for manifest, said in (
        (_manifest("qwen3", "embed_last"), "qwen3 graph has no token outputs"),
        (_manifest("bert", "classify"), "classify model has no token outputs"),
    ):
        out = refusals(manifest, [UNPACKED], {})
        assert [r.output for r in out] == list(m.OUTPUT_KINDS)
        assert all(r.side is None and said in r.reason for r in out), out


def test_no_admitted_shape_refuses_every_output_that_needs_a_prediction():
    out = refusals(_manifest("bert", "embed_mean"), [], {})
    assert [r.output for r in out] == list(m.OUTPUT_KINDS)
    assert all(r.side is None and r.reason == NO_TOKEN_SHAPE for r in out)
