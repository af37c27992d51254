"""Models a serve config names by Hugging Face repository id: `model = "BAAI/bge-m3"` (the
model a request that names none gets), `preload = ["BAAI/bge-m3"]`, or an alias to one
(`aliases = {"text-embedding-3-small" = "BAAI/bge-m3"}`).

Before any server starts (as the default models are installed), each repository id is
resolved to a model of the store: one already ingested from that repository (any commit: a
server's start must not depend on the network when it has what it serves), else pulled
(`ingest.hub.pull`), or with `--offline` built from the Hugging Face cache without the
network, or refused with the pull's own typed error. The config handed on names the store's
model, and the repository id becomes an alias of it, so clients may send either.
"""

from __future__ import annotations

import msgspec

from ingest.hub import RepoRef, ingest_cached, parse_ref, pull
from ingest.store import ArtifactStore
from service.config import ServeConfig


def repo_names(config: ServeConfig) -> list[str]:
    """The names in `config` that are repository ids (a store name never holds a `/`)."""
    names = [*config.preloaded, *config.aliases.values(), *([config.model] if config.model else [])]
    return sorted({n for n in names if "/" in n and parse_ref(n) is not None})


def resolve_repo_models(config: ServeConfig, offline: bool = False) -> ServeConfig:
    repos = repo_names(config)
    if not repos:
        return config
    store = ArtifactStore(config.module.store_root)
    names = {repo: _store_name(store, repo, offline) for repo in repos}
    aliases = {a: names.get(t, t) for a, t in config.aliases.items()}
    for repo, name in names.items():
        aliases.setdefault(repo, name)
    resolved = msgspec.structs.replace(
        config,
        model=names.get(config.model, config.model) if config.model else None,
        preload=[names.get(n, n) for n in config.preloaded],
        aliases=aliases,
    )
    resolved.__post_init__()
    return resolved


def _store_name(store: ArtifactStore, text: str, offline: bool) -> str:
    ref = parse_ref(text)
    assert ref is not None
    present = store.find("huggingface", ref.repo)
    if ref.revision != RepoRef(ref.repo).revision:
        present = [
            r
            for r in present
            if r.manifest.provenance is not None
            and ref.revision in (r.manifest.provenance.revision, r.manifest.provenance.requested)
        ]
    if present:
        return present[0].name
    result = ingest_cached(store, ref) if offline else pull(store, ref)
    return result.record.name
