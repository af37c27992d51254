"""macOS adapter: the chip, the macOS version and build, and whether a Neural Engine is there.

Every call here is Apple-only (sysctl names, Core ML's device list); off macOS each answer is
None and `describe()` says "not macOS". Hosted macOS VMs run Core ML without a Neural Engine:
`neural_engine_present()` is False there, which certification turns into `provisional`.
"""

from __future__ import annotations

import functools
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


# What coremltools runs for its own version checks (`coremltools.models.utils._macos_version`).
# `platform.mac_ver()` is not used: under a Python built with an older SDK it reports the
# compatibility version ("16.0" on macOS 26), so one Mac's certificates would differ by
# interpreter, and version gates (MLComputePlan from 14.4, function names from 15) would
# read the wrong number.
SW_VERS_ARGV = ("sw_vers", "-productVersion")


def parse_product_version(text: str) -> str | None:
    """`sw_vers -productVersion`'s answer ("26.0.1\n") as "26.0.1"; None when it is not
    dot-separated numbers (coremltools turns each part into an int, so do we, to check)."""
    value = text.strip()
    parts = value.split(".")
    if not value or not all(p.isdigit() for p in parts):
        return None
    return value


def product_version(argv: tuple[str, ...] = SW_VERS_ARGV) -> str | None:
    """Run `sw_vers -productVersion` (found on PATH, as coremltools runs it); None when it
    cannot run or says nothing a version looks like."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_product_version(out.stdout) if out.returncode == 0 else None


@functools.cache
def macos_version() -> str | None:
    return product_version() if is_macos() else None


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


def summarize_devices(devices: list[object], is_neural_engine) -> tuple[bool, int | None]:
    """(a Neural Engine is listed, its core count) from Core ML's device list. The count is
    `MLNeuralEngineComputeDevice.total_core_count` (macOS >= 14), None when it cannot be read;
    never guessed from the chip's name."""
    engines = [d for d in devices if is_neural_engine(d)]
    if not engines:
        return False, None
    try:
        cores = int(engines[0].total_core_count)  # type: ignore[attr-defined]
    except Exception:  # the native call is missing or fails: say unknown
        cores = None
    return True, cores


@functools.cache
def neural_engine() -> tuple[bool | None, int | None]:
    """(present, total cores) as Core ML lists it; (None, None) off macOS or when coremltools
    has no native runtime to ask."""
    if not is_macos():
        return None, None
    try:
        from coremltools.models.compute_device import (
            MLComputeDevice,
            MLNeuralEngineComputeDevice,
        )

        devices = MLComputeDevice.get_all_compute_devices()
    except Exception:  # no libcoremlpython, or an OS without the API (< 14.0)
        return None, None
    return summarize_devices(devices, lambda d: isinstance(d, MLNeuralEngineComputeDevice))


def neural_engine_present() -> bool | None:
    """True when Core ML lists an MLNeuralEngineComputeDevice; None off macOS (or when
    coremltools has no native runtime to ask)."""
    return neural_engine()[0]


def describe() -> dict:
    """What doctor and certification print: None everywhere off macOS, with the reason."""
    if not is_macos():
        return {
            "chip": None,
            "macos": None,
            "macos_build": None,
            "neural_engine": None,
            "neural_engine_cores": None,
            "reason": NOT_MACOS,
        }
    present, cores = neural_engine()
    return {
        "chip": chip(),
        "macos": macos_version(),
        "macos_build": macos_build(),
        "neural_engine": present,
        "neural_engine_cores": cores,
        "reason": None,
    }
