"""The default embedder's precision by platform (ingest.precision): pure rules."""

from __future__ import annotations

import platform

import pytest

from ingest.precision import embed_precision, lane_precisions


@pytest.mark.parametrize(
    ("machine", "system", "flags", "dtype"),
    [
        ("x86_64", "Linux", {"avx2", "f16c"}, "f32"),  # AMD EPYC: measured 1.74x in f32
        ("x86_64", "Linux", {"avx512f", "avx512_fp16"}, "f32"),  # ggml has no fp16 math here
        ("AMD64", "Windows", set(), "f32"),
        ("x86_64", "Darwin", set(), "f32"),  # Intel Macs: the x86 rule
        ("arm64", "Darwin", set(), "f16"),  # Apple silicon: Metal and CPU compute in f16
        ("aarch64", "Linux", {"fp", "asimd", "asimdhp"}, "f16"),
        ("aarch64", "Linux", {"fp", "asimd"}, "f32"),  # e.g. Cortex-A72: no fp16 arithmetic
        ("riscv64", "Linux", set(), "f32"),
    ],
)
def test_embed_precision_by_platform(machine, system, flags, dtype) -> None:
    choice = embed_precision(machine, system, frozenset(flags))
    assert choice.dtype == dtype
    assert choice.reason  # every choice says why


def test_this_machine_gets_a_choice() -> None:
    choice = embed_precision()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert choice.dtype == "f32" and "converts f16" in choice.reason


def test_lane_precisions() -> None:
    assert lane_precisions("embed", "f32") == {"llama": "f32", "ane": "fp16"}
    assert lane_precisions("rerank", "f16") == {"llama": "f16", "ane": "fp16"}
    assert lane_precisions("generate", "q4_k_m") == {"llama": "q4_k_m"}  # no Core ML lane
    assert lane_precisions("embed", None) == {"llama": "unknown", "ane": "fp16"}
