"""The default embedder's precision by the llama.cpp lane's device (ingest.precision): f32 on
every CPU lane (BLAS converts non-f32 weights per matmul), f16 on a GPU lane."""

from __future__ import annotations

import platform

import pytest

from ingest.precision import GPU_LAYERS_ENV, embed_precision, lane_device, lane_precisions


@pytest.mark.parametrize(
    ("machine", "system", "env", "device"),
    [
        ("x86_64", "Linux", {}, "cpu"),
        ("aarch64", "Linux", {}, "cpu"),  # our Linux wheel: CPU + OpenBLAS
        ("x86_64", "Darwin", {}, "cpu"),  # Intel Macs: no Metal lane
        ("arm64", "Darwin", {}, "metal"),  # llama-cpp-python always builds Metal there
        ("arm64", "Darwin", {GPU_LAYERS_ENV: "0"}, "cpu"),  # the operator keeps it on the CPU
        ("arm64", "Darwin", {GPU_LAYERS_ENV: "auto"}, "metal"),
    ],
)
def test_the_lane_device_by_machine_and_override(machine, system, env, device) -> None:
    assert lane_device(machine, system, env) == device


@pytest.mark.parametrize(("device", "dtype"), [("cpu", "f32"), ("metal", "f16"), ("cuda", "f16")])
def test_precision_follows_the_device_not_the_platform(device, dtype) -> None:
    choice = embed_precision(device)
    assert choice.dtype == dtype and choice.reason  # every choice says why
    if device == "cpu":
        assert "converts f16 weights" in choice.reason


def test_this_machine_gets_a_choice() -> None:
    choice = embed_precision()
    if platform.system() != "Darwin":
        assert choice.dtype == "f32"


def test_lane_precisions() -> None:
    assert lane_precisions("embed", "f32") == {"llama": "f32", "ane": "fp16"}
    assert lane_precisions("rerank", "f16") == {"llama": "f16", "ane": "fp16"}
    assert lane_precisions("generate", "q4_k_m") == {"llama": "q4_k_m"}  # no Core ML lane
    assert lane_precisions("embed", None) == {"llama": "unknown", "ane": "fp16"}
