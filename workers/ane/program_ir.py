"""A saved MIL program as plain Python objects: what the reference executor and the static
placement estimate walk.

Two sources:
- `from_mil(prog)`: coremltools' in-memory program (as `executor.load_package_program` reads
  it back from a saved `.mlpackage`) - needs coremltools, as reading a package does;
- `load(dir)`: the reference backend's compiled form, written once by `save(function, dir)`:
  `program.json` (the op list: types, inputs, outputs, shapes, dtypes, small constants) and
  `weights.bin` (every larger constant, 64-byte aligned, already in the executor's storage
  dtype: fp16 values stored as float32). Loading maps `weights.bin` read-only and builds views
  into it, so opening a cached shape copies no weights and never imports coremltools.

The objects answer the attribute names the executor and placement use on MIL objects:
`op.op_type`, `op.inputs`, `op.outputs`, `op.blocks`, `op.<input name>` (a Var, a tuple of
Vars, or AttributeError when absent); `var.name`, `var.shape`, `var.rank`, `var.dtype` (MIL
dtype name such as "fp16"), `var.val` (a constant's value, else None), `var.op` (producer).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1
PROGRAM_NAME = "program.json"
WEIGHTS_NAME = "weights.bin"
_ALIGN = 64
_INLINE_MAX_BYTES = 1024  # smaller constants live in program.json

# MIL dtype name -> the numpy dtype the executor stores it as (fp16 values held in float32).
STORAGE_DTYPES: dict[str, Any] = {
    "fp16": np.float32,
    "fp32": np.float32,
    "fp64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
    "bool": np.bool_,
}


class ProgramFormatError(ValueError):
    """A compiled program directory that cannot be read back."""


class Var:
    __slots__ = ("name", "shape", "dtype", "val", "op", "mapped")

    def __init__(self, name: str, shape: tuple, dtype: str, val: object = None) -> None:
        self.name = name
        self.shape = shape  # ints; a symbolic dim stays a str (the executor refuses it)
        self.dtype = dtype
        self.val = val
        self.op: Op | None = None
        self.mapped = False  # val is a read-only view into a mapped weights file

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Var({self.name}, {self.shape}, {self.dtype})"


class Op:
    __slots__ = ("op_type", "name", "inputs", "outputs", "blocks")

    def __init__(
        self,
        op_type: str,
        name: str,
        inputs: dict[str, Var | tuple[Var, ...]],
        outputs: list[Var],
        blocks: tuple = (),
    ) -> None:
        self.op_type = op_type
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self.blocks = blocks
        for v in outputs:
            v.op = self

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not slots: the op's named inputs, as MIL ops expose.
        try:
            return object.__getattribute__(self, "inputs")[name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"Op({self.op_type} {self.name})"


class Function:
    __slots__ = ("inputs", "operations", "outputs")

    def __init__(self, inputs: dict[str, Var], operations: list[Op], outputs: list[Var]) -> None:
        self.inputs = inputs
        self.operations = operations
        self.outputs = outputs


# ---- from coremltools' MIL ------------------------------------------------------------------


def from_mil(prog: object, function_name: str = "main") -> Function:
    """Convert one function of a MIL `Program` (nested blocks included)."""
    from coremltools.converters.mil.mil import types

    functions = prog.functions  # type: ignore[attr-defined]
    if function_name not in functions:
        raise ProgramFormatError(f"no function {function_name!r} in the program")
    seen: dict[int, Var] = {}

    def var(v: Any) -> Var:
        out = seen.get(id(v))
        if out is None:
            shape = tuple(int(d) if isinstance(d, (int, np.integer)) else str(d) for d in v.shape)
            out = Var(v.name, shape, types.builtin_to_string(v.dtype), v.val)
            seen[id(v)] = out
        return out

    def block(b: Any) -> Function:
        ops = []
        for op in b.operations:
            inputs = {
                k: tuple(var(x) for x in v) if isinstance(v, (list, tuple)) else var(v)
                for k, v in op.inputs.items()
            }
            ops.append(
                Op(
                    op.op_type,
                    op.name,
                    inputs,
                    [var(o) for o in op.outputs],
                    tuple(block(sub) for sub in op.blocks),
                )
            )
        named = getattr(b, "inputs", None)  # a function's inputs; nested blocks have none named
        ins = {k: var(v) for k, v in named.items()} if isinstance(named, dict) else {}
        return Function(ins, ops, [var(o) for o in b.outputs])

    return block(functions[function_name])


# ---- the compiled form: save / load -------------------------------------------------------------


def _inline(val: object) -> Any:
    if isinstance(val, (str, np.str_)):
        return {"str": str(val)}
    arr = np.asarray(val)
    if arr.dtype.kind in "US":
        return {"str_array": arr.astype(str).tolist(), "shape": list(arr.shape)}
    return {"np": arr.dtype.str, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def save(func: Function, out_dir: str | os.PathLike[str], *, weights: bool = True) -> Path:
    """Write `func` as `program.json` + `weights.bin` into `out_dir` (created). Without
    `weights`, large constants keep their shape and dtype but no value (enough for the
    placement estimate, not for execution)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(op.blocks for op in func.operations):
        raise ProgramFormatError("nested blocks (control flow) are not saved")
    names: dict[int, str] = {}
    vars_json: dict[str, Any] = {}
    offset = 0
    with open(out / WEIGHTS_NAME, "wb") as blob:  # not `weights`: that is the flag

        def name_of(v: Var) -> str:
            if id(v) in names:
                return names[id(v)]
            if v.name in vars_json:
                raise ProgramFormatError(f"two variables are named {v.name!r}")
            nonlocal offset
            entry: dict[str, Any] = {"shape": list(v.shape), "dtype": v.dtype}
            if v.val is not None:
                arr = None if isinstance(v.val, str) else np.asarray(v.val)
                storage = STORAGE_DTYPES.get(v.dtype)
                if arr is not None and storage is not None and arr.dtype.kind not in "US":
                    arr = np.asarray(arr, dtype=storage, order="C")  # keeps 0-d as 0-d
                if arr is None or arr.nbytes <= _INLINE_MAX_BYTES or storage is None:
                    entry["val"] = _inline(v.val if arr is None else arr)
                elif not weights:
                    pass  # left out on purpose: val None
                else:
                    pad = -offset % _ALIGN
                    blob.write(b"\0" * pad)
                    offset += pad
                    blob.write(arr.tobytes())
                    entry["val"] = {"mapped": offset, "np": arr.dtype.str, "shape": list(arr.shape)}
                    offset += arr.nbytes
            vars_json[v.name] = entry
            names[id(v)] = v.name
            return v.name

        inputs = {k: name_of(v) for k, v in func.inputs.items()}
        ops = []
        for op in func.operations:
            ins = {
                k: [name_of(x) for x in v] if isinstance(v, tuple) else name_of(v)
                for k, v in op.inputs.items()
            }
            ops.append(
                {
                    "type": op.op_type,
                    "name": op.name,
                    "inputs": ins,
                    "outputs": [name_of(o) for o in op.outputs],
                }
            )
        outputs = [name_of(v) for v in func.outputs]
        blob.flush()
        os.fsync(blob.fileno())
    doc = {"format": FORMAT, "inputs": inputs, "outputs": outputs, "vars": vars_json, "ops": ops}
    (out / PROGRAM_NAME).write_text(json.dumps(doc, separators=(",", ":")))
    return out


def load(path: str | os.PathLike[str]) -> Function:
    """Read a directory written by `save`; the large constants are read-only mapped views."""
    root = Path(path)
    try:
        doc = json.loads((root / PROGRAM_NAME).read_text())
    except (OSError, ValueError) as e:
        raise ProgramFormatError(f"{root / PROGRAM_NAME}: {e}") from e
    if doc.get("format") != FORMAT:
        raise ProgramFormatError(f"{root}: format {doc.get('format')!r}, expected {FORMAT}")
    mapped: mmap.mmap | None = None
    size = os.path.getsize(root / WEIGHTS_NAME)
    if size:
        with open(root / WEIGHTS_NAME, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    variables: dict[str, Var] = {}
    for name, entry in doc["vars"].items():
        shape = tuple(entry["shape"])
        v = Var(name, shape, entry["dtype"])
        raw = entry.get("val")
        if raw is not None:
            if "mapped" in raw:
                if mapped is None:
                    raise ProgramFormatError(f"{root}: {WEIGHTS_NAME} is empty")
                dt = np.dtype(raw["np"])
                count = int(np.prod(raw["shape"], dtype=np.int64))
                if raw["mapped"] + count * dt.itemsize > size:
                    raise ProgramFormatError(f"{root}: {name} lies past the end of the weights")
                v.val = np.frombuffer(mapped, dt, count, raw["mapped"]).reshape(raw["shape"])
                v.mapped = True
            elif "str" in raw:
                v.val = raw["str"]
            elif "str_array" in raw:
                v.val = np.asarray(raw["str_array"]).reshape(raw["shape"])
            else:
                v.val = np.asarray(raw["data"], dtype=np.dtype(raw["np"])).reshape(raw["shape"])
        variables[name] = v

    def get(name: str) -> Var:
        try:
            return variables[name]
        except KeyError:
            raise ProgramFormatError(f"{root}: unknown variable {name!r}") from None

    ops = [
        Op(
            o["type"],
            o["name"],
            {
                k: tuple(get(x) for x in v) if isinstance(v, list) else get(v)
                for k, v in o["inputs"].items()
            },
            [get(x) for x in o["outputs"]],
        )
        for o in doc["ops"]
    ]
    return Function(
        {k: get(v) for k, v in doc["inputs"].items()}, ops, [get(x) for x in doc["outputs"]]
    )


def walk(ops: Iterable[Op]) -> Iterable[Op]:
    """Every op, depth first, including those inside nested blocks."""
    for op in ops:
        yield op
        for b in op.blocks:
            yield from walk(b.operations)
