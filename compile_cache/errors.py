"""Typed errors of the compile cache.

Every refusal is a `CompileCacheError` subclass with a stable `code` string, so the host and
the CLI can report it as that code (HTTP error bodies and `error[code]` lines name it)
instead of parsing messages.
"""

from __future__ import annotations


class CompileCacheError(Exception):
    """Base class; `code` names the failure for callers that cross an HTTP/CLI boundary."""

    code: str = "compile_cache_error"

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.msg}


class InvalidKey(CompileCacheError, TypeError):
    """A key is not a non-empty mapping of str -> str/int/bool/finite float/lists of them.

    Also a `TypeError`, because almost every case is a value of the wrong type.
    """

    code = "invalid_key"


class InvalidSize(CompileCacheError, ValueError):
    """A byte size or budget could not be parsed or is negative."""

    code = "invalid_size"


class InvalidArgument(CompileCacheError, ValueError):
    """A parameter outside its domain (negative timeout, ...)."""

    code = "invalid_argument"


class InvalidRoot(CompileCacheError):
    """The cache root cannot be created or written (a file, read-only, ...)."""

    code = "invalid_root"


class InvalidSelector(CompileCacheError, ValueError):
    """`evict` got something that is neither a key mapping nor a hex digest prefix."""

    code = "invalid_selector"


class EntryNotFound(CompileCacheError, LookupError):
    code = "not_found"


class AmbiguousPrefix(CompileCacheError, LookupError):
    code = "ambiguous_prefix"

    def __init__(self, msg: str, matches: list[str]) -> None:
        super().__init__(msg)
        self.matches = matches


class EntryLeased(CompileCacheError):
    """Eviction refused: a live process holds a lease on the entry."""

    code = "entry_leased"


class EntryEvicted(CompileCacheError):
    """A lease was requested for an entry that was evicted in the meantime."""

    code = "entry_evicted"


class BuildFailed(CompileCacheError):
    """The caller's `build` raised or produced an unusable artifact; nothing was published.

    The original exception (if any) is chained as `__cause__`.
    """

    code = "build_failed"


class LockTimeout(CompileCacheError, TimeoutError):
    """Waiting for another process's build of the same key exceeded the caller's timeout."""

    code = "lock_timeout"
