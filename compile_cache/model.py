"""Values the cache hands out: entries and the reports of maintenance operations."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compile_cache.lease import Lease


@dataclass(frozen=True, slots=True, eq=False)
class Entry:
    """A published, immutable cache entry.

    `path` is the directory `build(tmp_dir)` filled (now read-only by convention: files are
    mode 0444). Hold `lease()` while using it so gc cannot evict it underneath you.
    """

    digest: str
    path: Path
    size: int
    created: float
    last_used: float
    key: dict[str, Any]
    files: dict[str, str]  # relative path under `path` -> sha256
    build_seconds: float
    object_dir: Path

    @property
    def artifact(self) -> Path:
        """The single top-level item `build` produced (e.g. `model.mlpackage`), else `path`."""
        names = os.listdir(self.path)
        return self.path / names[0] if len(names) == 1 else self.path

    def lease(self) -> Lease[Entry]:
        return Lease(self)

    def __eq__(self, other: object) -> bool:
        # Same published object, seen from any process.
        if not isinstance(other, Entry):
            return NotImplemented
        return (self.digest, self.created, self.path) == (other.digest, other.created, other.path)

    def __hash__(self) -> int:
        return hash((self.digest, self.created))

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "path": str(self.path),
            "size": self.size,
            "created": self.created,
            "last_used": self.last_used,
            "build_seconds": self.build_seconds,
            "key": self.key,
            "files": self.files,
        }


@dataclass(frozen=True, slots=True)
class CorruptEntry:
    digest: str
    reasons: list[str]
    evicted: bool  # False only when a live process holds a lease on it

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "reasons": self.reasons, "evicted": self.evicted}


@dataclass(frozen=True, slots=True)
class VerifyReport:
    checked: int
    ok: int
    corrupt: list[CorruptEntry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "ok": self.ok,
            "corrupt": [c.to_json() for c in self.corrupt],
        }


@dataclass(frozen=True, slots=True)
class EvictionReport:
    """Result of gc / evict / clear."""

    evicted: list[str]
    freed_bytes: int
    skipped_leased: list[str]
    before_bytes: int
    after_bytes: int
    budget_bytes: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "evicted": self.evicted,
            "freed_bytes": self.freed_bytes,
            "skipped_leased": self.skipped_leased,
            "before_bytes": self.before_bytes,
            "after_bytes": self.after_bytes,
            "budget_bytes": self.budget_bytes,
        }


@dataclass(frozen=True, slots=True)
class Usage:
    root: Path
    entries: int
    total_bytes: int
    budget_bytes: int | None
    tmp_bytes: int  # builds in flight and leftovers not yet cleaned

    def to_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "entries": self.entries,
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "tmp_bytes": self.tmp_bytes,
        }
