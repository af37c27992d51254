"""Human units for the CLI: parse byte sizes, format sizes and ages."""

from __future__ import annotations

import re

from compile_cache.errors import InvalidSize

# GNU coreutils convention: a bare or "i" prefix is binary (K = KiB = 1024), "KB" is decimal.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?)(b?)|(b?))\s*$", re.IGNORECASE)
_EXP = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE_HELP = (
    "use a byte count or a number with a unit, e.g. 1024, 500M, 2GiB, 1.5G, 10MB "
    "(K/M/G/T/P and KiB..PiB are powers of 1024; KB..PB are powers of 1000)"
)


def parse_size(text: str) -> int:
    """'1024' -> 1024, '500M' -> 500 MiB, '2GiB' -> 2 GiB, '10MB' -> 10_000_000."""
    if not isinstance(text, str):
        raise InvalidSize(f"a size must be a string, not {type(text).__name__}")
    m = _SIZE_RE.match(text)
    if m is None:
        raise InvalidSize(f"invalid size {text!r}: {_SIZE_HELP}")
    number, prefix, binary, b = m.group(1), m.group(2), m.group(3), m.group(4)
    if prefix is None:
        if "." in number:
            raise InvalidSize(f"invalid size {text!r}: a byte count must be a whole number")
        return int(number)
    base = 1024 if (binary or not b) else 1000
    return round(float(number) * base ** _EXP[prefix.lower()])


def format_size(n: int | float) -> str:
    """1536 -> '1.5 KiB'; below 1 KiB exact bytes."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_age(seconds: float) -> str:
    """How long ago, compactly: 'just now', '42s ago', '5m ago', '3h ago', '2d ago'."""
    if seconds < 1:
        return "just now"
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if seconds < limit:
            return f"{int(seconds // div)}{unit} ago"
    return f"{int(seconds // 86400)}d ago"
