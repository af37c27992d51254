"""The host process never imports llama_cpp: an abort-capable engine lives only in workers."""

from __future__ import annotations

import ast
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
        [sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout.strip().splitlines()[-1])  # a printed list of module names
    assert not [m for m in loaded if m.startswith("llama_cpp")]
    # The host may use the wire contract, and nothing else from workers.
    assert all(m == "workers" or m.startswith("workers.protocol") for m in loaded), loaded


def _certification_imports(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):  # late imports inside functions count too
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n == "certification" or n.startswith("certification.") for n in names):
            lines.append(node.lineno)
    return lines


def test_host_never_imports_certification_except_the_cli():
    """The dependency runs host <- certification: the Module gets its LanePolicy from the
    composition root (host/cli.py), so there is no import cycle to break at run time."""
    offenders = {
        str(p.relative_to(ROOT)): lines
        for p in sorted((ROOT / "host").rglob("*.py"))
        if p != ROOT / "host" / "cli.py" and (lines := _certification_imports(p))
    }
    assert offenders == {}
    code = "import host.module, host.serve.app, host.doctor, sys; " \
           "print(sorted(m for m in sys.modules if m.startswith('certification')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
