"""sha256 of artifact files, computed once at ingest and kept beside the artifact."""

from __future__ import annotations

import hashlib
from pathlib import Path


def copy_with_digest(src: str | Path, dst: str | Path, chunk: int = 1 << 22) -> str:
    """Copy `src` to `dst` and return the sha256 of what was written, in one read of `src`
    (a GGUF can be gigabytes: copying and then hashing would read it twice)."""
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(chunk):
            h.update(block)
            fout.write(block)
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
