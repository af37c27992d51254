"""Build the llama-cpp-python wheel once per BLAS flavour and print the directory holding it.

    python scripts/llama_wheel.py        # stdout: the wheel directory, for pip --find-links

llama-cpp-python ships as source only, and how it is built decides the CPU lane's speed:
with a BLAS library, llama.cpp hands the encoder's large matmuls to it (OpenBLAS's sgemm
measured 1.46x llama.cpp's own f32 kernels on MiniLM, 2 cores; see workers/llama/decode_plan.py).
pip's own wheel cache is keyed by the source archive, not by the build flags, so it could
hand back a wheel built without BLAS: this script builds with `--no-cache-dir` into a
directory named after the version and the flavour, under the user cache dir, and reuses it.

Flavours (each named for what the wheel contains):
- macOS: "metal-accelerate" — llama.cpp's default build there (Metal, and Apple's Accelerate
  as the BLAS backend); with SYNAPSE_LLAMA_BLAS=0, "metal": still Metal (llama.cpp builds it
  on Apple whatever the BLAS choice), llama.cpp's own CPU kernels instead of Accelerate. A CPU
  lane of either runs without Metal only because its worker starts with Metal switched off
  (host/cpu_lane.py), not because of the wheel.
- Linux with OpenBLAS's headers (Debian/Ubuntu: libopenblas-dev): "openblas". When they are
  missing and apt-get is there, it installs libopenblas-dev first (as root, or with
  `sudo -n`).
- otherwise, or with SYNAPSE_LLAMA_BLAS=0 off Apple: "cpu" — llama.cpp's own CPU kernels only
  (slower embedding on x86, same results within float rounding).
The CPU: llama.cpp builds with GGML_NATIVE by default (-march=native on x86, -mcpu=native on
ARM), so a wheel built on one CPU can die with SIGILL on another (a CI cache restored onto a
runner of another generation). The wheel directory is therefore also named after the CPU's
feature flags (`cpu_tag`: a digest of /proc/cpuinfo's flags, or of macOS's `hw.optional`
keys): another CPU builds its own wheel instead of reusing one it may not execute. We keep
the native build rather than a portable one because the encoder's speed on these 2-core
machines is the product (AVX-512 and the BLAS kernels are measured in workers/llama/decode_plan.py).
`python scripts/llama_wheel.py --cpu-tag` prints the tag (the CI cache key includes it).

Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLAS_ENV = "SYNAPSE_LLAMA_BLAS"
OPENBLAS_ARGS = "-DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS"
_CBLAS_HEADERS = (
    "/usr/include/cblas.h",
    "/usr/include/openblas/cblas.h",
    f"/usr/include/{platform.machine()}-linux-gnu/cblas.h",
)


def pinned_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The llama-cpp-python version pyproject.toml pins (one source of truth)."""
    found = re.search(r'"llama-cpp-python==([^"]+)"', pyproject.read_text())
    if found is None:
        raise SystemExit("pyproject.toml pins no llama-cpp-python==VERSION")
    return found.group(1)


def flavour(system: str, openblas: bool, blas_env: str | None) -> tuple[str, str]:
    """(flavour name, CMAKE_ARGS) for this machine."""
    if system == "Darwin":  # llama.cpp builds Metal on Apple whatever the BLAS choice
        if blas_env == "0":
            return "metal", "-DGGML_BLAS=OFF"
        return "metal-accelerate", ""  # llama.cpp's Apple default: Metal + Accelerate BLAS
    if blas_env == "0":
        return "cpu", "-DGGML_BLAS=OFF"
    if system == "Linux" and openblas:
        return "openblas", OPENBLAS_ARGS
    return "cpu", ""


def openblas_headers() -> bool:
    return any(Path(h).is_file() for h in _CBLAS_HEADERS)


def install_openblas() -> bool:
    """apt-get install libopenblas-dev; False (and the reason on stderr) when it cannot."""
    if shutil.which("apt-get") is None:
        print("llama_wheel: no apt-get; building without BLAS", file=sys.stderr)
        return False
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def apt(*args: str) -> bool:
        cmd = [*sudo, "apt-get", *args]
        return subprocess.run(cmd, stdout=sys.stderr, env=env, check=False).returncode == 0

    install = ("install", "-y", "--no-install-recommends", "libopenblas-dev")
    # A fresh machine may have no package lists yet: update once, then try again.
    if apt(*install) or (apt("update") and apt(*install)):
        return openblas_headers()
    print("llama_wheel: could not install libopenblas-dev; building without BLAS", file=sys.stderr)
    return False


def cpu_features(system: str | None = None) -> str:
    """The CPU's feature flags as one sorted, space-separated string ("" when unreadable)."""
    system = system or platform.system()
    if system == "Linux":
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return ""
        return features_from_cpuinfo(text)
    if system == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "hw.optional", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return " ".join(sorted(line.strip() for line in out.splitlines() if line.strip()))
    return platform.processor()


def features_from_cpuinfo(text: str) -> str:
    """x86 `flags` / ARM `Features` of the first CPU listed, sorted."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return " ".join(sorted(set(value.split())))
    return ""


def cpu_tag(features: str) -> str:
    """12 hex digits naming the CPU features a native build may use."""
    return hashlib.sha256(features.encode()).hexdigest()[:12]


def wheel_dir(version: str, name: str, cpu: str | None = None) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cpu = cpu if cpu is not None else cpu_tag(cpu_features())
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}-{cpu}"
    return cache / "synapse" / "wheels" / f"llama-cpp-python-{version}-{name}-{tag}"


def main() -> int:
    if sys.argv[1:] == ["--cpu-tag"]:
        print(cpu_tag(cpu_features()))
        return 0
    version = pinned_version()
    system = platform.system()
    blas_env = os.environ.get(BLAS_ENV)
    openblas = system == "Linux" and blas_env != "0" and (openblas_headers() or install_openblas())
    name, cmake_args = flavour(system, openblas, blas_env)
    out = wheel_dir(version, name)
    if not any(out.glob("llama_cpp_python-*.whl")):
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(filter(None, [env.get("CMAKE_ARGS", ""), cmake_args]))
        print(f"llama_wheel: building llama-cpp-python {version} ({name})", file=sys.stderr)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-cache-dir",
            "--no-binary",
            "llama-cpp-python",
            "-w",
            str(out),
            f"llama-cpp-python=={version}",
        ]
        subprocess.run(cmd, stdout=sys.stderr, env=env, check=True)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
