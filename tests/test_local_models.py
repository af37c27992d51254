"""What Ollama and LM Studio already downloaded, ingested in place: real stores laid out on
disk as those tools lay them out (Ollama's manifests and content-addressed blobs, LM Studio's
PUBLISHER/REPO folders) around a real tiny GGUF converted here, the tokenizer proven against a
real llama.cpp child, and `models ls --available` over them and a Hugging Face cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from certification.tokenizer_proof import prove_gguf_tokenizer
from ingest.errors import DigestMismatch
from ingest.hf_dir import convert_hf_dir
from ingest.local_models import OLLAMA_MODEL_LAYER, ingest_local
from ingest.store import ArtifactStore
from tests.gguf_edit import rewrite_gguf
from tests.hub_support import tiny_bert_dir

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(module_tmp) -> dict[str, Path]:
    src = tiny_bert_dir(module_tmp / "tiny-embed")
    gguf = module_tmp / "tiny-embed-f16.gguf"
    convert_hf_dir(src, gguf, "f16", name="tiny-embed")
    chat = rewrite_gguf(gguf, module_tmp / "chat.gguf", arch="llama")  # not an embedder
    return {"src": src, "gguf": gguf, "chat": chat}


def ollama_model(root: Path, name: str, gguf: Path, tag: str = "latest") -> Path:
    """`gguf` in an Ollama store at `root` as `ollama pull` leaves it; the blob's path."""
    data = gguf.read_bytes()
    hexdigest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{hexdigest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    license_blob = b"Apache-2.0"
    license_hex = hashlib.sha256(license_blob).hexdigest()
    (root / "blobs" / f"sha256-{license_hex}").write_bytes(license_blob)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": f"sha256:{license_hex}",
            "size": len(license_blob),
        },
        "layers": [
            {"mediaType": OLLAMA_MODEL_LAYER, "digest": f"sha256:{hexdigest}", "size": len(data)},
            {
                "mediaType": "application/vnd.ollama.image.license",
                "digest": f"sha256:{license_hex}",
                "size": len(license_blob),
            },
        ],
    }
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return blob


def test_an_ollama_model_is_a_hard_link_of_its_blob_never_a_copy(tmp_path, built, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    blob = ollama_model(tmp_path / "ollama", "tiny-embed", built["gguf"])
    store = ArtifactStore(tmp_path / "store")
    rec, new = ingest_local(store, "ollama:tiny-embed", None, prove_gguf_tokenizer)
    assert new and rec.name == "tiny-embed" and rec.kind == "embed"
    assert os.stat(rec.artifact_path).st_ino == os.stat(blob).st_ino  # the same bytes on disk
    assert not rec.artifact_path.is_symlink()
    assert rec.digest == blob.name.removeprefix("sha256-")
    prov = rec.manifest.provenance
    assert prov is not None and (prov.origin, prov.repo) == ("ollama", "tiny-embed:latest")
    assert prov.files == {"model.gguf": rec.digest}
    assert store.verify("tiny-embed").digest == rec.digest
    # Asked again: the model it already is, not a second entry.
    again, new = ingest_local(store, "ollama:tiny-embed:latest", None, prove_gguf_tokenizer)
    assert not new and again.name == rec.name and [r.name for r in store.ls()] == ["tiny-embed"]


def test_a_blob_that_does_not_hash_to_its_digest_is_refused(tmp_path, built, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    blob = ollama_model(tmp_path / "ollama", "tiny-embed", built["gguf"], tag="v1")
    with open(blob, "r+b") as f:  # one byte of a tensor changed behind Ollama's back
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(DigestMismatch, match="hashes to sha256:") as err:
        ingest_local(store, "ollama:tiny-embed:v1", None, prove_gguf_tokenizer)
    assert err.value.code == "digest_mismatch"
    assert store.ls() == [] and [p.name for p in store.root.iterdir() if p.name != ".lock"] == []


def test_a_store_on_another_filesystem_records_a_reference(tmp_path, built, monkeypatch):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm) beside the temp dir")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    blob = ollama_model(tmp_path / "ollama", "tiny-embed", built["gguf"])
    other = Path(tempfile.mkdtemp(dir=shm))
    try:
        store = ArtifactStore(other / "store")
        rec, _ = ingest_local(store, "ollama:tiny-embed", "tiny-ref", prove_gguf_tokenizer)
        assert rec.artifact_path.is_symlink() and rec.artifact_path.resolve() == blob.resolve()
        assert store.verify("tiny-ref").digest == rec.digest
        free = shutil.disk_usage(other).used
        assert free < built["gguf"].stat().st_size * 4  # nothing near a copy's size was written
    finally:
        shutil.rmtree(other, ignore_errors=True)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
            "PYTHONPATH": str(ROOT),
            **env,
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tools(module_tmp, built) -> dict[str, str]:
    """Ollama's store, LM Studio's folder and a Hugging Face cache, each holding an embedder
    and something that is not one."""
    home = module_tmp / "home"
    ollama = home / ".ollama" / "models"
    ollama_model(ollama, "tiny-embed", built["gguf"])
    ollama_model(ollama, "chatty", built["chat"])
    lms = home / ".lmstudio" / "models" / "acme" / "tiny-embed-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(built["gguf"], lms / "tiny-embed-f16.gguf")
    shutil.copy(built["chat"], lms / "mmproj-tiny-f16.gguf")  # a projector, not a model
    hub = home / "hf" / "hub"
    _hf_snapshot(hub, "acme/tiny-embed", built["src"])
    xenc = json.loads((built["src"] / "config.json").read_text())
    xenc["architectures"] = ["BertForSequenceClassification"]
    _hf_snapshot(hub, "acme/tiny-rerank", built["src"], config=xenc, st=False)
    chat = {**xenc, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    _hf_snapshot(hub, "acme/tiny-chat", built["src"], config=chat, st=False)
    return {
        "HOME": str(home),
        "HF_HOME": str(home / "hf"),
        "SYNAPSE_CACHE_DIR": str(module_tmp / "synapse"),
    }


def _hf_snapshot(hub: Path, repo: str, src: Path, config: dict | None = None, st: bool = True):
    """The Hugging Face cache's layout: blobs by digest, a snapshot of links, refs/main."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snap = folder / "snapshots" / commit
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src).as_posix()
        if path.is_dir() or (not st and ("/" in rel or rel.startswith(("modules", "sentence")))):
            continue
        data = (
            path.read_bytes()
            if rel != "config.json" or config is None
            else json.dumps(config).encode()
        )
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).symlink_to(os.path.relpath(blob, (snap / rel).parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)


def test_ls_available_lists_the_embedders_and_rerankers_other_tools_hold(tools):
    proc = _cli(tools, "models", "ls", "--available", "--json")
    assert proc.returncode == 0, proc.stderr
    found = {a["ref"]: a for a in json.loads(proc.stdout)}
    assert set(found) == {
        "ollama:tiny-embed:latest",
        "lmstudio:acme/tiny-embed-GGUF/tiny-embed-f16.gguf",
        "acme/tiny-embed",
        "acme/tiny-rerank",
    }, found
    assert found["ollama:tiny-embed:latest"]["kind"] == "embed"
    assert found["ollama:tiny-embed:latest"]["detail"] == "bert, mean, f16"
    assert found["acme/tiny-rerank"]["kind"] == "rerank"
    text = _cli(tools, "models", "ls", "--available")
    assert "ollama:tiny-embed:latest" in text.stdout


def test_lm_studio_model_is_ingested_in_place_from_the_command_line(tools):
    proc = _cli(tools, "models", "ingest", "lmstudio:acme/tiny-embed-GGUF")
    assert proc.returncode == 0, proc.stderr
    assert "ingested in place (no copy)" in proc.stdout
    store = ArtifactStore(Path(tools["SYNAPSE_CACHE_DIR"]) / "models")
    rec = store.get("tiny-embed-f16")
    src = Path(tools["HOME"]) / ".lmstudio/models/acme/tiny-embed-GGUF/tiny-embed-f16.gguf"
    assert os.stat(rec.artifact_path).st_ino == os.stat(src).st_ino
    prov = rec.manifest.provenance
    assert prov is not None and prov.repo == "acme/tiny-embed-GGUF/tiny-embed-f16.gguf"
    assert prov.files == {"tiny-embed-f16.gguf": rec.digest}
    missing = _cli(tools, "models", "ingest", "ollama:nomic-embed-text")
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("error[model_not_found]: Ollama's store")


def test_a_tokenizer_llama_cpp_disagrees_with_is_refused_and_leaves_no_link(
    tmp_path, built, monkeypatch
):
    """As for any GGUF: the derived tokenizer is proven against llama.cpp or the model is
    refused with the text they differ on; the staging link to Ollama's blob goes too."""
    import gguf

    from ingest.errors import TokenizerMismatch

    odd = rewrite_gguf(
        built["gguf"],
        tmp_path / "keep-accents.gguf",
        set_kv={"tokenizer.ggml.normalizer.strip_accents": (False, gguf.GGUFValueType.BOOL)},
    )
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    blob = ollama_model(tmp_path / "ollama", "odd-embed", odd)
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(TokenizerMismatch, match="differs from llama.cpp's on text"):
        ingest_local(store, "ollama:odd-embed", None, prove_gguf_tokenizer)
    assert store.ls() == [] and os.stat(blob).st_nlink == 1
