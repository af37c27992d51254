"""The code runs on macOS too: every module imports, Linux-only APIs sit behind a platform
check whose fallback works (exercised here for real), and worker socket paths fit macOS's
104-byte sun_path under a long $TMPDIR. The macOS CI job runs the rest of the suite there."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil
import pytest

from host import HostConfig, Lane, LaneConfig
from host import listener as listener_mod
from host.listener import socket_path
from workers import runtime
from workers.cpus import usable_cpu_count
from workers.protocol import messages as m

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("host", "workers", "formats", "compile_cache", "certification", "bench")

# Names (attributes / identifiers) and path prefixes (string literals) only Linux has.
LINUX_NAMES = {
    "sched_getaffinity",
    "sched_setaffinity",
    "prctl",
    "SO_PEERCRED",
    "pidfd_open",
    "memfd_create",
    "posix_fadvise",
    "eventfd",
    "epoll",
}
LINUX_PATHS = ("/proc/", "/sys/")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_module_imports():
    """Every module imports; off macOS only a macOS adapter may refuse, saying so."""
    modules = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in _sources()
        if p.name != "__main__.py"  # entry points run on import
    ]
    code = (
        "import importlib, json, sys\n"
        "refused = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        refused[name] = str(exc)\n"
        "print(json.dumps(refused))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *modules],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    refused = json.loads(out.stdout.strip().splitlines()[-1])
    if sys.platform == "darwin":
        assert refused == {}
    else:
        assert all("needs macOS" in why for why in refused.values()), refused


def _is_guard(test: ast.expr, what: str) -> bool:
    """A platform check: `sys.platform ...`, `platform.system() ...`, or `hasattr(x, "what")`."""
    for node in ast.walk(test):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "platform"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "system"
            and getattr(node.func.value, "id", "") == "platform"
        ):
            return True
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "hasattr"
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == what
        ):
            return True
    return False


def _linux_only_uses(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in LINUX_NAMES:
            uses.append((node, node.attr))
        elif isinstance(node, ast.Name) and node.id in LINUX_NAMES:
            uses.append((node, node.id))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(LINUX_PATHS)
        ):
            uses.append((node, node.value))
    return uses


def _early_exit_before(parent: ast.AST, stmt: ast.AST, what: str) -> bool:
    """`if <platform check>: return/raise` earlier in the same block as `stmt`."""
    for field in ("body", "orelse", "finalbody"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and stmt in block:
            return any(
                isinstance(s, ast.If)
                and _is_guard(s.test, what)
                and isinstance(s.body[-1], ast.Return | ast.Raise)
                for s in block[: block.index(stmt)]
            )
    return False


def unguarded_linux_apis(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node, what in _linux_only_uses(tree):
        cur, guarded = node, False
        while cur in parents and not guarded:
            parent = parents[cur]
            # Guarded = in the body of an `if` / conditional expression whose test checks
            # the platform (not in its else branch, and not in the test itself), or after
            # an early `if <platform check>: return` in the same block.
            if isinstance(parent, ast.If | ast.IfExp) and cur is not parent.test:
                body = parent.body if isinstance(parent.body, list) else [parent.body]
                guarded = cur in body and _is_guard(parent.test, what)
            guarded = guarded or _early_exit_before(parent, cur, what)
            cur = parent
        if not guarded:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {what}")
    return found


def test_the_scan_catches_an_unguarded_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os, sys\nn = len(os.sched_getaffinity(0))\n"
        "if sys.platform == 'linux':\n    f = open('/proc/self/statm')\n"
        "else:\n    g = open('/proc/cpuinfo')\n"
        "def ok():\n    if sys.platform != 'linux':\n        return 0\n"
        "    return open('/proc/meminfo')\n"
        "def not_ok():\n    if sys.platform != 'linux':\n        print()\n"
        "    return open('/proc/meminfo')\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert unguarded_linux_apis(bad) == [
            "bad.py:2 sched_getaffinity",
            "bad.py:6 /proc/cpuinfo",
            "bad.py:14 /proc/meminfo",
        ]
    finally:
        ROOT = saved


def test_linux_only_apis_sit_behind_a_platform_check():
    offenders = [hit for p in _sources() for hit in unguarded_linux_apis(p)]
    assert offenders == []


# ---- the fallbacks, exercised for real on Linux ---------------------------------------------


def test_cpu_count_fallback(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert usable_cpu_count() == (os.cpu_count() or 1)


def test_rss_fallback_agrees_with_statm(monkeypatch):
    fast = runtime._rss_mb()
    monkeypatch.setattr(runtime, "_STATM", None)  # as where /proc does not exist
    slow = runtime._rss_mb()
    assert slow == pytest.approx(psutil.Process().memory_info().rss / 2**20, rel=0.05)
    assert fast == pytest.approx(slow, rel=0.05)


@pytest.fixture
def long_tmpdir(monkeypatch):
    """A real 60-character $TMPDIR (hosted macOS runners have ~50), no XDG_RUNTIME_DIR."""
    base = tempfile.mkdtemp(prefix="t", dir="/tmp")
    path = Path(base + "/" + "x" * (60 - len(base) - 1))
    path.mkdir()
    assert len(str(path)) == 60
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    yield path
    subprocess.run(["rm", "-rf", base], check=False)


def test_socket_path_fits_macos_under_a_long_tmpdir(long_tmpdir, monkeypatch):
    monkeypatch.setattr(listener_mod, "SUN_PATH_MAX", 104)  # macOS's sun_path
    runtime_dir = HostConfig().resolved_runtime_dir()
    assert str(runtime_dir).startswith(str(long_tmpdir))
    longest = "l" * 48 + "-99999"  # a 48-character lane id, generation 99999
    path = socket_path(runtime_dir, longest)
    assert len(os.fsencode(str(path))) < 104, path
    assert socket_path(runtime_dir, "t-1") == runtime_dir / "synapse" / "workers" / "t-1.sock"
    assert socket_path(runtime_dir, longest) != socket_path(runtime_dir, "l" * 48 + "-99998")


async def test_a_lane_starts_with_macos_limits_and_without_peer_credentials(
    long_tmpdir, monkeypatch
):
    """A real worker under the long $TMPDIR with macOS's sun_path limit, and with the Linux
    peer-credential call absent (the fallback: nonce + private 0700 directory)."""
    monkeypatch.setattr(listener_mod, "SUN_PATH_MAX", 104)
    monkeypatch.delattr(socket, "SO_PEERCRED", raising=False)
    assert listener_mod.peer_credentials(socket.socket(socket.AF_UNIX)) is None
    lane = Lane(
        LaneConfig(lane_id="p" * 48, argv=["python", "-m", "workers.faulty"]),
        HostConfig(ping_interval_s=0, hello_timeout_s=30),
    )
    await lane.start()
    try:
        req = m.EMBED_BATCH(req_id=0, model_ref="echo", items=[m.EmbedItem(id=0, n_tokens=3)])
        _, vectors = await lane.request(req, np.array([1, 2, 3], np.int32), deadline_s=30)
        assert vectors.shape[0] == 1
    finally:
        await lane.stop()
