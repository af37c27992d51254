"""Certificates on disk: `<cache dir>/certificates/<id>.json`, one per key (latest wins).

The cache dir is `$SYNAPSE_CACHE_DIR`, else platformdirs' user_cache_dir("synapse") — the
same base as the artifact store's `models/`. A re-certification of the same key replaces the
current record and keeps the previous one under `history/<id>/` so drift stays traceable.

Rule for `save`: `<id>.json` always exists once written. The new record is written and synced
to a temp file, the current one is hard-linked into history (it stays in place), and only then
does one rename replace it. A reader sees the old record or the new one, never none; a crash
at any point leaves the old record current. Saves of one id are serialized by a file lock
(two processes re-certifying at once), and history names carry a unique suffix, so records
created within the same second never overwrite each other. A save the disk cannot hold is a
`StorageFull`, and the old record stays current.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import msgspec
import platformdirs
from filelock import FileLock

from certification.certificate import Certificate, decode, encode
from certification.errors import CertificateNotFound
from common.errors import StorageFull
from compile_cache.fsutil import fsync_dir, full_fsync
from ingest.durable import full_disk_as


def default_root() -> Path:
    env = os.environ.get("SYNAPSE_CACHE_DIR")
    base = Path(env) if env else Path(platformdirs.user_cache_dir("synapse"))
    return base / "certificates"


class CertificateStore:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def path(self, cert_id: str) -> Path:
        return self.root / f"{cert_id}.json"

    def get(self, cert_id: str) -> Certificate | None:
        try:
            return decode(self.path(cert_id).read_bytes())
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError, OSError):
            return None  # unreadable or an older schema: treated as absent (re-certify)

    def find(self, prefix: str) -> Certificate:
        """By id or unique id prefix (`certify show 3fa9`)."""
        matches = [p for p in self._files() if p.stem.startswith(prefix)]
        if not matches:
            raise CertificateNotFound(f"no certificate with id {prefix!r} in {self.root}")
        if len(matches) > 1:
            ids = ", ".join(p.stem for p in matches)
            raise CertificateNotFound(f"id prefix {prefix!r} is ambiguous: {ids}")
        cert = self.get(matches[0].stem)
        if cert is None:
            raise CertificateNotFound(f"certificate {matches[0].stem} is unreadable")
        return cert

    def ls(self) -> list[Certificate]:
        certs = [c for c in (self.get(p.stem) for p in self._files()) if c is not None]
        return sorted(certs, key=lambda c: c.created_at, reverse=True)

    def latest_for(self, model: str, lane: str) -> Certificate | None:
        """The most recent certificate of this model on this lane, whatever its key."""
        for cert in self.ls():
            if cert.key.model == model and cert.key.lane == lane:
                return cert
        return None

    def save(self, cert: Certificate) -> Path:
        """Make `cert` its id's current record (see the rule in the module docstring)."""
        self.root.mkdir(parents=True, exist_ok=True)
        dest = self.path(cert.id)
        data = encode(cert)
        try:  # a record that cannot be read back must not replace one that can
            decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"certificate {cert.id} would not read back: {exc}") from None
        full = lambda exc: StorageFull(  # noqa: E731
            f"cannot save certificate {cert.id} under {self.root}: {exc.strerror or exc}; the "
            f"previous record is unchanged. Free some space and certify again"
        )
        with full_disk_as(full, self.root, len(data)), FileLock(self.root / f".{cert.id}.lock"):
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.root)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    full_fsync(f.fileno())
                if dest.exists():
                    hist = self.root / "history" / cert.id
                    hist.mkdir(parents=True, exist_ok=True)
                    kept = hist / f"{_stamp(dest)}-{uuid.uuid4().hex[:8]}.json"
                    try:
                        os.link(dest, kept)
                    except OSError:  # a file system without hard links
                        shutil.copyfile(dest, kept)
                    fsync_dir(hist)
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            fsync_dir(self.root)
        return dest

    def _files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("*.json") if not p.name.startswith("."))


def _stamp(path: Path) -> str:
    try:
        raw = decode(path.read_bytes()).created_at
    except (msgspec.DecodeError, msgspec.ValidationError, OSError):
        raw = str(int(path.stat().st_mtime))
    return raw.replace(":", "").replace("-", "")
