"""Where the llama.cpp lane computes: gpu_layers, the env override, the device it names, the
execution permit it takes. Real workers and this machine's real llama.cpp build (CPU-only
here: llama_supports_gpu_offload() is false); the Metal half runs on the macOS CI job."""

from __future__ import annotations

import os
import platform
import sys

import llama_cpp
import msgspec
import numpy as np
import pytest

from certification.identity import LaneIdentity, key_for
from certification.lane_client import llama_identity
from host.config import HostConfig
from host.errors import WorkerError
from host.module import Module, ModuleConfig, permit_for
from workers.cpus import performance_cores, usable_cpu_count
from workers.llama.device import (
    ALL_LAYERS,
    GPU_LAYERS_ENV,
    backends,
    describe_build,
    offload_device,
    parse_gpu_layers,
    resolve_gpu_layers,
)
from workers.llama.native import context_params, model_params

MODEL = "minilm-l6-v2"
BUILD_OFFLOADS = bool(llama_cpp.llama_supports_gpu_offload())
SYSTEM_INFO = llama_cpp.llama_print_system_info().decode()


def module_config(store_root: str, runtime_dir: str) -> ModuleConfig:
    return ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )


# ---- the rules, on this build's real facts ----------------------------------------------------


def test_auto_follows_the_build_and_integers_need_offload():
    build = "llama-cpp-python 0.3.36, backends: CPU"
    assert resolve_gpu_layers("auto", False, build, {}) == 0
    assert resolve_gpu_layers("auto", True, build, {}) == ALL_LAYERS
    assert resolve_gpu_layers(0, False, build, {}) == 0
    assert resolve_gpu_layers(12, True, build, {}) == 12
    with pytest.raises(ValueError, match=r"gpu_layers=12: this llama.cpp build \(llama-cpp"):
        resolve_gpu_layers(12, False, build, {})


def test_env_override_wins_and_is_validated():
    build = "b"
    assert resolve_gpu_layers("auto", True, build, {GPU_LAYERS_ENV: "0"}) == 0
    assert resolve_gpu_layers(5, True, build, {GPU_LAYERS_ENV: "auto"}) == ALL_LAYERS
    assert resolve_gpu_layers(5, True, build, {GPU_LAYERS_ENV: " "}) == 5  # empty: unset
    with pytest.raises(ValueError, match=f"{GPU_LAYERS_ENV}=3: this llama.cpp build"):
        resolve_gpu_layers(0, False, build, {GPU_LAYERS_ENV: "3"})
    for bad in ("-1", "all", "1.5"):
        with pytest.raises(ValueError, match='expected "auto" or an integer >= 0'):
            parse_gpu_layers(bad)


def test_offload_device_is_named_from_the_backend_list():
    assert offload_device(SYSTEM_INFO, False) == "cpu"  # no offload: the CPU, whatever listed
    # llama_print_system_info's format: "<backend> : FEATURE = 1 | ... | <backend> : ..."; the
    # Metal backend registers as "MTL" (older builds "Metal"), CPU-side BLAS is no GPU.
    assert offload_device("MTL : EMBED_LIBRARY = 1 | CPU : NEON = 1 | ", True) == "metal"
    assert offload_device("BLAS : ACCELERATE = 1 | Metal : EMBED_LIBRARY = 1 | ", True) == "metal"
    assert offload_device("CUDA : ARCHS = 890 | CPU : AVX2 = 1 | ", True) == "cuda"
    assert offload_device("CPU : AVX2 = 1 | ", True) == "gpu"  # offloads to an unnamed GPU
    # This build's own list: "CPU" here; "MTL, CPU" (Metal) with llama-cpp-python on a Mac,
    # where it forces GGML_METAL. Expectations follow the backends actually present.
    present = backends(SYSTEM_INFO)
    assert "CPU" in present
    gpus = [b for b in present if b.lower() not in ("cpu", "blas", "amx", "rpc")]
    assert offload_device(SYSTEM_INFO, True) == (
        {"mtl": "metal", "metal": "metal"}.get(gpus[0].lower(), gpus[0].lower()) if gpus else "gpu"
    )
    if sys.platform == "darwin":
        assert gpus and gpus[0].lower() in ("mtl", "metal"), present
    assert describe_build("0.3.36", SYSTEM_INFO) == (
        f"llama-cpp-python 0.3.36, backends: {', '.join(present)}"
    )
    assert describe_build("0.3.36", "CPU : AVX2 = 1 | ") == "llama-cpp-python 0.3.36, backends: CPU"


def test_a_cpu_lane_lists_no_gpu_device_and_offloads_no_op():
    # llama.cpp keeps every GPU in model->devices unless split_mode is NONE and main_gpu < 0,
    # and op_offload hands large host-weight matmuls to a GPU: a CPU lane must say all three.
    cpu = model_params(0)
    assert (cpu.n_gpu_layers, cpu.split_mode, cpu.main_gpu) == (
        0,
        llama_cpp.LLAMA_SPLIT_MODE_NONE,
        -1,
    )
    assert context_params(offloaded=False).op_offload is False
    gpu = model_params(ALL_LAYERS)
    default = llama_cpp.llama_model_default_params()
    assert gpu.n_gpu_layers == ALL_LAYERS
    assert (gpu.split_mode, gpu.main_gpu) == (default.split_mode, default.main_gpu)
    assert context_params(offloaded=True).op_offload is True  # llama.cpp's default, kept
    assert model_params(0, use_mmap=False).load_mode == llama_cpp.LLAMA_LOAD_MODE_NONE
    assert model_params(0).load_mode == llama_cpp.LLAMA_LOAD_MODE_MMAP


def test_permit_kind_follows_the_device():
    assert permit_for("llama", "cpu") == "cpu"
    assert permit_for("llama", "metal") == "gpu" and permit_for("llama", "cuda") == "gpu"
    assert permit_for("ane", "ane") == "ane"
    assert HostConfig().permits()["gpu"] == 1  # one shared GPU on Apple silicon


def test_thread_count_falls_back_where_there_is_no_affinity(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        assert usable_cpu_count() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")  # as on macOS
    if sys.platform == "darwin":  # Apple silicon: the performance cores, where it says
        import subprocess

        perf = subprocess.run(
            ["sysctl", "-n", "hw.perflevel0.physicalcpu"], capture_output=True, text=True
        ).stdout.strip()
        assert usable_cpu_count() == (int(perf) if perf.isdigit() else os.cpu_count())
        assert usable_cpu_count() <= (os.cpu_count() or 1)
    else:
        assert usable_cpu_count() == (os.cpu_count() or 1)


def test_performance_cores_are_read_from_sysctl_or_not_at_all():
    assert performance_cores("8\n") == 8 and performance_cores("4") == 4
    # Intel Macs and older macOS have no perflevel keys: the core count is used instead.
    for missing in ("", None, "0", "sysctl: unknown oid 'hw.perflevel0.physicalcpu'"):
        assert performance_cores(missing) is None


# ---- through real workers ---------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.skipif(BUILD_OFFLOADS, reason="this llama.cpp build offloads; covered on macOS")
async def test_auto_serves_on_the_cpu_here_and_names_it(store_root, short_runtime_dir, monkeypatch):
    monkeypatch.delenv(GPU_LAYERS_ENV, raising=False)
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load(MODEL, "llama")
        lane = mod.supervisor(MODEL, "llama")
        flags = lane.hello.engine.build_flags
        assert flags.startswith("CPU : ") and flags.endswith(" | device=cpu")
        assert mod.lane_identity(MODEL, "llama")["device"] == "cpu"
        assert lane.config.device == "cpu" and mod.llama_device == "cpu"
        assert llama_identity(mod, MODEL).device == "cpu"
        await mod.load("minilm-l6-v2-f32", "llama")
        assert mod.supervisor("minilm-l6-v2-f32", "llama").permits is lane.permits is mod.permits
        with pytest.raises(KeyError, match="no execution permits configured for device 'tpu'"):
            lane.set_device("tpu")
        assert lane.config.device == "cpu"


@pytest.mark.model
@pytest.mark.skipif(BUILD_OFFLOADS, reason="this llama.cpp build offloads; covered on macOS")
async def test_gpu_layers_without_offload_is_config_invalid_naming_the_build(
    store_root, short_runtime_dir, monkeypatch
):
    monkeypatch.delenv(GPU_LAYERS_ENV, raising=False)
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        with pytest.raises(WorkerError) as info:
            await mod.load(MODEL, "llama", {"gpu_layers": 4})
        assert info.value.code == "config_invalid"
        assert f"llama-cpp-python {llama_cpp.__version__}, backends: CPU" in info.value.message
        assert "gpu_layers=4" in info.value.message
        for bad in (-1, "all", 1.5):
            with pytest.raises(WorkerError) as info:
                await mod.load(MODEL, "llama", {"gpu_layers": bad})
            assert info.value.code == "config_invalid"
        # Explicit 0 is the CPU, as asked.
        await mod.load(MODEL, "llama", {"gpu_layers": 0})
        assert mod.lane_identity(MODEL, "llama")["device"] == "cpu"


@pytest.mark.model
@pytest.mark.skipif(BUILD_OFFLOADS, reason="this llama.cpp build offloads; covered on macOS")
async def test_env_override_reaches_the_worker(store_root, short_runtime_dir, monkeypatch):
    monkeypatch.setenv(GPU_LAYERS_ENV, "3")  # workers inherit the host's environment
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        with pytest.raises(WorkerError) as info:
            await mod.load(MODEL, "llama")
        assert info.value.code == "config_invalid"
        assert f"{GPU_LAYERS_ENV}=3: this llama.cpp build" in info.value.message
    monkeypatch.setenv(GPU_LAYERS_ENV, "lots")
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        with pytest.raises(WorkerError) as info:
            await mod.load(MODEL, "llama")
        assert info.value.code == "config_invalid"
        assert f"{GPU_LAYERS_ENV}='lots': expected" in info.value.message
    monkeypatch.setenv(GPU_LAYERS_ENV, "0")  # wins over the runtime_config
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load(MODEL, "llama", {"gpu_layers": 7})
        assert mod.lane_identity(MODEL, "llama")["device"] == "cpu"
        assert (await mod.embed(["still served"], lane="llama")).vectors.shape == (1, 384)


@pytest.mark.model
async def test_identity_differs_by_device(store_root, short_runtime_dir):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load(MODEL, "llama")
        here = llama_identity(mod, MODEL)
    metal = msgspec.structs.replace(here, device="metal")
    assert key_for(here).id != key_for(metal).id
    assert "device: metal -> " + here.device in key_for(here).differences(key_for(metal))
    assert LaneIdentity.from_mapping(MODEL, "llama", {"device": "metal"}).device == "metal"


# ---- macOS: Metal really used (on a Mac with a usable GPU; never faked here) ----------------


@pytest.mark.model
async def test_metal_offload_is_used_and_agrees_with_the_cpu(store_root, short_runtime_dir):
    if sys.platform != "darwin" or platform.machine() != "arm64":
        pytest.skip("needs macOS on Apple silicon: Metal offload")
    if not BUILD_OFFLOADS:
        pytest.skip("needs a llama.cpp build with Metal (llama_supports_gpu_offload)")
    if os.environ.get(GPU_LAYERS_ENV) == "0":
        pytest.skip(f"needs a usable Metal device ({GPU_LAYERS_ENV}=0: hosted VM)")
    texts = ["The cat sits on the mat.", "Stock markets fell sharply on Monday."]
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load(MODEL, "llama")
        assert mod.lane_identity(MODEL, "llama")["device"] == "metal"
        assert mod.supervisor(MODEL, "llama").config.device == "gpu"
        gpu = (await mod.embed(texts, lane="llama")).vectors
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load(MODEL, "llama", {"gpu_layers": 0})
        assert mod.lane_identity(MODEL, "llama")["device"] == "cpu"
        cpu = (await mod.embed(texts, lane="llama")).vectors
    assert np.sum(gpu * cpu, axis=1).min() >= 0.9999
