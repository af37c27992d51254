"""bench.kernels against real processes: every bench side gets the OpenBLAS kernels our llama
workers choose, and the report of what another process runs is read from that process (its
mapped library and the environment it was started with), checked against the process's own
answer from inside."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from bench import kernels
from workers.llama import openblas_core as oc

AVX512 = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc and OpenBLAS are Linux's here"
)
needs_openblas = pytest.mark.skipif(oc.library() is None, reason="no system OpenBLAS")

# A process that loads the system OpenBLAS, says from inside which kernels it picked, and
# waits until its stdin closes.
_CHILD = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    lib = ctypes.CDLL(ctypes.util.find_library("openblas"))
    lib.openblas_get_corename.restype = ctypes.c_char_p
    print(lib.openblas_get_corename().decode(), flush=True)
    sys.stdin.read()
""")


def _spawn(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != kernels.ENV}


@linux_only
@needs_openblas
def test_another_process_is_reported_as_it_runs():
    """Two children started with different OPENBLAS_CORETYPE: each report names what that
    child itself says it loaded, whatever this process runs on."""
    library_name = os.path.basename(os.path.realpath(oc.library() or ""))
    children = []
    try:
        for coretype in (None, "Sandybridge"):
            env = _base_env()
            if coretype:
                env[kernels.ENV] = coretype
            proc, inside = _spawn(env)
            children.append(proc)
            report = kernels.process_kernels(proc.pid)
            assert report["pid"] == proc.pid and report["OPENBLAS_CORETYPE"] == coretype
            system = {k: v for k, v in report["openblas"].items() if "scipy" not in k}
            assert list(system.values()) == [inside], (report, inside, library_name)
        first, second = (kernels.process_kernels(p.pid) for p in children)
        if first["openblas"] != second["openblas"]:  # the override changed the kernels
            assert not kernels.agree({"a": first, "b": second})
        assert kernels.agree({"a": second, "b": [second, second]})
    finally:
        for proc in children:
            proc.communicate("")


@linux_only
@needs_openblas
@pytest.mark.parametrize("bench", ["bench.serve", "bench.batch", "bench.ane"])
def test_a_bench_gives_its_own_process_and_its_children_the_workers_kernels(bench):
    """In a fresh interpreter started WITHOUT OPENBLAS_CORETYPE (as a user runs a bench):
    importing the bench makes the workers' choice before OpenBLAS loads, so the in-process
    engine (llama_cpp's BLAS backend) and every process the bench starts (a peer server, the
    workers, ceiling shards) run the kernels our workers get, never the fallback the rule
    replaces. bench.serve used to measure its ceiling and llama-cpp-python's server without it."""
    code = textwrap.dedent(f"""
        import json, subprocess, sys
        import {bench}
        import llama_cpp  # loads the system OpenBLAS through ggml's BLAS backend
        from bench import kernels
        child = subprocess.Popen([sys.executable, "-c", {_CHILD!r}],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        inside = child.stdout.readline().strip()
        print(json.dumps({{"self": kernels.process_kernels(),
                          "child": kernels.process_kernels(child.pid), "inside": inside}}))
        child.communicate("")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], env=_base_env(), capture_output=True, text=True, check=True
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    expected = oc.choose(oc.corename(oc.library() or ""), oc.this_cpu_flags(), {})
    for side in ("self", "child"):
        report = found[side]
        for lib, family in report["openblas"].items():
            assert oc.choose(family, oc.this_cpu_flags(), {}) is None, (side, lib, family)
        if expected is not None:  # the rule names kernels here: every side carries them
            assert report["OPENBLAS_CORETYPE"] == expected, (side, report)
    child_system = [v for k, v in found["child"]["openblas"].items() if "scipy" not in k]
    assert child_system == [found["inside"]]
    assert kernels.agree({"self": found["self"], "child": found["child"]})


def test_reports_read_proc_text_as_the_kernel_writes_it():
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/openblas-pthread/"
        "libopenblas.so.0\n"
        "7f10-7f20 r--p 00000000 08:01 124 /venv/numpy.libs/libscipy_openblas64_-ff651d7f.so\n"
        "7f20-7f30 r--p 00000000 08:01 125 /usr/lib/libc.so.6\n"
        "7f30-7f40 rw-p 00000000 00:00 0 \n"
        "7f40-7f50 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/openblas-pthread/"
        "libopenblas.so.0\n"
    )
    assert kernels.openblas_libraries(maps) == [
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/venv/numpy.libs/libscipy_openblas64_-ff651d7f.so",
    ]
    env = kernels.parse_environ(b"A=1\0OPENBLAS_CORETYPE=SkylakeX\0EMPTY=\0junk\0B=x=y\0")
    assert env == {"A": "1", "OPENBLAS_CORETYPE": "SkylakeX", "EMPTY": "", "B": "x=y"}
    assert kernels.is_llama_worker(["/venv/bin/python", "-m", "workers.llama", "--socket", "s"])
    assert not kernels.is_llama_worker(["python", "-m", "llama_cpp.server"])
    # A user's own choice is what a worker (and any process) loads under.
    assert kernels.start_coretype({kernels.ENV: "Haswell"}, llama_worker=True) == "Haswell"
    assert kernels.start_coretype({}, llama_worker=False) is None


@linux_only
@needs_openblas
@pytest.mark.model  # starts a llama worker
async def test_the_watch_reads_a_live_llama_worker(short_runtime_dir):
    """bench.batch's job side: a llama worker this process starts is read while it lives, and
    runs what this process (the ceiling's engine, same rule) runs."""
    from host import HostConfig, Lane, LaneConfig

    lane = Lane(
        LaneConfig(lane_id="watched", argv=["python", "-m", "workers.llama"]),
        HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    with kernels.WorkerWatch(interval_s=0.1) as watch:
        try:
            await lane.start()  # HELLO: the engine is built, llama_cpp (and OpenBLAS) loaded
            pid = lane.state().pid
            for _ in range(50):
                if watch.seen:
                    break
                await asyncio.sleep(0.1)
        finally:
            await lane.stop()
    assert [r["pid"] for r in watch.seen] == [pid]
    (report,) = watch.seen
    assert report["openblas"], report
    for lib, family in report["openblas"].items():
        assert oc.choose(family, oc.this_cpu_flags(), {}) is None, (lib, family)
    assert report["OPENBLAS_CORETYPE"] == os.environ.get(kernels.ENV)  # conftest's choice


@pytest.mark.parametrize(
    "environ, flags, kept",
    [
        ({kernels.ENV: "Haswell"}, AVX512, None),  # held the CPU back: dropped
        ({kernels.ENV: "Haswell", kernels.INHERIT: "inherit"}, AVX512, "Haswell"),
        ({kernels.ENV: "SkylakeX"}, AVX512, "SkylakeX"),  # the CPU's own: kept
        ({kernels.ENV: "Haswell"}, {"avx", "avx2", "fma"}, "Haswell"),
        ({kernels.ENV: "NoSuchCore"}, AVX512, "NoSuchCore"),  # unjudged: kept
        ({}, AVX512, None),
    ],
)
def test_an_inherited_value_older_than_the_cpu_is_dropped(environ, flags, kept):
    env = dict(environ)
    note = kernels.drop_held_back(env, flags)
    assert env.get(kernels.ENV) == kept
    assert (note is not None) == (kept is None and kernels.ENV in environ)
    if note is not None:
        assert f"{kernels.ENV}={environ[kernels.ENV]} dropped" in note


@linux_only
@needs_openblas
@pytest.mark.parametrize("inherit", [False, True])
def test_a_bench_started_under_a_held_back_value_runs_the_cpu_kernels(inherit):
    """A fresh interpreter started with OPENBLAS_CORETYPE=Sandybridge (AVX only): importing
    bench.kernels drops it when this CPU runs better, so the bench process and its children
    load what the workers' rule gives without it; SYNAPSE_BENCH_OPENBLAS=inherit keeps it."""
    better = oc.held_back("Sandybridge", oc.this_cpu_flags())
    if better is None:
        pytest.skip("this CPU runs nothing newer than AVX kernels")
    env = {**_base_env(), kernels.ENV: "Sandybridge"}
    env.pop(kernels.INHERIT, None)
    if inherit:
        env[kernels.INHERIT] = "inherit"
    code = textwrap.dedent(f"""
        import json, subprocess, sys
        from bench import kernels
        child = subprocess.Popen([sys.executable, "-c", {_CHILD!r}],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        inside = child.stdout.readline().strip()
        print(json.dumps({{"choice": kernels.CHOICE, "inside": inside,
                          "child": kernels.process_kernels(child.pid)}}))
        child.communicate("")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if inherit:
        assert found["child"]["OPENBLAS_CORETYPE"] == "Sandybridge"
        assert found["inside"].lower() == "sandybridge"
    else:
        assert "Sandybridge dropped" in found["choice"]
        expected = oc.choose(oc.corename(oc.library() or ""), oc.this_cpu_flags(), {})
        assert found["child"]["OPENBLAS_CORETYPE"] == expected
        assert oc.held_back(found["inside"], oc.this_cpu_flags()) is None, found


@linux_only
def test_a_process_that_already_loaded_openblas_keeps_the_inherited_value():
    """This test process loaded numpy's OpenBLAS under its environment: a drop now would run
    the processes it starts on other kernels than its own, so nothing is dropped."""
    import numpy  # noqa: F401  (maps its OpenBLAS, if not yet)

    assert kernels._openblas_loaded_here()
    env = {kernels.ENV: "Sandybridge"}
    line = kernels.match_workers(env)
    assert env == {kernels.ENV: "Sandybridge"} and "dropped" not in line
