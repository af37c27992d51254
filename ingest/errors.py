"""Typed errors of artifact ingest; each carries the code it crosses the API/CLI boundary as."""

from __future__ import annotations


class ArtifactError(Exception):
    """Base of every artifact error; `code` is the error-contract string."""

    code: str = "artifact_invalid"

    def __init__(self, msg: str) -> None:
        super().__init__(f"{self.code}: {msg}")
        self.msg = msg


class ArtifactInvalid(ArtifactError):
    """The input files are missing, unreadable, corrupt or of an unsupported architecture."""

    code = "artifact_invalid"


class InvalidRequest(ArtifactError):
    """The caller asked for something malformed (bad name, bad dtype, name already taken)."""

    code = "invalid_request"


class ArtifactExists(InvalidRequest):
    """A model of that name is already in the store (ingest never overwrites silently)."""


class ArtifactNotFound(ArtifactError):
    """No model of that name in the store."""

    code = "not_found"


class StorageFull(ArtifactError):
    """The disk under the store cannot hold the model: refused before writing, or the disk
    filled up during the build (nothing of the build is kept either way)."""

    code = "storage_full"


class TokenizerMismatch(ArtifactInvalid):
    """The module-side tokenizer derived from a GGUF does not reproduce llama.cpp's own
    tokenization: a different tokenization is a different model, so it is refused."""
