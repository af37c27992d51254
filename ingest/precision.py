"""Which precision the default embedder's GGUF has on this machine, and what each lane serves.

The rule follows the device the llama.cpp lane computes on, not the platform:

- CPU lanes -> f32. ggml's CPU path hands f32 matmuls to the BLAS library as they are, but
  converts non-f32 weights to float on every matmul first (`ggml-blas.cpp`: OpenBLAS on Linux,
  Accelerate on macOS); without BLAS, x86 has no fp16 arithmetic either, and converts (F16C)
  per matmul too. Measured on x86 (`python -m bench.embed`, 512 mixed sentences, 2 threads,
  in-process, same run) at equal fidelity, f32 / f16 throughput: 1.74x on a 2-core AMD EPYC
  (AVX2: 30.7 vs 17.6 sentences/s), ~1.1x on a 2-core Xeon with AVX512-FP16 (noisy); f16 was
  faster on no CPU measured. So a Mac's CPU lane (SYNAPSE_LLAMA_GPU_LAYERS=0, as on hosted
  VMs) gets f32 as well.
- GPU lanes (Metal on Apple silicon, where llama-cpp-python's build always has it) -> f16: the
  GPU computes in half precision natively and reads half the weight bytes.

`lane_device` says which of the two this machine's llama.cpp lane uses when nothing is forced:
llama-cpp-python on macOS arm64 is built with Metal (scripts/llama_wheel.py builds the same
wheel), and the project's Linux wheel is CPU with OpenBLAS; the operator's override
SYNAPSE_LLAMA_GPU_LAYERS=0 keeps the lane on the CPU.

The Core ML lane builds its own fp16 graph from the same Hugging Face weights, whatever the
GGUF's precision.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Literal

Dtype = Literal["f32", "f16"]

GPU_LAYERS_ENV = "SYNAPSE_LLAMA_GPU_LAYERS"


@dataclass(frozen=True)
class PrecisionChoice:
    dtype: Dtype
    reason: str


def lane_device(
    machine: str | None = None, system: str | None = None, environ: dict | None = None
) -> str:
    """ "metal" or "cpu": where this machine's llama.cpp lane computes by default."""
    machine = (machine if machine is not None else platform.machine()).lower()
    system = system if system is not None else platform.system()
    env = os.environ if environ is None else environ
    if env.get(GPU_LAYERS_ENV, "").strip() == "0":
        return "cpu"
    return "metal" if (system == "Darwin" and machine == "arm64") else "cpu"


def embed_precision(device: str | None = None) -> PrecisionChoice:
    """The default embedder's GGUF precision for a llama.cpp lane on `device` (None: this
    machine's `lane_device()`)."""
    device = device or lane_device()
    if device == "cpu":
        return PrecisionChoice(
            "f32",
            "CPU lane: llama.cpp converts f16 weights to float on every matmul (BLAS "
            "and x86 kernels); f32 measured 1.1-1.7x faster",
        )
    return PrecisionChoice("f16", f"{device} lane: the GPU computes in f16 natively")


def lane_precisions(kind: str, gguf_dtype: str | None) -> dict[str, str]:
    """What each lane computes with for a store entry: the GGUF's dtype on the llama.cpp lane,
    fp16 on the Core ML lane (encoders only: it builds its graph from the HF weights)."""
    out = {"llama": gguf_dtype or "unknown"}
    if kind in ("embed", "rerank"):
        out["ane"] = "fp16"
    return out
