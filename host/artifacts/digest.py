"""sha256 of artifact files, computed once at ingest and kept beside the artifact."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 4 * 1024 * 1024


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def write_digest_file(artifact: Path, hexdigest: str) -> Path:
    """`<artifact>.sha256` in `sha256sum` format, so `sha256sum -c` can check it by hand."""
    side = artifact.with_name(artifact.name + ".sha256")
    side.write_text(f"{hexdigest}  {artifact.name}\n", encoding="ascii")
    return side


def read_digest_file(artifact: Path) -> str | None:
    side = artifact.with_name(artifact.name + ".sha256")
    try:
        return side.read_text(encoding="ascii").split()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        return None
