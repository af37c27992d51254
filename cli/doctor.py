"""`synapse doctor`: what this machine can run, and why not where it cannot.

Never imports llama_cpp into the host (a subprocess asks it), and reports the Core ML runtime
honestly: on Linux coremltools can build and save packages but cannot compile or run them.
Also: the chip, the macOS version (None elsewhere), whether llama.cpp offloads to a GPU and
to which device, and which lane would serve each installed model and why (the lane policy
the CLI hands in; no worker is started).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import psutil


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# Run in a child process: the host never loads llama.cpp. The build flags are exactly what a
# llama worker's HELLO says (backends and, last, the device a LOAD with gpu_layers "auto" uses,
# env override included), read back with the host's own `hello_device`.
_LLAMA_PROBE = """
import json, llama_cpp
from workers.llama.device import env_gpu_layers
from workers.llama.engine import LlamaEngine
flags = LlamaEngine().info().build_flags
offload = bool(llama_cpp.llama_supports_gpu_offload())
try:
    env = env_gpu_layers()
except ValueError as exc:
    env = str(exc)
print(json.dumps({"build_flags": flags, "gpu_offload": offload, "gpu_layers_env": env}))
"""


def _llama_cpp() -> dict:
    code = _LLAMA_PROBE
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "reason": str(exc)}
    if proc.returncode != 0:
        return {"available": False, "reason": proc.stderr.strip()[-300:]}
    from host.module import hello_device  # late, as the Module import below
    from workers.llama import openblas_core

    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "available": True,
        "version": _version("llama_cpp_python"),
        "device": hello_device(probe["build_flags"]) or "cpu",
        # The OpenBLAS kernels a CPU worker will run and why: the workers' own rule and log
        # line, on a copy of this environment (a user's OPENBLAS_CORETYPE that holds the CPU
        # back is kept, and the line says so).
        "openblas": openblas_core.apply(dict(os.environ)),
        **probe,
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
    return info


def _sysctl(name: str) -> str | None:
    try:
        return subprocess.run(
            ["sysctl", "-n", name], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except OSError:
        return None


def chip() -> str:
    """The processor's marketing name ("Apple M2 Pro", "Intel(R) Xeon(R) ...")."""
    if sys.platform == "darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.machine()
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.partition(":")[2].strip()
        except OSError:
            pass
    return platform.processor() or platform.machine()


def macos_version() -> str | None:
    """`sw_vers -productVersion`, as certificates record it (see workers.ane.apple_device)."""
    from workers.ane import apple_device

    return apple_device.macos_version()


def neural_engine() -> dict:
    """Presence and core count as Core ML lists them (None off macOS, with the source)."""
    # Late: the host imports nothing from workers at import time (only the wire contract).
    from workers.ane import apple_device

    present, cores = apple_device.neural_engine()
    return {
        "present": present,
        "cores": cores,
        "source": "not macOS"
        if sys.platform != "darwin"
        else "MLComputeDevice.get_all_compute_devices",
    }


def lane_choices(llama_device: str | None) -> dict[str, dict]:
    """Which lane would serve each installed model and why, without starting a worker."""
    from certification.modules import build_module
    from host.module import ModuleConfig

    mod = build_module(ModuleConfig())
    mod.llama_device = llama_device
    return {r.name: mod.default_lane(r.name).to_dict() for r in mod.store.ls()}


def report() -> dict:
    from workers.ane import apple_device  # late, as above
    from workers.ane.config import ENV_COMPUTE_UNITS

    coreml = _coreml()
    backends = ["reference"] + (["coreml"] if coreml.get("runtime") else [])
    llama = _llama_cpp()
    return {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "chip": chip(),
        "macos_version": macos_version(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "llama_cpp": llama,
        "coreml": coreml,
        "neural_engine": neural_engine(),
        "ane_backends": backends,
        # chip, macOS version/build, Neural Engine presence: None off macOS, with the reason.
        "apple": apple_device.describe(),
        "coreml_compute_units": os.environ.get(ENV_COMPUTE_UNITS) or "cpu_and_ne",
        "lanes": lane_choices(llama.get("device")),
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
    table.add_row("chip / macOS", f"{data['chip']} / {data['macos_version'] or 'not macOS'}")
    table.add_row("cpus / memory", f"{data['cpus']} / {data['memory_gib']} GiB")
    llama = data["llama_cpp"]
    table.add_row(
        "llama.cpp",
        f"llama-cpp-python {llama['version']}: {llama['build_flags']}"
        if llama["available"]
        else f"unavailable: {llama['reason']}",
    )
    if llama["available"]:
        table.add_row(
            "llama.cpp GPU offload",
            f"{'yes' if llama['gpu_offload'] else 'no'}; lanes run on {llama['device']}"
            + (
                f" (SYNAPSE_LLAMA_GPU_LAYERS: {llama['gpu_layers_env']})"
                if llama["gpu_layers_env"] is not None
                else ""
            ),
        )
        table.add_row("llama.cpp OpenBLAS", llama["openblas"])
    ne, apple, cm = data["neural_engine"], data["apple"], data["coreml"]
    if ne["present"] is None:
        ne_text = f"unknown — {apple['reason'] or ne['source']}"
    else:
        cores = f", {ne['cores']} cores" if ne["cores"] is not None else ""
        ne_text = (
            f"{'present' if ne['present'] else 'absent'}{cores} ({apple['chip']}, macOS "
            f"{apple['macos']} {apple['macos_build']}; {ne['source']})"
        )
    table.add_row("Neural Engine", ne_text)
    table.add_row("Core ML runtime", "yes" if cm.get("runtime") else f"no — {cm['reason']}")
    table.add_row("coremltools", str(cm["coremltools"]))
    table.add_row("ANE lane backends", ", ".join(data["ane_backends"]))
    table.add_row("Core ML compute units", data["coreml_compute_units"])
    for name, choice in data["lanes"].items():
        table.add_row(f"lane for {name}", choice["reason"])
    Console().print(table)
    return 0
