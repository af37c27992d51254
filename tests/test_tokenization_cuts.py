"""Which end of an over-long input is cut (host/tokenization.py), with the real MiniLM
tokenizer and no model: the ids a cut gives are built independently here from the bare
tokens, the template's [CLS]/[SEP] and the prompt's own tokens."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import InvalidRequest
from host.tokenization import Tokenizer
from ingest.model_packages import minilm_dir
from service.coalesce import Coalescer, Options

CLS, SEP = 101, 102
LONG = " ".join(f"w{i}" for i in range(300))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(minilm_dir())


def _bare(tok: Tokenizer, text: str) -> list[int]:
    return tok.tokenize([text], add_special_tokens=False)[0].ids


def _ids(encoded) -> list[list[int]]:
    return [a.tolist() for a in encoded.ids]


def test_right_and_left_cuts(tok):
    ids = _bare(tok, LONG)
    right = tok.encode([LONG], True, 16)
    left = tok.encode([LONG], True, 16, direction="left")
    assert _ids(right) == [[CLS, *ids[:14], SEP]]
    assert _ids(left) == [[CLS, *ids[-14:], SEP]]
    assert right.truncated == left.truncated == [True] and left.n_tokens == [16]
    short = tok.encode(["a cat"], True, 16, direction="left")
    assert _ids(short) == [[CLS, *_bare(tok, "a cat"), SEP]] and short.truncated == [False]


def test_a_left_cut_keeps_the_prompt(tok):
    prompt, ids = _bare(tok, "query: "), _bare(tok, LONG)
    left = tok.encode([LONG], True, 16, prompt="query: ", direction="left")
    assert _ids(left) == [[CLS, *prompt, *ids[-(14 - len(prompt)) :], SEP]]
    right = tok.encode([LONG], True, 16, prompt="query: ")
    assert _ids(right) == [[CLS, *_bare(tok, "query: " + LONG)[:14], SEP]]
    # A prompt that alone fills the limit is cut as a right cut would cut it.
    huge = "instruction " * 20
    assert _ids(tok.encode(["x"], True, 8, prompt=huge, direction="left")) == _ids(
        tok.encode(["x"], True, 8, prompt=huge)
    )


def test_refusals_name_the_input_and_the_direction(tok):
    with pytest.raises(InvalidRequest) as info:
        tok.encode(["ok", LONG], False, 16, direction="left")
    assert info.value.details["index"] == 1 and "input 1 has" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        tok.encode(["x"], True, direction="middle")
    assert info.value.details["param"] == "truncation_direction"


def test_pairs_cut_at_the_asked_end_and_cap_documents(tok):
    q, d = _bare(tok, "what is it"), _bare(tok, LONG)
    pairs = tok.encode_pairs("what is it", [LONG], True, 20, direction="left")
    keep = 20 - tok.n_special_pair - len(q)
    assert pairs.ids[0].tolist() == [CLS, *q, SEP, *d[-keep:], SEP]
    capped = tok.encode_pairs("what is it", ["a b c d e", "a b"], True, max_doc_tokens=3)
    assert [x.tolist() for x in capped.ids] == [
        [CLS, *q, SEP, *_bare(tok, "a b c"), SEP],
        [CLS, *q, SEP, *_bare(tok, "a b"), SEP],
    ]
    assert capped.truncated == [True, False]
    seg = tok.rerank_segments(
        "what is it", [LONG, "a b c d e"], True, 20, direction="left", max_doc_tokens=3
    )
    assert seg.docs[0].tolist() == d[-3:] and seg.docs[1].tolist() == _bare(tok, "c d e")
    assert seg.truncated == [True, True]
    right = tok.rerank_segments("what is it", [LONG], True, 20)
    assert right.docs[0].tolist() == d[:keep]


def test_tokenize_shows_tokens_offsets_and_specials(tok):
    (t,) = tok.tokenize(["Héllo [SEP]\x00x"])
    assert t.text == "Héllo [SEP] x"  # sanitized: the control character became a space
    assert t.tokens == ["[CLS]", "hello", "[", "sep", "]", "x", "[SEP]"]
    assert t.special == [True, False, False, False, False, False, True]
    assert t.offsets == [None, (0, 5), (6, 7), (7, 10), (10, 11), (12, 13), None]
    (p,) = tok.tokenize(["x"], add_special_tokens=False, prompt="query: ")
    assert p.text == "query: x" and p.ids == _bare(tok, "query: x") and not any(p.special)


def test_coalesced_requests_with_different_options_get_what_each_gets_alone(tok):
    requests = [
        ([LONG, "a"], True, Options()),
        ([LONG], True, Options("query: ", "left")),
        (["b", LONG], True, Options("", "left", 32)),
        ([LONG], True, Options()),
    ]

    async def run():
        co = Coalescer(tok, 1 << 20)
        futures = [co.add(texts, trunc, 1, opts) for texts, trunc, opts in requests]
        co.flush()
        return [f.result() for f in futures]

    for (texts, trunc, opts), got in zip(requests, asyncio.run(run()), strict=True):
        alone = tok.encode(
            texts, trunc, opts.max_tokens, prompt=opts.prompt, direction=opts.direction
        )
        assert _ids(got) == _ids(alone) and got.truncated == alone.truncated
