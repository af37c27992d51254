"""Admitting a shape through the content-addressed compile cache: two kinds of entry.

    kind "mlpackage"          the converted `.mlpackage` (built on any OS)
    kind <backend's kind>     its compiled form: "mlmodelc" (Core ML, macOS) or
                              "reference-program" (the numpy executor's mapped program)

Admission = compiled form from the cache if there (no build, no compile) -> else the package
(from the cache or built: graph, convert, save) -> compile it with the backend -> publish the
compiled form -> open it -> one warm-up prediction -> its placement share. `on_stage` is
called after each completed stage ("graph", "converted", "compiled", "loaded", "warmed",
"placed"), which the engine turns into PROGRESS; `AdmitTimings` carries the milliseconds of
each stage for SHAPE_ADMITTED.

The package key (what the compile cache files the package under) is (manifest_digest,
kernel_revision, shape, precision, deployment target, coremltools version) plus `packed`, the
head type, the token heads built into an embedder's graph, packed or not
(`GraphHeads.key_fields`: a digest of what the graph reads of each) and any non-default
test-only `BuildOptions`: everything that changes the bytes of the package, nothing that does
not. The compiled key adds the backend, its kind and what the
compiled form depends on (`Backend.compiled_key_fields`: the macOS build for `.mlmodelc`). One
process builds a key at a time; others wait for it and reuse the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compile_cache import CompileCache, Entry, EntryEvicted, Lease, make_key
from formats.owned.manifest import Manifest
from workers.ane.backend_errors import BackendOpenFailed
from workers.ane.backends import Backend, ShapeRunner
from workers.ane.executor import UnsupportedOp
from workers.ane.identity import (
    DEPLOYMENT_TARGET,
    PRECISION,
    coremltools_version,
    kernel_revision,
)
from workers.ane.program_ir import ProgramFormatError
from workers.ane.shapes import Shape
from workers.ane.token_heads import GraphHeads, has_token_outputs

PACKAGE_NAME = "model.mlpackage"
PACKAGE_KIND = "mlpackage"
_RETRIES = 5


def cache_key(
    manifest: Manifest, shape: Shape, options: Any, heads: GraphHeads | None = None
) -> dict[str, Any]:
    """The package's key (`options`: builder.BuildOptions; `heads`: the token heads built in,
    named by their digests)."""
    return make_key(
        manifest_digest=manifest.digest,
        kernel_revision=kernel_revision(manifest.config.family, manifest.head.type),
        shape=shape.dims,
        precision=PRECISION,
        deployment_target=DEPLOYMENT_TARGET,
        coremltools_version=coremltools_version(),
        packed=shape.packed,
        head=manifest.head.type,
        kind=PACKAGE_KIND,
        **options.key_fields(),
        **(heads.key_fields() if heads is not None and has_token_outputs(manifest) else {}),
    )


def compiled_key(package_key: dict[str, Any], backend: Backend) -> dict[str, Any]:
    return {
        **package_key,
        "kind": backend.compiled_kind,
        "backend": backend.name,
        **backend.compiled_key_fields(),
    }


@dataclass
class AdmitTimings:
    build_ms: float = 0.0  # graph + convert + save of the package (0 when it was cached)
    compile_ms: float = 0.0  # package -> compiled form (0 on a compiled hit)
    load_ms: float = 0.0  # opening the compiled form
    warmup_ms: float = 0.0  # the first prediction (buffers, lazy set-up; Core ML compiles at load)
    placement_ms: float = 0.0  # the placement share (Core ML: its compute plan)


@dataclass
class CompiledShape:
    """A compiled shape opened from its cache entry, held under a lease (released on evict)."""

    shape: Shape
    entry: Entry  # the compiled form's entry
    lease: Lease
    runner: ShapeRunner
    cache_hit: bool  # the compiled form came from the cache: nothing was built or compiled
    package_hit: bool | None  # None on a compiled hit (the package was not looked at)
    timings: AdmitTimings = field(default_factory=AdmitTimings)

    @property
    def size(self) -> int:
        return self.entry.size

    def release(self) -> int:
        self.runner.close()
        self.lease.release()
        return self.entry.size


def package_entry(
    cache: CompileCache,
    manifest: Manifest,
    shape: Shape,
    options: Any,
    on_stage: Callable[[str], None],
    timings: AdmitTimings,
    heads: GraphHeads | None = None,
) -> tuple[Entry, bool]:
    """The package's entry (built if absent) and whether it was a hit."""
    from workers.ane import builder, builder_nomic, builder_qwen3  # coremltools

    # The decoder's own graph, NomicBERT's variant of BERT's, or BERT's.
    graph = {"qwen3": builder_qwen3, "nomic_bert": builder_nomic}.get(
        manifest.config.family, builder
    )
    built: list[float] = []

    def build(tmp: Path) -> None:
        start = time.perf_counter()
        if graph is builder:
            prog = builder.build_program(manifest, shape, options, heads)
        else:
            prog = graph.build_program(manifest, shape, options)
        on_stage("graph")
        out = builder.convert_and_save(prog, tmp)
        assert out.name == PACKAGE_NAME
        on_stage("converted")
        built.append((time.perf_counter() - start) * 1e3)

    entry = cache.get_or_build(cache_key(manifest, shape, options, heads), build)
    timings.build_ms = sum(built)
    return entry, not built


def admit(
    cache: CompileCache,
    manifest: Manifest,
    shape: Shape,
    backend: Backend,
    options: Any,
    on_stage: Callable[[str], None] | None = None,
    warmup_feeds: dict[str, np.ndarray] | None = None,
    heads: GraphHeads | None = None,
) -> CompiledShape:
    """Open `shape`'s compiled form (compiling and publishing it first on a miss), leased.
    Raises compile_cache errors (BuildFailed wraps the builder's or compiler's exception) and
    whatever the backend raises on open."""
    stage = on_stage or (lambda _name: None)
    key = compiled_key(cache_key(manifest, shape, options, heads), backend)
    timings = AdmitTimings()
    package_hit: list[bool] = []

    def compile_(tmp: Path) -> None:
        for _ in range(_RETRIES):
            pkg, hit = package_entry(cache, manifest, shape, options, stage, timings, heads)
            try:
                held = pkg.lease().acquire()
            except EntryEvicted:
                continue
            with held:
                start = time.perf_counter()
                backend.compile(pkg.path / PACKAGE_NAME, tmp)
                timings.compile_ms = (time.perf_counter() - start) * 1e3
            package_hit.append(hit)
            stage("compiled")
            return
        raise EntryEvicted(f"the package of {shape.id} keeps being evicted from the cache")

    for _ in range(_RETRIES):
        entry = cache.get_or_build(key, compile_)
        try:
            lease = entry.lease().acquire()
        except EntryEvicted:
            continue  # gc'd between publish and lease (another process): look up again
        try:
            start = time.perf_counter()
            runner = backend.open(entry.path)
            timings.load_ms = (time.perf_counter() - start) * 1e3
            stage("loaded")
            if warmup_feeds is not None:
                start = time.perf_counter()
                runner.run(warmup_feeds)
                timings.warmup_ms = (time.perf_counter() - start) * 1e3
                stage("warmed")
            # Here, under the control window, never in PING (see backends): Core ML's
            # compute plan can take longer than PING's window.
            start = time.perf_counter()
            runner.compute_placement()
            timings.placement_ms = (time.perf_counter() - start) * 1e3
            stage("placed")
        except BaseException as e:
            if "runner" in locals():
                runner.close()
            lease.release()
            if isinstance(e, Exception) and not isinstance(
                e, (BackendOpenFailed, ProgramFormatError, UnsupportedOp, OSError)
            ):
                # Whatever a native runtime raises while opening or warming up is a typed
                # failure of this shape, never an untyped crash of the exchange.
                raise BackendOpenFailed(
                    f"{backend.name} backend, shape {shape.id}: {type(e).__name__}: {e}"
                ) from e
            raise
        return CompiledShape(
            shape=shape,
            entry=entry,
            lease=lease,
            runner=runner,
            cache_hit=not package_hit,
            package_hit=package_hit[0] if package_hit else None,
            timings=timings,
        )
    raise EntryEvicted(f"compiled shape {shape.id} keeps being evicted from the cache")
