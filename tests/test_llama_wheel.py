"""scripts/llama_wheel.py: which llama-cpp-python build a machine gets, and where it is kept."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("llama_wheel", ROOT / "scripts" / "llama_wheel.py")
assert _spec is not None and _spec.loader is not None
llama_wheel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama_wheel)


def test_pinned_version_is_the_one_pyproject_pins() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    version = llama_wheel.pinned_version()
    assert f'"llama-cpp-python=={version}"' in text
    # every pin of llama-cpp-python (the bench extra's [server] too) names that version
    assert set(re.findall(r'llama-cpp-python(?:\[\w+\])?==([^"]+)"', text)) == {version}


@pytest.mark.parametrize(
    ("system", "openblas", "env", "expected"),
    [
        ("Linux", True, None, ("openblas", llama_wheel.OPENBLAS_ARGS)),
        ("Linux", False, None, ("cpu", "")),
        ("Linux", True, "0", ("cpu", "-DGGML_BLAS=OFF")),
        ("Darwin", False, None, ("metal-accelerate", "")),  # llama.cpp's own Apple default
        # Without BLAS an Apple build still has Metal: the name says so, never "cpu".
        ("Darwin", False, "0", ("metal", "-DGGML_BLAS=OFF")),
        ("Windows", True, None, ("cpu", "")),
    ],
)
def test_flavour(system, openblas, env, expected) -> None:
    assert llama_wheel.flavour(system, openblas, env) == expected


def test_wheel_dir_names_version_flavour_python_and_machine(monkeypatch, tmp_path) -> None:
    # pip's cache is keyed by the source archive, not the build flags: each flavour gets its
    # own directory so a build without BLAS is never handed back for one with it.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = llama_wheel.wheel_dir("0.3.36", "openblas")
    b = llama_wheel.wheel_dir("0.3.36", "cpu")
    assert a != b and a.parent == b.parent == tmp_path / "synapse" / "wheels"
    assert "0.3.36-openblas-cp3" in a.name


def test_the_wheel_dir_names_the_cpu_it_was_built_for(monkeypatch, tmp_path) -> None:
    # A native build (GGML_NATIVE) may use every instruction its CPU has: another CPU must
    # get its own wheel, never one that can die with SIGILL there.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    epyc = llama_wheel.cpu_tag(
        llama_wheel.features_from_cpuinfo(
            "processor : 0\nflags : fpu sse2 avx2 avx512f\nprocessor : 1\nflags : fpu"
        )
    )
    haswell = llama_wheel.cpu_tag(llama_wheel.features_from_cpuinfo("flags\t: avx2 sse2 fpu"))
    assert epyc != haswell and len(epyc) == 12
    assert llama_wheel.wheel_dir("0.3.36", "openblas", epyc) != llama_wheel.wheel_dir(
        "0.3.36", "openblas", haswell
    )
    assert llama_wheel.wheel_dir("0.3.36", "openblas", epyc).name.endswith("-" + epyc)
    # Order and repeats of the flags do not matter; ARM's "Features" line counts the same.
    assert llama_wheel.features_from_cpuinfo("flags : b a a") == "a b"
    assert llama_wheel.features_from_cpuinfo("Features\t: fp asimd") == "asimd fp"
    if sys.platform.startswith("linux"):  # this machine's own flags are read, sorted
        here = llama_wheel.cpu_features("Linux").split()
        assert here and here == sorted(set(here))
        assert {"fpu", "fp"} & set(here)  # x86's "fpu", ARM's "fp": every CPU lists one


def test_cpu_tag_command_prints_this_machines_tag() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "llama_wheel.py"), "--cpu-tag"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert out == llama_wheel.cpu_tag(llama_wheel.cpu_features())
