"""Typed errors of certification, each a `common.errors.SynapseError` with its own code; a
certificate that does not fit on the disk is `common.errors.StorageFull`."""

from __future__ import annotations

from common.errors import SynapseError


class CertificateNotFound(SynapseError):
    """No stored certificate answers the id or prefix (none, several, or unreadable)."""

    code = "certificate_not_found"
    http_status = 404


class ReferenceUnavailable(SynapseError, ValueError):
    """No reference this machine has can judge the model (a non-BERT family without
    sentence-transformers): the caller installs the extra the message names. Also a
    `ValueError`, as every other refusal of a reference choice is."""

    code = "reference_unavailable"
    http_status = 400


class LaneUnavailable(SynapseError):
    """The Module has no such lane for the model, or the lane has no live worker to
    describe."""

    code = "lane_unavailable"
    http_status = 503
