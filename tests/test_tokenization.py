"""Module-side tokenization: explicit truncation policy, limits, pairs, sanitization on the way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidRequest
from host.errors import ConfigInvalid
from host.sanitize import sanitize
from host.tokenization import Encoded, Tokenizer, model_limits
from ingest.model_packages import minilm_dir

CLS, SEP, PAD = 101, 102, 0
LONG = "token " * 600  # 600 word pieces


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(minilm_dir())


@pytest.fixture(scope="module")
def hf() -> tokenizers.Tokenizer:
    """The library tokenizer configured by hand (no padding/truncation) for comparisons."""
    t = tokenizers.Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    t.no_padding()
    t.no_truncation()
    return t


def test_limits_come_from_the_model_dir(tok: Tokenizer) -> None:
    assert (tok.max_tokens, tok.hard_limit) == (256, 512)  # max_seq_length, positions
    assert model_limits(minilm_dir()) == (512, 256)


def test_roberta_style_position_offset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "xlm-roberta", "max_position_embeddings": 514, "pad_token_id": 1})
    )
    assert model_limits(tmp_path) == (512, 512)


def test_no_padding_even_though_the_file_asks_for_it(tok: Tokenizer) -> None:
    # MiniLM's tokenizer.json pads to 128 and truncates at 128: both must be off.
    enc = tok.encode(["hello world", "x " * 200], truncate=True)
    assert enc.ids[0].tolist() == [CLS, 7592, 2088, SEP]
    assert enc.n_tokens == [4, 202]
    assert all(PAD not in ids for ids in enc.ids)
    assert all(ids.dtype == np.int32 for ids in enc.ids)


def test_matches_the_library_with_special_tokens(tok: Tokenizer, hf: tokenizers.Tokenizer) -> None:
    texts = ["Hello, World!", "naïve café", "東京タワー", "emoji 😀", "  spaced   out  "]
    enc = tok.encode(texts, truncate=False)
    assert [i.tolist() for i in enc.ids] == [e.ids for e in hf.encode_batch(texts)]


def test_truncate_true_cuts_at_limit_and_keeps_final_sep(tok: Tokenizer) -> None:
    enc = tok.encode([LONG, "short"], truncate=True)
    assert enc.n_tokens == [256, 3]
    assert enc.truncated == [True, False]
    ids = enc.ids[0]
    assert len(ids) == 256 and ids[0] == CLS and ids[-1] == SEP
    assert np.count_nonzero(ids == SEP) == 1
    assert enc.total_tokens == 259


def test_truncate_false_over_limit_is_a_typed_error(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequest) as exc:
        tok.encode(["fine", LONG], truncate=False)
    err = exc.value
    assert err.code == "invalid_request"
    assert err.details["index"] == 1
    assert err.details["n_tokens"] == 602 and err.details["max_tokens"] == 256


def test_exactly_at_the_limit_is_not_truncated(tok: Tokenizer) -> None:
    text = "x " * 254  # 254 pieces + [CLS] + [SEP] = 256
    enc = tok.encode([text], truncate=False)
    assert enc.n_tokens == [256] and enc.truncated == [False]
    with pytest.raises(InvalidRequest):
        tok.encode([text + "x"], truncate=False)


def test_per_request_limit_within_hard_limit(tok: Tokenizer) -> None:
    assert tok.encode([LONG], truncate=True, max_tokens=512).n_tokens == [512]
    assert tok.encode([LONG], truncate=True, max_tokens=10).n_tokens == [10]
    with pytest.raises(InvalidRequest):
        tok.encode([LONG], truncate=True, max_tokens=513)
    with pytest.raises(InvalidRequest):
        tok.encode(["a"], truncate=True, max_tokens=0)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigInvalid):
        Tokenizer.from_file(minilm_dir() / "tokenizer.json", max_tokens=600, hard_limit=512)


def test_empty_list_and_empty_string(tok: Tokenizer) -> None:
    empty = tok.encode([], truncate=False)
    assert empty == Encoded(ids=[], n_tokens=[], truncated=[])
    assert empty.total_tokens == 0
    enc = tok.encode([""], truncate=False)
    assert enc.ids[0].tolist() == [CLS, SEP] and enc.n_tokens == [2]


def test_texts_must_be_a_list_of_strings(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="list"):
        tok.encode("not a list", truncate=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as exc:
        tok.encode(["ok", 5], truncate=True)  # type: ignore[list-item]
    assert exc.value.details["index"] == 1


def test_sanitization_applies_before_tokenizing(tok: Tokenizer, hf: tokenizers.Tokenizer) -> None:
    # NUL -> space keeps the word boundary: "foo\x00bar" tokenizes like "foo bar".
    a = tok.encode(["foo\x00bar"], truncate=False).ids[0].tolist()
    assert a == hf.encode("foo bar").ids
    assert a != hf.encode("foobar").ids
    # Invalid UTF-8 bytes and lone surrogates neither raise nor vanish silently as errors.
    b = tok.encode([b"caf\xc3\xa9 \xff ok", "x\ud800y"], truncate=False)
    assert b.ids[0].tolist() == hf.encode("café \ufffd ok").ids
    assert b.ids[1].tolist() == hf.encode("x\ufffdy").ids
    c = tok.encode(["bell\x07 and\x1b escape\x85"], truncate=False)
    assert c.ids[0].tolist() == hf.encode("bell  and  escape ").ids


def test_ten_thousand_characters(tok: Tokenizer) -> None:
    text = ("lorem ipsum dolor sit amet " * 400)[:10_000]
    enc = tok.encode([text], truncate=True)
    assert enc.n_tokens == [256] and enc.truncated == [True]
    with pytest.raises(InvalidRequest):
        tok.encode([text], truncate=False)


def test_special_tokens_in_text_are_plain_text_by_default(hf: tokenizers.Tokenizer) -> None:
    safe = Tokenizer.from_model_dir(minilm_dir())
    parsed = Tokenizer.from_model_dir(minilm_dir(), parse_special=True)
    text = "before [SEP] after"
    assert SEP not in safe.encode([text], truncate=False).ids[0][1:-1]
    assert SEP in parsed.encode([text], truncate=False).ids[0][1:-1]


def test_pairs_have_token_types_and_n_first(tok: Tokenizer, hf: tokenizers.Tokenizer) -> None:
    p = tok.encode_pair("what is this", "a doc", truncate=False)
    want = hf.encode("what is this", "a doc")
    assert p.ids[0].tolist() == want.ids
    assert p.token_type_ids[0].tolist() == want.type_ids == [0] * 5 + [1] * 3
    assert p.n_first == [5] and p.n_tokens == [8] and p.truncated == [False]


def test_pair_truncation_cuts_the_document_first(tok: Tokenizer) -> None:
    p = tok.encode_pairs("short query", ["doc " * 600, "tiny"], truncate=True)
    assert p.n_tokens[0] == 256 and p.truncated == [True, False]
    ids, types = p.ids[0], p.token_type_ids[0]
    assert ids[-1] == SEP and ids[p.n_first[0] - 1] == SEP and np.count_nonzero(ids == SEP) == 2
    assert p.n_first[0] == 4  # the query is intact
    assert int(types.sum()) == 256 - 4
    with pytest.raises(InvalidRequest) as exc:
        tok.encode_pairs("short query", ["tiny", "doc " * 600], truncate=False)
    assert exc.value.details["index"] == 1


def test_pair_truncation_of_an_oversized_query(tok: Tokenizer) -> None:
    p = tok.encode_pairs(LONG, ["a doc", "doc " * 600], truncate=True)
    assert p.n_tokens == [256, 256]
    # budget 253: the query keeps all it can next to a 2-token doc, else half.
    assert p.n_first == [251 + 2, 126 + 2]


def test_llama_style_rerank_segments_have_no_special_tokens(
    tok: Tokenizer, hf: tokenizers.Tokenizer
) -> None:
    seg = tok.rerank_segments("what is this", ["a doc", "doc " * 600], truncate=True)
    assert seg.query.tolist() == hf.encode("what is this", add_special_tokens=False).ids
    assert seg.docs[0].tolist() == hf.encode("a doc", add_special_tokens=False).ids
    assert CLS not in seg.query and SEP not in seg.docs[0]
    assert seg.n_special == 3  # the worker adds [CLS] q [SEP] d [SEP]
    assert seg.n_tokens == [3 + 2 + 3, 256] and seg.truncated == [False, True]
    with pytest.raises(InvalidRequest):
        tok.rerank_segments("what is this", ["doc " * 600], truncate=False)
    with pytest.raises(InvalidRequest, match="no room"):
        tok.rerank_segments(LONG, ["a doc"], truncate=True)


def test_decode(tok: Tokenizer) -> None:
    ids = tok.encode(["Hello World"], truncate=False).ids[0]
    assert tok.decode(ids) == "hello world"
    assert "[CLS]" in tok.decode(ids, skip_special_tokens=False)


def test_other_tokenizer_files_load(tmp_path: Path) -> None:
    # A directory without sentence_bert_config.json: the default limit is the hard limit.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(minilm_dir() / name, tmp_path / name)
    t = Tokenizer.from_model_dir(tmp_path)
    assert (t.max_tokens, t.hard_limit) == (512, 512)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=300), max_size=4), st.booleans())
def test_any_text_tokenizes_within_the_limit(texts: list[str], truncate: bool) -> None:
    t, _ = _shared()
    try:
        enc = t.encode(texts, truncate=truncate, max_tokens=64)
    except InvalidRequest:
        assert not truncate
        return
    assert len(enc.ids) == len(texts)
    for ids, n in zip(enc.ids, enc.n_tokens, strict=True):
        assert len(ids) == n <= 64 and ids[0] == CLS and ids[-1] == SEP


_SHARED: list[tuple[Tokenizer, tokenizers.Tokenizer]] = []


def _shared() -> tuple[Tokenizer, tokenizers.Tokenizer]:
    """MiniLM's Tokenizer (as `from_model_dir` builds it) and the library tokenizer it was
    given, configured by it: the plain rule below runs on the very same object."""
    # hypothesis forbids function-scoped fixtures; build once per process instead.
    if not _SHARED:
        hard, default = model_limits(minilm_dir())
        hf = tokenizers.Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
        _SHARED.append((Tokenizer(hf, max_tokens=default, hard_limit=hard), hf))
    return _SHARED[0]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.text(max_size=200), min_size=1, max_size=4), st.integers(5, 80))
def test_one_call_path_equals_encode_cut_then_add_specials(texts: list[str], limit: int) -> None:
    # `encode` asks the library for the template's tokens in the same call and re-encodes
    # only inputs over the limit; the ids must be those of the plain rule: encode bare, cut
    # to the limit minus the template's tokens, then add them.
    t, hf = _shared()
    enc = t.encode(texts, truncate=True, max_tokens=limit)
    for text, ids, cut in zip(texts, enc.ids, enc.truncated, strict=True):
        bare = hf.encode(sanitize(text), add_special_tokens=False)
        assert cut == (len(bare.ids) + t.n_special_single > limit)
        bare.truncate(limit - t.n_special_single)
        assert ids.tolist() == hf.post_process(bare, None, add_special_tokens=True).ids
