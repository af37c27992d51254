"""Typed errors of artifact ingest that no other package raises; the store's other refusals
are `common.errors`' (`InvalidRequest`, `ModelNotFound`, `StorageFull`)."""

from __future__ import annotations

from common.errors import InvalidRequest, SynapseError


class ArtifactInvalid(SynapseError):
    """The input files are missing, unreadable, corrupt or of an unsupported architecture."""

    code = "artifact_invalid"
    http_status = 422


class ArtifactExists(InvalidRequest):
    """A model of that name is already in the store (ingest never overwrites silently)."""


class TokenizerMismatch(ArtifactInvalid):
    """The module-side tokenizer derived from a GGUF does not reproduce llama.cpp's own
    tokenization: a different tokenization is a different model, so it is refused."""


class ModelPackageUnavailable(SynapseError):
    """The default embedder's package is not installed and pip could not install it (offline,
    no pip): the service cannot build its default model until an operator provides it."""

    code = "model_package_unavailable"
    http_status = 503
