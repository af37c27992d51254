"""Key canonicalization (never collide, wrong types are typed errors) and size/age units."""

from __future__ import annotations

import enum
import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_cache import (
    CompileCacheError,
    InvalidKey,
    InvalidSize,
    canonical_json,
    format_age,
    format_size,
    key_digest,
    make_key,
    parse_size,
)

scalars = st.one_of(
    st.text(max_size=8),
    st.integers(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner)),
    max_leaves=6,
)
keys = st.dictionaries(st.text(min_size=1, max_size=6), values, min_size=1, max_size=5)


def tagged(v: Any) -> Any:
    """An independent model of key identity: type-tagged, lists == tuples, floats by repr
    (so -0.0 != 0.0, 1 != 1.0 != True != "1")."""
    if isinstance(v, dict):
        return tuple(sorted((k, tagged(x)) for k, x in v.items()))
    if isinstance(v, list | tuple):
        return ("list", tuple(tagged(x) for x in v))
    if isinstance(v, float):
        return ("float", repr(v))
    return (type(v).__name__, v)


@settings(max_examples=150, deadline=None)
@given(keys, keys)
def test_digests_equal_exactly_when_keys_are_equal(a: dict, b: dict) -> None:
    assert (key_digest(a) == key_digest(b)) == (tagged(a) == tagged(b))


@settings(max_examples=150, deadline=None)
@given(keys, st.data())
def test_changing_any_one_field_changes_the_digest(key: dict, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(key)))
    new = data.draw(values.filter(lambda v: tagged(v) != tagged(key[name])))
    assert key_digest({**key, name: new}) != key_digest(key)
    extra = data.draw(st.text(min_size=1, max_size=6).filter(lambda n: n not in key))
    assert key_digest({**key, extra: 0}) != key_digest(key)
    without = {k: v for k, v in key.items() if k != name}
    if without:
        assert key_digest(without) != key_digest(key)


def _swap_sequences(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _swap_sequences(x) for k, x in v.items()}
    if isinstance(v, list):
        return tuple(_swap_sequences(x) for x in v)
    if isinstance(v, tuple):
        return [_swap_sequences(x) for x in v]
    return v


@settings(max_examples=100, deadline=None)
@given(keys)
def test_equal_keys_share_a_digest_and_survive_a_json_round_trip(key: dict) -> None:
    digest = key_digest(key)
    assert key_digest(_swap_sequences(key)) == digest
    assert key_digest(dict(reversed(list(key.items())))) == digest
    # An index rebuilt from meta.json re-derives digests from decoded JSON keys.
    assert key_digest(json.loads(canonical_json(key))) == digest


def test_canonical_form() -> None:
    assert canonical_json({"b": (1, 2.5), "a": "é"}) == '{"a":"é","b":[1,2.5]}'
    assert key_digest({"shape": (1, 2)}) == key_digest({"shape": [1, 2]})
    assert len({key_digest({"v": v}) for v in (1, 1.0, True, "1", [1])}) == 5
    k = make_key(
        manifest_digest="m",
        kernel_revision="k",
        shape=(1, 128),
        precision="fp16",
        deployment_target="macOS15",
        coremltools_version="9.0",
        packed=True,
    )
    assert k["shape"] == [1, 128] and k["packed"] is True


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ({"a": b"x"}, "'a': bytes is not allowed"),
        ({"a": None}, "'a': None is not allowed"),
        ({"a": object()}, "'a': object is not allowed"),
        ({"a": {"b": 1}}, "'a': dict is not allowed"),
        ({"a": {1, 2}}, "'a': set is not allowed"),
        ({"a": [1, [2, None]]}, "'a'[1][1]: None"),
        ({"a": math.nan}, "not finite"),
        ({"a": math.inf}, "not finite"),
        ({"a": np.int64(3)}, "numpy scalar: pass value.item()"),
        ({"a": Color.RED}, "Color is not allowed"),
        ({"a": "\ud800"}, "not valid Unicode"),
        ({1: "x"}, "field names must be non-empty str"),
        ({"": "x"}, "field names must be non-empty str"),
        ({}, "at least one field"),
        ([("a", 1)], "must be a mapping"),
        ({"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}, "nested deeper"),
    ],
)
def test_wrong_key_types_are_typed_errors(key: object, needle: str) -> None:
    with pytest.raises(InvalidKey) as info:
        key_digest(key)
    assert needle in str(info.value)
    assert info.value.code == "invalid_key"
    assert isinstance(info.value, CompileCacheError) and isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("0", 0),
        ("500M", 500 * 2**20),
        ("500m", 500 * 2**20),
        ("2GiB", 2 * 2**30),
        ("2 GiB", 2 * 2**30),
        ("2Gi", 2 * 2**30),
        ("1.5G", 3 * 2**29),
        ("10MB", 10_000_000),
        ("1KB", 1000),
        ("12B", 12),
        ("1T", 2**40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "x", "-1", "1.5", "1e3", "5 XB", "M", "1,000"])
def test_parse_size_rejects_garbage_clearly(text: str) -> None:
    with pytest.raises(InvalidSize) as info:
        parse_size(text)
    assert info.value.code == "invalid_size" and repr(text) in str(info.value)


def test_human_units() -> None:
    assert format_size(512) == "512 B"
    assert format_size(int(12.3 * 2**20)) == "12.3 MiB"
    assert format_size(2**30) == "1.0 GiB"
    assert format_age(0.2) == "just now"
    assert format_age(42) == "42s ago"
    assert format_age(300) == "5m ago"
    assert format_age(3 * 3600 + 5) == "3h ago"
    assert format_age(2 * 86400 + 1) == "2d ago"
