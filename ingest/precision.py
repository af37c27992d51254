"""Which precision the default embedder's GGUF has on this machine, and what each lane serves.

The rule is decided by measurement (`python -m bench.embed`, 512 mixed sentences, 2 threads,
llama.cpp in-process, same run), at equal fidelity: f16 and f32 MiniLM both certify with min
cosine >= 0.9999 against the fp32 reference.

- x86_64 -> f32. ggml's x86 kernels have no fp16 arithmetic: an f16 weight matrix is
  converted to f32 (F16C) on every matmul, which costs more than the halved weight bytes save
  on a model this small (MiniLM: 90 MB in f32). Measured f32 / f16: 1.74x on a 2-core AMD
  EPYC (AVX2; issue 14: 30.7 vs 17.6 sentences/s), ~1.1x on a 2-core Intel Xeon with AVX-512
  and AVX512-FP16 (interleaved in-process runs on a heavily shared machine: noisy), whose fp16
  arithmetic ggml does not use for f16 matmuls. f16 was faster on no x86 machine measured.
  With the OpenBLAS build (scripts/llama_wheel.py) f32 gains again: ggml hands f32 matmuls
  to sgemm as they are, f16 ones only after converting the weights to f32 per matmul.
- Apple silicon (and other ARMv8.2+ CPUs with fp16 vector arithmetic) -> f16. Metal computes
  in f16 natively and ggml's ARM kernels multiply f16 without converting, so the cost above
  does not apply. NOT measured: there is no Mac here. f16 stays the default until
  `bench.embed --model minilm-l6-v2-f32` on a Mac shows the CPU lane faster in f32.
- anything else -> f32 (no fp16 arithmetic assumed: the x86 case).

The Core ML lane builds its own fp16 graph from the same Hugging Face weights, whatever the
GGUF's precision.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Dtype = Literal["f32", "f16"]

_ARM = ("arm64", "aarch64")


@dataclass(frozen=True)
class PrecisionChoice:
    dtype: Dtype
    reason: str


def embed_precision(
    machine: str | None = None, system: str | None = None, cpu_flags: frozenset[str] | None = None
) -> PrecisionChoice:
    """The default embedder's GGUF precision for this machine (arguments: for tests)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    system = system if system is not None else platform.system()
    if machine in _ARM and system == "Darwin":
        return PrecisionChoice(
            "f16", "Apple silicon: Metal and the CPU compute in f16 natively (CPU not measured)"
        )
    if machine in _ARM:
        flags = cpu_flags if cpu_flags is not None else _linux_cpu_flags()
        if "asimdhp" in flags:  # ARMv8.2 half-precision vector arithmetic
            return PrecisionChoice("f16", f"{machine} with fp16 vector arithmetic (not measured)")
        return PrecisionChoice("f32", f"{machine} without fp16 vector arithmetic")
    return PrecisionChoice(
        "f32", f"{machine or 'this CPU'}: llama.cpp converts f16 weights on every matmul here; "
        "f32 measured 1.1-1.7x faster"
    )


def lane_precisions(kind: str, gguf_dtype: str | None) -> dict[str, str]:
    """What each lane computes with for a store entry: the GGUF's dtype on the llama.cpp lane,
    fp16 on the Core ML lane (encoders only: it builds its graph from the HF weights)."""
    out = {"llama": gguf_dtype or "unknown"}
    if kind in ("embed", "rerank"):
        out["ane"] = "fp16"
    return out


def _linux_cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Features", "flags"):
            return frozenset(value.split())
    return frozenset()
