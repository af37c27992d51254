"""Keep Metal out of a llama.cpp worker that computes on the CPU, from its first instruction.

ggml builds its backend registry the first time llama.cpp asks it anything (the worker does
before HELLO: its build flags name the backends). On a build with Metal, the registry calls
`ggml_backend_metal_reg()`, which creates `GGML_METAL_DEVICES` Metal devices (default 1):
each opens the MTLDevice and compiles ggml's kernel library. A lane that computes on the CPU
needs none of that, and a hosted macOS VM has no usable Metal device to open.

llama.cpp's own switch (`ggml-metal.cpp`): the registry reads `GGML_METAL_DEVICES` with
`atoi` when it first builds its device list, so `GGML_METAL_DEVICES=0` registers the Metal
backend with no device at all: nothing is opened or compiled, llama.cpp sees no GPU
(`llama_supports_gpu_offload()` is false, so HELLO says `device=cpu`). The variable must be
in the worker's environment when it starts, so the host puts it there.

A lane is a CPU lane when the operator's `SYNAPSE_LLAMA_GPU_LAYERS` is 0 (it wins over the
LOAD) or, without it, when the LOAD asks for `gpu_layers` 0. Any other case is left alone: the
switch would turn an "auto" or offloaded lane into a CPU one (or a refusal). The parse
mirrors workers.llama.device, which the host does not import (the dependency arrows).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

METAL_DEVICES_ENV = "GGML_METAL_DEVICES"
GPU_LAYERS_ENV = "SYNAPSE_LLAMA_GPU_LAYERS"


def _is_zero(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value == 0
    if isinstance(value, str):
        try:
            return int(value.strip()) == 0
        except ValueError:
            return False
    return False


def is_cpu_lane(requested_gpu_layers: object, environ: Mapping[str, str] | None = None) -> bool:
    """True when a llama.cpp worker with this LOAD `gpu_layers` (None: not given, i.e. "auto")
    will compute on the CPU whatever its build offers."""
    env = os.environ if environ is None else environ
    override = env.get(GPU_LAYERS_ENV, "").strip()
    if override:
        return _is_zero(override)
    return _is_zero(requested_gpu_layers)


def llama_worker_env(
    requested_gpu_layers: object, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What a llama.cpp lane's worker environment adds: Metal switched off for a CPU lane."""
    return {METAL_DEVICES_ENV: "0"} if is_cpu_lane(requested_gpu_layers, environ) else {}
