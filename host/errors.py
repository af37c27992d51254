"""The host's typed errors, each a `common.errors.SynapseError` with a code of its own; the
codes other packages share too (`invalid_request`, `model_not_found`, `storage_full`) are
`common.errors`' classes.

Failure of a worker is always `EngineCrashed` (code ``engine_crashed``); its subclasses say
why — the process died (`WorkerDied`), it broke the protocol (`ProtocolViolation`) or it went
silent past its window (`WatchdogExpired`) — so callers can catch one class and logs can tell
the cases apart. A quarantined lane also answers `EngineCrashed`, at once, with
``quarantined=True`` and ``retry_after_s``.
"""

from __future__ import annotations

from common.errors import SynapseError


class ConfigInvalid(SynapseError):
    code = "config_invalid"
    http_status = 500


class CertificateRequired(SynapseError):
    """`require_certificate="strict"`: the lane has no certified certificate for its exact
    identity. Raised by the lane policy (certification implements it); defined here so the
    host can catch it without importing certification."""

    code = "certificate_required"
    http_status = 503


class Overloaded(SynapseError):
    """Admission refused the work: a fast, typed 'try later', never an unbounded queue."""

    code = "overloaded"
    http_status = 429

    def __init__(self, message: str, retry_after_s: float = 1.0, **details: object) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(SynapseError):
    """The caller's deadline passed. The worker is neither killed nor struck."""

    code = "deadline_exceeded"
    http_status = 504


class LaneStopped(SynapseError):
    code = "lane_stopped"
    http_status = 503


class InsufficientMemory(SynapseError):
    """A model does not fit: its estimated (or measured) size is over the memory budget, or
    the models in use leave no room, or the machine has too little memory free. Refused
    before any worker starts (see host/residency.py); nothing is unloaded for a model that
    cannot fit."""

    code = "insufficient_memory"
    http_status = 503


class EngineCrashed(SynapseError):
    code = "engine_crashed"
    http_status = 503

    def __init__(
        self,
        message: str,
        *,
        lane_id: str = "",
        log_tail: str = "",
        quarantined: bool = False,
        retry_after_s: float | None = None,
        exit_status: str | None = None,
    ) -> None:
        super().__init__(
            message,
            lane_id=lane_id,
            quarantined=quarantined,
            retry_after_s=retry_after_s,
            exit_status=exit_status,
        )
        self.lane_id = lane_id
        self.log_tail = log_tail
        self.quarantined = quarantined
        self.retry_after_s = retry_after_s
        self.exit_status = exit_status


class WorkerDied(EngineCrashed):
    """The worker exited, was killed, or closed its socket mid-request."""


class ProtocolViolation(EngineCrashed):
    """The worker broke wire protocol v3; it was killed."""


class WatchdogExpired(EngineCrashed):
    """No valid PROGRESS within the silence window; the worker was killed."""


class WorkerError(SynapseError):
    """The worker refused the request with ERR; `code` is the worker's code."""

    http_status = 400

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # instance attribute: one class carries every worker ERR code
        self.http_status = _WORKER_CODE_STATUS.get(code, 500)


_WORKER_CODE_STATUS = {
    "invalid_request": 400,
    "unsupported": 400,
    "shape_unsupported": 400,
    "model_not_loaded": 404,
    "artifact_invalid": 422,
    "config_invalid": 422,
    "oom": 507,
    "compile_failed": 500,
}


class MissingExtra(SynapseError):
    """A feature was asked for whose optional packages are not installed (`pip install
    'synapse[EXTRA]'` provides them)."""

    code = "missing_extra"
    http_status = 400
