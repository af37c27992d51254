"""Where things live under a cache root, and each object's own metadata file.

    <root>/index.sqlite         the index (WAL); a cache of what objects/ holds, rebuildable
    <root>/objects/<digest>/    one published entry:
        data/                   what `build(tmp_dir)` wrote (Entry.path)
        meta.json               key, file manifest, size, times - written before publish
        .lease                  flock target: shared = leased, exclusive = being evicted
    <root>/tmp/b.<digest>.<pid>.<token>/   a build in progress (same shape as an object)
    <root>/tmp/x.<digest>.<pid>.<token>/   an evicted object being deleted
    <root>/locks/<digest>.lock  one builder per key (filelock)
    <root>/locks/{index,gc}.lock

Objects carry their own metadata so the index can always be rebuilt from the disk alone.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import msgspec

from compile_cache.errors import InvalidKey
from compile_cache.keys import is_digest_prefix, key_digest

FORMAT = 1
META_NAME = "meta.json"
LEASE_NAME = ".lease"
DATA_NAME = "data"
BUILD_PREFIX = "b."
TRASH_PREFIX = "x."


class ObjectMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    format: int
    digest: str
    key: dict[str, Any]
    files: dict[str, str]  # relative path under data/ -> sha256
    size: int
    created: float
    build_seconds: float = 0.0


_meta_decoder = msgspec.json.Decoder(ObjectMeta)


class MetaError(ValueError):
    """An object's meta.json is missing, unreadable or inconsistent."""


class Layout:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / "objects"
        self.tmp = root / "tmp"
        self.locks = root / "locks"
        self.index_path = root / "index.sqlite"
        self.index_lock = self.locks / "index.lock"
        self.gc_lock = self.locks / "gc.lock"

    def ensure(self) -> None:
        for d in (self.root, self.objects, self.tmp, self.locks):
            d.mkdir(parents=True, exist_ok=True)

    def object_dir(self, digest: str) -> Path:
        return self.objects / digest

    def build_lock(self, digest: str) -> Path:
        return self.locks / f"{digest}.lock"

    def list_objects(self) -> set[str]:
        try:
            names = os.listdir(self.objects)
        except FileNotFoundError:
            return set()
        return {n for n in names if len(n) == 64 and is_digest_prefix(n)}

    def _private(self, prefix: str, digest: str) -> Path:
        return self.tmp / f"{prefix}{digest}.{os.getpid()}.{secrets.token_hex(4)}"

    def new_build_dir(self, digest: str) -> Path:
        return self._private(BUILD_PREFIX, digest)

    def new_trash_dir(self, digest: str) -> Path:
        return self._private(TRASH_PREFIX, digest)

    def read_meta(self, digest: str) -> ObjectMeta:
        path = self.object_dir(digest) / META_NAME
        try:
            meta = _meta_decoder.decode(path.read_bytes())
        except FileNotFoundError as e:
            raise MetaError(f"{META_NAME} is missing") from e
        except (OSError, msgspec.DecodeError) as e:
            raise MetaError(f"{META_NAME} is unreadable: {e}") from e
        if meta.digest != digest:
            raise MetaError(f"{META_NAME} names digest {meta.digest[:12]}, not its directory")
        if meta.format != FORMAT:
            raise MetaError(f"{META_NAME} has format {meta.format}, expected {FORMAT}")
        try:
            if key_digest(meta.key) != digest:
                raise MetaError(f"the key in {META_NAME} does not hash to its directory name")
        except InvalidKey as e:
            raise MetaError(f"the key in {META_NAME} is invalid: {e}") from e
        return meta


def encode_meta(meta: ObjectMeta) -> bytes:
    return msgspec.json.format(msgspec.json.encode(meta), indent=2) + b"\n"
