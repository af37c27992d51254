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


class RepoNotFound(SynapseError):
    """The Hugging Face Hub has no repository (or no revision) of that name, or it is private
    and the token (`HF_TOKEN`) does not open it."""

    code = "repo_not_found"
    http_status = 404


class RepoGated(SynapseError):
    """The repository is gated: its licence must be accepted on the Hub and a token of that
    account given (`HF_TOKEN`, or `hf auth login`)."""

    code = "repo_gated"
    http_status = 403


class HubUnreachable(SynapseError):
    """The Hub could not be reached (no network, DNS, a dead proxy, `HF_HUB_OFFLINE=1`) and
    the Hugging Face cache does not hold what was asked for; the same command may work once
    the network is back."""

    code = "hub_unreachable"
    http_status = 503


class NoSupportedWeights(ArtifactInvalid):
    """The repository holds no weights we read (safetensors): pickled `.bin`/`.pt` checkpoints
    run code when they are loaded, and GGUF-only repositories are ingested as files."""

    code = "no_supported_weights"


class UnsupportedModelType(ArtifactInvalid):
    """The repository's `config.json` names a `model_type` no converter of ours reads; known
    before any weight is downloaded."""

    code = "unsupported_architecture"


class DigestMismatch(ArtifactInvalid):
    """A file another tool downloaded (an Ollama blob, a Hub LFS file) does not hash to the
    digest it is stored under: it is damaged or was replaced, and is not ingested."""

    code = "digest_mismatch"
