"""The one family of typed errors: every refusal anywhere in Synapse is a `SynapseError`.

Each class names one failure by its `code` (the string that crosses the HTTP and CLI
boundaries: `{"error": {"code": ...}}`, `error[<code>]: ...`) and the HTTP status it answers
with, so each boundary (the service's error handler, the `synapse` command line, the bulk
job) catches this one base and needs nothing else. A code is assigned by exactly one class;
subclasses that only refine the cause for callers and logs (a crashed engine that died or
broke the protocol) inherit it.

This module is a leaf: every package may import it, and it imports nothing of ours. The codes
used by more than one package live here (`artifact_invalid`: the file readers in `formats`
raise it as well as `ingest`); each package's own codes live in its `errors`
module. The worker's `ERR` codes are the wire protocol's, not this family's
(`workers/protocol`).
"""

from __future__ import annotations


class SynapseError(Exception):
    """Base of every typed error; raised as itself it is a bug answered in the contract."""

    code = "internal"
    http_status = 500

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, **_jsonable(self.details)}


class InvalidRequest(SynapseError):
    """The caller asked for something malformed or impossible (a bad argument, a model name
    that cannot be one, a text over the limit with truncation off)."""

    code = "invalid_request"
    http_status = 400


class ModelNotFound(SynapseError):
    """No installed model of that name (the store's answer, the host's and the API's)."""

    code = "model_not_found"
    http_status = 404


class NotFound(SynapseError):
    """Something other than a model that the caller named does not exist: an HTTP route, a
    compile-cache entry."""

    code = "not_found"
    http_status = 404


class StorageFull(SynapseError):
    """Something had to be written (a model build, a certificate, a batch commit) and the disk
    could not hold it; what was written before is intact. Free space and retry."""

    code = "storage_full"
    http_status = 507


class ArtifactInvalid(SynapseError):
    """The input files are missing, unreadable, corrupt or of an unsupported architecture."""

    code = "artifact_invalid"
    http_status = 422


def _jsonable(details: dict) -> dict:
    return {k: v for k, v in details.items() if v is not None}
