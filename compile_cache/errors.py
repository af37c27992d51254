"""Typed errors of the compile cache.

Every refusal is a `CompileCacheError`, the cache's branch of `common.errors.SynapseError`,
with a stable `code` string, so the host and the CLI can report it as that code instead of
parsing messages. Several are also the builtin exception their case is (`TypeError`,
`ValueError`, `LookupError`, `TimeoutError`), so a caller that knows nothing of the cache can
still catch them as such.
"""

from __future__ import annotations

from common.errors import NotFound, SynapseError


class CompileCacheError(SynapseError):
    """The cache's refusals; never raised as itself, each subclass names its own code."""


class InvalidKey(CompileCacheError, TypeError):
    """A key is not a non-empty mapping of str -> str/int/bool/finite float/lists of them.

    Also a `TypeError`, because almost every case is a value of the wrong type.
    """

    code = "invalid_key"
    http_status = 400


class InvalidSize(CompileCacheError, ValueError):
    """A byte size or budget could not be parsed or is negative."""

    code = "invalid_size"
    http_status = 400


class InvalidArgument(CompileCacheError, ValueError):
    """A parameter outside its domain (negative timeout, ...)."""

    code = "invalid_argument"
    http_status = 400


class InvalidRoot(CompileCacheError):
    """The cache root cannot be created or written (a file, read-only, ...)."""

    code = "invalid_root"
    http_status = 500


class InvalidSelector(CompileCacheError, ValueError):
    """`evict` got something that is neither a key mapping nor a hex digest prefix."""

    code = "invalid_selector"
    http_status = 400


class EntryNotFound(NotFound, CompileCacheError, LookupError):
    """No entry matches the key or digest prefix (the code is `NotFound`'s: not_found)."""


class AmbiguousPrefix(CompileCacheError, LookupError):
    code = "ambiguous_prefix"
    http_status = 400

    def __init__(self, msg: str, matches: list[str]) -> None:
        super().__init__(msg)
        self.matches = matches


class EntryLeased(CompileCacheError):
    """Eviction refused: a live process holds a lease on the entry."""

    code = "entry_leased"
    http_status = 409


class EntryEvicted(CompileCacheError):
    """A lease was requested for an entry that was evicted in the meantime."""

    code = "entry_evicted"
    http_status = 409


class BuildFailed(CompileCacheError):
    """The caller's `build` raised or produced an unusable artifact; nothing was published.

    The original exception (if any) is chained as `__cause__`.
    """

    code = "build_failed"
    http_status = 500


class LockTimeout(CompileCacheError, TimeoutError):
    """Waiting for another process's build of the same key exceeded the caller's timeout."""

    code = "lock_timeout"
    http_status = 504
