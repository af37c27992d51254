"""Every side of a bench on the kernels our workers run on, and a report of what each side ran.

A baseline must run at its best, or a ratio against it means nothing. On a CPU newer than the
system OpenBLAS (Debian 12's 0.3.21 on our family 6 model 207 Xeons) the library falls back to
its SSE3 "Prescott" kernels unless `OPENBLAS_CORETYPE` names better ones, and llama.cpp's BLAS
backend runs every encoder matmul through it. Our llama workers make that choice before
llama_cpp loads (workers.llama.openblas_core); a bench that did not would compare our AVX-512
workers with a peer server, or an in-process ceiling, on SSE3.

- `match_workers()`: the workers' choice, made in the bench process before anything in it
  loads OpenBLAS (an inherited `OPENBLAS_CORETYPE` older than the CPU's kernels is dropped
  first: `drop_held_back`), and left in `os.environ`, so every process the bench starts
  afterwards (a peer server, our server and its workers, ceiling shards) is exec'd with the same
  `OPENBLAS_CORETYPE`. Importing this module makes it (`CHOICE`, the workers' log line): a
  bench imports it before anything that loads OpenBLAS (numpy does, at import).
- `process_kernels(pid)`: what one process runs on: each OpenBLAS mapped into it (Linux:
  /proc/PID/maps) and the kernel family it picked. In this process the library itself says
  (`openblas_get_corename`); for another process, the family the same library file picks under
  the environment that process was started with (/proc/PID/environ): a DYNAMIC_ARCH OpenBLAS
  decides once, at load, from the CPU and that variable alone. A llama worker applies the
  workers' rule to its environment before loading, so its report applies it too.
- `agree(reports)`: every side runs the same family in each OpenBLAS they share.

Off Linux (a Mac: Accelerate, whose kernels the OS picks) nothing is chosen or read; the
report says so.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from workers.llama import openblas_core

ENV = openblas_core.ENV
# The corename getters OpenBLAS builds export: the system library, and the symbol-suffixed
# copy numpy and scipy bundle (scipy-openblas).
_GETTERS = ("openblas_get_corename", "scipy_openblas_get_corename64_", "openblas_get_corename64_")
NOT_LINUX = "not read off Linux (macOS: Accelerate, whose kernels the OS picks)"


# An inherited OPENBLAS_CORETYPE older than the CPU's kernels (some machines set Haswell
# machine-wide, AVX-512 CPUs included) would hold every OpenBLAS side of a bench below what
# torch's MKL and ONNX Runtime's MLAS pick for themselves by CPUID, and a ratio against those
# would measure the variable. A bench drops it, and says so, unless this is set to "inherit".
# (Workers themselves always keep a user's value.)
INHERIT = "SYNAPSE_BENCH_OPENBLAS"


def drop_held_back(environ: dict[str, str] | os._Environ, flags: set[str]) -> str | None:
    """Remove an inherited OPENBLAS_CORETYPE that names older kernels than `flags` support;
    returns what was done, for the report (None: nothing dropped)."""
    value = environ.get(ENV)
    if not value or environ.get(INHERIT) == "inherit":
        return None
    better = openblas_core.held_back(value, flags)
    if better is None:
        return None
    del environ[ENV]
    return (
        f"inherited {ENV}={value} dropped: this CPU runs {better} kernels, as the bench's "
        f"other sides do ({INHERIT}=inherit keeps it)"
    )


def match_workers(environ: dict[str, str] | os._Environ | None = None) -> str:
    """Make the llama workers' OpenBLAS choice for this process and everything it starts,
    after dropping an inherited value that holds the CPU back. Returns the workers' own log
    line (what was chosen and why), with what was dropped."""
    environ = os.environ if environ is None else environ
    dropped = None
    # Only while no OpenBLAS is loaded here: one that is has its kernels already, and a drop
    # then would split this process from the ones it starts (a test importing a bench).
    # (Off Linux neither procfs nor cpuinfo flags are read, and nothing is dropped.)
    if not _openblas_loaded_here():
        dropped = drop_held_back(environ, openblas_core.this_cpu_flags())
    line = openblas_core.apply(environ)
    return f"{line}; {dropped}" if dropped else line


def _openblas_loaded_here() -> bool:
    if sys.platform != "linux":  # procfs: Linux only
        return False
    try:
        return bool(openblas_libraries(Path("/proc/self/maps").read_text(errors="replace")))
    except OSError:
        return False


def openblas_libraries(maps: str) -> list[str]:
    """The OpenBLAS shared objects in a /proc/PID/maps text, sorted and without repeats."""
    paths = set()
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if path.startswith("/") and ".so" in path and "openblas" in Path(path).name.lower():
            paths.add(path)
    return sorted(paths)


# At import, so a bench that imports this module first has decided before OpenBLAS loads.
CHOICE = match_workers()


def parse_environ(raw: bytes) -> dict[str, str]:
    """A Linux process's environ file: NUL-separated NAME=value entries."""
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0"))
    return {name: value for name, sep, value in pairs if sep and name}


def loaded_corename(path: str) -> str | None:
    """The family the copy of `path` loaded in THIS process picked (CDLL returns that copy)."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for name in _GETTERS:
        get = getattr(lib, name, None)
        if get is not None:
            get.restype = ctypes.c_char_p
            return (get() or b"?").decode()
    return None


def probed_corename(path: str, coretype: str | None) -> str | None:
    """The family `path` picks when loaded with OPENBLAS_CORETYPE=coretype (unset: None), in a
    child interpreter of its own (the workers' own probe, with every getter name)."""
    return openblas_core.corename(path, coretype, _GETTERS)


def _cmdline(pid: int) -> list[str]:
    if sys.platform != "linux":  # procfs: Linux only
        return []
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def is_llama_worker(cmdline: list[str]) -> bool:
    return any(a == "workers.llama" for a in cmdline)


def start_coretype(environ: Mapping[str, str], llama_worker: bool) -> str | None:
    """The OPENBLAS_CORETYPE a process loads OpenBLAS under: its start environment's, after
    the workers' rule for a llama worker (which applies it to itself before loading)."""
    env = dict(environ)
    if llama_worker and sys.platform.startswith("linux"):
        openblas_core.apply(env)
    return env.get(ENV) or None


def process_kernels(pid: int | None = None) -> dict:
    """{"pid", "OPENBLAS_CORETYPE", "openblas": {library file name: kernel family}} of one
    process (None: this one). See the module doc for how each is read."""
    own = pid is None or pid == os.getpid()
    pid = os.getpid() if pid is None else pid
    if not sys.platform.startswith("linux"):
        return {"pid": pid, "OPENBLAS_CORETYPE": None, "openblas": {}, "note": NOT_LINUX}
    try:
        libraries = openblas_libraries(Path(f"/proc/{pid}/maps").read_text(errors="replace"))
        environ = (
            dict(os.environ) if own else parse_environ(Path(f"/proc/{pid}/environ").read_bytes())
        )
    except OSError as e:
        return {"pid": pid, "OPENBLAS_CORETYPE": None, "openblas": {}, "note": str(e)}
    coretype = environ.get(ENV) if own else start_coretype(environ, is_llama_worker(_cmdline(pid)))
    found: dict[str, str] = {}
    for path in libraries:
        name = loaded_corename(path) if own else probed_corename(path, coretype)
        found[Path(path).name] = name or "?"
    return {"pid": pid, "OPENBLAS_CORETYPE": coretype or None, "openblas": found}


def agree(reports: Mapping[str, dict | list[dict]]) -> bool:
    """True when, for every OpenBLAS library more than one side loaded, every side that loaded
    it runs the same kernel family (sides name one report or a list, e.g. several workers)."""
    families: dict[str, set[str]] = {}
    for value in reports.values():
        for report in value if isinstance(value, list) else [value]:
            for lib, family in report.get("openblas", {}).items():
                families.setdefault(lib, set()).add(family.lower())
    return all(len(names) == 1 for names in families.values())


def torch_kernels() -> dict:
    """sentence-transformers' side: torch picks its CPU kernels itself (ATen's dispatch by the
    CPU's capability; MKL / oneDNN on x86 builds), so the report names that choice."""
    import torch

    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": bool(torch.backends.mkl.is_available()),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "threads": torch.get_num_threads(),
    }


def onnxruntime_kernels(session: object | None = None) -> dict:
    """ONNX Runtime's side: its CPU provider runs MLAS, which picks kernels by CPUID at load."""
    import onnxruntime as ort

    providers = session.get_providers() if session is not None else ["CPUExecutionProvider"]  # type: ignore[attr-defined]
    return {"version": ort.__version__, "providers": providers, "kernels": "MLAS (by CPUID)"}


class WorkerWatch:
    """Reads the kernels of every llama worker this process starts while the block runs (a
    job's workers live only as long as the job): `seen`, one report per worker, read once its
    OpenBLAS is mapped."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.seen: list[dict] = []
        self._interval = interval_s
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self._interval):
            for child in me.children(recursive=True):
                if child.pid in self._done or not is_llama_worker(_cmdline(child.pid)):
                    continue
                report = process_kernels(child.pid)
                if report["openblas"] or not sys.platform.startswith("linux"):
                    self._done.add(child.pid)
                    self.seen.append(report)
