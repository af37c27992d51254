"""The one input-sanitization rule, applied to every text before it is tokenized.

Rule (in this order):
1. `bytes`/`bytearray` are decoded as UTF-8; every invalid sequence becomes U+FFFD (Python's
   "replace" handler: one U+FFFD per maximal invalid subsequence).
2. In a `str`, a correctly ordered high+low surrogate pair becomes the character it encodes
   (what a UTF-16 consumer would read); every other (lone) surrogate becomes U+FFFD. Such
   strings cannot be encoded as UTF-8 at all, so the tokenizer would otherwise raise.
3. Control characters (Unicode category Cc: C0 U+0000-U+001F, DEL U+007F, C1 U+0080-U+009F)
   other than TAB, LF and CR are replaced by ONE SPACE EACH.

Why a space rather than deletion: deleting would glue the neighbours together
("foo\\x00bar" -> "foobar", a word the caller never wrote), while a space keeps the boundary
the control character stood for and keeps character offsets stable. Models' own normalizers
(BERT's `clean_text`) also treat such characters as whitespace or drop them, so a space never
produces a token the model would not otherwise see between two words.

Nothing else changes: no Unicode normalization (the tokenizer's normalizer owns that), no
trimming, no format characters touched (ZWJ/variation selectors carry meaning in emoji).
The empty string is valid and stays empty. Anything that is not str/bytes is an
`InvalidRequest`.
"""

from __future__ import annotations

from common.errors import InvalidRequest

# Every Cc code point except \t \n \r maps to a space (str.translate is C-speed).
_CONTROLS = {
    cp: " " for cp in (*range(0x00, 0x20), *range(0x7F, 0xA0)) if cp not in (0x09, 0x0A, 0x0D)
}


def sanitize(text: str | bytes) -> str:
    """Apply the documented rule above; never raises for str/bytes input."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        raise InvalidRequest(f"text must be a string, got {type(text).__name__}")
    elif not is_utf8_encodable(text):
        text = _fix_surrogates(text)
    return text.translate(_CONTROLS)


def is_utf8_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fix_surrogates(text: str) -> str:
    # Round-trip through UTF-16 code units: the decoder joins valid pairs and replaces lone
    # halves with U+FFFD, which is exactly rule 2.
    units = text.encode("utf-16-le", errors="surrogatepass")
    return units.decode("utf-16-le", errors="replace")
