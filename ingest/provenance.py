"""Where a model's files came from: the record a manifest keeps beside its local `source`.

`source` says which local files were converted or published (`hf-dir:PATH`, `gguf:PATH`); the
provenance says what those files are upstream, so a model can be traced back and fetched
again: the Hub repository and the commit its revision resolved to, an Ollama model's name and
manifest digest, an LM Studio file. `files` holds the sha256 of every file ingest read,
computed by us from the bytes (not taken from the Hub's listing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from formats.digest import sha256_file

Origin = Literal["huggingface", "ollama", "lmstudio"]


class Provenance(msgspec.Struct, frozen=True, omit_defaults=True):
    origin: Origin
    # Hub: the repository id ("BAAI/bge-m3"); Ollama: "NAME:TAG" (with its namespace when
    # not `library`); LM Studio: "PUBLISHER/REPO/FILE".
    repo: str
    # Hub: the commit sha the revision resolved to; Ollama: its manifest's sha256; LM Studio
    # keeps no revision: "".
    revision: str = ""
    requested: str | None = None  # the revision asked for when it was a branch or tag
    endpoint: str | None = None  # the Hub it came from, when not huggingface.co
    files: dict[str, str] = {}  # file (relative to the repository) -> sha256 hex

    def label(self) -> str:
        """One line for listings: `huggingface BAAI/bge-m3@5617a9f`."""
        rev = f"@{self.revision[:12]}" if self.revision else ""
        return f"{self.origin} {self.repo}{rev}"


def file_digests(root: Path, names: list[str]) -> dict[str, str]:
    """sha256 of each `root/name` (symlinks followed: the Hub cache links snapshots to
    blobs)."""
    return {name: sha256_file(root / name) for name in sorted(names)}
