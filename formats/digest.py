"""sha256 of a file: the digest an artifact is named, checked and certified by, on every side
(ingest records it, the worker re-checks it at LOAD, the owned format keys its build by it)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
