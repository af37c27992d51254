"""Which OpenBLAS kernels llama.cpp's BLAS backend runs on, decided before the library loads.

Built with GGML_BLAS (the Linux wheel: scripts/llama_wheel.py), llama.cpp hands every large f32
matmul — an encoder's whole forward pass — to the system OpenBLAS. A DYNAMIC_ARCH OpenBLAS
picks its kernels once, when it loads, from the CPU's family and model; a release older than
the CPU does not know the model and falls back to its generic SSE3 "Prescott" kernels. Debian
12's 0.3.21 does that on our family 6 model 207 Xeons (AVX-512): Qwen3-0.6B-sized encodes ran
5x slower than with the AVX-512 kernels. `OPENBLAS_CORETYPE` names the kernels instead; it is
read at load time, so the worker sets it before it imports llama_cpp.

The rule: a user's own `OPENBLAS_CORETYPE` always wins; otherwise, only when the library's
own pick is a pre-AVX fallback while the CPU flags say better, name the best family the flags
support (AVX-512 F/BW/DQ/VL/CD -> SkylakeX, AVX2+FMA -> Haswell, AVX -> Sandybridge). An
OpenBLAS that knows the CPU is left alone. The pick is read in a child interpreter (loading
the library in this process would fix its kernels before the choice is made). A user's value
that names older kernels than the CPU runs is kept, and the log line says so (some machines set
OPENBLAS_CORETYPE=Haswell machine-wide: on an AVX-512 EPYC that made a bge-m3 encode 1.4x
slower than the library's own pick).
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

ENV = "OPENBLAS_CORETYPE"

# openblas_get_corename() names of kernels older than AVX: what an unknown CPU falls back to.
_PRE_AVX = frozenset(
    {
        "prescott",
        "katmai",
        "coppermine",
        "northwood",
        "banias",
        "core2",
        "penryn",
        "dunnington",
        "nehalem",
        "atom",
        "athlon",
        "opteron",
        "opteron_sse3",
        "barcelona",
        "bobcat",
        "nano",
        "generic",
        "unknown",
    }
)
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")

# Prints the corename of the library argv[1] through the first getter of argv[2:] it exports.
_PROBE = (
    "import ctypes, sys\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "for name in sys.argv[2:]:\n"
    "    get = getattr(lib, name, None)\n"
    "    if get is not None:\n"
    "        get.restype = ctypes.c_char_p\n"
    "        print((get() or b'').decode())\n"
    "        break\n"
)


def best_coretype(flags: set[str]) -> str | None:
    """The OpenBLAS kernel family these x86 CPU flags support, None below AVX."""
    if all(f in flags for f in _AVX512):
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    if "avx" in flags:
        return "Sandybridge"
    return None


# OpenBLAS kernel families (as openblas_get_corename spells them, lower-cased) by the widest x86
# vector instructions they use: 0 below AVX, 1 AVX, 2 AVX2 (OpenBLAS's Zen runs the Haswell
# kernels), 3 AVX-512. Only to tell when a user's OPENBLAS_CORETYPE holds this CPU back.
_ISA_LEVEL = {
    **dict.fromkeys(_PRE_AVX, 0),
    **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"), 1),
    **dict.fromkeys(("haswell", "zen"), 2),
    **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), 3),
}


def held_back(coretype: str, flags: set[str]) -> str | None:
    """The family these CPU flags support when `coretype` names older kernels (a machine-wide
    OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU runs llama.cpp's matmuls at half their vector
    width), else None: also for a name not ranked here, which is left unjudged."""
    level = _ISA_LEVEL.get(coretype.strip().lower())
    best = best_coretype(flags)
    if level is None or best is None:
        return None
    return best if _ISA_LEVEL[best.lower()] > level else None


def choose(detected: str | None, flags: set[str], env: dict[str, str]) -> str | None:
    """The OPENBLAS_CORETYPE to set, None to leave the library's own pick (see module doc)."""
    if env.get(ENV) or not detected:
        return None
    if detected.strip().lower() not in _PRE_AVX:
        return None
    return best_coretype(flags)


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def this_cpu_flags() -> set[str]:
    if sys.platform != "linux":  # procfs: Linux only (macOS builds use Accelerate anyway)
        return set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return cpu_flags(f.read())
    except OSError:
        return set()


def library() -> str | None:
    """The OpenBLAS the dynamic loader gives a program linked against it (as libggml-blas is)."""
    return ctypes.util.find_library("openblas")


def corename(
    lib: str, coretype: str | None = None, getters: tuple[str, ...] = ("openblas_get_corename",)
) -> str | None:
    """The kernels `lib` picks when loaded (with OPENBLAS_CORETYPE=coretype when given), read
    in a child interpreter through the first of `getters` the library exports."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["OPENBLAS_NUM_THREADS"] = "1"  # the probe needs no thread pool
    if coretype:
        env[ENV] = coretype
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, lib, *getters],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = done.stdout.strip()
    return name if done.returncode == 0 and name else None


def apply(environ: os._Environ | dict[str, str] | None = None) -> str:
    """Set OPENBLAS_CORETYPE in `environ` (default: this process) when the rule says so, before
    OpenBLAS loads. Returns one line saying what the kernels are and why, for the worker log."""
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):  # macOS builds use Accelerate, not OpenBLAS
        return "openblas: not used on this platform"
    if environ.get(ENV):
        better = held_back(environ[ENV], this_cpu_flags())
        hint = f"; this CPU runs {better} kernels: unset it to let OpenBLAS pick" if better else ""
        return f"openblas: {ENV}={environ[ENV]} (set by the user{hint})"
    lib = library()
    if lib is None:
        return "openblas: not installed (llama.cpp uses its own kernels)"
    detected = corename(lib)
    pick = choose(detected, this_cpu_flags(), dict(environ))
    if pick is None:
        return f"openblas: {detected or 'unknown'} kernels (the library's own pick)"
    # Keep the override only when the library loads exactly those kernels (a name it does not
    # know makes it pick something else, and an older release may lack a family).
    forced = corename(lib, pick)
    if forced is None or forced.lower() != pick.lower():
        return f"openblas: {detected} kernels ({ENV}={pick} was not accepted)"
    environ[ENV] = pick
    return f"openblas: {forced} kernels ({ENV}={pick}: the library's own pick was {detected})"
