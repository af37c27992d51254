"""Certification runs that several modules judge, each run ONCE per test run (across xdist's
processes: tests/session_share.py) in a certificate store of its own. No tests here.

A module that needs the run's certificate in its own store `adopt`s it: the certificate as the
run saved it, and the run's fp32 reference results (a content-addressed cache: sha256 of the
reference's files and the ids), so the module's later runs find them as they would after
running it there. Every process ingests the default models alike (same digests), so the
certificate's identity is each process's lane's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from certification.certificate import Certificate
from certification.runner import RunOptions, certify
from certification.store import CertificateStore
from host.config import HostConfig
from host.module import Module, ModuleConfig
from ingest.store import ArtifactStore
from tests.session_share import build_once

REFERENCE_CACHE = "reference-cache"  # beside the certificates: certification.runner's layout
_RUN_DIRS: dict[str, Path] = {}  # certificate id -> the store its run wrote


def certify_once(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    cache_dir: Path,
    options: RunOptions,
    prepare: Callable[[ArtifactStore], object] | None = None,
) -> Certificate:
    """The certificate of `options` run through a Module on `cache_dir` (a SYNAPSE_CACHE_DIR:
    its models, its Core ML compile cache), run once per test run; `prepare` first puts the
    model in that store (in the process that runs it: the other only reads the certificate)."""

    def build(out: Path) -> None:
        if prepare is not None:
            prepare(ArtifactStore(cache_dir / "models"))
        runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")  # short: socket paths
        config = ModuleConfig(
            store_root=str(cache_dir / "models"),
            host=HostConfig(runtime_dir=runtime, ping_interval_s=0),
        )

        async def run() -> None:
            async with Module(config) as mod:
                await certify(mod, options, CertificateStore(out))

        try:
            with pytest.MonkeyPatch.context() as mp:  # workers compile into this cache
                mp.setenv("SYNAPSE_CACHE_DIR", str(cache_dir))
                asyncio.run(run())
        finally:
            shutil.rmtree(runtime, ignore_errors=True)

    out = build_once(tmp_path_factory, name, build)
    (cert,) = CertificateStore(out).ls()
    _RUN_DIRS[cert.id] = out
    return cert


def adopt(cert: Certificate, store: CertificateStore) -> Certificate:
    """`cert` (of `certify_once`) saved in `store`, with its run's reference results beside
    it."""
    src = _RUN_DIRS[cert.id] / REFERENCE_CACHE
    dst = store.root / REFERENCE_CACHE
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.npy"):
        if not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:  # another filesystem
                shutil.copy2(f, dst / f.name)
    store.save(cert)
    return cert
