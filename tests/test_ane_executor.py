"""The reference executor: op semantics against numpy, bit-exact fp16 emulation, typed refusals."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from workers.ane.builder import convert_and_save
from workers.ane.ct_quiet import Function, Program, ct, mb, types
from workers.ane.executor import (
    SUPPORTED_OPS,
    CompiledProgram,
    UnsupportedOp,
    load_executor,
)
from workers.ane.fp16 import erf, gelu_exact, round_fp16_

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

RNG = np.random.default_rng(7)


def _program(inputs: dict[str, tuple[tuple[int, ...], type]], body: Callable) -> Program:
    ph = {n: mb.placeholder(shape=s, dtype=t) for n, (s, t) in inputs.items()}
    with Function(ph, ct.target.macOS14) as func:
        out = body(**func.inputs)
        func.set_outputs(list(out) if isinstance(out, (list, tuple)) else [out])
    prog = Program()
    prog.add_function("main", func)
    return prog


def _run(inputs: dict[str, np.ndarray], body: Callable) -> list[np.ndarray]:
    spec = {
        n: (a.shape, types.int32 if a.dtype.kind == "i" else types.fp32) for n, a in inputs.items()
    }
    prog = CompiledProgram(_program(spec, body))
    out = prog.run(inputs)
    return [out[t.name] for t in prog.outputs]


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# ---- fp16 emulation ---------------------------------------------------------------------------


def _all_fp16_values() -> np.ndarray:
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    return h[np.isfinite(h)].astype(np.float32)


def test_round_fp16_is_bit_exact_with_ieee_half() -> None:
    vals = np.sort(_all_fp16_values())
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)  # ties
    up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, -np.float32(np.inf))
    scales = [
        RNG.standard_normal(20000).astype(np.float32) * s
        for s in (1e-8, 1e-6, 1e-4, 1e-2, 1, 1e2, 1e4, 6e4, 1e6)
    ]
    special = np.array(
        [
            np.inf,
            -np.inf,
            np.nan,
            0.0,
            -0.0,
            65504,
            65519.99,
            65520,
            -65520,
            3e38,
            1e-30,
            2.0**-24,
            2.0**-25,
            1.5 * 2.0**-25,
        ],
        np.float32,
    )
    for arr in [vals, mids, up, down, special, *scales]:
        with np.errstate(all="ignore"):
            want = arr.astype(np.float16).astype(np.float32)
            got = round_fp16_(arr.copy())
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (arr[~same][:4], got[~same][:4], want[~same][:4])
        assert (np.signbit(got) == np.signbit(want))[~np.isnan(want) & (want != 0)].all()


def test_round_fp16_needs_its_own_buffer() -> None:
    with pytest.raises(ValueError):
        round_fp16_(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(ValueError):
        round_fp16_(np.zeros(4, np.float64))


def test_erf_and_gelu() -> None:
    z = np.linspace(-7, 7, 20001, dtype=np.float32)
    ref = np.array([math.erf(float(v)) for v in z])
    assert np.abs(erf(z) - ref).max() < 1e-6
    x = np.linspace(-10, 10, 4001, dtype=np.float32)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float)])
    assert np.abs(gelu_exact(x) - want).max() < 2e-6


def test_fp16_program_is_rounded_after_every_op(tmp_path: Path) -> None:
    """A converted (fp16) package: executor output equals a numpy float16 step-by-step run,
    bit for bit (elementwise ops and a softmax: no summation-order freedom)."""
    x = RNG.standard_normal((2, 8, 1, 16)).astype(np.float32) * 3
    c = RNG.standard_normal((1, 8, 1, 1)).astype(np.float32)

    def body(x):
        sq = mb.mul(x=x, y=x)
        y = mb.softmax(x=mb.add(x=sq, y=c), axis=1)
        y = mb.mul(x=mb.sub(x=y, y=x), y=np.float32(1 / 3))
        return mb.real_div(x=y, y=mb.add(x=sq, y=1.0), name="out")

    convert_and_save(_program({"x": ((2, 8, 1, 16), types.fp32)}, body), tmp_path)
    ex = load_executor(tmp_path / "model.mlpackage")
    got = ex.run({"x": x})["out"]

    def r(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)

    h = r(x)
    sq = r(h * h)
    a = r(sq + r(c))
    e = np.exp(a - a.max(axis=1, keepdims=True))
    y = r(r(r(e / e.sum(axis=1, keepdims=True)) - h) * r(np.float32(1 / 3)))
    want = r(y / r(sq + 1))
    assert np.array_equal(got, want)
    assert not np.array_equal(got, r(_float32_run(x, c)))  # rounding points matter
    assert ex.op_counts["cast"] == 2  # fp32 I/O around an fp16 body
    assert ex.outputs[0].dtype == "fp32"


def _float32_run(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    sq = x * x
    e = np.exp(sq + c - (sq + c).max(axis=1, keepdims=True))
    return ((e / e.sum(axis=1, keepdims=True)) - x) / 3 / (sq + 1)


# ---- op semantics (fp32 programs: no rounding, numpy is the oracle) ------------------------


def test_linear_algebra_ops() -> None:
    x4, y4 = _f32(2, 6, 1, 5), _f32(2, 5, 1, 3)
    xh, yh = _f32(2, 6, 3, 5), _f32(1, 5, 3, 4)  # h > 1 and batch broadcast
    x3, y3 = _f32(6, 2, 5), _f32(5, 2, 3)
    w = _f32(7, 6, 1, 1)
    b = _f32(7)
    lw, lb = _f32(4, 5), _f32(4)
    a, bb = _f32(2, 3, 5, 4), _f32(2, 3, 5, 6)
    pool_x, pool_w = _f32(2, 6, 1, 5), _f32(2, 1, 5, 3)
    outs = _run(
        {
            "x4": x4,
            "y4": y4,
            "xh": xh,
            "yh": yh,
            "x3": x3,
            "y3": y3,
            "a": a,
            "bb": bb,
            "px": pool_x,
            "pw": pool_w,
        },
        lambda x4, y4, xh, yh, x3, y3, a, bb, px, pw: [
            mb.einsum(values=(x4, y4), equation="nchw,nwhu->nchu"),
            mb.einsum(values=(xh, yh), equation="abcd,adce->abce"),  # renamed letters
            mb.einsum(values=(x3, y3), equation="chw,whu->chu"),
            mb.conv(x=x4, weight=w, bias=b, pad_type="valid"),
            mb.linear(x=x3, weight=lw, bias=lb),
            mb.matmul(x=a, y=bb, transpose_x=True),
            mb.matmul(x=px, y=pw),
        ],
    )
    assert np.allclose(outs[0], np.einsum("nchw,nwhu->nchu", x4, y4), atol=1e-5)
    assert np.allclose(outs[1], np.einsum("nchw,nwhu->nchu", xh, yh), atol=1e-5)
    assert np.allclose(outs[2], np.einsum("chw,whu->chu", x3, y3), atol=1e-5)
    conv = np.einsum("oc,bchw->bohw", w[:, :, 0, 0], x4) + b[None, :, None, None]
    assert np.allclose(outs[3], conv, atol=1e-5)
    assert np.allclose(outs[4], x3 @ lw.T + lb, atol=1e-5)
    assert np.allclose(outs[5], np.swapaxes(a, -1, -2) @ bb, atol=1e-5)
    assert np.allclose(outs[6], pool_x @ pool_w, atol=1e-5)


def test_normalization_and_activation_ops() -> None:
    x = _f32(2, 8, 1, 5) * 2
    g, b = _f32(8), _f32(8)
    outs = _run(
        {"x": x},
        lambda x: [
            mb.layer_norm(x=x, axes=[1], gamma=g, beta=b, epsilon=1e-5),
            mb.layer_norm(x=x, axes=[-1], epsilon=1e-3),
            mb.softmax(x=x, axis=1),
            mb.gelu(x=x, mode="EXACT"),
            mb.gelu(x=x, mode="TANH_APPROXIMATION"),
            mb.tanh(x=x),
            mb.rsqrt(x=mb.add(x=mb.mul(x=x, y=x), y=1.0), epsilon=1e-6),
            mb.log(x=mb.add(x=mb.relu(x=x), y=1.0)),  # SPLADE's log1p(relu(.))
            mb.log(x=mb.mul(x=x, y=x), epsilon=0.5),  # MIL's log is log(x + epsilon)
        ],
    )
    mu, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    ln = (x - mu) / np.sqrt(var + 1e-5) * g[None, :, None, None] + b[None, :, None, None]
    assert np.allclose(outs[0], ln, atol=1e-5)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    assert np.allclose(outs[1], (x - mu) / np.sqrt(var + 1e-3), atol=1e-5)
    e = np.exp(x - x.max(1, keepdims=True))
    assert np.allclose(outs[2], e / e.sum(1, keepdims=True), atol=1e-6)
    exact = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))(x)
    assert np.allclose(outs[3], exact, atol=1e-5)
    tanh_gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert np.allclose(outs[4], tanh_gelu, atol=1e-5)
    assert np.allclose(outs[5], np.tanh(x), atol=1e-6)
    assert np.allclose(outs[6], 1 / np.sqrt(x * x + 1 + 1e-6), atol=1e-5)
    assert np.allclose(outs[7], np.log1p(np.maximum(x, 0)), atol=1e-6)
    assert np.allclose(outs[8], np.log(x * x + 0.5), atol=1e-6)


def test_elementwise_reduction_and_logic_ops() -> None:
    x, y = _f32(2, 3, 1, 4), _f32(1, 3, 1, 1)
    outs = _run(
        {"x": x, "y": y},
        lambda x, y: [
            mb.add(x=x, y=y),
            mb.sub(x=x, y=y),
            mb.mul(x=x, y=y),
            mb.real_div(x=x, y=y),
            mb.maximum(x=x, y=y),
            mb.minimum(x=x, y=0.0),
            mb.reduce_sum(x=x, axes=[1], keep_dims=True),
            mb.reduce_mean(x=x, axes=[-1]),
            mb.reduce_max(x=x, axes=[1, 3]),
            mb.reduce_l2_norm(x=x, axes=[1], keep_dims=True),
            mb.select(
                cond=mb.logical_and(x=mb.greater_equal(x=x, y=y), y=mb.not_equal(x=x, y=0.0)),
                a=x,
                b=mb.mul(x=x, y=-1.0),
            ),
            mb.cast(x=mb.logical_or(x=mb.equal(x=x, y=x), y=mb.less(x=x, y=y)), dtype="fp32"),
        ],
    )
    want = [
        x + y,
        x - y,
        x * y,
        x / y,
        np.maximum(x, y),
        np.minimum(x, 0),
        x.sum(1, keepdims=True),
        x.mean(-1),
        x.max(axis=(1, 3)),
        np.sqrt((x * x).sum(1, keepdims=True)),
        np.where((x >= y) & (x != 0), x, -x),
        np.ones_like(x),
    ]
    for got, exp in zip(outs, want, strict=True):
        assert got.shape == exp.shape
        assert np.allclose(got, exp, atol=1e-5)


def test_layout_and_indexing_ops() -> None:
    x = _f32(2, 6, 1, 4)
    table = _f32(10, 3)
    ids = np.array([[1, 9, 0], [4, 4, 2]], np.int32)
    outs = _run(
        {"x": x, "ids": ids},
        lambda x, ids: [
            mb.reshape(x=x, shape=[2, -1]),
            mb.transpose(x=x, perm=[0, 3, 2, 1]),
            mb.expand_dims(x=mb.squeeze(x=x, axes=[2]), axes=[-1]),
            mb.concat(values=[x, x], axis=-1),
            *mb.split(x=x, split_sizes=[1, 5], axis=1),
            mb.slice_by_index(
                x=x,
                begin=[0, 1, 0, 0],
                end=[2, 6, 1, 4],
                stride=[1, 2, 1, 1],
                begin_mask=[False, False, True, False],
                end_mask=[False, False, True, True],
                squeeze_mask=[False, False, True, False],
            ),
            mb.gather(x=table, indices=ids, axis=0),
            mb.gather(x=table, indices=mb.cast(x=ids, dtype="int16"), axis=0),
            mb.cast(x=mb.add(x=ids, y=np.int32(3)), dtype="fp32"),
        ],
    )
    assert np.array_equal(outs[0], x.reshape(2, -1))
    assert np.array_equal(outs[1], x.transpose(0, 3, 2, 1))
    assert np.array_equal(outs[2], x[:, :, 0, :, None])
    assert np.array_equal(outs[3], np.concatenate([x, x], -1))
    assert np.array_equal(outs[4], x[:, :1]) and np.array_equal(outs[5], x[:, 1:])
    assert np.array_equal(outs[6], x[:, 1:6:2, 0, :])
    assert np.array_equal(outs[7], table[ids]) and np.array_equal(outs[8], table[ids])
    assert np.array_equal(outs[9], (ids + 3).astype(np.float32))


def test_float_to_int_cast_truncates() -> None:
    x = np.array([[1.7, -1.7, 2.5, -0.2]], np.float32)
    (out,) = _run({"x": x}, lambda x: [mb.cast(x=x, dtype="int32")])
    assert out.dtype == np.int32 and out.tolist() == [[1, -1, 2, 0]]


# ---- refusals ------------------------------------------------------------------------------


def test_unknown_op_is_typed_and_named() -> None:
    prog = _program({"x": ((2, 3), types.fp32)}, lambda x: mb.sin(x=x))
    with pytest.raises(UnsupportedOp) as e:
        CompiledProgram(prog)
    assert e.value.op_type == "sin" and "sin" in str(e.value)
    assert "sin" not in SUPPORTED_OPS


def test_unsupported_modes_are_typed() -> None:
    w3 = _f32(4, 4, 3, 3)
    for body, op_type in [
        (lambda x: mb.conv(x=x, weight=w3, pad_type="same"), "conv"),
        (
            lambda x: mb.gather(x=x, indices=np.array([[0, 1]], np.int32), axis=1, batch_dims=1),
            "gather",
        ),
        (lambda x: mb.concat(values=[x, x], axis=1, interleave=True), "concat"),
    ]:
        with pytest.raises(UnsupportedOp) as e:
            CompiledProgram(_program({"x": ((1, 4, 5, 5), types.fp32)}, body))
        assert e.value.op_type == op_type and e.value.detail


def test_dynamic_shapes_are_refused() -> None:
    from coremltools.converters.mil.mil import get_new_symbol

    prog = _program({"x": ((get_new_symbol(), 4), types.fp32)}, lambda x: mb.tanh(x=x))
    with pytest.raises(UnsupportedOp) as e:
        CompiledProgram(prog)
    assert e.value.op_type == "dynamic_shape"


def test_inputs_are_checked() -> None:
    prog = CompiledProgram(
        _program({"ids": ((2, 3), types.int32)}, lambda ids: mb.cast(x=ids, dtype="fp32"))
    )
    with pytest.raises(ValueError, match="shape"):
        prog.run({"ids": np.zeros((3, 2), np.int32)})
    with pytest.raises(ValueError, match="missing"):
        prog.run({})
    with pytest.raises(ValueError, match="integer"):
        prog.run({"ids": np.zeros((2, 3), np.float32)})
    out = prog.run({"ids": np.ones((2, 3), np.int64)})[prog.outputs[0].name]
    assert out.tolist() == [[1.0] * 3] * 2
