"""Compiling a shape through the content-addressed compile cache.

The key (DESIGN section 7) is (manifest_digest, kernel_revision, shape, precision, deployment
target, coremltools version) plus `packed`, the head type and any non-default test-only
`BuildOptions`: everything that changes the bytes of the package, nothing that does not.
One process builds a key at a time; others wait for it and reuse the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compile_cache import CompileCache, Entry, EntryEvicted, Lease, make_key
from workers.ane.builder import (
    DEPLOYMENT_TARGET,
    KERNEL_REVISION,
    PRECISION,
    BuildOptions,
    build_program,
    convert_and_save,
)
from workers.ane.ct_quiet import COREMLTOOLS_VERSION
from workers.ane.manifest import Manifest
from workers.ane.shapes import Shape

PACKAGE_NAME = "model.mlpackage"


def cache_key(manifest: Manifest, shape: Shape, options: BuildOptions) -> dict[str, Any]:
    return make_key(
        manifest_digest=manifest.digest,
        kernel_revision=KERNEL_REVISION,
        shape=shape.dims,
        precision=PRECISION,
        deployment_target=DEPLOYMENT_TARGET,
        coremltools_version=COREMLTOOLS_VERSION,
        packed=shape.packed,
        head=manifest.head.type,
        **options.key_fields(),
    )


@dataclass
class CompiledShape:
    """A compiled shape held under a cache lease (release it when the shape is evicted)."""

    shape: Shape
    entry: Entry
    lease: Lease
    cache_hit: bool
    compile_ms: float

    @property
    def package(self) -> Path:
        return self.entry.path / PACKAGE_NAME

    @property
    def size(self) -> int:
        return self.entry.size

    def release(self) -> None:
        self.lease.release()


def compile_shape(
    cache: CompileCache,
    manifest: Manifest,
    shape: Shape,
    options: BuildOptions | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> CompiledShape:
    """Get (or build) `shape`'s package and lease it. `on_stage("graph" | "converted")` is
    called as a build progresses (never on a hit). Raises compile_cache errors (BuildFailed
    wraps the builder's exception)."""
    options = options or BuildOptions()
    key = cache_key(manifest, shape, options)
    built: list[float] = []

    def build(tmp: Path) -> None:
        start = time.perf_counter()
        prog = build_program(manifest, shape, options)
        if on_stage is not None:
            on_stage("graph")
        out = convert_and_save(prog, tmp)
        assert out.name == PACKAGE_NAME
        if on_stage is not None:
            on_stage("converted")
        built.append((time.perf_counter() - start) * 1e3)

    for _ in range(5):
        entry = cache.get_or_build(key, build)
        try:
            lease = entry.lease().acquire()
        except EntryEvicted:
            continue  # gc'd between publish and lease (another process): look up again
        return CompiledShape(
            shape=shape,
            entry=entry,
            lease=lease,
            cache_hit=not built,
            compile_ms=sum(built),
        )
    raise EntryEvicted(f"compiled shape {shape.id} keeps being evicted from the cache")
