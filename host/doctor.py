"""`synapse doctor`: what this machine can run, and why not where it cannot.

Never imports llama_cpp into the host (a subprocess asks it), and reports the Core ML runtime
honestly: on Linux coremltools can build and save packages but cannot compile or run them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import psutil

# Apple does not expose the Neural Engine's core count; every M-series chip so far has 16.
_ANE_CORES_BY_CHIP_PREFIX = {"Apple M1": 16, "Apple M2": 16, "Apple M3": 16, "Apple M4": 16}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _llama_cpp() -> dict:
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "reason": str(exc)}
    if proc.returncode != 0:
        return {"available": False, "reason": proc.stderr.strip()[-300:]}
    return {
        "available": True,
        "version": _version("llama_cpp_python"),
        "build_flags": proc.stdout.strip(),
    }


def _coreml() -> dict:
    info: dict = {"coremltools": _version("coremltools")}
    if sys.platform != "darwin":
        info.update(
            runtime=False,
            reason="Core ML runtime is macOS-only: packages are built and saved here, and run "
            "by the reference executor",
        )
        return info
    try:
        from coremltools import libcoremlpython  # noqa: F401
    except ImportError as exc:
        info.update(runtime=False, reason=f"coremltools has no native runtime: {exc}")
        return info
    info["runtime"] = True
    chip = _sysctl("machdep.cpu.brand_string") or ""
    info["chip"] = chip
    info["ane_cores"] = next(
        (n for prefix, n in _ANE_CORES_BY_CHIP_PREFIX.items() if chip.startswith(prefix)), None
    )
    return info


def _sysctl(name: str) -> str | None:
    try:
        return subprocess.run(
            ["sysctl", "-n", name], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except OSError:
        return None


def report() -> dict:
    # Late: the host imports nothing from workers at import time (only the wire contract).
    from workers.ane import apple_device
    from workers.ane.config import ENV_COMPUTE_UNITS

    coreml = _coreml()
    backends = ["reference"] + (["coreml"] if coreml.get("runtime") else [])
    return {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "llama_cpp": _llama_cpp(),
        "coreml": coreml,
        "ane_backends": backends,
        # chip, macOS version/build, Neural Engine presence: None off macOS, with the reason.
        "apple": apple_device.describe(),
        "coreml_compute_units": os.environ.get(ENV_COMPUTE_UNITS) or "cpu_and_ne",
    }


def main(as_json: bool) -> int:
    data = report()
    if as_json:
        print(json.dumps(data))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("check", "result", show_header=False)
    table.add_row("system", f"{data['os']} {data['machine']}, Python {data['python']}")
    table.add_row("cpus / memory", f"{data['cpus']} / {data['memory_gib']} GiB")
    llama = data["llama_cpp"]
    table.add_row(
        "llama.cpp",
        f"llama-cpp-python {llama['version']}: {llama['build_flags']}"
        if llama["available"]
        else f"unavailable: {llama['reason']}",
    )
    cm = data["coreml"]
    table.add_row(
        "Core ML runtime",
        f"yes ({cm.get('chip')}, ANE cores {cm.get('ane_cores')})"
        if cm.get("runtime")
        else f"no — {cm['reason']}",
    )
    table.add_row("coremltools", str(cm["coremltools"]))
    table.add_row("ANE lane backends", ", ".join(data["ane_backends"]))
    apple = data["apple"]
    table.add_row(
        "Neural Engine",
        f"{'present' if apple['neural_engine'] else 'absent'} ({apple['chip']}, macOS "
        f"{apple['macos']} {apple['macos_build']})" if apple["reason"] is None
        else f"unknown — {apple['reason']}",
    )
    table.add_row("Core ML compute units", data["coreml_compute_units"])
    Console().print(table)
    return 0
