"""The CLI as a user runs it: real subprocesses, real workers, a private cache dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ingest.precision import embed_precision

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker


def synapse(cache_dir, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "SYNAPSE_CACHE_DIR": str(cache_dir)}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_models_ls_json(synapse_cache_dir):
    proc = synapse(synapse_cache_dir, "models", "ls", "--json")
    assert proc.returncode == 0, proc.stderr
    models = {m["name"]: m for m in json.loads(proc.stdout)}
    assert {"minilm-l6-v2", "minilm-l6-v2-f16", "minilm-l6-v2-f32", "gemma3-270m"} <= set(models)
    # The precision each lane serves; the default embedder's is this platform's choice.
    default = embed_precision().dtype
    assert models["minilm-l6-v2"]["precision"] == {"llama": default, "ane": "fp16"}
    assert models["minilm-l6-v2-f32"]["precision"]["llama"] == "f32"
    assert models["gemma3-270m"]["precision"] == {"llama": "q4_k_m"}


def test_models_ls_says_which_precision_is_default_and_why(synapse_cache_dir):
    proc = synapse(synapse_cache_dir, "models", "ls")
    assert proc.returncode == 0, proc.stderr
    choice = embed_precision()
    assert f"minilm-l6-v2 is {choice.dtype} on this machine" in " ".join(proc.stdout.split())


def test_embed_json_prints_unit_vectors(synapse_cache_dir):
    proc = synapse(synapse_cache_dir, "embed", "--json", "hello world", "bonjour")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    vectors = np.array(out["data"])
    assert vectors.shape == (2, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    assert out["usage"]["total_tokens"] > 4


def test_quickstart_installs_the_defaults_and_embeds(synapse_cache_dir):
    """What `make run` runs, the README's first command."""
    proc = synapse(synapse_cache_dir, "quickstart")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "minilm-l6-v2" in out and "Le chat dort sur le tapis." in out
    assert "next: `synapse rerank" in out


def test_typed_error_exit_code(synapse_cache_dir):
    proc = synapse(synapse_cache_dir, "embed", "--model", "nope", "x")
    assert proc.returncode == 2
    assert "error[model_not_found]" in proc.stderr


def test_generate_with_grammar_file(synapse_cache_dir, tmp_path):
    grammar = tmp_path / "yn.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    proc = synapse(
        synapse_cache_dir,
        "generate",
        "Is fire hot?",
        "--max-tokens",
        "4",
        "--grammar",
        str(grammar),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] in ("yes", "no")


def test_generate_with_a_grammar_file_that_cannot_be_read_is_a_clear_error(
    synapse_cache_dir, tmp_path
):
    proc = synapse(synapse_cache_dir, "generate", "x", "--grammar", str(tmp_path / "none"))
    assert proc.returncode == 2, proc.stderr
    assert "error[invalid_request]: cannot read grammar" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctor_reports_what_runs_here(synapse_cache_dir):
    proc = synapse(synapse_cache_dir, "doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["llama_cpp"]["available"] and report["llama_cpp"]["build_flags"]
    assert "reference" in report["ane_backends"]
    if sys.platform != "darwin":
        assert report["coreml"]["runtime"] is False and "macOS" in report["coreml"]["reason"]
        assert report["ane_backends"] == ["reference"]
        assert report["apple"] == {
            "chip": None,
            "macos": None,
            "macos_build": None,
            "neural_engine": None,
            "neural_engine_cores": None,
            "reason": "not macOS",
        }
    # macOS CI sets SYNAPSE_COREML_COMPUTE_UNITS=cpu_only (its VMs have no Neural Engine).
    want_units = os.environ.get("SYNAPSE_COREML_COMPUTE_UNITS") or "cpu_and_ne"
    assert report["coreml_compute_units"] == want_units
