"""sha256 of artifact files, computed once at ingest and kept beside the artifact."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
