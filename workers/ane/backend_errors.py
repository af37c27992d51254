"""The backends' errors, in a module of their own: the macOS backend raises them and the
backend chooser opens that backend lazily, so neither imports the other back."""

from __future__ import annotations


class BackendUnavailable(Exception):
    """The backend cannot run on this platform."""


class BackendOpenFailed(Exception):
    """A compiled form could not be opened or warmed up (Core ML's native errors arrive as
    bare Exception/RuntimeError): the engine answers `compile_failed` and keeps serving."""
