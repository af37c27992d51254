"""A worker's start never races its imports: a slow engine import happens during LOAD, whose
window is long, never before HELLO, whose window is short.

Real processes: the faulty worker with a library whose import really takes longer than the
host's HELLO window, imported during LOAD (starts and serves) or before HELLO (missed window,
the failure the fix removes); and the Core ML worker, whose HELLO must not import coremltools
and whose process keeps coremltools from importing torch / scikit-learn."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from host import HostConfig, Lane, LaneConfig
from host.errors import EngineCrashed
from tests import test_ane_helpers as h
from workers.protocol import messages as m

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

# The window holds an interpreter's start with room to spare on a loaded 2-core machine (the
# suite runs in two processes); the import alone outlasts it.
HELLO_S = 2.0
IMPORT_S = 4.0


def _lane(runtime_dir: str, *extra: str) -> Lane:
    argv = ["python", "-m", "workers.faulty", "--import-s", str(IMPORT_S), *extra]
    host = HostConfig(
        runtime_dir=runtime_dir,
        hello_timeout_s=HELLO_S,
        control_window_s=30,
        ping_interval_s=0,
        quarantine_s=60,
    )
    return Lane(LaneConfig(lane_id="slow-import", argv=argv), host)


async def test_engine_import_slower_than_the_hello_window_runs_in_load(short_runtime_dir):
    lane = _lane(short_runtime_dir)
    try:
        await lane.start()  # HELLO from cheap state, well inside the window
        load = m.LOAD(
            req_id=0,
            artifact_path="-",
            artifact_digest="-",
            format="echo",
            runtime_config={"model_ref": "echo"},
        )
        loaded, _ = await lane.request(load)  # the slow import happens here
        assert isinstance(loaded, m.LOADED)
        req = m.EMBED_BATCH(req_id=0, model_ref="echo", items=[m.EmbedItem(id=0, n_tokens=3)])
        reply, vectors = await lane.request(req, np.array([1, 2, 3], np.int32))
        assert reply.n == 1 and vectors.reshape(-1)[:2].tolist() == [6.0, 3.0]
        assert lane.state().strikes == 0
    finally:
        await lane.stop()


async def test_the_same_import_before_hello_misses_the_window(short_runtime_dir):
    lane = _lane(short_runtime_dir, "--import-at-start")
    try:
        with pytest.raises(EngineCrashed) as info:
            await lane.start()
        assert "did not connect" in info.value.message
        assert lane.state().strikes == 1
    finally:
        await lane.stop()


def test_ane_worker_hello_imports_no_coremltools_and_coremltools_skips_torch(tmp_path):
    """In a fresh interpreter, as `python -m workers.ane` runs: build the engine and its HELLO
    fields, then import coremltools and convert a program with the frameworks blocked."""
    code = textwrap.dedent(f"""
        import json, sys
        from workers.ane.import_guard import block_converter_frameworks
        block_converter_frameworks()
        from workers.ane.__main__ import _factory
        engine = _factory(["--artifact", {str(h.minilm().dir)!r}, "--backend", "reference"])
        hello = {{"info": engine.info().version, **engine.hello_extras()}}
        at_hello = "coremltools" in sys.modules
        from workers.ane.ct_quiet import Function, Program, ct, mb, types
        from coremltools import _deps
        with Function({{"x": mb.placeholder(shape=(1, 4), dtype=types.fp32)}},
                      ct.target.macOS14) as f:
            f.set_outputs([mb.relu(x=f.inputs["x"], name="y")])
        prog = Program()
        prog.add_function("main", f)
        from workers.ane.builder import convert_and_save
        convert_and_save(prog, {str(tmp_path)!r})
        print(json.dumps({{"hello": hello, "coremltools_at_hello": at_hello,
                          "has_torch": _deps._HAS_TORCH, "has_sklearn": _deps._HAS_SKLEARN,
                          "torch_loaded": sys.modules.get("torch") is not None}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["coremltools_at_hello"] is False
    assert got["hello"]["manifest_digest"] == h.minilm().digest
    assert got["hello"]["kernel_revision"] and "coremltools-" in got["hello"]["info"]
    assert got["has_torch"] is False and got["has_sklearn"] is False
    assert got["torch_loaded"] is False
    assert (tmp_path / "model.mlpackage").is_dir()  # coremltools still converts
