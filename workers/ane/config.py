"""LOAD's `runtime_config` for the Core ML engine, validated strictly.

Unknown keys and wrong types are refused (`config_invalid`), never ignored: a typo such as
`max_loaded_shape` must not silently run with the default budget.

    model_ref          name the host addresses the model by (default: the artifact dir's name)
    backend            "reference" (numpy executor; default off macOS) | "coreml" (macOS only)
    shapes             shapes compiled and loaded during LOAD (default DEFAULT_SHAPES); each
                       {rows, seq_len, packed?, max_segments?}; [] admits nothing
    max_loaded_shapes  loaded-shape budget: admitting beyond it evicts the least recently
                       used shape (default 4)
    max_rows           largest admissible rows per shape (default 64)
    max_shape_tokens   largest admissible rows * seq_len (default 8192)
    cache_root         compile-cache directory (default: compile_cache.default_root())
    cache_budget_bytes compile-cache byte budget for its LRU gc (default: the cache's default)
    pooling            the pooling the host serves the model with (its record's): ENCODE's
                       dense output is refused when the graph pools otherwise, as an
                       EMBED_BATCH naming another pooling is
    heads              the heads on the token states by output ("sparse", "multivector"),
                       each {path, digest, limit} as the llama.cpp engine takes them
                       (`workers.heads.files`): digests checked at LOAD, then built into an
                       embedder's unpacked graphs (`workers.ane.token_heads`)
    compute_units      where Core ML may run the compiled model: "cpu_and_ne" (default),
                       "cpu_only", "cpu_and_gpu", "all". The environment variable
                       SYNAPSE_COREML_COMPUTE_UNITS overrides it (hosted macOS VMs have no
                       usable Neural Engine, and asking for one there can hang a load for
                       minutes); a bad value in either place is `config_invalid`. The
                       reference backend accepts and ignores it.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal, get_args

import msgspec

from workers.heads.files import HeadFile

PosInt = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
Backend = Literal["reference", "coreml"]
ComputeUnits = Literal["cpu_and_ne", "cpu_only", "cpu_and_gpu", "all"]
COMPUTE_UNITS: tuple[str, ...] = get_args(ComputeUnits)
DEFAULT_COMPUTE_UNITS = "cpu_and_ne"
MAX_SEGMENTS_DEFAULT_CAP = 64


def default_max_segments(seq_len: int) -> int:
    """A packed shape's segments when none are asked for: a few 16-token sentences per row,
    the short-input case packing is for (also what certificates key an unnamed count by)."""
    return min(MAX_SEGMENTS_DEFAULT_CAP, max(2, seq_len // 16))


ENV_COMPUTE_UNITS = "SYNAPSE_COREML_COMPUTE_UNITS"


class ShapeSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    rows: PosInt
    seq_len: PosInt
    packed: bool = False
    max_segments: PosInt | None = None


# Served out of the box: short inputs in 128-token rows, and long ones up to the model's
# default truncation (`max_seq_length`, substituted at LOAD for seq_len 0 here).
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((8, 128), (4, 0))


def default_shapes(max_seq_length: int, max_positions: int) -> list[tuple[int, int]]:
    """DEFAULT_SHAPES as (rows, seq_len) for one model: seq 0 is its `max_seq_length`, and
    every seq_len is clamped to its positions (a small model still loads), duplicates that
    the clamp makes dropped, order kept. The worker loads these; certificates key by them."""
    return list(
        dict.fromkeys(
            (rows, min(seq or max_seq_length, max_positions)) for rows, seq in DEFAULT_SHAPES
        )
    )


class AneRuntimeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    model_ref: str | None = None
    backend: Backend | None = None
    shapes: list[ShapeSpec] | None = None
    max_loaded_shapes: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    max_rows: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    max_shape_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 8192
    cache_root: str | None = None
    cache_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    compute_units: ComputeUnits | None = None
    pooling: Literal["mean", "cls", "last", "rank"] | None = None
    heads: dict[Literal["sparse", "multivector"], HeadFile] = {}


def parse_runtime_config(raw: object) -> AneRuntimeConfig:
    """Raise ValueError with a readable reason on any unknown key or bad value."""
    if not isinstance(raw, dict):
        raise ValueError("runtime_config must be an object")
    try:
        return msgspec.convert(raw, AneRuntimeConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from e


def resolve_compute_units(config: AneRuntimeConfig, environ: dict | None = None) -> str:
    """The environment override, else the runtime_config value, else the default. Raises
    ValueError naming the variable for a value outside COMPUTE_UNITS."""
    env = (os.environ if environ is None else environ).get(ENV_COMPUTE_UNITS)
    if env is not None and env != "":
        if env not in COMPUTE_UNITS:
            raise ValueError(
                f"{ENV_COMPUTE_UNITS}={env!r}: expected one of {', '.join(COMPUTE_UNITS)}"
            )
        return env
    return config.compute_units or DEFAULT_COMPUTE_UNITS
