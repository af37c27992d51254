"""Shared fixtures. Protocol windows are shortened by configuration, never slept through."""

from __future__ import annotations

import ast
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ingest.model_packages import minilm_dir
from workers.llama import openblas_core

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# Tests that run llama.cpp in this process get the OpenBLAS kernels its workers get: decided
# before any test loads llama_cpp (and with it OpenBLAS).
openblas_core.apply()
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
    from ingest.store import MANIFEST_FILE
    from tests.encoding_support import private_store
    from tests.session_share import build_once

    cache = tmp_path_factory.mktemp("synapse-cache")
    # Converted once per test run (across xdist's processes); each process's store hard-links
    # the files and owns its manifests, as a private store does. The defaults check finds them.
    built = build_once(tmp_path_factory, "default-models", lambda d: ensure_defaults(str(d)))
    private_store(built, cache / "models", sorted(p.name for p in built.iterdir() if p.is_dir()))
    ensure_defaults(str(cache / "models"))
    # Every module reads these models as ingest wrote them: a test that changes one (records a
    # calibration, say) must do it in a store of its own (tests/encoding_support.private_store),
    # or the outcome of later modules depends on the order they run in.
    manifests = {p: p.read_bytes() for p in (cache / "models").glob(f"*/{MANIFEST_FILE}")}
    assert manifests, "the default models were not ingested"
    yield cache
    changed = sorted(p.parent.name for p, text in manifests.items() if p.read_bytes() != text)
    assert not changed, f"a test changed the session store's manifests of {changed}"


@pytest.fixture(scope="session")
def store_root(synapse_cache_dir) -> str:
    return str(synapse_cache_dir / "models")


@pytest.fixture(scope="module")
def own_certificates_cache(synapse_cache_dir, module_tmp) -> Path:
    """A SYNAPSE_CACHE_DIR for one module that shares the session's models and compile cache
    (linked: nothing is rebuilt) and keeps its certificates to itself. A lane policy reads the
    certificates beside the store, so one module's certificates would otherwise decide another
    module's lane choice and make "never certified" depend on the order modules run in."""
    dst = module_tmp / "cache"
    dst.mkdir()
    for shared in ("models", "compile_cache"):
        (synapse_cache_dir / shared).mkdir(exist_ok=True)
        (dst / shared).symlink_to(synapse_cache_dir / shared, target_is_directory=True)
    (dst / "certificates").mkdir()
    return dst


# The test model with sentence-transformers prompts: MiniLM's weights and tokenizer under an
# e5-style config (MiniLM itself declares none). Its Matryoshka widths exercise the manifest
# path only; MiniLM was not trained for them.
PROMPTED_MODEL = "minilm-prompts"
PROMPTS = {"query": "query: ", "passage": "passage: "}


def write_prompted_dir(dst):
    """MiniLM's package directory copied to `dst` with e5-style prompts, "query" the default."""
    import json

    shutil.copytree(minilm_dir(), dst)
    (dst / "config_sentence_transformers.json").write_text(
        json.dumps(
            {"prompts": PROMPTS, "default_prompt_name": "query", "similarity_fn_name": "cosine"}
        )
    )
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


# Certifications of the default model that several modules judge, each run once per test run
# (tests/session_certs.py): every 8th corpus item (42 items, every category); the Core ML lane
# on the reference executor (provisional: its placement is the estimate on every OS) in one
# packed shape (compiles once). A Core ML run's latency curve alone is ~255 requests on the
# reference executor. The runs leave the token-level outputs unjudged (late chunking's long
# documents): the modules that read them judge lanes, curves, policies and reports; the
# token-level judging is proven where it lives (tests/test_certification_kinds.py, and one
# default run in tests/test_certification.py).
CERT_MODEL = "minilm-l6-v2"
CERT_STRIDE = 8
ANE_CERT_SHAPES = [{"rows": 4, "seq_len": 256, "packed": True}]
XENC_CERT_MODEL = "cert-xenc-f16"


@pytest.fixture(scope="session")
def minilm_llama_certificate(synapse_cache_dir, tmp_path_factory):
    """The default model's llama.cpp lane, certified (sentence-transformers' reference)."""
    from certification.runner import RunOptions
    from tests.session_certs import certify_once

    options = RunOptions(model=CERT_MODEL, sample_stride=CERT_STRIDE, token_outputs=False)
    return certify_once(tmp_path_factory, "minilm-llama-cert", synapse_cache_dir, options)


@pytest.fixture(scope="session")
def minilm_ane_certificate(synapse_cache_dir, tmp_path_factory):
    """The default model's Core ML lane on the reference executor, provisionally certified."""
    from certification.runner import RunOptions
    from tests.session_certs import certify_once

    options = RunOptions(
        model=CERT_MODEL,
        lane="ane",
        shapes=ANE_CERT_SHAPES,
        sample_stride=CERT_STRIDE,
        runtime_config_extra={"backend": "reference"},
        token_outputs=False,
    )
    return certify_once(tmp_path_factory, "minilm-ane-cert", synapse_cache_dir, options)


@pytest.fixture(scope="session")
def xenc_llama_certificate(synapse_cache_dir, test_cross_encoder_dir, tmp_path_factory):
    """The TEST cross-encoder (f16, as `XENC_CERT_MODEL`) on the llama lane, certified: judged
    by the cross-encoder itself, on its own token types."""
    from certification.runner import RunOptions
    from tests.session_certs import certify_once

    def ingest(store) -> None:
        store.ingest_hf_dir(test_cross_encoder_dir, name=XENC_CERT_MODEL, dtype="f16")

    options = RunOptions(model=XENC_CERT_MODEL, sample_stride=CERT_STRIDE)
    return certify_once(tmp_path_factory, "xenc-llama-cert", synapse_cache_dir, options, ingest)


@pytest.fixture(scope="session")
def ray_session():
    """ONE local Ray (2 CPUs, private temp dir) for every Ray test of the session."""
    from tests.ray_support import start_ray, stop_ray

    ray, temp_dir, _ = start_ray()
    yield ray
    left = stop_ray(ray, temp_dir)
    assert not left, f"Ray processes outlived ray.shutdown(): {[p.pid for p in left]}"


# ---- `make test-fast`: the inner loop ---------------------------------------------------------
# A test that starts a model worker or builds/loads a real model says so: its module declares
# `pytestmark = pytest.mark.model`, or the test itself `@pytest.mark.model`. `pytest -m "not
# model"` (make test-fast) keeps protocol, supervision (with the faulty worker), config, cache,
# layout and docs tests: the fast inner loop. `make test` runs everything.
# The shared fixtures below build or load real models; a test that asks for one without the
# mark is a collection error, so the fast loop can never start a model by accident.
MODEL_FIXTURES = {
    "synapse_cache_dir",
    "store_root",
    "ray_session",
    "test_cross_encoder_dir",
    "prompted_model",
    "own_certificates_cache",
    "minilm_llama_certificate",
    "minilm_ane_certificate",
    "xenc_llama_certificate",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "model: starts a model worker or builds a real model")


# ---- Two test processes (pytest-xdist, `--dist loadscope`) ------------------------------------
# Each module runs whole in one process, so its module-scoped artifacts are built once. Every
# module that starts a Ray shares one scope and so one process, one module after another: two
# Rays at once on two cores starve each other's agents past their startup wait. The scopes are
# handed out in collection order, which puts the longest first (the Ray scope, then the modules
# that build models): one started last would leave the other process idle at the end.
# (pytest-xdist's own `loadgroup` cannot do this under pytest 9: it renames `Item._nodeid`,
# which pytest 9 no longer reads.)
RAY_SCOPE = "ray"


@functools.cache
def _module_scope(path: Path) -> str:
    source = path.read_text()
    if "_ray" in path.stem or "ray_session" in source:
        return RAY_SCOPE
    return str(path)


def _runs_first(path: Path) -> int:
    if _module_scope(path) == RAY_SCOPE:
        return 0
    return 1 if _declares_model_mark(path) else 2


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _module_scope(config.rootpath / nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False  # keep the order below
    return ModuleScopes(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _runs_first(item.path))  # stable: a module stays whole
    unmarked = [
        f"{item.nodeid} (uses {', '.join(sorted(MODEL_FIXTURES & set(item.fixturenames)))})"
        for item in items
        if MODEL_FIXTURES & set(item.fixturenames) and item.get_closest_marker("model") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that use a model fixture must be marked `model` "
            "(pytestmark = pytest.mark.model):\n  " + "\n  ".join(unmarked)
        )


@functools.cache  # asked once per test item, and a module has hundreds
def _declares_model_mark(path: Path) -> bool:
    """The module's own `pytestmark` names `pytest.mark.model` (read from its source: importing
    it would load what it tests)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return any(
                isinstance(n, ast.Attribute)
                and n.attr == "model"
                and isinstance(n.value, ast.Attribute)
                and n.value.attr == "mark"
                for n in ast.walk(node.value)
            )
    return False


def pytest_ignore_collect(collection_path: Path, config):
    # `-m "not model"` would deselect a model module's tests after importing it, and importing
    # them (coremltools, torch, Ray, the OpenAI client) cost the fast loop ~40 s of CPU: such a
    # module is not collected at all. Any other selection collects as usual.
    if (config.getoption("markexpr") or "").strip() != "not model":
        return None
    if (
        collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and _declares_model_mark(collection_path)
    ):
        return True
    return None
