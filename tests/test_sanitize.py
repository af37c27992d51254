"""The single input-sanitization rule (host/sanitize.py)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.errors import InvalidRequest
from host.sanitize import sanitize

ALLOWED_CONTROLS = {"\t", "\n", "\r"}
# Any code point, plus the awkward ones often enough to matter: surrogate halves, C0/C1.
NASTY_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec=None, exclude_categories=()),
        st.sampled_from(["\ud800", "\udbff", "\udc00", "\ud83d", "\ude00", "\x00", "\x85", "\t"]),
    )
)


def _controls(text: str) -> set[str]:
    return {c for c in text if unicodedata.category(c) == "Cc"} - ALLOWED_CONTROLS


def test_plain_text_is_untouched() -> None:
    for text in ["", "hello", "tab\there\nnew\r\nline", "naïve 日本 😀 👨‍👩‍👧", "e\u0301"]:
        assert sanitize(text) == text


def test_no_unicode_normalization() -> None:
    # NFD stays NFD, compatibility characters stay: the tokenizer's normalizer owns that.
    assert sanitize("cafe\u0301") == "cafe\u0301"
    assert sanitize("ﬁ １") == "ﬁ １"


def test_invalid_utf8_bytes_become_replacement_characters() -> None:
    assert sanitize(b"ok \xff\xfe end") == "ok \ufffd\ufffd end"
    assert sanitize(b"\xe6\x97") == "\ufffd"  # truncated sequence: one U+FFFD
    assert sanitize(b"\xed\xa0\x80") == "\ufffd\ufffd\ufffd"  # encoded surrogate is invalid
    assert sanitize(bytearray("ünï".encode())) == "ünï"


def test_nul_and_controls_become_one_space_each() -> None:
    assert sanitize("a\x00b") == "a b"
    assert sanitize("a\x00\x00b") == "a  b"
    assert sanitize("\x01\x07\x08\x0b\x0c\x1b\x1f\x7f") == " " * 8
    assert sanitize("c1:\x80\x85\x9f.") == "c1:   ."
    assert sanitize(b"x\x00y") == "x y"


def test_tab_newline_carriage_return_survive() -> None:
    assert sanitize("\t\n\r") == "\t\n\r"


def test_format_characters_are_not_controls() -> None:
    # ZWJ, ZWNJ, BOM, line separator: meaningful, not category Cc.
    text = "a\u200db\u200cc\ufeffd\u2028e"
    assert sanitize(text) == text


def test_lone_surrogates_become_replacement_characters() -> None:
    assert sanitize("x\ud800y") == "x\ufffdy"
    assert sanitize("\udc00") == "\ufffd"
    assert sanitize("\udc00\ud800") == "\ufffd\ufffd"  # wrong order: two lone halves
    # A correctly ordered pair is the character it encodes.
    assert sanitize("\ud83d\ude00") == "😀"
    assert sanitize("a\ud83d\ude00\ud800") == "a😀\ufffd"


def test_empty_is_allowed() -> None:
    assert sanitize("") == ""
    assert sanitize(b"") == ""


@pytest.mark.parametrize("bad", [None, 3, 1.5, ["a"], {"a": 1}, True])
def test_non_text_is_a_typed_invalid_request(bad: object) -> None:
    with pytest.raises(InvalidRequest) as exc:
        sanitize(bad)  # type: ignore[arg-type]
    assert exc.value.code == "invalid_request"


def test_long_input() -> None:
    text = ("abc\x00" * 2500)[:10_000]
    out = sanitize(text)
    assert len(out) == 10_000 and "\x00" not in out


@given(NASTY_TEXT)
def test_never_raises_and_leaves_no_controls_str(text: str) -> None:
    out = sanitize(text)
    assert not _controls(out)
    out.encode("utf-8")  # always encodable: no surrogates left
    assert len(out) <= len(text)


@given(st.binary())
def test_never_raises_and_leaves_no_controls_bytes(data: bytes) -> None:
    out = sanitize(data)
    assert not _controls(out)
    out.encode("utf-8")


@given(NASTY_TEXT)
def test_idempotent(text: str) -> None:
    once = sanitize(text)
    assert sanitize(once) == once
