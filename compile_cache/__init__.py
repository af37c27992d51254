"""compile_cache: a crash-safe, content-addressed store of compiled shapes (DESIGN section 7).

    cache = CompileCache(root, budget_bytes=10 * 2**30)
    with cache.lease(key, build) as entry:   # build(tmp_dir) runs at most once per key
        use(entry.path)

See `keys` for what a key may contain, `store` for the crash-safety invariants, `cli` for
`synapse cache ...`.
"""

from compile_cache.errors import (
    AmbiguousPrefix,
    BuildFailed,
    CompileCacheError,
    EntryEvicted,
    EntryLeased,
    EntryNotFound,
    InvalidArgument,
    InvalidKey,
    InvalidRoot,
    InvalidSelector,
    InvalidSize,
    LockTimeout,
)
from compile_cache.keys import canonical_json, key_digest, make_key
from compile_cache.lease import Lease
from compile_cache.model import CorruptEntry, Entry, EvictionReport, Usage, VerifyReport
from compile_cache.paths import default_root
from compile_cache.store import DEFAULT_BUDGET_BYTES, HOOK_POINTS, CompileCache
from compile_cache.units import format_age, format_size, parse_size

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "HOOK_POINTS",
    "AmbiguousPrefix",
    "BuildFailed",
    "CompileCache",
    "CompileCacheError",
    "CorruptEntry",
    "Entry",
    "EntryEvicted",
    "EntryLeased",
    "EntryNotFound",
    "EvictionReport",
    "InvalidArgument",
    "InvalidKey",
    "InvalidRoot",
    "InvalidSelector",
    "InvalidSize",
    "Lease",
    "LockTimeout",
    "Usage",
    "VerifyReport",
    "canonical_json",
    "default_root",
    "format_age",
    "format_size",
    "key_digest",
    "make_key",
    "parse_size",
]
