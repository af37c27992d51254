"""A static estimate of how much of a program would run on the Neural Engine.

Only macOS can ask Core ML (`MLComputePlan`, see `coreml_backend`); everywhere else the engine
reports this estimate, labelled `"estimate"`, and certification caps such a result at
`provisional` (an estimate proves no placement, so it cannot certify one).

    share = sum(cost of ops judged ANE-eligible) / sum(cost of all non-const ops)

Cost (`op_cost`) is an estimate of work, not time: 2 * MACs for conv / matmul / einsum /
linear, and output elements times a small per-element factor for everything else (softmax,
layer_norm, gelu ~ several passes; data movement ~ half a pass).

Eligibility (`ane_eligible`), from op type, dtypes and shapes; the first matching rule wins:

  rule                                               verdict  why
  any dynamic (symbolic) dimension                   CPU      the ANE compiles static shapes
  rank > 4 of a data input or output                 CPU      ANE tensors are (N, C, H, W);
                                                              higher ranks are split or fall back
  any dim > 16384                                    CPU      ANE dimension limit
  gather, cast, or an op type not listed below       CPU      int ids / index arithmetic and the
                                                              fp32 I/O casts run outside the ANE
  an int or fp32 data input or output                CPU      the ANE has an fp16 datapath only
  a bool tensor (except masks between fp16 compares  CPU      as above
    and select / logical / layout ops)
  fp16 conv, matmul, einsum, linear, elementwise,    ANE      the ANE's supported layer set
    compares, reductions, softmax, layer_norm, gelu,
    tanh, reshape, transpose, split, concat, slice

Sources: Apple, "Deploying Transformers on the Apple Neural Engine" (machinelearning.apple.com,
2022) and its ml-ane-transformers code (fp16, (B, C, 1, S) layout, 1x1 conv, einsum
attention, static shapes); M. Hollemans, "The Neural Engine — what do we know about it?"
(github.com/hollance/neural-engine: supported/unsupported layers, fp16 only, dimension
limits); coremltools documentation on typed execution (fp16 compute, fp32 I/O casts). An
estimate: Core ML can still split a graph differently, which is why it is labelled as such.
"""

from __future__ import annotations

import math
from typing import Any

from workers.ane import program_ir

SOURCE = "estimate"
MAX_ANE_DIM = 16384

_GEMM_OPS = frozenset({"conv", "matmul", "einsum", "linear"})
_ANE_OPS = frozenset(
    {
        "conv",
        "matmul",
        "einsum",
        "linear",
        "add",
        "sub",
        "mul",
        "real_div",
        "maximum",
        "minimum",
        "pow",
        "equal",
        "not_equal",
        "greater",
        "greater_equal",
        "less",
        "less_equal",
        "logical_and",
        "logical_or",
        "logical_not",
        "select",
        "reduce_sum",
        "reduce_mean",
        "reduce_max",
        "reduce_min",
        "reduce_l2_norm",
        "softmax",
        "layer_norm",
        "gelu",
        "tanh",
        "relu",
        "sigmoid",
        "silu",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "reshape",
        "transpose",
        "expand_dims",
        "squeeze",
        "split",
        "concat",
        "slice_by_index",
    }
)
# Bool is fine where it is a mask between fp16 compares and select / logical ops.
_BOOL_OK = frozenset(
    {
        "equal",
        "not_equal",
        "greater",
        "greater_equal",
        "less",
        "less_equal",
        "logical_and",
        "logical_or",
        "logical_not",
        "select",
        "reshape",
        "expand_dims",
        "squeeze",
        "transpose",
    }
)
_PER_ELEMENT = {
    "softmax": 5.0,
    "layer_norm": 8.0,
    "gelu": 10.0,
    "tanh": 4.0,
    "sigmoid": 4.0,
    "exp": 4.0,
    "silu": 5.0,
    "reshape": 0.5,
    "transpose": 0.5,
    "expand_dims": 0.5,
    "squeeze": 0.5,
    "split": 0.5,
    "concat": 0.5,
    "slice_by_index": 0.5,
    "gather": 1.0,
    "cast": 1.0,
}


def _static_shape(var: object) -> tuple[int, ...] | None:
    shape = getattr(var, "shape", None)
    if shape is None:
        return ()
    if any(not isinstance(d, (int,)) and not hasattr(d, "__index__") for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _vars(op: object) -> tuple[list[Any], list[Any]]:  # Any: MIL (or program_ir) variables
    ins: list[Any] = []
    for v in op.inputs.values():  # type: ignore[attr-defined]
        ins.extend(v if isinstance(v, (list, tuple)) else [v])
    return ins, list(op.outputs)  # type: ignore[attr-defined]


def _dtype(var: object) -> str:
    return getattr(var, "dtype", "?")  # program_ir.Var: the MIL dtype name


def op_cost(op: object) -> float:
    """Estimated work (FLOP-like units) of one op; dynamic shapes count as 1."""
    ins, outs = _vars(op)
    out_shape = _static_shape(outs[0]) if outs else ()
    if out_shape is None:
        return 1.0
    elements = sum(math.prod(_static_shape(o) or (1,)) for o in outs)
    kind = op.op_type  # type: ignore[attr-defined]
    if kind == "conv":
        w = _static_shape(op.weight)  # type: ignore[attr-defined]
        if w:
            return 2.0 * math.prod(out_shape) * math.prod(w[1:])
    if kind in ("matmul", "linear", "einsum"):
        x = _static_shape(ins[0])
        if x:
            # The contracted dim is x's last, or its second to last for matmul(transpose_x).
            tx = getattr(op, "transpose_x", None)
            k = x[-2] if kind == "matmul" and tx is not None and bool(tx.val) else x[-1]
            return 2.0 * math.prod(out_shape) * k
    return float(elements) * _PER_ELEMENT.get(kind, 1.0)


def ane_eligible(op: object) -> bool:
    kind = op.op_type  # type: ignore[attr-defined]
    if kind not in _ANE_OPS:
        return False  # gather, cast, and anything unknown
    ins, outs = _vars(op)
    data = [v for v in ins if getattr(v, "op", None) is None or v.op.op_type != "const"]
    for v in data + outs:
        shape = _static_shape(v)
        if shape is None or len(shape) > 4 or any(d > MAX_ANE_DIM for d in shape):
            return False
        dt = _dtype(v)
        if dt == "bool" and kind in _BOOL_OK:
            continue
        if dt != "fp16":
            return False
    return True


def estimate(prog: object, function_name: str = "main") -> tuple[float, str]:
    """(share of estimated cost on the ANE, "estimate") over the function's non-const ops.
    `prog` is a `program_ir.Function` or a MIL `Program` (converted)."""
    func = (
        prog if isinstance(prog, program_ir.Function) else program_ir.from_mil(prog, function_name)
    )
    total = ane = 0.0
    for op in program_ir.walk(func.operations):
        if op.op_type == "const":
            continue
        cost = op_cost(op)
        total += cost
        if ane_eligible(op):
            ane += cost
    return (ane / total if total else 0.0), SOURCE
