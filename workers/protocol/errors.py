"""The one error the protocol layer raises: the peer broke the wire contract."""

from __future__ import annotations


class ProtocolError(Exception):
    """A protocol violation: the connection is unusable and must be closed (and the worker
    killed). `reason` says which rule was broken, for logs and the caller's error."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
