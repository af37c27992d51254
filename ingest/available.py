"""`synapse models ls --available`: the embedding and rerank models other tools already
downloaded, each with the reference `models ingest` takes.

Found in Ollama's store, LM Studio's folder (`ingest.local_models`) and the Hugging Face cache
(`ingest.hub`), without the network and without hashing a byte: a GGUF is judged by its header
(`ingest.gguf_model.inspect_gguf`, as its ingest does), a Hugging Face snapshot by its
`config.json` and sentence-transformers files (as `models ingest DIR` does). A model is
listed when its ingest would take it as an embedder or a reranker; an encoder that does not
say how it pools is listed with that note (ingest asks for `--pooling`). Generation models
(a chat Qwen3, a Llama) are not listed: a decoder counts as an embedder only when it says so
(a GGUF pooling type, a sentence-transformers Pooling module).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.errors import ArtifactInvalid, InvalidRequest, SynapseError
from formats.hf_config import HfConfig
from ingest.gguf_model import DECODER_EMBEDDERS, inspect_gguf, read_header
from ingest.hf_common import st_layout
from ingest.hf_dir import FAMILIES
from ingest.local_models import (
    lmstudio_models,
    lmstudio_root,
    ollama_models,
    resolve_lmstudio,
    resolve_ollama,
)

# Families whose directories are decoders: an embedder only with a Pooling module.
HF_DECODERS = frozenset({"qwen3", "gemma3_text"})


@dataclass(frozen=True)
class Available:
    ref: str  # what `synapse models ingest` takes
    origin: str  # ollama | lmstudio | huggingface
    kind: str  # embed | rerank
    detail: str  # architecture, pooling, or what ingest will need
    size_bytes: int


def available_models() -> list[Available]:
    return [*_ollama(), *_lmstudio(), *_hf_cache()]


def _gguf(ref: str, origin: str, path: Path) -> Available | None:
    try:
        info = inspect_gguf(path)
    except InvalidRequest as e:
        # An encoder that does not say how it pools is still an embedder; a decoder that
        # does not is a generation model.
        try:
            arch = read_header(path).architecture
        except ArtifactInvalid:
            return None
        if arch in DECODER_EMBEDDERS or "pooling" not in e.message:
            return None
        return Available(ref, origin, "embed", f"{arch}; needs --pooling", path.stat().st_size)
    except ArtifactInvalid:
        return None
    return Available(
        ref,
        origin,
        info.kind,
        f"{info.architecture}, {info.pooling}, {info.dtype}",
        path.stat().st_size,
    )


def _ollama() -> Iterator[Available]:
    for label in ollama_models():
        try:
            found = resolve_ollama(label, check_digest=False)  # ingest checks it
        except SynapseError:
            continue
        entry = _gguf(f"ollama:{label}", "ollama", found.path)
        if entry is not None:
            yield entry


def _lmstudio() -> Iterator[Available]:
    if not lmstudio_root().is_dir():
        return
    for label in lmstudio_models():
        try:
            found = resolve_lmstudio(label)
        except SynapseError:
            continue
        entry = _gguf(f"lmstudio:{label}", "lmstudio", found.path)
        if entry is not None:
            yield entry


def _hf_cache() -> Iterator[Available]:
    from ingest.hub import cache_dir

    root = cache_dir()
    if not root.is_dir():
        return
    for repo_dir in sorted(root.glob("models--*--*")):
        snapshot = _current_snapshot(repo_dir)
        if snapshot is None:
            continue
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        entry = _hf_snapshot(repo, snapshot)
        if entry is not None:
            yield entry


def _current_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot `refs/main` names, else the newest one."""
    try:
        commit = (repo_dir / "refs" / "main").read_text().strip()
        if (repo_dir / "snapshots" / commit).is_dir():
            return repo_dir / "snapshots" / commit
    except OSError:
        pass
    snaps = sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def _hf_snapshot(repo: str, snapshot: Path) -> Available | None:
    if not (snapshot / "config.json").is_file():
        return None
    try:
        config = HfConfig.read(snapshot)
        model_type = config.model_type
        architectures = config.architectures
        layout = st_layout(snapshot)
    except (ArtifactInvalid, ValueError):
        return None
    if model_type not in FAMILIES:
        return None
    weights = [p for p in snapshot.glob("*.safetensors") if p.is_file()]
    if not weights:
        return None
    size = sum(p.stat().st_size for p in weights)
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return Available(repo, "huggingface", "rerank", f"{model_type}, rank", size)
    if layout.pooling_modes:
        return Available(
            repo, "huggingface", "embed", f"{model_type}, {'+'.join(layout.pooling_modes)}", size
        )
    if model_type in HF_DECODERS:
        return None
    return Available(repo, "huggingface", "embed", f"{model_type}; needs --pooling", size)
