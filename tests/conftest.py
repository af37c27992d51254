"""Shared fixtures. Protocol windows are shortened by configuration, never slept through."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from ingest.model_packages import minilm_dir

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the test Ray never phones home


@pytest.fixture
def short_runtime_dir():
    # pytest's tmp_path can exceed the 107-byte sun_path limit; sockets need a short dir.
    path = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """A temp dir for one module's shared artifacts, removed when the module ends: the suite
    builds artifacts of 90-370 MB, and keeping every module's until the session ends needs GBs
    of disk that a CI machine may not have."""
    path = tmp_path_factory.mktemp("module")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def test_cross_encoder_dir(tmp_path_factory):
    """The TEST cross-encoder (MiniLM + seeded head, seed 0), written once per session: for
    numerical fidelity only, it ranks nothing."""
    from certification.reference.cross_encoder import build_test_cross_encoder

    return build_test_cross_encoder(tmp_path_factory.mktemp("xenc") / "test-xenc", seed=0)


@pytest.fixture(scope="session")
def synapse_cache_dir(tmp_path_factory):
    """A private SYNAPSE_CACHE_DIR with the default models ingested once per session."""
    from ingest.defaults import ensure_defaults

    cache = tmp_path_factory.mktemp("synapse-cache")
    ensure_defaults(str(cache / "models"))
    return cache


@pytest.fixture(scope="session")
def store_root(synapse_cache_dir) -> str:
    return str(synapse_cache_dir / "models")


# The test model with sentence-transformers prompts: MiniLM's weights and tokenizer under an
# e5-style config (MiniLM itself declares none). Its Matryoshka widths exercise the manifest
# path only; MiniLM was not trained for them.
PROMPTED_MODEL = "minilm-prompts"
PROMPTS = {"query": "query: ", "passage": "passage: "}


def write_prompted_dir(dst):
    """MiniLM's package directory copied to `dst` with e5-style prompts, "query" the default."""
    import json

    shutil.copytree(minilm_dir(), dst)
    (dst / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": PROMPTS, "default_prompt_name": "query", "similarity_fn_name": "cosine"}))
    return dst


@pytest.fixture(scope="session")
def prompted_model(store_root, tmp_path_factory) -> str:
    """`PROMPTED_MODEL` in the session's store, ingested once (f16: the smaller build)."""
    from ingest.store import ArtifactStore

    store = ArtifactStore(store_root)
    if PROMPTED_MODEL not in {r.name for r in store.ls()}:
        src = write_prompted_dir(tmp_path_factory.mktemp("prompted") / "e5-style")
        store.ingest_hf_dir(src, name=PROMPTED_MODEL, dtype="f16", matryoshka_dims=[256, 128])
        shutil.rmtree(src, ignore_errors=True)
    return PROMPTED_MODEL


@pytest.fixture(scope="session")
def ray_session():
    """ONE local Ray (2 CPUs, private temp dir) for every Ray test of the session."""
    from tests.ray_support import start_ray, stop_ray

    ray, temp_dir, _ = start_ray()
    yield ray
    left = stop_ray(ray, temp_dir)
    assert not left, f"Ray processes outlived ray.shutdown(): {[p.pid for p in left]}"


# ---- `make test-fast`: the inner loop ---------------------------------------------------------
# A test is marked `model` when it starts a model worker or builds/loads a real model, so
# `pytest -m "not model"` (make test-fast) keeps protocol, supervision (with the faulty worker),
# config, cache, layout and docs tests: the fast inner loop. `make test` runs everything.
MODEL_FIXTURES = {"synapse_cache_dir", "store_root", "ray_session", "test_cross_encoder_dir",
                  "prompted_model"}
# Modules whose own fixtures build or load real models (no shared fixture to detect).
MODEL_MODULES = {
    "test_ane_builder", "test_ane_compiler", "test_ane_compute_plan", "test_ane_coreml",
    "test_ane_engine", "test_ane_executor", "test_ane_packing", "test_artifacts", "test_disk_full",
    "test_llama_engine", "test_prompts", "test_reference_bert", "test_worker_start",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "model: starts a model worker or builds a real model")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if MODEL_FIXTURES & set(item.fixturenames) or module in MODEL_MODULES:
            item.add_marker(pytest.mark.model)
