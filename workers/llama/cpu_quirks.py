"""CPU kernel choices llama.cpp gets wrong on some machines, decided once per process.

AMX. On Intel CPUs with AMX (Sapphire Rapids and later) llama.cpp's CPU backend routes
quantized matmuls (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS) through its AMX "extra buffer
type". With the llama.cpp that llama-cpp-python 0.3.36 vendors, that path segfaults in
`ggml_backend_amx_mul_mat` on our 2-core Xeon VMs: Gemma 3's Q4_K_M crashed on its first
decode every time, in our worker and in plain llama-cpp-python alike (upstream llama.cpp's
tracker has a report with the same backtrace). So on a CPU that advertises AMX the extra buffer
types are turned off (`use_extra_bufts = False`); the price is llama.cpp's weight repacking
for quantized types on that machine. f16/f32 models (the embedders) never take that path.

`SYNAPSE_LLAMA_EXTRA_BUFTS=1` forces them on (to check a fixed llama.cpp), `=0` forces them
off, unset or `auto` decides by the CPU flags. Apple silicon has no x86 AMX: always on there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import llama_cpp

EXTRA_BUFTS_ENV = "SYNAPSE_LLAMA_EXTRA_BUFTS"
_AMX_FLAGS = ("amx_int8", "amx_tile")


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """True when the CPU flags list AMX. Only Linux says (in /proc/cpuinfo); elsewhere False."""
    if cpuinfo is None:
        if not sys.platform.startswith("linux"):
            return False
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return any(flag in flags for flag in _AMX_FLAGS)
    return False


def extra_buffer_types_allowed(env: str | None = None, has_amx: bool | None = None) -> bool:
    """The policy above; raises ValueError on a value of the override it does not know."""
    value = os.environ.get(EXTRA_BUFTS_ENV, "auto") if env is None else env
    if value == "1":
        return True
    if value == "0":
        return False
    if value != "auto":
        raise ValueError(f"{EXTRA_BUFTS_ENV}={value!r}: expected 0, 1 or auto")
    return not (cpu_has_amx() if has_amx is None else has_amx)


@functools.cache
def _allowed_here() -> bool:
    return extra_buffer_types_allowed()


def model_params() -> llama_cpp.llama_model_params:
    """llama.cpp's default model params with this machine's extra-buffer-type policy."""
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = _allowed_here()
    return params


@contextlib.contextmanager
def high_level_llama_follows_policy() -> Iterator[None]:
    """Make `llama_cpp.Llama(...)` built inside the block use `model_params()`'s policy.

    For reference runs (tests, benchmarks) that must use the same kernels as the worker: the
    high-level constructor exposes no `use_extra_bufts` argument.
    """
    import llama_cpp.llama as high_level

    original = high_level.llama_cpp.llama_model_default_params

    def patched() -> llama_cpp.llama_model_params:
        params = original()
        params.use_extra_bufts = _allowed_here()
        return params

    high_level.llama_cpp.llama_model_default_params = patched
    try:
        yield
    finally:
        high_level.llama_cpp.llama_model_default_params = original
