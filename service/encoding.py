"""Embedding types over HTTP: vectors in the JSON forms a route answers with.

    float    JSON numbers at float32's shortest round-trip precision
    base64   the float32 little-endian bytes, base64 (OpenAI's `encoding_format=base64`)
    int8     integers -128..127 \
    uint8    integers 0..255     } sentence-transformers' `quantize_embeddings` (see
    binary   integers -128..127  } ingest.quantization): int8/uint8 bucket each dimension
    ubinary  integers 0..255    /  over the model's calibration ranges, (u)binary pack bits

Every route that offers types (`/v1/embeddings`' `encoding_format`, Cohere's `embedding_types`)
calls `encode_embeddings`; the ranges int8/uint8 need come from `quantization_ranges`, for the
width the vectors are served at: cut a Matryoshka `dimensions` request first, then quantize
with that width's ranges.
"""

from __future__ import annotations

import asyncio
import base64
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import orjson

from common.errors import InvalidRequest
from host.errors import Overloaded
from host.module import Module
from ingest.quantization import RANGED, quantize

if TYPE_CHECKING:  # imported on first use: serving loads no certification code until then
    from certification.calibration import Calibrations

EMBEDDING_TYPES = ("float", "base64", "int8", "uint8", "binary", "ubinary")
# How long a request waits for a model's first calibration (tens of seconds on two cores)
# before it is told to come back: a request should not hang behind a one-time job, and the
# calibration goes on either way.
CALIBRATION_WAIT_S = 10.0
CALIBRATION_RETRY_S = 5.0


class Calibrating(Overloaded):
    """A model's int8/uint8 ranges are being computed: a typed 'try later' (503 with
    Retry-After, which OpenAI's and Cohere's SDKs retry by themselves, twice by default)."""

    code = "calibrating"
    http_status = 503


_NUMPY = orjson.OPT_SERIALIZE_NUMPY

# One calibration cache per Module (a server has one; a test may build several).
_calibrations: weakref.WeakKeyDictionary[Module, Calibrations] = weakref.WeakKeyDictionary()


def needs_ranges(types: Iterable[str]) -> bool:
    return any(t in RANGED for t in types)


async def quantization_ranges(
    module: Module,
    model: str,
    width: int,
    types: Iterable[str] = ("int8",),
    normalize: bool = True,
    param: str = "encoding_format",
) -> np.ndarray | None:
    """The ranges `encode_embeddings` needs for `types` at `width` (None when no type needs
    any). The first int8/uint8 call for a model embeds the calibration corpus through its lane
    (see certification.calibration); a call that would wait longer than `CALIBRATION_WAIT_S`
    for it is a 503 `calibrating` with Retry-After, and later ones read memory.

    The ranges are those of the vectors as served, normalized: int8/uint8 of unnormalized
    vectors would clip most values silently, so `normalize=False` with them is a 400 naming
    `param` (the request's field for the types)."""
    types = list(types)
    if not needs_ranges(types):
        return None
    if not normalize:
        asked = ", ".join(t for t in types if t in RANGED)
        raise InvalidRequest(
            f"{asked} buckets each dimension over the model's calibration ranges, which are "
            f"those of normalized vectors: drop normalize=false (binary and ubinary keep only "
            f"signs and work either way)",
            param=param,
        )
    book = _calibrations.get(module)
    if book is None:
        from certification.calibration import Calibrations

        book = _calibrations[module] = Calibrations(module)
    try:
        return await asyncio.wait_for(book.ranges(model, width), CALIBRATION_WAIT_S)
    except TimeoutError:
        raise Calibrating(
            f"{model!r} is computing its int8/uint8 ranges (once: it embeds its calibration "
            f"corpus); retry in a few seconds",
            retry_after_s=CALIBRATION_RETRY_S,
            param=param,
        ) from None


def encode_embeddings(
    vectors: np.ndarray, types: Iterable[str], ranges: np.ndarray | None = None
) -> dict[str, list | str]:
    """`vectors` in each of `types` (names in EMBEDDING_TYPES): {type: one value per row}.

    `vectors` is (n, width) float32 as served (already cut to `dimensions`, if any); each
    row's value is a list of numbers, or a string for `base64`. A 1-D vector gives one
    value per type instead of a list of them. `ranges` ((2, width), `quantization_ranges`)
    is required for int8/uint8.

    `float` rows are `msgspec.Raw` JSON arrays, so each number keeps float32's own shortest
    form (4.7 instead of 8 KB per 384-d vector, parsing back to exactly the computed float32):
    encode the result with `msgspec.json`, as every response body here is. The other types
    are plain Python values."""
    v = np.asarray(vectors, dtype=np.float32)
    single = v.ndim == 1
    if single:
        v = v[None, :]
    out: dict[str, list | str] = {}
    for t in dict.fromkeys(types):  # once each, in the order asked
        if t == "float":
            # orjson writes a float32 array at float32's own shortest round-trip precision:
            # each number parses back to exactly the float32 the model computed, in about 10
            # characters where float64's repr of the same value takes 17-19, and it costs the
            # serving loop a third less. Non-finite -> null.
            rows: list = [
                msgspec.Raw(orjson.dumps(np.ascontiguousarray(r), option=_NUMPY)) for r in v
            ]
        elif t == "base64":
            rows = [base64.b64encode(r.astype("<f4").tobytes()).decode("ascii") for r in v]
        elif t in ("int8", "uint8", "binary", "ubinary"):
            if t in RANGED and ranges is None:
                raise ValueError(f"{t} needs the model's calibration ranges")
            rows = quantize(v, t, ranges if t in RANGED else None).tolist()
        else:
            raise ValueError(f"unknown embedding type {t!r}; one of {', '.join(EMBEDDING_TYPES)}")
        out[t] = rows[0] if single else rows
    return out
