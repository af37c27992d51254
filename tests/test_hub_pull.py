"""`synapse models pull ORG/NAME` against a real HTTP server on loopback that speaks the Hub's
file protocol (tests/hub_support.py), with the real huggingface_hub client pointed at it by
HF_ENDPOINT and the real `synapse` command line in a child process (huggingface_hub reads its
environment when it is imported). The model is a tiny seeded BERT built here; what pull makes
of it must be byte for byte what `models ingest DIR` makes of the same directory."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from ingest.store import ArtifactStore
from tests import small_disk
from tests.hub_support import HubServer, Repo, cut_at, repo_from_dir, tiny_bert_dir
from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
REPO = "acme/tiny-embed"
TOKEN = "hf_test_token_0123456789"
# Files the Hub repository has that the model does not need: never downloaded.
EXTRA = {
    "pytorch_model.bin": b"PK\x03\x04 a pickle that must never be fetched",
    "onnx/model.onnx": b"onnx graph",
    "rust_model.ot": b"rust weights",
    ".gitattributes": b"*.safetensors filter=lfs\n",
}
# Files of the source directory (MiniLM's layout) a model does not need.
SOURCE_NOT_NEEDED = (".gitattributes", "data_config.json")


@pytest.fixture(scope="module")
def source(module_tmp) -> Path:
    return tiny_bert_dir(module_tmp / "tiny-embed")


@pytest.fixture(scope="module")
def hub(source):
    files = repo_from_dir(source)
    config = json.loads(files["config.json"])
    repos = {
        REPO: Repo({**files, **EXTRA}),
        "acme/gated-embed": Repo(dict(files), gated_token=TOKEN),
        "acme/pickles-only": Repo(
            {"config.json": files["config.json"], "pytorch_model.bin": b"pickle"}
        ),
        "acme/llama-chat": Repo(
            {
                "config.json": json.dumps({**config, "model_type": "llama"}).encode(),
                "model.safetensors": files["model.safetensors"],
            }
        ),
    }
    with HubServer(repos) as server:
        yield server


def _env(tmp: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        # huggingface_hub also reads TRANSFORMERS_OFFLINE as its offline switch.
        if not k.startswith(("HF_", "HUGGINGFACE_"))
        and k not in ("SYNAPSE_CACHE_DIR", "TRANSFORMERS_OFFLINE")
    }
    return {
        **env,
        "PYTHONPATH": str(ROOT),
        "HF_HOME": str(tmp / "hf"),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "SYNAPSE_CACHE_DIR": str(tmp / "synapse"),
        "COLUMNS": "200",  # rich wraps listings at the terminal's width
        # Online unless a test says otherwise, whatever this process inherited (a runner that
        # merges os.environ under these keeps them); huggingface_hub reads both switches.
        "HF_HUB_OFFLINE": "",
        "TRANSFORMERS_OFFLINE": "",
        **extra,
    }


def synapse(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # one line, nothing else (no traceback)
    return lines[0]


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: connections are refused


def _fetched(hub: HubServer) -> list[str]:
    """The files the client downloaded (GET of a file or of its CDN blob)."""
    out = []
    for method, path in hub.requests():
        if method == "GET" and ("/resolve/" in path or path.startswith("/cdn/")):
            out.append(path)
    return out


@pytest.fixture(scope="module")
def pulled(module_tmp, hub, source):
    """One pull of REPO into a fresh Hugging Face cache and store, the connection dropped
    near the end of the weights (the transfer must resume, not start over)."""
    tmp = module_tmp / "pull"
    weights = (source / "model.safetensors").read_bytes()
    sha = hashlib.sha256(weights).hexdigest()
    env = _env(tmp, hub.endpoint)
    hub.clear()
    hub.interrupt.add(sha)
    proc = synapse(env, "models", "pull", REPO)
    assert proc.returncode == 0, proc.stderr
    return {
        "tmp": tmp,
        "env": env,
        "proc": proc,
        "requests": hub.requests(),
        "ranges": hub.range_requests(),
        "sha": sha,
        "cut": cut_at(weights),
    }


def test_pull_fetches_only_what_the_model_needs_and_builds_what_ingest_dir_builds(
    pulled, hub, source, module_tmp
):
    store = ArtifactStore(pulled["tmp"] / "synapse" / "models")
    rec = store.get("tiny-embed")
    prov = rec.manifest.provenance
    assert prov is not None and (prov.origin, prov.repo) == ("huggingface", REPO)
    assert prov.revision == hub.repos[REPO].commit and prov.requested == "main"
    assert prov.endpoint == hub.endpoint
    # Every file read, hashed from its bytes; none of the ones the model does not need.
    expected = {
        f: hashlib.sha256(d).hexdigest()
        for f, d in repo_from_dir(source).items()
        if f not in SOURCE_NOT_NEEDED
    }
    assert prov.files == expected
    fetched = " ".join(p for m, p in pulled["requests"] if m == "GET")
    for name in [*EXTRA, *SOURCE_NOT_NEEDED]:
        assert name not in fetched
    # The cut transfer resumed where it stopped (a Range request), and the result is whole
    # (the digests above).
    (ranged,) = [r for p, r in pulled["ranges"] if pulled["sha"] in p]
    start = int(ranged.removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= pulled["cut"], ranged
    # The same directory given to `models ingest DIR` makes the same GGUF, byte for byte.
    ref = ArtifactStore(module_tmp / "ref-store").ingest_hf_dir(source, name="tiny-embed")
    assert rec.digest == ref.digest
    assert (
        rec.manifest.prompts == ref.manifest.prompts == {"query": "query: ", "passage": "passage: "}
    )
    # The listing shows where it came from, as text and as JSON.
    ls = synapse(pulled["env"], "models", "ls")
    assert f"tiny-embed: from huggingface {REPO}@{prov.revision[:12]}" in ls.stdout
    listed = json.loads(synapse(pulled["env"], "models", "ls", "--json").stdout)
    assert listed[0]["provenance"]["revision"] == prov.revision


def test_a_pull_at_the_same_commit_does_nothing(pulled, hub):
    hub.clear()
    again = synapse(pulled["env"], "models", "pull", REPO)
    assert again.returncode == 0, again.stderr
    assert "already in the store, nothing to do" in again.stdout
    # Resolving the revision is the one request.
    assert [(m, p.split("?")[0]) for m, p in hub.requests()] == [
        ("GET", f"/api/models/{REPO}/revision/main")
    ]
    hub.clear()
    offline = synapse({**pulled["env"], "HF_HUB_OFFLINE": "1"}, "models", "pull", REPO)
    assert offline.returncode == 0, offline.stderr
    assert "nothing to do" in offline.stdout and hub.requests() == []


def test_ingest_by_repo_id_reads_the_cache_without_the_network(pulled, hub):
    env = {**pulled["env"], "HF_ENDPOINT": _dead_endpoint()}
    digest = ArtifactStore(pulled["tmp"] / "synapse" / "models").get("tiny-embed").digest
    assert synapse(env, "models", "rm", "tiny-embed").returncode == 0
    hub.clear()
    proc = synapse(env, "models", "ingest", REPO)
    assert proc.returncode == 0, proc.stderr
    assert "built from the Hugging Face cache" in proc.stdout
    assert hub.requests() == []
    rec = ArtifactStore(pulled["tmp"] / "synapse" / "models").get("tiny-embed")
    assert rec.digest == digest and rec.manifest.provenance is not None
    missing = synapse(env, "models", "ingest", "acme/never-pulled")
    assert missing.returncode == 2
    assert _error_line(missing).startswith("error[model_not_found]: the Hugging Face cache")


# (repository, HF_TOKEN, code, exit status, what the line says)
REFUSALS = [
    ("acme/no-such-repo", None, "repo_not_found", 2, "no repository acme/no-such-repo"),
    (f"{REPO}@v9", None, "repo_not_found", 2, "has no revision 'v9'"),
    ("acme/gated-embed", None, "repo_gated", 2, "no token was given"),
    ("acme/gated-embed", "hf_wrong", "repo_gated", 2, "has no access"),
    ("acme/pickles-only", None, "no_supported_weights", 2, "pytorch_model.bin"),
    ("acme/llama-chat", None, "unsupported_architecture", 2, "'llama'"),
]
# One interpreter runs every case through the command line's own entry point (each case a
# separate `main()`, its stderr captured): the same boundary, without an interpreter start per
# case.
_RUN_CASES = """
import contextlib, io, json, os, sys
from cli.main import main
out = []
for repo, token in json.loads(sys.argv[1]):
    os.environ.pop("HF_TOKEN", None)
    if token:
        os.environ["HF_TOKEN"] = token
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["models", "pull", repo])
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def test_each_refusal_is_one_line_with_its_code_and_the_store_is_untouched(tmp_path, hub):
    hub.clear()
    cases = json.dumps([[repo, token] for repo, token, *_ in REFUSALS])
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_CASES, cases],
        env=_env(tmp_path, hub.endpoint),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    for (repo, _, code, exit_code, says), (got, stderr) in zip(REFUSALS, results, strict=True):
        line = _error_line(subprocess.CompletedProcess([], got, "", stderr))
        assert (got, line.startswith(f"error[{code}]: ")) == (exit_code, True), (repo, line)
        assert says in line, (repo, line)
    # No network: the same one line, exit 3 (the same command may work later).
    dead = synapse(_env(tmp_path, _dead_endpoint()), "models", "pull", REPO)
    assert dead.returncode == 3
    assert _error_line(dead).startswith("error[hub_unreachable]: cannot reach http://127.0.0.1:")
    store = tmp_path / "synapse" / "models"
    assert not store.exists() or [p.name for p in store.iterdir() if p.name != ".lock"] == []
    # Refused before the download: no weights were fetched.
    assert not [p for p in _fetched(hub) if p.startswith("/cdn/")]


def test_a_gated_repository_opens_with_its_token(tmp_path, hub, pulled):
    env = _env(tmp_path, hub.endpoint, HF_TOKEN=TOKEN)
    proc = synapse(env, "models", "pull", "acme/gated-embed", "--name", "gated")
    assert proc.returncode == 0, proc.stderr
    rec = ArtifactStore(tmp_path / "synapse" / "models").get("gated")
    done = ArtifactStore(pulled["tmp"] / "synapse" / "models").get("tiny-embed")
    assert rec.manifest.provenance.files == done.manifest.provenance.files


def test_serve_config_names_models_by_repository_id(tmp_path, hub, pulled):
    """`preload = ["acme/tiny-embed"]`: pulled before the server starts when missing; with
    --offline, built from the cache without the network; the repository id becomes an
    alias of the store's model."""
    code = (
        "import sys, msgspec\n"
        "from service.config import ServeConfig\n"
        "from service.hub_models import resolve_repo_models\n"
        "c = resolve_repo_models(ServeConfig(preload=[sys.argv[1]], install_defaults=False),"
        " offline=sys.argv[2] == '1')\n"
        "print(msgspec.json.encode({'preload': c.preload, 'aliases': c.aliases}).decode())\n"
    )

    def resolve(env: dict[str, str], offline: bool) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code, REPO, "1" if offline else "0"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    # A fresh store, the cache already holding the files: --offline builds from the cache.
    env = {
        **pulled["env"],
        "SYNAPSE_CACHE_DIR": str(tmp_path / "syn"),
        "HF_ENDPOINT": _dead_endpoint(),
    }
    proc = resolve(env, offline=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"preload": ["tiny-embed"], "aliases": {REPO: "tiny-embed"}}
    # Online with an empty store and an empty cache: pulled.
    env = _env(tmp_path / "online", hub.endpoint)
    proc = resolve(env, offline=False)
    assert proc.returncode == 0, proc.stderr
    assert ArtifactStore(tmp_path / "online" / "synapse" / "models").find("huggingface", REPO)
    # Offline with nothing anywhere: the pull's own typed error.
    env = _env(tmp_path / "nothing", _dead_endpoint())
    proc = resolve(env, offline=True)
    assert proc.returncode != 0 and "ModelNotFound" in proc.stderr


def test_serve_model_key_pulls_the_repository_at_start_and_serves_it_by_default(
    tmp_path, hub, source
):
    """`model = "acme/tiny-embed"`: with an empty store and an empty Hugging Face cache the
    server pulls it before it listens, loads it alone (not the default embedder too), and a
    request naming no model gets its vectors, which match sentence-transformers' over the
    source directory; a repository the Hub does not have stops the start with one line."""
    from sentence_transformers import SentenceTransformer

    env = _env(tmp_path, hub.endpoint)
    store = tmp_path / "synapse" / "models"
    server = ServerProcess(server_config(str(store), model=REPO), env=env)
    try:
        assert list(server.health()["lanes"]) == ["tiny-embed"]
        got = httpx.post(
            f"{server.url}/v1/embeddings", json={"input": ["a short text"]}, timeout=60
        )
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["model"] == "tiny-embed"
        vec = np.array(body["data"][0]["embedding"], dtype=np.float32)
        # The repository id is an alias of the model it became.
        by_repo = httpx.post(
            f"{server.url}/v1/embeddings", json={"input": ["a short text"], "model": REPO}
        ).json()
        assert by_repo["data"][0]["embedding"] == body["data"][0]["embedding"]
    finally:
        server.stop()
    ref = SentenceTransformer(str(source), device="cpu").encode(
        ["a short text"], normalize_embeddings=True
    )[0]
    assert vec.shape == ref.shape and float(vec @ ref) > 0.999
    prov = ArtifactStore(store).get("tiny-embed").manifest.provenance
    assert prov is not None and prov.repo == REPO

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(server_config(str(store), model="acme/no-such-repo")))
    proc = synapse(env, "serve", "--config", str(bad))
    assert proc.returncode == 2
    assert _error_line(proc) == (
        "synapse serve: cannot get the models the config names: error[repo_not_found]: "
        f"no repository acme/no-such-repo on {hub.endpoint} (a private one needs HF_TOKEN)"
    )


@pytest.mark.skipif(small_disk.unavailable() is not None, reason=str(small_disk.unavailable()))
def test_a_full_disk_is_storage_full_the_store_keeps_nothing_and_the_next_pull_resumes(
    tmp_path, hub, source
):
    """On a real small filesystem holding both the Hugging Face cache and the store: a download
    the disk cannot hold is refused before it starts; one whose size the listing does not
    give fills the disk midway; neither leaves anything in the store, and once there is
    space the next pull completes it and builds the model."""
    hub.repos["acme/unsized"] = Repo(repo_from_dir(source), hide_sizes=True)
    disk = tmp_path / "disk"
    disk.mkdir()
    env = _env(disk, hub.endpoint)
    store = '"$DISK/synapse/models"'
    script = (
        f"$PY -m cli models pull {REPO} 2>&1 | tail -n1; ls -A {store}; echo '--'\n"
        "remount 3M\n"
        f"$PY -m cli models pull acme/unsized 2>&1 | tail -n1; ls -A {store}; echo '--'\n"
        "remount 64M\n"
        f"$PY -m cli models pull acme/unsized 2>&1 | grep -o 'downloaded and built'\n"
        f"ls -A {store}\n"
    )
    hub.clear()
    proc = small_disk.run_on_small_disk(disk, "2M", script, env=env)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    before, midway, after = proc.stdout.split("--\n")
    assert before.startswith("error[storage_full]: ") and "needs about" in before, before
    assert _models_in(before) == []
    assert midway.startswith("error[storage_full]: ") and "filled up while downloading" in midway
    assert _models_in(midway) == [], midway
    assert "downloaded and built" in after and _models_in(after) == ["unsized"], after


def _models_in(output: str) -> list[str]:
    """The entries `ls -A STORE` printed after the command's last line (its lock aside)."""
    return [n for n in output.splitlines()[1:] if n and n != ".lock"]
