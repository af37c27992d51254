"""fp16 arithmetic emulated in float32 storage: rounding, and an erf for exact GELU.

`round_fp16_` rounds a float32 array in place to the nearest float16 value (ties to even,
subnormals and overflow to +-inf exactly as IEEE binary16), bit-identical to
`x.astype(np.float16).astype(np.float32)` but ~5x faster here: numpy's float16 cast is a scalar
loop, and the reference executor rounds after every arithmetic op.

How: for |x| in [2^e, 2^(e+1)), adding and subtracting M = 1.5 * 2^(e+13) makes float32's own
round-to-nearest-even drop exactly the 13 mantissa bits float16 lacks (x + M stays inside
[2^(e+13), 2^(e+14)), whose float32 spacing is 2^(e-10), float16's spacing at e). Clamping e
at -14 makes the spacing 2^-24 below that: float16's subnormal grid. M is built from x's
exponent bits with integer ops; the work runs in cache-sized chunks.
"""

from __future__ import annotations

import numpy as np

FP16_MAX = 65504.0
_CHUNK = 1 << 16
_EXP_MASK = np.uint32(0x7F800000)
_MIN_EXP = np.uint32(0x38800000)  # 2^-14: float16's smallest normal
_MAGIC = np.uint32(0x06C00000)  # +13 to the exponent, and the 1.5 mantissa bit
_scratch = np.empty(_CHUNK, dtype=np.uint32)


def round_fp16_(x: np.ndarray) -> np.ndarray:
    """Round a C-contiguous float32 array to float16 values, in place; returns it."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError("round_fp16_ needs a writeable C-contiguous float32 array")
    flat = x.reshape(-1)
    with np.errstate(all="ignore"):
        for start in range(0, flat.size, _CHUNK):
            part = flat[start : start + _CHUNK]
            m = _scratch[: part.size]
            np.bitwise_and(part.view(np.uint32), _EXP_MASK, out=m)
            np.maximum(m, _MIN_EXP, out=m)
            m += _MAGIC
            mf = m.view(np.float32)
            part += mf
            part -= mf
        if x.size:
            hi, lo = x.max(), x.min()
            # `not (...)` so a NaN max/min also takes the (exact) slow path.
            if not (lo >= -FP16_MAX and hi <= FP16_MAX):
                np.copyto(x, np.copysign(np.float32(np.inf), x), where=np.abs(x) > FP16_MAX)
    return x


def to_fp16_values(x: np.ndarray) -> np.ndarray:
    """A new float32 array holding `x` rounded to float16 values."""
    return round_fp16_(np.array(x, dtype=np.float32, order="C", copy=True))


# Abramowitz & Stegun 7.1.26: |erf error| <= 1.5e-7, far below float16's resolution (2^-11
# relative), so GELU's float16 result is what an exact erf would give except at rounding ties.
_P = np.float32(0.3275911)
_A = [np.float32(v) for v in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)]
_INV_SQRT2 = np.float32(1.0 / np.sqrt(2.0))


def _erf_chunk(z: np.ndarray) -> np.ndarray:
    a = np.abs(z)
    t = a * _P
    t += 1.0
    np.reciprocal(t, out=t)
    poly = t * _A[4]
    for coef in (_A[3], _A[2], _A[1], _A[0]):
        poly += coef
        poly *= t
    np.multiply(a, a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a  # erfc(|z|)
    np.subtract(1.0, poly, out=poly)
    return np.copysign(poly, z, out=poly)


def erf(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float32)
    return _erf_chunk(z.copy())


def gelu_exact(x: np.ndarray) -> np.ndarray:
    """x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) in float32, chunked to stay in cache."""
    src = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(src)
    for start in range(0, src.size, _CHUNK):
        part = src[start : start + _CHUNK]
        e = _erf_chunk(part * _INV_SQRT2)
        e += 1.0
        e *= part
        e *= 0.5
        out[start : start + _CHUNK] = e
    return out.reshape(np.shape(x))
