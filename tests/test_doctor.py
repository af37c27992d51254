"""`synapse doctor` on this machine, through the real CLI: chip, macOS version, llama.cpp
GPU offload and its device, Neural Engine presence, and the lane each model would get."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

ROOT = Path(__file__).resolve().parent.parent


def doctor(cache_dir, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "doctor", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        env={**os.environ, "SYNAPSE_CACHE_DIR": str(cache_dir), **env, "COLUMNS": "200"},
    )


def test_doctor_json_reports_devices_and_lanes(synapse_cache_dir):
    proc = doctor(synapse_cache_dir, "--json", SYNAPSE_LLAMA_GPU_LAYERS="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["chip"]
    llama = data["llama_cpp"]
    assert llama["available"] and llama["gpu_layers_env"] == 0 and llama["device"] == "cpu"
    assert isinstance(llama["gpu_offload"], bool) and "CPU : " in llama["build_flags"]
    backends = llama["build_flags"].split("backends=")[1].split("|")[0].strip()
    assert "CPU" in backends.split(",")
    lanes = data["lanes"]
    assert lanes["gemma3-270m"] == {
        "lane": "llama",
        "device": "cpu",
        "reason": "llama/cpu: generation runs on llama.cpp only",
    }
    minilm = lanes["minilm-l6-v2"]
    if sys.platform != "darwin":
        assert data["macos_version"] is None
        assert data["neural_engine"] == {"present": None, "cores": None, "source": "not macOS"}
        assert not llama["gpu_offload"]  # this Linux build has no GPU backend
        # No certificate can be certified here (placement needs Core ML's compute plan).
        assert minilm["lane"] == "llama" and minilm["reason"].startswith("llama/cpu: ")
        assert "ANE certificate" in minilm["reason"]


def test_doctor_table_names_the_lane_of_each_model(synapse_cache_dir):
    proc = doctor(synapse_cache_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "llama.cpp GPU offload" in out and "lane for minilm-l6-v2" in out
    assert "chip / macOS" in out
    # One Neural Engine row (presence and cores together), never two that could disagree.
    assert sum(line.lstrip("│ ").startswith("Neural Engine") for line in out.splitlines()) == 1


def test_doctor_reports_a_bad_env_override(synapse_cache_dir):
    proc = doctor(
        synapse_cache_dir,
        "--json",
        SYNAPSE_LLAMA_GPU_LAYERS="lots",
        OPENBLAS_CORETYPE="Sandybridge",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    llama = json.loads(proc.stdout)["llama_cpp"]
    assert 'expected "auto" or an integer >= 0' in llama["gpu_layers_env"]
    if sys.platform.startswith("linux"):
        # Kept for the workers, as a user's choice, and named for what it costs here.
        from workers.llama import openblas_core as oc

        assert "OPENBLAS_CORETYPE=Sandybridge (set by the user" in llama["openblas"]
        better = oc.held_back("Sandybridge", oc.this_cpu_flags())
        assert (f"this CPU runs {better} kernels" in llama["openblas"]) == bool(better)


@pytest.mark.skipif(sys.platform != "darwin", reason="needs macOS: macOS version and chip")
def test_doctor_on_a_mac(synapse_cache_dir):
    data = json.loads(doctor(synapse_cache_dir, "--json").stdout)
    assert data["macos_version"] and data["chip"].startswith("Apple")
    ne = data["neural_engine"]
    if ne["present"]:  # a real Mac: Core ML's own count (macOS >= 14), never a guess
        assert ne["cores"] is None or ne["cores"] > 0
