"""The host process never imports llama_cpp: an abort-capable engine lives only in workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = """
import importlib, pkgutil, sys
import host
for info in pkgutil.walk_packages(host.__path__, "host."):
    importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("llama_cpp", "workers")))
"""


def test_importing_every_host_module_pulls_in_no_engine():
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout.strip().splitlines()[-1])  # a printed list of module names
    assert not [m for m in loaded if m.startswith("llama_cpp")]
    # The host may use the wire contract and the standard-library CPU count, nothing else.
    assert all(
        m in ("workers", "workers.cpus") or m.startswith("workers.protocol") for m in loaded
    ), loaded


def test_serving_imports_no_certification_until_a_policy_is_built():
    """The dependency runs host <- certification (tests/test_layout.py checks the imports):
    every entry point builds its Module with certification.modules.build_module when it runs
    (the app at start-up, a CLI command when it serves), so importing the serving stack
    loads no certification code."""
    code = (
        "import host.module, service.app, cli.doctor, sys; "
        "print(sorted(m for m in sys.modules if m.startswith('certification')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
