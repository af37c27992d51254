"""compile_cache: a crash-safe, content-addressed store of compiled shapes (a Core ML shape
takes seconds to minutes to compile, so each is built once per key and reused).

    cache = CompileCache(root, budget_bytes=10 * 2**30)
    with cache.lease(key, build) as entry:   # build(tmp_dir) runs at most once per key
        use(entry.path)

Keys (see `keys`): a non-empty mapping of str -> str | int | bool | finite float, or
lists/tuples of those. No None, bytes, dicts, enums or numpy scalars (`InvalidKey`); lists
and tuples are equal; 1, 1.0, True and "1" are different keys. The address is sha256 over
the canonical JSON (sorted fields, no whitespace).

Guarantees (see `store`): one build per key across processes (file lock; others wait and
reuse it); an entry becomes visible by one rename after everything is fsynced, so a crash
never exposes half an entry; temp dirs of dead builds are removed on open; the SQLite index
is rebuilt from the objects if lost or corrupt; a lease (shared flock, dropped by the kernel
if its process dies) keeps an entry from eviction; `gc` evicts least recently used unleased
entries down to the byte budget. POSIX only (flock). CLI: `cli`, `python -m compile_cache`.
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
