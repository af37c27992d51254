"""scripts/llama_wheel.py: which llama-cpp-python build a machine gets, and where it is kept."""

from __future__ import annotations

import importlib.util
import re
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
        ("Darwin", False, None, ("accelerate", "")),  # llama.cpp's own Apple default
        ("Darwin", False, "0", ("cpu", "-DGGML_BLAS=OFF")),
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
