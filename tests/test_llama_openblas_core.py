"""workers.llama.openblas_core: which OpenBLAS kernels the llama worker runs on, and why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.llama import openblas_core as oc

SAPPHIRE = {
    "sse3",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512cd",
    "amx_tile",
}
ZEN3 = {"sse3", "avx", "avx2", "fma", "f16c"}
linux_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or oc.library() is None,
    reason="needs Linux with a system OpenBLAS (macOS builds use Accelerate)",
)


@pytest.mark.parametrize(
    "detected, flags, env, want",
    [
        ("Prescott", SAPPHIRE, {}, "SkylakeX"),  # Debian 12's 0.3.21 on a model 207 Xeon
        ("Nehalem", ZEN3, {}, "Haswell"),
        ("Core2", {"sse3", "avx"}, {}, "Sandybridge"),
        ("Prescott", {"sse3", "ssse3"}, {}, None),  # nothing better to name
        ("SkylakeX", SAPPHIRE, {}, None),  # a library that knows the CPU is left alone
        ("Zen", ZEN3, {}, None),
        ("Prescott", SAPPHIRE, {"OPENBLAS_CORETYPE": "Haswell"}, None),  # the user's wins
        (None, SAPPHIRE, {}, None),  # no library pick read: change nothing
    ],
)
def test_the_rule(detected, flags, env, want):
    assert oc.choose(detected, flags, env) == want


@pytest.mark.parametrize(
    "coretype, flags, want",
    [
        ("Haswell", SAPPHIRE, "SkylakeX"),  # a machine-wide Haswell on an AVX-512 CPU
        ("zen", SAPPHIRE, "SkylakeX"),  # OpenBLAS's Zen runs the Haswell kernels
        ("Prescott", ZEN3, "Haswell"),
        ("Sandybridge", ZEN3, "Haswell"),
        ("Haswell", ZEN3, None),  # what the CPU runs at best
        ("Cooperlake", SAPPHIRE, None),
        ("SkylakeX", ZEN3, None),  # newer than the CPU: not ours to judge here
        ("NoSuchCore", SAPPHIRE, None),  # a name not ranked is left unjudged
        ("Haswell", {"sse3"}, None),
    ],
)
def test_a_user_value_that_holds_the_cpu_back(coretype, flags, want):
    assert oc.held_back(coretype, flags) == want


def test_avx512_needs_every_skylakex_flag():
    assert oc.best_coretype(SAPPHIRE - {"avx512vl"}) == "Haswell"


def test_flags_come_from_the_flags_line():
    assert oc.cpu_flags("processor\t: 0\nflags\t\t: fpu avx2 fma\n") == {"fpu", "avx2", "fma"}
    assert oc.cpu_flags("no flags here\n") == set()


def test_a_user_setting_is_kept_and_reported():
    env = {"OPENBLAS_CORETYPE": "Haswell"}
    line = oc.apply(env)
    assert env == {"OPENBLAS_CORETYPE": "Haswell"}
    if sys.platform.startswith("linux"):
        assert "set by the user" in line
        better = oc.held_back("Haswell", oc.this_cpu_flags())
        # Kept, but the line says what the CPU could run instead.
        assert (f"this CPU runs {better} kernels" in line) == (better is not None), line


@linux_openblas
def test_this_machine_gets_the_kernels_its_flags_support():
    lib = oc.library()
    detected = oc.corename(lib)
    assert detected, "the probe read no core name from the system OpenBLAS"
    env: dict[str, str] = {}
    line = oc.apply(env)
    pick = oc.choose(detected, oc.this_cpu_flags(), {})
    if pick is None:
        assert env == {} and detected in line
    else:  # the library loads exactly the named kernels with the override
        assert env == {"OPENBLAS_CORETYPE": pick}
        assert oc.corename(lib, pick).lower() == pick.lower()
        assert f"the library's own pick was {detected}" in line


@linux_openblas
def test_a_name_the_library_does_not_know_is_not_kept():
    lib = oc.library()
    assert oc.corename(lib, "NoSuchCore").lower() != "nosuchcore"


@pytest.mark.model
@linux_openblas
def test_the_worker_process_decides_before_llama_cpp_loads():
    # A real worker process with nothing to connect to: it logs its kernel choice (made
    # before the engine import loads OpenBLAS), then fails to connect.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.llama",
            "--socket",
            "/nonexistent/s.sock",
            "--nonce",
            "0" * 32,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if "openblas:" in ln]
    assert len(lines) == 1, done.stderr[-2000:]
    pick = oc.choose(oc.corename(oc.library()), oc.this_cpu_flags(), {})
    if pick is not None:
        assert f"OPENBLAS_CORETYPE={pick}" in lines[0]
