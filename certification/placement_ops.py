"""Per-op placement of a Core ML lane's admitted shapes, for the report's placement chart.

The lane reports one number after admission (PONG `placement_share`). To show WHERE the work
goes, this reads the very packages the lane admitted — looked up in the compile cache by the
worker's own key (a lookup only: nothing is compiled here) — and applies the same static
eligibility table and cost model the worker's estimate uses (`workers.ane.placement`), op by
op. It is therefore an estimate too, and labelled so; on macOS the gate itself uses Core ML's
compute plan, which this chart does not claim to reproduce.

An embedder's unpacked packages also hold the token heads LOAD named (SPLADE's vocabulary
projection, the multi-vector projection, bge-m3's lexical weights), and the compile-cache key
names the heads built in: the lookup builds that key from the same head files, as the worker
does, or it would miss every package of a model with heads.

Imports of `workers.ane` (coremltools) are late: only a Core ML report pays for them.
Anything missing (evicted entry, unknown shape) yields None and the report says so.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

log = logging.getLogger("synapse.certification")


def per_op_estimate(
    owned_dir: Path,
    shapes: list[dict],
    build_options: dict | None = None,
    cache_root: str | None = None,
    heads: dict[str, dict] | None = None,
) -> dict[str, dict[str, float]] | None:
    """{op type: {"ane": cost, "cpu": cost}} summed over `shapes`, or None if unavailable.
    `heads`: the `heads` of the lane's LOAD ({kind: {path, digest}}), whose graph-built heads
    are part of each package's key."""
    try:
        from compile_cache import CompileCache, default_root
        from formats.owned.manifest import load_manifest
        from workers.ane.builder import BuildOptions
        from workers.ane.compiler import PACKAGE_NAME, cache_key
        from workers.ane.config import default_max_segments
        from workers.ane.executor import load_package_program
        from workers.ane.placement import ane_eligible, op_cost
        from workers.ane.program_ir import from_mil, walk
        from workers.ane.shapes import Shape

        manifest = load_manifest(owned_dir, verify_weights=False)
        options = BuildOptions(**(build_options or {}))
        graph_heads = _graph_heads(manifest, heads or {})
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"ane": 0.0, "cpu": 0.0})
        with CompileCache(Path(cache_root) if cache_root else default_root()) as cache:
            for spec in shapes:
                packed = bool(spec.get("packed"))
                seq = int(spec["seq_len"])
                segs = spec.get("max_segments") or (default_max_segments(seq) if packed else 1)
                shape = Shape(int(spec["rows"]), seq, packed, int(segs))
                entry = cache.get(cache_key(manifest, shape, options, graph_heads))
                if entry is None:
                    return None
                func = from_mil(load_package_program(entry.path / PACKAGE_NAME))
                for op in walk(func.operations):
                    if op.op_type == "const":
                        continue
                    device = "ane" if ane_eligible(op) else "cpu"
                    out[op.op_type][device] += op_cost(op)
        return {k: dict(v) for k, v in out.items()}
    except Exception as exc:  # a chart must never fail a certification run
        log.warning("per-op placement unavailable: %s", exc)
        return None


def _graph_heads(manifest, files: dict[str, dict]):
    """The heads the worker builds into `manifest`'s graphs from LOAD's `heads` (as its
    engine does at LOAD: digests checked, none for a graph without token outputs)."""
    from workers.ane.token_heads import GraphHeads, token_refusal
    from workers.heads.files import HeadFile, load_heads

    if not files or token_refusal(manifest) is not None:
        return None
    loaded = load_heads({kind: HeadFile(**spec) for kind, spec in files.items()})
    return GraphHeads.of(loaded, manifest.config.hidden_size)
