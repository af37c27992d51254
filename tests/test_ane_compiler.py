"""Two-kind admission through the real compile cache (reference backend, Linux): the package
and its compiled form are separate entries; a compiled hit builds and compiles nothing; losing
either kind costs exactly the stages that produce it; gc / evict / verify / ls cover both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from compile_cache import CompileCache
from tests import test_ane_helpers as h
from workers.ane import program_ir
from workers.ane.backends import ReferenceBackend
from workers.ane.build_options import BuildOptions
from workers.ane.compiler import PACKAGE_KIND, PACKAGE_NAME, admit, cache_key, compiled_key
from workers.ane.executor import CompiledProgram, load_package_program
from workers.ane.shapes import Shape

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

SHAPE = Shape(2, 16)


@pytest.fixture(scope="module")
def cache_root(module_tmp) -> Path:
    return module_tmp


def _admit(root: Path, stages: list[str] | None = None, budget: int | None = None):
    cache = CompileCache(root, budget_bytes=budget)
    compiled = admit(
        cache,
        h.minilm(),
        SHAPE,
        ReferenceBackend(),
        BuildOptions(),
        stages.append if stages is not None else None,
    )
    return cache, compiled


def _kinds(cache: CompileCache) -> list[str]:
    return sorted(e.key["kind"] for e in cache.ls())


def test_cold_admission_publishes_both_kinds_then_hits_the_compiled_form(cache_root):
    stages: list[str] = []
    cache, cold = _admit(cache_root, stages)
    try:
        assert not cold.cache_hit and cold.package_hit is False
        assert stages == ["graph", "converted", "compiled", "loaded", "placed"]
        t = cold.timings
        assert t.build_ms > 0 and t.compile_ms > 0 and t.load_ms > 0 and t.warmup_ms == 0
        assert _kinds(cache) == [PACKAGE_KIND, "reference-program"]
        assert cold.entry.key["kind"] == "reference-program"
        assert cold.entry.key == compiled_key(
            cache_key(h.minilm(), SHAPE, BuildOptions()), ReferenceBackend()
        )
    finally:
        cold.release()
        cache.close()
    stages.clear()
    cache, warm = _admit(cache_root, stages)
    try:
        assert warm.cache_hit and warm.package_hit is None  # the package was not looked at
        assert stages == ["loaded", "placed"]
        assert warm.timings.build_ms == warm.timings.compile_ms == 0
        assert warm.entry == cold.entry and len(cache.ls()) == 2
    finally:
        warm.release()
        cache.close()


def test_compiled_form_runs_like_the_package_and_maps_its_weights(cache_root):
    cache, compiled = _admit(cache_root)
    try:
        with CompileCache(cache_root) as c:
            package = c.get(cache_key(h.minilm(), SHAPE, BuildOptions()))
        from_package = CompiledProgram(load_package_program(package.path / PACKAGE_NAME))
        func = program_ir.load(compiled.entry.path / ReferenceBackend.PROGRAM_DIR)
        mapped = [v for op in func.operations for v in op.outputs if v.mapped]
        assert sum(v.val.nbytes for v in mapped) > 40_000_000  # the weights, not copied
        assert all(not v.val.flags.writeable for v in mapped)
        seqs = [h.encode("a compiled form is a program")[: SHAPE.seq_len]]
        feeds = {
            "input_ids": np.zeros(SHAPE.dims, np.int32),
            "token_type_ids": np.zeros(SHAPE.dims, np.int32),
            "attention_mask": np.zeros(SHAPE.dims, np.int32),
        }
        feeds["input_ids"][0, : len(seqs[0])] = seqs[0]
        feeds["attention_mask"][0, : len(seqs[0])] = 1
        got = compiled.runner.run(feeds)
        want = from_package.run(feeds)
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    finally:
        compiled.release()
        cache.close()


def test_losing_a_kind_costs_only_its_stages(cache_root):
    with CompileCache(cache_root) as cache:
        compiled_digest = next(e.digest for e in cache.ls() if e.key["kind"] != PACKAGE_KIND)
        cache.evict(compiled_digest[:8])
        assert _kinds(cache) == [PACKAGE_KIND]
    stages: list[str] = []
    cache, again = _admit(cache_root, stages)
    try:
        # The package came from the cache: compiled again, nothing rebuilt.
        assert not again.cache_hit and again.package_hit is True
        assert stages == ["compiled", "loaded", "placed"]
        assert again.timings.build_ms == 0 and again.timings.compile_ms > 0
    finally:
        again.release()
        cache.close()


def test_saved_program_round_trips_small_constants_and_refuses_a_truncated_weights_file(
    cache_root, tmp_path
):
    cache, compiled = _admit(cache_root)
    try:
        src = compiled.entry.path / ReferenceBackend.PROGRAM_DIR
        func = program_ir.load(src)
        kinds = {
            type(v.val).__name__ for op in func.operations for v in op.outputs if v.val is not None
        }
        assert {"ndarray", "str"} <= kinds  # weights, scalars and strings (e.g. pad_type)
        assert all(
            v.val.ndim == 0
            for op in func.operations
            if op.op_type == "const"
            for v in op.outputs
            if isinstance(v.val, np.ndarray) and v.shape == ()
        )
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / program_ir.PROGRAM_NAME).write_bytes((src / program_ir.PROGRAM_NAME).read_bytes())
        (broken / program_ir.WEIGHTS_NAME).write_bytes(
            (src / program_ir.WEIGHTS_NAME).read_bytes()[:1000]
        )
        with pytest.raises(program_ir.ProgramFormatError, match="past the end"):
            program_ir.load(broken)
    finally:
        compiled.release()
        cache.close()


def test_saved_program_without_weights_keeps_every_large_constant_out_of_the_file(
    cache_root, tmp_path
):
    cache, compiled = _admit(cache_root)
    try:
        func = program_ir.load(compiled.entry.path / ReferenceBackend.PROGRAM_DIR)
        big = {v.name: (v.shape, v.dtype) for op in func.operations for v in op.outputs if v.mapped}
        assert big  # the model's weight matrices are mapped
        out = program_ir.save(func, tmp_path / "ops", weights=False)
        assert (out / program_ir.WEIGHTS_NAME).stat().st_size == 0
        structure = program_ir.load(out)
        kept = {v.name: v for op in structure.operations for v in op.outputs}
        for name, (shape, dtype) in big.items():
            assert kept[name].val is None and (kept[name].shape, kept[name].dtype) == (shape, dtype)
    finally:
        compiled.release()
        cache.close()


def test_gc_verify_and_ls_cover_both_kinds(cache_root):
    cache, held = _admit(cache_root)
    try:
        # A loaded (leased) compiled form survives gc to 0; its unleased package does not.
        report = cache.gc(0)
        assert report.skipped_leased == [held.entry.digest]
        assert _kinds(cache) == ["reference-program"]
        # ls through the CLI names the kind of every entry.
        out = subprocess.run(
            [sys.executable, "-m", "compile_cache", "ls", "--json", "--root", str(cache_root)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert [e["kind"] for e in json.loads(out.stdout)["entries"]] == ["reference-program"]
    finally:
        held.release()
    # A damaged compiled form is found by verify and evicted like any entry.
    weights = held.entry.path / ReferenceBackend.PROGRAM_DIR / program_ir.WEIGHTS_NAME
    weights.chmod(0o644)
    with open(weights, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = cache.verify()
    assert [c.digest for c in report.corrupt] == [held.entry.digest]
    assert "content changed" in report.corrupt[0].reasons[0]
    assert cache.ls() == []
    cache.close()
