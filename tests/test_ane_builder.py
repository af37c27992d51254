"""The owned graph's form: what the Neural Engine needs, asserted on the MIL programs."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import numpy as np
import pytest

from compile_cache import CompileCache
from tests import test_ane_helpers as h
from workers.ane.builder import (
    KERNEL_REVISION,
    LN_EPS_FLOOR,
    BuildOptions,
    build_program,
    convert_and_save,
    truncate_mantissa,
)
from workers.ane.compiler import PACKAGE_NAME, AdmitTimings, cache_key, package_entry
from workers.ane.ct_quiet import Function, Program, ct, mb, types
from workers.ane.executor import load_package_program
from workers.ane.shapes import Shape

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

ROWS, SEQ, SEGS = 2, 32, 4


@pytest.fixture(scope="module")
def programs() -> dict[str, Program]:
    embed, cross = h.minilm(), h.cross_encoder()
    return {
        "embed": build_program(embed, Shape(ROWS, SEQ)),
        "embed_packed": build_program(embed, Shape(ROWS, SEQ, True, SEGS)),
        "cross": build_program(cross, Shape(ROWS, SEQ)),
        "cross_packed": build_program(cross, Shape(ROWS, SEQ, True, SEGS)),
    }


def _ops(prog: Program, op_type: str | None = None) -> list:
    ops = [op for op in prog.functions["main"].operations if op.op_type != "const"]
    return ops if op_type is None else [op for op in ops if op.op_type == op_type]


def _all_vars(prog: Program) -> list:
    func = prog.functions["main"]
    out = list(func.inputs.values())
    for op in func.operations:
        out += list(op.outputs)
    return out


def test_every_linear_layer_is_a_1x1_conv_in_channels_first_form(programs) -> None:
    cfg = h.minilm().config
    for name, prog in programs.items():
        convs = _ops(prog, "conv")
        head = 2 if name.startswith("cross") else 0  # pooler + classifier
        assert len(convs) == 6 * cfg.num_layers + head, name  # Q K V O up down per layer
        assert not _ops(prog, "linear")
        for op in convs:
            b, c, one, s = op.x.shape
            assert (b, one) == (ROWS, 1), name
            assert s in (SEQ, 1, SEGS)  # encoder: sequence axis; head: pooled
            w = op.weight.val
            assert w.shape[1:] == (c, 1, 1)
            assert op.outputs[0].shape[2] == 1
        encoder = convs[: 6 * cfg.num_layers]
        assert all(op.x.shape == (ROWS, op.x.shape[1], 1, SEQ) for op in encoder)
        widths = collections.Counter(op.outputs[0].shape[1] for op in encoder)
        assert widths == {
            cfg.hidden_size: 5 * cfg.num_layers,
            cfg.intermediate_size: cfg.num_layers,
        }


def test_attention_runs_per_head_without_relayouts(programs) -> None:
    cfg = h.minilm().config
    for name, prog in programs.items():
        einsums = _ops(prog, "einsum")
        assert len(einsums) == 2 * cfg.num_heads * cfg.num_layers
        for op in einsums:
            assert op.equation.val == "nchw,nwhu->nchu"
            a, b = op.values
            assert a.rank == b.rank == 4 and a.shape[2] == b.shape[2] == 1
            assert cfg.head_dim in (a.shape[1], a.shape[3])
        splits = _ops(prog, "split")
        assert len(splits) == 3 * cfg.num_layers
        assert all(op.num_splits.val == cfg.num_heads for op in splits)
        assert all(op.axis.val == 1 for op in _ops(prog, "softmax"))  # keys on channels
        # One transpose per layer (K), one at the embedding, one per pooled packed output
        # ((B, C, K) -> (B, K, C) at the very end; token states stay (B, C, S)).
        pooled = [v for v in prog.functions["main"].outputs if v.name != "token_states"]
        packed_out = len(pooled) if name.endswith("packed") else 0
        assert len(_ops(prog, "transpose")) == cfg.num_layers + 1 + packed_out
        # Reshapes only outside the layers: masks, token types, outputs.
        assert len(_ops(prog, "reshape")) <= 5


def test_layer_norm_over_channels_with_an_fp16_safe_epsilon(programs) -> None:
    assert h.minilm().config.layer_norm_eps == 1e-12  # what fp16 would flush to 0
    for prog in programs.values():
        lns = _ops(prog, "layer_norm")
        assert len(lns) == 1 + 2 * h.minilm().config.num_layers
        for op in lns:
            assert list(op.axes.val) == [1]
            assert op.epsilon.val == pytest.approx(LN_EPS_FLOOR)
            assert np.float16(op.epsilon.val) > 0
        assert all(op.mode.val == "EXACT" for op in _ops(prog, "gelu"))


def test_static_shapes_everywhere(programs) -> None:
    for prog in programs.values():
        for var in _all_vars(prog):
            assert all(isinstance(d, (int, np.integer)) for d in var.shape), var


def test_inputs_outputs_and_heads(programs) -> None:
    hidden = h.minilm().config.hidden_size
    io = {
        name: (
            list(p.functions["main"].inputs),
            {v.name: v.shape for v in p.functions["main"].outputs},
        )
        for name, p in programs.items()
    }
    # An embedder's graph also gives every token's final state, channels-first
    # (workers.ane.token_heads), packed or not; a packed one also takes a key mask.
    assert io["embed"] == (
        ["input_ids", "token_type_ids", "attention_mask"],
        {
            "embedding": (ROWS, hidden),
            "embedding_l2": (ROWS, hidden),
            "token_states": (ROWS, hidden, SEQ),
        },
    )
    assert io["embed_packed"] == (
        ["input_ids", "token_type_ids", "segment_ids", "position_ids", "attention_mask"],
        {
            "embedding": (ROWS, SEGS, hidden),
            "embedding_l2": (ROWS, SEGS, hidden),
            "token_states": (ROWS, hidden, SEQ),
        },
    )
    # A cross-encoder has no token outputs, so no key mask either.
    assert io["cross_packed"][0] == ["input_ids", "token_type_ids", "segment_ids", "position_ids"]
    assert io["cross"][1] == {"logits": (ROWS, 1)}
    assert io["cross_packed"][1] == {"logits": (ROWS, SEGS, 1)}
    for name in ("cross", "cross_packed"):
        assert len(_ops(programs[name], "tanh")) == 1  # pooler
    # Packed rows: the block-diagonal mask is built in the graph from segment ids.
    for name in ("embed_packed", "cross_packed"):
        kinds = {op.op_type for op in _ops(programs[name])}
        assert {"equal", "not_equal", "logical_and"} <= kinds


def test_converted_package_is_static_and_keeps_the_form() -> None:
    manifest = h.minilm()
    with CompileCache(h.CACHE_ROOT) as cache:
        entry, _hit = package_entry(
            cache,
            manifest,
            Shape(**h.EMBED_UNPACKED),
            BuildOptions(),
            lambda _stage: None,
            AdmitTimings(),
        )
        with entry.lease().acquire():
            prog = load_package_program(entry.path / PACKAGE_NAME)
    for var in _all_vars(prog):
        assert all(isinstance(d, (int, np.integer)) for d in var.shape), var
    convs = _ops(prog, "conv")
    assert len(convs) == 36
    assert all(op.x.rank == 4 and op.x.shape[2] == 1 for op in convs)
    assert {types.builtin_to_string(op.outputs[0].dtype) for op in convs} == {"fp16"}
    eps = {float(op.epsilon.val) for op in _ops(prog, "layer_norm")}
    assert eps == {float(np.float16(LN_EPS_FLOOR))}  # survived the fp16 cast, nonzero


def test_conversion_writes_the_package_in_place_and_nothing_in_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # coremltools' default writes a temp package that only atexit removes: a worker the host
    # SIGKILLs would leave one per build under /tmp.
    tmp, build = tmp_path / "tmp", tmp_path / "build"
    tmp.mkdir()
    build.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with Function({"x": mb.placeholder(shape=(1, 4), dtype=types.fp32)}, ct.target.macOS14) as func:
        func.set_outputs([mb.relu(x=func.inputs["x"], name="y")])
    prog = Program()
    prog.add_function("main", func)
    out = convert_and_save(prog, build)
    assert out == build / "model.mlpackage"
    assert (out / "Manifest.json").is_file()
    assert list(tmp.iterdir()) == []


def test_build_options_degrade_the_graph_on_purpose() -> None:
    manifest = h.minilm()
    assert BuildOptions().key_fields() == {}
    eps_prog = build_program(manifest, Shape(1, 8), BuildOptions(ln_eps_override=1e-1))
    eps = [float(op.epsilon.val) for op in _ops(eps_prog, "layer_norm")]
    assert eps == pytest.approx([1e-1] * len(eps))
    bits = 4
    trunc = build_program(manifest, Shape(1, 8), BuildOptions(weight_mantissa_bits=bits))
    faithful = build_program(manifest, Shape(1, 8))
    w_t = _ops(trunc, "conv")[3].weight.val.astype(np.float32)
    w_f = _ops(faithful, "conv")[3].weight.val.astype(np.float32)
    assert not (w_t.view(np.uint32) & np.uint32((1 << (23 - bits)) - 1)).any()
    assert 0 < np.abs(w_t - w_f).max() <= np.abs(w_f).max() * 2.0**-bits
    assert BuildOptions(weight_mantissa_bits=4).key_fields() == {"weight_mantissa_bits": 4}
    with pytest.raises(ValueError):
        BuildOptions(weight_mantissa_bits=24)


def test_truncate_mantissa() -> None:
    x = np.array([1.0 + 2.0**-1 + 2.0**-5, -3.999, 0.0], dtype=np.float32)
    t = truncate_mantissa(x, 2)
    assert t.tolist() == [1.5, -3.5, 0.0]
    assert np.array_equal(truncate_mantissa(x, 23), x)


def test_cache_key_covers_what_changes_the_package() -> None:
    man = h.minilm()
    base = cache_key(man, Shape(4, 64), BuildOptions())
    assert base["kernel_revision"] == KERNEL_REVISION
    assert base["manifest_digest"] == man.digest
    assert base == cache_key(man, Shape(4, 64), BuildOptions())
    others = [
        cache_key(man, Shape(4, 128), BuildOptions()),
        cache_key(man, Shape(4, 64, True, 4), BuildOptions()),
        cache_key(man, Shape(4, 64), BuildOptions(ln_eps_override=1e-3)),
        cache_key(h.cross_encoder(), Shape(4, 64), BuildOptions()),
    ]
    assert all(k != base for k in others)


def test_shape_ids_round_trip() -> None:
    for shape in (Shape(8, 128), Shape(4, 256, True, 16), Shape(1, 1)):
        assert Shape.parse(shape.id) == shape
    assert Shape(8, 128).id == "8x128" and Shape(4, 256, True, 16).id == "4x256p16"
    for bad in ("8x", "x128", "8x128p", "8X128", "0x8"):
        with pytest.raises(ValueError):
            Shape.parse(bad)
    with pytest.raises(ValueError):
        Shape(2, 4, True, 5)  # more segments than tokens
    with pytest.raises(ValueError):
        build_program(h.minilm(), Shape(1, 513))
