"""A CPU lane's llama.cpp worker starts with Metal switched off (`host.cpu_lane`).

llama.cpp's rule (ggml-metal.cpp, `ggml_backend_metal_reg`): the registry creates
`atoi(getenv("GGML_METAL_DEVICES"))` Metal devices when it is first built, so the variable
must be in the worker's environment at exec. The real test reads the environment the kernel
holds for the spawned worker process (Linux: /proc/PID/environ; macOS: `ps -E`), so it pins
what the process was started with, not what the host meant to pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host.config import HostConfig
from host.cpu_lane import GPU_LAYERS_ENV, METAL_DEVICES_ENV, is_cpu_lane, llama_worker_env
from host.module import Module, ModuleConfig

pytestmark = pytest.mark.model  # starts model workers


@pytest.mark.parametrize(
    ("requested", "env", "cpu"),
    [
        (None, {}, False),  # "auto": the build decides (Metal on a Mac)
        ("auto", {}, False),
        (0, {}, True),
        (4, {}, False),
        (None, {GPU_LAYERS_ENV: "0"}, True),  # the operator's override wins
        (None, {GPU_LAYERS_ENV: " 0 "}, True),
        (8, {GPU_LAYERS_ENV: "0"}, True),
        (0, {GPU_LAYERS_ENV: "auto"}, False),  # ... both ways: "auto" may offload
        (0, {GPU_LAYERS_ENV: "12"}, False),
        (0, {GPU_LAYERS_ENV: ""}, True),  # empty is unset (workers.llama.device)
        (None, {GPU_LAYERS_ENV: "zero"}, False),  # refused at LOAD; nothing to switch
        (False, {}, False),  # a bool is not a layer count
    ],
)
def test_which_lanes_are_cpu_lanes(requested, env, cpu) -> None:
    assert is_cpu_lane(requested, env) is cpu
    assert llama_worker_env(requested, env) == ({METAL_DEVICES_ENV: "0"} if cpu else {})


def process_environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with, as the OS reports it."""
    if sys.platform.startswith("linux"):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0"))
        return {k: v for k, sep, v in pairs if sep}
    # macOS: `ps -E` appends the environment to the command line (same user only).
    out = subprocess.run(
        ["ps", "-wwE", "-o", "command=", "-p", str(pid)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {k: v for k, sep, v in (w.partition("=") for w in out.split()) if sep and k.isupper()}


async def test_the_cpu_lane_worker_is_spawned_with_metal_off(
    store_root, short_runtime_dir, monkeypatch
) -> None:
    monkeypatch.delenv(METAL_DEVICES_ENV, raising=False)
    operator_cpu = os.environ.get(GPU_LAYERS_ENV, "").strip() == "0"  # the macOS CI job
    config = ModuleConfig(
        store_root=store_root,
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    async with Module(config) as mod:
        await mod.load("minilm-l6-v2-f32", lane="llama", runtime_config_extra={"gpu_layers": 0})
        await mod.load("minilm-l6-v2-f16", lane="llama")  # "auto"
        cpu_lane = mod.supervisor("minilm-l6-v2-f32", "llama")
        auto_lane = mod.supervisor("minilm-l6-v2-f16", "llama")
        assert cpu_lane is not None and auto_lane is not None
        cpu_pid, auto_pid = cpu_lane.state().pid, auto_lane.state().pid
        assert cpu_pid and auto_pid and cpu_pid != os.getpid()

        assert process_environ(cpu_pid).get(METAL_DEVICES_ENV) == "0"
        expected_auto = "0" if operator_cpu else None
        assert process_environ(auto_pid).get(METAL_DEVICES_ENV) == expected_auto

        # The switched-off worker serves: the CPU lane computes as before.
        result = await mod.embed(["a cpu lane still embeds"], model="minilm-l6-v2-f32")
        assert result.vectors.shape[0] == 1 and np.isfinite(result.vectors).all()
