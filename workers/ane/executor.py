"""The reference executor: runs a SAVED `.mlpackage` with numpy, emulating fp16.

What it executes is exactly what was compiled: the package is read back with coremltools'
`load_spec` and milproto loader into a MIL program (weights from the package's weight blob),
not the builder's in-memory graph, so every coremltools pass (int16 index casts, fp16 casts,
const folding, transposes it moved) is executed as converted.

Precompilation (`CompiledProgram`, once per loaded shape): every non-const op becomes a closure
over slot indices of a flat environment list; constants are materialised once into the
environment template, op attributes (axes, perm, equation, ...) are resolved at compile time,
and each step releases the slots whose last reader it was, so peak memory is a few layers of
activations. Unknown op types or attribute values raise `UnsupportedOp` at precompile time.

Numerics: fp16 and fp32 tensors are stored as float32; an op whose output dtype is fp16 is
computed in float32 and its result rounded to the nearest float16 (`round_fp16_`), as a
float16 datapath with wider accumulation would. Data-movement ops (reshape, transpose, split,
concat, gather, slice, select, max/min, ...) produce values of their inputs, so they need no
rounding. Integer and bool tensors keep their MIL dtype.
"""

from __future__ import annotations

import collections
import hashlib
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from workers.ane import program_ir
from workers.ane.fp16 import gelu_exact, round_fp16_

Env = list  # slot -> np.ndarray | None
Step = Callable[[Env], None]


class UnsupportedOp(Exception):
    """The program uses an op (or an op mode) this executor does not implement."""

    def __init__(self, op_type: str, detail: str = "") -> None:
        super().__init__(f"unsupported op {op_type}" + (f" ({detail})" if detail else ""))
        self.op_type = op_type
        self.detail = detail


class PackageError(Exception):
    """The package cannot be read back as an ML Program."""


# MIL dtype name -> numpy storage dtype: one table, shared with the compiled-program format.
_NP_DTYPES = program_ir.STORAGE_DTYPES


def _dtype_name(var: object) -> str:
    return var.dtype  # type: ignore[attr-defined]  # program_ir.Var: the MIL dtype name


# ---- loading -----------------------------------------------------------------------------------


def load_package_program(path: str | os.PathLike[str]) -> Any:
    """The MIL program saved in an `.mlpackage` (weights read from its weight directory): a
    coremltools `Program` (Any: coremltools ships no types)."""
    from workers.ane.ct_quiet import ct  # coremltools, quietly, before its submodules

    load_spec = ct.models.utils.load_spec
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    pkg = Path(path)
    try:
        spec = load_spec(str(pkg))
    except Exception as e:  # coremltools raises bare Exception/OSError subclasses
        raise PackageError(f"{pkg}: {e}") from e
    if spec.WhichOneof("Type") != "mlProgram":
        raise PackageError(f"{pkg}: not an ML Program")
    weights = pkg / "Data" / "com.apple.CoreML" / "weights"
    return milproto_load(spec, spec.specificationVersion, str(weights))


# ---- op implementations --------------------------------------------------------------------------


@dataclass
class _Ctx:
    slot_of: dict[int, int]  # id(var) -> slot

    def slot(self, var: object) -> int:
        return self.slot_of[id(var)]


def _val(op: object, name: str, default: object = None) -> Any:
    """A compile-time (const) input's value, or `default` if absent. Any: a numpy array or
    scalar, a str or a bool, whichever the op's attribute is; each caller converts it."""
    var = getattr(op, name, None)
    if var is None:
        return default
    v = var.val
    if v is None:
        raise UnsupportedOp(op.op_type, f"non-const {name}")  # type: ignore[attr-defined]
    return v


def _axes(value: Any, rank: int) -> tuple[int, ...] | None:  # a const value (see _val)
    if value is None:
        return None
    return tuple(sorted(int(a) % rank for a in np.atleast_1d(value)))


_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "real_div": np.true_divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
}


def _sigmoid_stable(x: np.ndarray) -> np.ndarray:
    # exp of -|x| only: no overflow for a very negative gate, and full relative precision on
    # both tails (1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below).
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tanh": np.tanh,
    "exp": np.exp,
    "sqrt": np.sqrt,
    "relu": lambda x: np.maximum(x, np.float32(0)),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "silu": lambda x: x * _sigmoid_stable(x),
    "logical_not": np.logical_not,
    "identity": lambda x: x,
}

# Ops whose outputs are (re-arranged or selected) values of their inputs: no rounding needed.
_EXACT = frozenset(
    {
        "reshape",
        "transpose",
        "expand_dims",
        "squeeze",
        "split",
        "concat",
        "slice_by_index",
        "gather",
        "select",
        "maximum",
        "minimum",
        "identity",
        "relu",
    }
)


def _binary(op_type: str) -> Callable[[object, _Ctx], Callable[[Env], list]]:
    fn = _ELEMENTWISE[op_type]

    def make(op: object, c: _Ctx) -> Callable[[Env], list]:
        x, y = c.slot(op.x), c.slot(op.y)  # type: ignore[attr-defined]
        return lambda env: [fn(env[x], env[y])]

    return make


def _unary(op_type: str) -> Callable[[object, _Ctx], Callable[[Env], list]]:
    fn = _UNARY[op_type]

    def make(op: object, c: _Ctx) -> Callable[[Env], list]:
        x = c.slot(op.x)  # type: ignore[attr-defined]
        return lambda env: [fn(env[x])]

    return make


def _make_cast(op, c: _Ctx):
    x = c.slot(op.x)
    target = _NP_DTYPES.get(str(_val(op, "dtype")))
    if target is None:
        raise UnsupportedOp("cast", f"dtype {_val(op, 'dtype')}")
    if np.issubdtype(target, np.integer) and _dtype_name(op.x) in ("fp16", "fp32"):
        # MIL casts floats to ints toward zero, as C does.
        return lambda env: [np.trunc(env[x]).astype(target)]
    return lambda env: [env[x].astype(target)]


def _make_log(op, c: _Ctx):
    # MIL's log is log(x + epsilon); its default 1e-45 is 0 in fp16 and nothing next to any
    # float32 it is added to but 0, where it keeps log(0) finite as MIL specifies.
    x, eps = c.slot(op.x), np.float32(_val(op, "epsilon", 1e-45))
    return lambda env: [np.log(env[x] + eps)]


def _make_rsqrt(op, c: _Ctx):
    x, eps = c.slot(op.x), np.float32(_val(op, "epsilon", 1e-12))
    return lambda env: [1.0 / np.sqrt(env[x] + eps)]


def _make_select(op, c: _Ctx):
    cond, a, b = c.slot(op.cond), c.slot(op.a), c.slot(op.b)
    return lambda env: [np.where(env[cond], env[a], env[b])]


def _make_gather(op, c: _Ctx):
    if int(_val(op, "batch_dims", 0)) != 0:
        raise UnsupportedOp("gather", "batch_dims != 0")
    x, idx = c.slot(op.x), c.slot(op.indices)
    axis = int(_val(op, "axis", 0)) % op.x.rank

    def run(env: Env) -> list:
        ind = env[idx]
        # Out-of-range ids are refused by the engine before execution; np.take raises too.
        return [np.take(env[x], ind.astype(np.intp, copy=False), axis=axis)]

    return run


def _make_reshape(op, c: _Ctx):
    x, shape = c.slot(op.x), tuple(op.outputs[0].shape)  # static: covers 0 / -1 semantics
    return lambda env: [env[x].reshape(shape)]


def _make_expand_dims(op, c: _Ctx):
    x, shape = c.slot(op.x), tuple(op.outputs[0].shape)
    return lambda env: [env[x].reshape(shape)]


def _make_squeeze(op, c: _Ctx):
    x, shape = c.slot(op.x), tuple(op.outputs[0].shape)
    return lambda env: [env[x].reshape(shape)]


def _make_transpose(op, c: _Ctx):
    x, perm = c.slot(op.x), tuple(int(p) for p in _val(op, "perm"))
    # Materialised: later matmuls and convs want contiguous operands for BLAS.
    return lambda env: [np.ascontiguousarray(np.transpose(env[x], perm))]


def _make_concat(op, c: _Ctx):
    if bool(_val(op, "interleave", False)):
        raise UnsupportedOp("concat", "interleave=True")
    xs = [c.slot(v) for v in op.values]
    axis = int(_val(op, "axis")) % op.outputs[0].rank
    return lambda env: [np.concatenate([env[i] for i in xs], axis=axis)]


def _make_split(op, c: _Ctx):
    x = c.slot(op.x)
    axis = int(_val(op, "axis")) % op.x.rank
    sizes = [int(o.shape[axis]) for o in op.outputs]
    cuts = list(np.cumsum(sizes)[:-1])
    return lambda env: np.split(env[x], cuts, axis=axis)


def _make_slice_by_index(op, c: _Ctx):
    x = c.slot(op.x)
    rank = op.x.rank
    begin = [int(v) for v in _val(op, "begin")]
    end = [int(v) for v in _val(op, "end")]
    stride = [int(v) for v in _val(op, "stride", [1] * rank)]
    bmask = [bool(v) for v in _val(op, "begin_mask", [False] * rank)]
    emask = [bool(v) for v in _val(op, "end_mask", [False] * rank)]
    smask = [bool(v) for v in _val(op, "squeeze_mask", [False] * rank)]
    index: list[object] = []
    for i in range(rank):
        if smask[i]:
            index.append(begin[i])
        else:
            index.append(
                slice(None if bmask[i] else begin[i], None if emask[i] else end[i], stride[i])
            )
    key = tuple(index)
    return lambda env: [env[x][key]]


def _make_reduce(
    fn: Callable[..., np.ndarray],
) -> Callable[[object, _Ctx], Callable[[Env], list]]:
    def make(op, c: _Ctx):
        x = c.slot(op.x)
        axes = _axes(_val(op, "axes"), op.x.rank)
        keep = bool(_val(op, "keep_dims", False))
        return lambda env: [fn(env[x], axes, keep)]

    return make


def _l2(x: np.ndarray, axes: tuple[int, ...] | None, keep: bool) -> np.ndarray:
    return np.sqrt(np.sum(np.square(x), axis=axes, keepdims=keep))


_REDUCE = {
    "reduce_sum": lambda x, a, k: np.sum(x, axis=a, keepdims=k),
    "reduce_mean": lambda x, a, k: np.mean(x, axis=a, keepdims=k),
    "reduce_max": lambda x, a, k: np.max(x, axis=a, keepdims=k),
    "reduce_min": lambda x, a, k: np.min(x, axis=a, keepdims=k),
    "reduce_l2_norm": _l2,
}


def _make_softmax(op, c: _Ctx):
    x, axis = c.slot(op.x), int(_val(op, "axis", -1))

    def run(env: Env) -> list:
        v = env[x]
        e = v - v.max(axis=axis, keepdims=True)
        np.exp(e, out=e)
        e /= e.sum(axis=axis, keepdims=True)
        return [e]

    return run


def _make_layer_norm(op, c: _Ctx):
    x = c.slot(op.x)
    rank = op.x.rank
    raw_axes = _val(op, "axes")
    # _axes returns None only for None, which the condition excludes.
    axes = (
        cast(tuple[int, ...], _axes(raw_axes, rank)) if raw_axes is not None else tuple(range(rank))
    )
    if raw_axes is not None and [int(a) % rank for a in np.atleast_1d(raw_axes)] != list(axes):
        raise UnsupportedOp("layer_norm", "unsorted axes")
    bshape = [op.x.shape[i] if i in axes else 1 for i in range(rank)]
    gamma, beta = _val(op, "gamma"), _val(op, "beta")
    g = None if gamma is None else np.asarray(gamma, np.float32).reshape(bshape)
    b = None if beta is None else np.asarray(beta, np.float32).reshape(bshape)
    eps = np.float32(_val(op, "epsilon", 1e-5))

    def run(env: Env) -> list:
        v = env[x]
        mean = v.mean(axis=axes, keepdims=True)
        d = v - mean
        var = np.mean(np.square(d), axis=axes, keepdims=True)
        var += eps
        d *= 1.0 / np.sqrt(var)
        if g is not None:
            d *= g
        if b is not None:
            d += b
        return [d]

    return run


def _make_gelu(op, c: _Ctx):
    x, mode = c.slot(op.x), str(_val(op, "mode", "EXACT"))
    if mode == "EXACT":
        return lambda env: [gelu_exact(env[x])]
    if mode == "TANH_APPROXIMATION":
        k = np.float32(np.sqrt(2.0 / np.pi))
        return lambda env: [0.5 * env[x] * (1.0 + np.tanh(k * (env[x] + 0.044715 * env[x] ** 3)))]
    if mode == "SIGMOID_APPROXIMATION":
        return lambda env: [env[x] / (1.0 + np.exp(-1.702 * env[x]))]
    raise UnsupportedOp("gelu", f"mode {mode}")


def _make_conv(op, c: _Ctx):
    weight = getattr(op, "weight", None)
    if weight is None or weight.val is None:
        raise UnsupportedOp("conv", "non-const weight")
    w = np.asarray(weight.val, np.float32)
    if op.x.rank != 4 or w.shape[2:] != (1, 1):
        raise UnsupportedOp("conv", f"kernel {w.shape[2:]} on rank {op.x.rank} (1x1 2-D only)")
    if int(_val(op, "groups", 1)) != 1:
        raise UnsupportedOp("conv", "groups != 1")
    if any(int(s) != 1 for s in _val(op, "strides", [1, 1])):
        raise UnsupportedOp("conv", "strides != 1")
    if (
        any(int(p) != 0 for p in _val(op, "pad", [0, 0, 0, 0]))
        and str(_val(op, "pad_type", "valid")) == "custom"
    ):
        raise UnsupportedOp("conv", "non-zero padding")
    w2 = np.ascontiguousarray(w.reshape(w.shape[0], w.shape[1]))
    bias = _val(op, "bias")
    b = None if bias is None else np.asarray(bias, np.float32).reshape(1, -1, 1)
    x = c.slot(op.x)
    n, _, h, wd = op.x.shape
    out_shape = (n, w2.shape[0], h, wd)

    def run(env: Env) -> list:
        # A 1x1 conv is a GEMM per batch item: (C_out, C_in) @ (C_in, H*W).
        v = env[x].reshape(n, w2.shape[1], h * wd)
        r = np.matmul(w2, v)
        if b is not None:
            r += b
        return [r.reshape(out_shape)]

    return run


def _make_linear(op, c: _Ctx):
    w = np.ascontiguousarray(np.asarray(_val(op, "weight"), np.float32).T)
    bias = _val(op, "bias")
    b = None if bias is None else np.asarray(bias, np.float32)
    x = c.slot(op.x)

    def run(env: Env) -> list:
        r = env[x] @ w
        if b is not None:
            r += b
        return [r]

    return run


def _make_matmul(op, c: _Ctx):
    x, y = c.slot(op.x), c.slot(op.y)
    tx, ty = bool(_val(op, "transpose_x", False)), bool(_val(op, "transpose_y", False))
    xs, ys = tuple(op.x.shape), tuple(op.y.shape)
    out_shape = tuple(op.outputs[0].shape)
    # (B, C, 1, S) x (B, 1, S, K), the pooling matmul: one batched GEMM over B instead of
    # B*C broadcast GEMVs.
    pooled = (
        len(xs) == 4
        and len(ys) == 4
        and not tx
        and not ty
        and xs[2] == 1
        and ys[1] == 1
        and xs[0] == ys[0]
    )

    def run(env: Env) -> list:
        a, b = env[x], env[y]
        if pooled:
            r = np.matmul(a.reshape(xs[0], xs[1], xs[3]), b.reshape(ys[0], ys[2], ys[3]))
            return [r.reshape(out_shape)]
        if tx:
            a = np.swapaxes(a, -1, -2)
        if ty:
            b = np.swapaxes(b, -1, -2)
        return [np.matmul(a, b)]

    return run


def _einsum_form(equation: str) -> int:
    """Rank (4 or 3) of an equation equivalent to "nchw,nwhu->nchu" / "chw,whu->chu"."""
    eq = equation.replace(" ", "")
    try:
        lhs, out = eq.split("->")
        a, b = lhs.split(",")
    except ValueError:
        return 0
    if len(set(a + b)) != len(a) + 1 or len(set(a)) != len(a):
        return 0
    if len(a) == 4 and len(b) == 4 and len(out) == 4:
        n, ch, h, w = tuple(a)
        u = b[3]
        ok = b[0] == n and b[1] == w and b[2] == h and out == n + ch + h + u
        return 4 if ok else 0
    if len(a) == 3 and len(b) == 3 and len(out) == 3:
        ch, h, w = tuple(a)
        u = b[2]
        return 3 if b[0] == w and b[1] == h and out == ch + h + u else 0
    return 0


def _make_einsum(op, c: _Ctx):
    equation = str(_val(op, "equation"))
    rank = _einsum_form(equation)
    if rank == 0:
        raise UnsupportedOp("einsum", f"equation {equation!r}")
    x, y = (c.slot(v) for v in op.values)
    xs, ys = tuple(op.values[0].shape), tuple(op.values[1].shape)
    out_shape = tuple(op.outputs[0].shape)
    if rank == 3:  # chw,whu->chu: batch over h

        def run3(env: Env) -> list:
            a = np.transpose(env[x], (1, 0, 2))
            b = np.transpose(env[y], (1, 0, 2))
            return [np.ascontiguousarray(np.transpose(np.matmul(a, b), (1, 0, 2)))]

        return run3
    if xs[2] == 1 and ys[2] == 1 and xs[0] == ys[0]:
        # The per-head attention form: h == 1, a plain batched GEMM over n.
        def run_h1(env: Env) -> list:
            a = env[x].reshape(xs[0], xs[1], xs[3])
            b = env[y].reshape(ys[0], ys[1], ys[3])
            return [np.matmul(a, b).reshape(out_shape)]

        return run_h1

    def run4(env: Env) -> list:
        a = np.transpose(env[x], (0, 2, 1, 3))  # n h c w
        b = np.transpose(env[y], (0, 2, 1, 3))  # n h w u
        return [np.ascontiguousarray(np.transpose(np.matmul(a, b), (0, 2, 1, 3)))]

    return run4


_FACTORIES: dict[str, Callable[[object, _Ctx], Callable[[Env], list]]] = {
    **{name: _binary(name) for name in _ELEMENTWISE},
    **{name: _unary(name) for name in _UNARY},
    **{name: _make_reduce(fn) for name, fn in _REDUCE.items()},
    "cast": _make_cast,
    "rsqrt": _make_rsqrt,
    "log": _make_log,
    "select": _make_select,
    "gather": _make_gather,
    "reshape": _make_reshape,
    "expand_dims": _make_expand_dims,
    "squeeze": _make_squeeze,
    "transpose": _make_transpose,
    "concat": _make_concat,
    "split": _make_split,
    "slice_by_index": _make_slice_by_index,
    "softmax": _make_softmax,
    "layer_norm": _make_layer_norm,
    "gelu": _make_gelu,
    "conv": _make_conv,
    "linear": _make_linear,
    "matmul": _make_matmul,
    "einsum": _make_einsum,
}

#: Every op type the executor runs (besides `const`).
SUPPORTED_OPS: frozenset[str] = frozenset(_FACTORIES)


# ---- the compiled program ------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # MIL dtype name: "int32", "fp16", ...


class CompiledProgram:
    """A MIL function precompiled into closures. `run` is not thread-safe (shared scratch).

    `prog` is a `program_ir.Function` (e.g. loaded from the compiled form) or a coremltools
    MIL `Program`, converted here."""

    def __init__(self, prog: object, function_name: str = "main") -> None:
        if isinstance(prog, program_ir.Function):
            func = prog
        else:
            if function_name not in prog.functions:  # type: ignore[attr-defined]
                raise PackageError(f"no function {function_name!r} in the program")
            func = program_ir.from_mil(prog, function_name)
        self.function = func
        ops = list(func.operations)
        if any(op.blocks for op in ops):
            raise UnsupportedOp(next(op.op_type for op in ops if op.blocks), "control flow")
        self.op_counts: collections.Counter[str] = collections.Counter(op.op_type for op in ops)
        slot_of: dict[int, int] = {}
        template: list[np.ndarray | None] = []

        def new_slot(var: object) -> int:
            for dim in var.shape:  # type: ignore[attr-defined]
                if not isinstance(dim, (int, np.integer)):
                    raise UnsupportedOp("dynamic_shape", f"{var.name} has dim {dim}")  # type: ignore[attr-defined]
            slot_of[id(var)] = len(template)
            template.append(None)
            return len(template) - 1

        self.inputs: list[TensorInfo] = []
        self._input_slots: list[tuple[int, TensorInfo]] = []
        for name, var in func.inputs.items():
            slot = new_slot(var)  # refuses symbolic dims first
            info = TensorInfo(name, tuple(int(d) for d in var.shape), _dtype_name(var))
            self.inputs.append(info)
            self._input_slots.append((slot, info))

        ctx = _Ctx(slot_of)
        raw_steps: list[tuple[Callable[[Env], list], list[int], list[bool], list[tuple], list[int]]]
        raw_steps = []
        for op in ops:
            if op.op_type == "const":
                slot = new_slot(op.outputs[0])
                template[slot] = _const_array(op.outputs[0])
                continue
            factory = _FACTORIES.get(op.op_type)
            if factory is None:
                raise UnsupportedOp(op.op_type)
            run = factory(op, ctx)
            out_slots = [new_slot(v) for v in op.outputs]
            rounds = [_dtype_name(v) == "fp16" and op.op_type not in _EXACT for v in op.outputs]
            shapes = [tuple(int(d) for d in v.shape) for v in op.outputs]
            reads = [slot_of[id(v)] for v in _input_vars(op)]
            raw_steps.append((run, out_slots, rounds, shapes, reads))

        self.outputs: list[TensorInfo] = []
        out_slots_final: list[int] = []
        for var in func.outputs:
            self.outputs.append(
                TensorInfo(var.name, tuple(int(d) for d in var.shape), _dtype_name(var))
            )
            out_slots_final.append(slot_of[id(var)])

        # Free each activation after its last reader (constants stay in the template).
        last_read: dict[int, int] = {}
        for i, (_, _, _, _, reads) in enumerate(raw_steps):
            for s in reads:
                if template[s] is None:
                    last_read[s] = i
        keep = set(out_slots_final)
        frees: list[list[int]] = [[] for _ in raw_steps]
        for s, i in last_read.items():
            if s not in keep:
                frees[i].append(s)

        self._template = template
        self._out_slots = out_slots_final
        self._steps = [
            _bind(run, outs, rnd, shp, frees[i], ops_name)
            for i, ((run, outs, rnd, shp, _), ops_name) in enumerate(
                zip(raw_steps, [op.op_type for op in ops if op.op_type != "const"], strict=True)
            )
        ]

    @property
    def op_types(self) -> set[str]:
        return set(self.op_counts)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env: Env = list(self._template)
        for slot, info in self._input_slots:
            if info.name not in feeds:
                raise ValueError(f"missing input {info.name!r}")
            arr = np.asarray(feeds[info.name])
            if arr.shape != info.shape:
                raise ValueError(f"input {info.name!r}: shape {arr.shape}, expected {info.shape}")
            env[slot] = _to_storage(arr, info.dtype)
        for step in self._steps:
            step(env)
        return {
            info.name: np.asarray(env[slot], dtype=np.float32)
            if info.dtype in ("fp16", "fp32")
            else env[slot]
            for info, slot in zip(self.outputs, self._out_slots, strict=True)
        }


def _bind(
    run: Callable[[Env], list],
    outs: list[int],
    rounds: list[bool],
    shapes: list[tuple],
    frees: list[int],
    op_type: str,
) -> Step:
    pairs = list(zip(outs, rounds, shapes, strict=True))

    def step(env: Env) -> None:
        results = run(env)
        for (slot, rnd, shape), value in zip(pairs, results, strict=True):
            if value.shape != shape:
                raise RuntimeError(
                    f"executor bug: {op_type} produced {value.shape}, program says {shape}"
                )
            if rnd:
                # Non-exact ops return fresh arrays (never an input), so rounding in place is
                # safe; a strided or read-only result is copied first.
                value = np.ascontiguousarray(value, dtype=np.float32)
                if not value.flags.writeable:
                    value = value.copy()
                round_fp16_(value)
            env[slot] = value
        for s in frees:
            env[s] = None

    return step


def _input_vars(op: object) -> list[object]:
    out: list[object] = []
    for v in op.inputs.values():  # type: ignore[attr-defined]
        if isinstance(v, (list, tuple)):
            out.extend(v)
        else:
            out.append(v)
    return out


def _to_storage(arr: np.ndarray, dtype: str) -> np.ndarray:
    target = _NP_DTYPES[dtype]
    if dtype == "fp16":
        return round_fp16_(np.array(arr, dtype=np.float32, order="C", copy=True))
    if np.issubdtype(target, np.integer) and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"expected integer input, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=target)


# Constants shared by every loaded program in the process: the shapes of one model carry the
# same weights, which would otherwise be held once per loaded shape.
_INTERNED: weakref.WeakValueDictionary[tuple, np.ndarray] = weakref.WeakValueDictionary()
_INTERN_MIN_BYTES = 1 << 12


def _const_array(var: object) -> np.ndarray:
    name = _dtype_name(var)
    val = var.val  # type: ignore[attr-defined]
    if getattr(var, "mapped", False):
        return val  # already in storage dtype, read-only, in the page cache: no copy
    if name in ("str", "string"):
        return np.asarray(val)
    target = _NP_DTYPES.get(name)
    if target is None:
        raise UnsupportedOp("const", f"dtype {name}")
    arr = np.array(val, dtype=target)  # fp16 -> float32 is exact
    arr.setflags(write=False)  # shared by every run: an in-place op on it would be a bug
    if arr.nbytes < _INTERN_MIN_BYTES:
        return arr
    key = (arr.dtype.str, arr.shape, hashlib.blake2b(arr.data, digest_size=20).digest())
    shared = _INTERNED.get(key)
    if shared is None:
        _INTERNED[key] = shared = arr
    return shared


def load_executor(path: str | os.PathLike[str], function_name: str = "main") -> CompiledProgram:
    """Read a saved `.mlpackage` and precompile it; raises UnsupportedOp / PackageError."""
    return CompiledProgram(load_package_program(path), function_name)
