"""Where llama.cpp runs a model: GPU offload (Metal, CUDA, ...) or the CPU.

`runtime_config.gpu_layers` is "auto" (default: every layer on the GPU when the build can
offload, else the CPU) or a layer count. `SYNAPSE_LLAMA_GPU_LAYERS` overrides it for the
whole machine (hosted macOS VMs have no usable Metal: set it to 0 there). Asking for layers
on a build without offload is a refusal that names the build, never a silent CPU run.
Pure functions over the build's facts, so the rules are tested on any machine.
"""

from __future__ import annotations

import os
from typing import Literal

GPU_LAYERS_ENV = "SYNAPSE_LLAMA_GPU_LAYERS"
ALL_LAYERS = 0x7FFFFFFF  # llama.cpp clamps to the model's layer count (as llama-cpp-python)

GpuLayers = Literal["auto"] | int

# ggml backend registry names (llama_print_system_info's "NAME : ..." sections) -> device.
# CPU-side accelerators (BLAS, AMX) are not offload targets.
_GPU_BACKENDS = {
    "metal": "metal",
    "mtl": "metal",
    "cuda": "cuda",
    "rocm": "rocm",
    "hip": "rocm",
    "vulkan": "vulkan",
    "sycl": "sycl",
    "opencl": "opencl",
    "musa": "musa",
    "cann": "cann",
}
_CPU_SIDE = {"cpu", "blas", "amx", "rpc"}


def offload_device(system_info: str, supports_offload: bool) -> str:
    """The device a full offload lands on, named from the build's backend list; "cpu" when
    the build cannot offload."""
    if not supports_offload:
        return "cpu"
    for name in backends(system_info):
        if name.lower() not in _CPU_SIDE:
            return _GPU_BACKENDS.get(name.lower(), name.lower())
    return "gpu"  # the build offloads but does not say to what


def backends(system_info: str) -> list[str]:
    """Backend names in llama_print_system_info order ("CPU", "MTL", "CUDA"...)."""
    names = []
    for section in system_info.split("|"):
        name, sep, _ = section.partition(":")
        if sep and name.strip() and " " not in name.strip():
            names.append(name.strip())
    return names


def describe_build(version: str, system_info: str) -> str:
    """How a refusal names the build: "llama-cpp-python 0.3.36, backends: CPU"."""
    return f"llama-cpp-python {version}, backends: {', '.join(backends(system_info)) or '?'}"


# llama.cpp's LLAMA_SPLIT_MODE_NONE (llama.h); device.py stays free of llama_cpp imports.
SPLIT_MODE_NONE = 0


def model_param_fields(gpu_layers: int) -> dict[str, int]:
    """What `llama_model_params` must say for a lane of `gpu_layers` layers.

    n_gpu_layers = 0 alone does not keep llama.cpp off the GPU: it still lists every GPU
    device in `model->devices` unless split_mode is NONE and main_gpu < 0 (llama.cpp's
    llama_model_load), and each context then opens a backend per device. A CPU lane (0
    layers) therefore clears the device list; an offloaded lane keeps llama.cpp's defaults.
    """
    if gpu_layers == 0:
        return {"n_gpu_layers": 0, "split_mode": SPLIT_MODE_NONE, "main_gpu": -1}
    return {"n_gpu_layers": gpu_layers}


def context_param_fields(offloaded: bool) -> dict[str, bool]:
    """What `llama_context_params` must say: with op_offload (llama.cpp's default) the
    scheduler hands a matmul of >= 32 rows whose weights sit in host memory to a GPU backend
    (Metal's f32 matmul runs with half operands), so a CPU lane turns it off."""
    return {} if offloaded else {"op_offload": False}


def parse_gpu_layers(text: str) -> GpuLayers:
    """`SYNAPSE_LLAMA_GPU_LAYERS`: "auto" or an integer >= 0; anything else is ValueError."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    try:
        layers = int(value)
    except ValueError:
        layers = -1
    if layers < 0:
        raise ValueError(f'{GPU_LAYERS_ENV}={text!r}: expected "auto" or an integer >= 0')
    return layers


def env_gpu_layers(environ: dict[str, str] | None = None) -> GpuLayers | None:
    raw = (os.environ if environ is None else environ).get(GPU_LAYERS_ENV)
    return None if raw is None or raw.strip() == "" else parse_gpu_layers(raw)


def resolve_gpu_layers(
    requested: GpuLayers, supports_offload: bool, build: str, environ: dict[str, str] | None = None
) -> int:
    """n_gpu_layers for llama.cpp. The env override wins over the LOAD's runtime_config (it
    is the operator's word about this machine). ValueError names the build for an impossible
    ask; `build` describes it (version and backends)."""
    env = env_gpu_layers(environ)
    layers, source = (env, GPU_LAYERS_ENV) if env is not None else (requested, "gpu_layers")
    if layers == "auto":
        return ALL_LAYERS if supports_offload else 0
    if layers > 0 and not supports_offload:
        raise ValueError(
            f"{source}={layers}: this llama.cpp build ({build}) cannot offload to a GPU "
            '(llama_supports_gpu_offload() is false); use 0 or "auto"'
        )
    return layers
