"""Typed errors of artifact ingest that no other package raises; the store's other refusals
are `common.errors`' (`ArtifactInvalid`, which the file readers in `formats` raise too,
`InvalidRequest`, `ModelNotFound`, `StorageFull`)."""

from __future__ import annotations

from common.errors import ArtifactInvalid, InvalidRequest, SynapseError


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
