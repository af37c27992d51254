"""macOS adapter: the chip, the macOS version and build, and whether a Neural Engine is there.

Every call here is Apple-only (sysctl names, Core ML's device list); off macOS each answer is
None and `describe()` says "not macOS". Hosted macOS VMs run Core ML without a Neural Engine:
`neural_engine_present()` is False there, which certification turns into `provisional`.
"""

from __future__ import annotations

import functools
import platform
import subprocess
import sys

NOT_MACOS = "not macOS"


def is_macos() -> bool:
    return sys.platform == "darwin"


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


@functools.cache
def chip() -> str | None:
    return _sysctl("machdep.cpu.brand_string") if is_macos() else None


@functools.cache
def macos_version() -> str | None:
    return (platform.mac_ver()[0] or None) if is_macos() else None


@functools.cache
def macos_build() -> str | None:
    """e.g. "23E214": a compiled model belongs to one OS build."""
    return _sysctl("kern.osversion") if is_macos() else None


def version_at_least(version: str | None, wanted: tuple[int, ...]) -> bool:
    if not version:
        return False
    parts = []
    for p in version.split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts) >= wanted


@functools.cache
def neural_engine_present() -> bool | None:
    """True when Core ML lists an MLNeuralEngineComputeDevice; None off macOS (or when
    coremltools has no native runtime to ask)."""
    if not is_macos():
        return None
    try:
        from coremltools.models.compute_device import (
            MLComputeDevice,
            MLNeuralEngineComputeDevice,
        )

        devices = MLComputeDevice.get_all_compute_devices()
    except Exception:  # no libcoremlpython, or an OS without the API (< 14.0)
        return None
    return any(isinstance(d, MLNeuralEngineComputeDevice) for d in devices)


def describe() -> dict:
    """What doctor and certification print: None everywhere off macOS, with the reason."""
    if not is_macos():
        return {"chip": None, "macos": None, "macos_build": None, "neural_engine": None,
                "reason": NOT_MACOS}
    return {"chip": chip(), "macos": macos_version(), "macos_build": macos_build(),
            "neural_engine": neural_engine_present(), "reason": None}
