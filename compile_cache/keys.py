"""Cache keys: validation, canonical JSON and the content address (sha256).

The rule (also what `InvalidKey` enforces):

- a key is a non-empty mapping whose field names are non-empty `str`;
- a value is a `str`, `int`, `bool`, finite `float`, or a `list`/`tuple` of values (nesting
  allowed, at most 16 levels). Nothing else: no `None`, `bytes`, dicts, enums, numpy scalars
  or other subclasses, because their JSON form would be ambiguous or unstable;
- lists and tuples are the same thing (both become JSON arrays), so `(1, 128)` == `[1, 128]`;
- types are never coerced: `1`, `1.0`, `True` and `"1"` are four different keys.

The canonical form is JSON with sorted field names, no whitespace, UTF-8, and the digest is
sha256 over a version prefix plus that JSON, so a future change of the rule can never alias an
old entry.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any, cast

from compile_cache.errors import InvalidKey

Scalar = str | int | bool | float
KeyValue = Scalar | list["KeyValue"] | tuple["KeyValue", ...]
Key = Mapping[str, KeyValue]

# Bumping this re-addresses every entry; old objects are simply never hit again.
_DIGEST_DOMAIN = b"synapse.compile_cache.key/v1\n"
_MAX_DEPTH = 16
_RULE = "values must be str, int, bool, finite float, or lists/tuples of them"


class _Bad(Exception):
    """Internal: a rejected value; the field path is assembled while unwinding (only on error,
    so the hot path of a cache hit never formats strings)."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.path: list[str] = []


def _check_value(value: object, depth: int) -> Any:
    # Exact type checks on purpose: bool is an int subclass, and enums / numpy scalars would
    # either be rejected by json or serialize in a way that silently changes with versions.
    t = type(value)
    if t is str:
        try:
            cast(str, value).encode("utf-8")
        except UnicodeEncodeError as e:
            raise _Bad(f"string is not valid Unicode ({e.reason})") from e
        return value
    if t is bool or t is int:
        return value
    if t is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise _Bad(f"float {value!r} is not finite")
        return value
    if t is list or t is tuple:
        if depth >= _MAX_DEPTH:
            raise _Bad(f"lists nested deeper than {_MAX_DEPTH} levels")
        out: list[Any] = []
        for i, v in enumerate(cast("list[object] | tuple[object, ...]", value)):
            try:
                out.append(_check_value(v, depth + 1))
            except _Bad as bad:
                bad.path.append(f"[{i}]")
                raise
        return out
    if value is None:
        raise _Bad(f"None is not allowed (leave the field out instead); {_RULE}")
    hint = " (numpy scalar: pass value.item())" if hasattr(value, "dtype") else ""
    raise _Bad(f"{t.__name__} is not allowed{hint}; {_RULE}")


def canonicalize(key: object) -> dict[str, Any]:
    """Validate `key` and return a plain-JSON copy (tuples become lists)."""
    if not isinstance(key, Mapping):
        raise InvalidKey(
            f"a key must be a mapping of field name -> value, not {type(key).__name__}"
        )
    if not key:
        raise InvalidKey("a key must have at least one field")
    out: dict[str, Any] = {}
    for name, value in key.items():
        if type(name) is not str or not name:
            raise InvalidKey(f"key field names must be non-empty str, got {name!r}")
        try:
            _check_value(name, 0)  # names must be valid Unicode too
            out[name] = _check_value(value, 0)
        except _Bad as bad:
            where = repr(name) + "".join(reversed(bad.path))
            raise InvalidKey(f"key field {where}: {bad.problem}") from bad.__cause__
    return out


def canonical_json(key: object) -> str:
    """The canonical JSON text of a key (sorted fields, no whitespace, non-ASCII kept)."""
    obj = canonicalize(key)
    try:
        return json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as e:  # e.g. an int above Python's str-conversion digit limit
        raise InvalidKey(f"key cannot be serialized: {e}") from e


def digest_of_json(canonical: str) -> str:
    return hashlib.sha256(_DIGEST_DOMAIN + canonical.encode("utf-8")).hexdigest()


def key_digest(key: object) -> str:
    """The content address (64 lowercase hex chars) of a key."""
    return digest_of_json(canonical_json(key))


def make_key(
    *,
    manifest_digest: str,
    kernel_revision: str,
    shape: tuple[int, ...] | list[int],
    precision: str,
    deployment_target: str,
    coremltools_version: str,
    **extra: KeyValue,
) -> dict[str, Any]:
    """The standard key of a compiled Core ML shape: every input that changes the package's
    bytes, nothing that does not, validated.

    `extra` fields (e.g. `packed=True`, `compute_units="CPU_AND_NE"`) join the key as-is.
    """
    key: dict[str, Any] = {
        "manifest_digest": manifest_digest,
        "kernel_revision": kernel_revision,
        "shape": shape,
        "precision": precision,
        "deployment_target": deployment_target,
        "coremltools_version": coremltools_version,
        **extra,
    }
    return canonicalize(key)


def is_digest_prefix(text: str) -> bool:
    return 0 < len(text) <= 64 and all(c in "0123456789abcdef" for c in text)
