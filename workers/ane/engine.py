"""`AneEngine`: the Core ML (Neural Engine) engine over the owned BERT graph.

One model per engine (HELLO advertises one manifest digest). The model's compiled shapes are
admitted explicitly (ADMIT_SHAPE, or the `shapes` list of LOAD's runtime_config), compiled
through the content-addressed compile cache, loaded into a backend and kept under a
loaded-shape budget that evicts the least recently used shape. Inference packs the request's
sequences into the loaded shapes (`packing.plan`), runs one shape-sized chunk of rows at a
time and reports PROGRESS after each.

    AneEngine(artifact=None, *, backend=None, cache_root=None, build_options=None)
    AneEngine.from_argv(["--artifact", PATH, "--backend", "reference", "--cache-root", DIR])

`artifact` (the owned-format directory) lets HELLO carry `manifest_digest` before LOAD;
`backend` / `cache_root` are defaults that LOAD's runtime_config overrides; `build_options`
is the test-only graph degradation of `builder.BuildOptions` (certification tests).

Start-up is cheap on purpose: constructing the engine and answering HELLO import no coremltools
(identity constants come from `identity`), so a worker never misses the HELLO window however
slow the heavy imports are. coremltools is imported when a package must be built (ADMIT_SHAPE
or LOAD's shapes, on a compile-cache miss) or the Core ML runtime is opened (LOAD with the
coreml backend), with PROGRESS after each completed stage; a compiled form found in the cache
on the reference backend needs no coremltools at all.

Admission (`compiler.admit`): compiled form from the cache -> else package (cache or build)
-> compile -> publish -> open -> one warm-up prediction. SHAPE_ADMITTED carries `cache_hit`
(the compiled form was cached: nothing built or compiled) and the milliseconds of each stage;
PONG carries the worker's compile-cache hits, misses and the cache's total bytes.

Error mapping: manifest problems -> `artifact_invalid` (or `unsupported` for a model the builder
does not implement); bad runtime_config -> `config_invalid`; a shape over the configured
limits or no loaded shape that fits an item -> `shape_unsupported`; a failed conversion, or an
op the backend cannot execute (`UnsupportedOp`), or a compiled form the backend cannot open
or warm up (`BackendOpenFailed`: Core ML's native errors) -> `compile_failed` naming it. After
any of these the engine keeps serving.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from compile_cache import CompileCache, CompileCacheError, default_root
from compile_cache.paths import default_budget
from formats.owned.manifest import FORMAT, Manifest, load_manifest
from formats.owned.model import EMBED_HEADS, RANK_HEADS, ManifestError
from workers.ane.backend_errors import BackendOpenFailed, BackendUnavailable
from workers.ane.backends import Backend, default_backend, open_backend
from workers.ane.build_options import BuildOptions
from workers.ane.compiler import CompiledShape, admit
from workers.ane.config import (
    AneRuntimeConfig,
    default_max_segments,
    default_shapes,
    parse_runtime_config,
    resolve_compute_units,
)
from workers.ane.coreml_args import lane_device
from workers.ane.executor import PackageError, UnsupportedOp
from workers.ane.identity import KERNEL_REVISION, coremltools_version, kernel_revision
from workers.ane.packing import Chunk, NoShapeFits, feeds_for, gather_rows, plan
from workers.ane.program_ir import ProgramFormatError
from workers.ane.refusals import refusals as declared_refusals
from workers.ane.shapes import Shape
from workers.ane.token_heads import (
    MULTIVECTOR,
    SPARSE_POOLED,
    TOKEN_STATES,
    TOKEN_WEIGHTS,
    VOCAB_CHUNK_ELEMENTS,
    GraphHeads,
    has_token_outputs,
    token_refusal,
)
from workers.engine import (
    Engine,
    EngineError,
    Progress,
    Section,
    dense_section,
    ragged_section,
    sparse_section,
)
from workers.heads import sparse
from workers.heads.files import load_heads
from workers.protocol import messages as m

log = logging.getLogger("synapse.ane")

ENGINE_NAME = "coreml-ane"


@dataclass
class _Model:
    ref: str
    manifest: Manifest
    config: AneRuntimeConfig
    backend: Backend
    cache: CompileCache
    shapes: OrderedDict[str, CompiledShape]  # least recently used first
    device: str = "ane"  # what LOADED names: "ane+gpu" when Core ML may use the GPU too
    heads: dict[str, Any] = field(default_factory=dict)  # by output kind (workers.heads)
    head_limits: dict[str, int] = field(default_factory=dict)  # a head's own token limit
    graph_heads: GraphHeads | None = None  # what its graphs build on token states


@dataclass
class CacheStats:
    """This worker's compile-cache lookups (admissions of a compiled form) and the cache's
    total bytes after its last admission: PONG's `cache_*` fields."""

    hits: int = 0
    misses: int = 0
    bytes: int | None = None


class _Forward:
    """Keeps a request's progress phases monotonic when stages repeat (LOAD admits several
    shapes: setup, control, setup... would go backwards)."""

    def __init__(self, progress: Progress, phases: tuple[m.Phase, ...]) -> None:
        self._progress = progress
        self._phases = phases
        self._at = 0

    def advance(self, phase: m.Phase, completed: int = 1) -> None:
        self._at = max(self._at, self._phases.index(phase))
        self._progress.advance(self._phases[self._at], completed)


class AneEngine(Engine):
    def __init__(
        self,
        artifact: str | Path | None = None,
        *,
        backend: str | None = None,
        cache_root: str | Path | None = None,
        build_options: BuildOptions | None = None,
    ) -> None:
        self._backend = backend
        self._cache_root = Path(cache_root) if cache_root is not None else None
        self._options = build_options or BuildOptions()
        self._model: _Model | None = None
        self._hello_digest: str | None = None
        # The graph HELLO names: the artifact's family's; BERT's when none is known yet.
        self._hello_revision = KERNEL_REVISION
        self.cache_stats = CacheStats()
        if artifact is not None:
            try:
                # Body digest only: HELLO must not wait for hashing every weight; LOAD
                # verifies them all.
                hello = load_manifest(artifact, verify_weights=False)
                self._hello_digest = hello.digest
                self._hello_revision = kernel_revision(hello.config.family, hello.head.type)
            except ManifestError as e:
                log.warning(
                    "artifact %s unreadable at start (%s); LOAD will report it", artifact, e
                )

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> AneEngine:
        parser = argparse.ArgumentParser(prog="workers.ane")
        parser.add_argument("--artifact", help="owned-format model directory (for HELLO)")
        parser.add_argument("--backend", choices=["reference", "coreml"])
        parser.add_argument("--cache-root", help="compile-cache directory")
        parser.add_argument(
            "--build-options", help="TEST ONLY: JSON of builder.BuildOptions (degraded graphs)"
        )
        args = parser.parse_args(list(argv))
        options = None
        if args.build_options:
            options = msgspec.convert(json.loads(args.build_options), BuildOptions)
        return cls(
            args.artifact, backend=args.backend, cache_root=args.cache_root, build_options=options
        )

    # ---- identity ---------------------------------------------------------------------------

    def info(self) -> m.EngineInfo:
        return m.EngineInfo(
            engine=ENGINE_NAME,
            version=f"{self._hello_revision} coremltools-{coremltools_version()}",
            build_flags=f"backend={self._backend or default_backend()} numpy-{np.__version__}",
        )

    def hello_extras(self) -> dict:
        extras: dict = {"kernel_revision": self._hello_revision, "packed": True}
        if self._hello_digest is not None:
            extras["manifest_digest"] = self._hello_digest
        return extras

    def models_loaded(self) -> list[str]:
        return [self._model.ref] if self._model is not None else []

    def placement(self) -> tuple[float | None, str | None]:
        model = self._model
        if model is None or not model.shapes:
            return None, None
        # Computed at admission; PING only reads it (it must answer within its window).
        found = next(reversed(model.shapes.values())).runner.placement()
        return found if found is not None else (None, None)

    def pong_extras(self) -> dict:
        stats = self.cache_stats
        return {"cache_hits": stats.hits, "cache_misses": stats.misses, "cache_bytes": stats.bytes}

    # ---- LOAD / UNLOAD ----------------------------------------------------------------------

    def load(self, req: m.LOAD, progress: Progress) -> m.LOADED:
        start = time.perf_counter()
        if req.format != FORMAT:
            raise EngineError(
                "artifact_invalid", f"format {req.format!r}: this engine loads {FORMAT!r}"
            )
        try:
            config = parse_runtime_config(req.runtime_config)
        except ValueError as e:
            raise EngineError("config_invalid", str(e)) from None
        backend_name = config.backend or self._backend or default_backend()
        if backend_name == "coreml" and default_backend() != "coreml":
            raise EngineError("config_invalid", "backend 'coreml' needs macOS (Core ML runtime)")
        try:
            compute_units = resolve_compute_units(config)
        except ValueError as e:
            raise EngineError("config_invalid", str(e)) from None
        try:
            manifest = load_manifest(req.artifact_path)
        except ManifestError as e:
            raise EngineError(e.code, f"{req.artifact_path}: {e}") from None
        if manifest.digest != req.artifact_digest:
            raise EngineError(
                "artifact_invalid",
                f"manifest digest {manifest.digest[:16]}... "
                f"!= artifact_digest {req.artifact_digest[:16]}...",
            )
        if self._hello_digest is not None and manifest.digest != self._hello_digest:
            raise EngineError(
                "artifact_invalid",
                f"this worker advertised manifest {self._hello_digest[:16]}... in HELLO",
            )
        revision = kernel_revision(manifest.config.family, manifest.head.type)
        if revision != self._hello_revision:
            # What HELLO named is what certificates are keyed by: never serve another graph.
            raise EngineError(
                "artifact_invalid",
                f"a {manifest.config.family} {manifest.head.type} model builds "
                f"{revision}, this worker "
                f"advertised {self._hello_revision} in HELLO (start it with "
                "--artifact)",
            )
        ref = config.model_ref or Path(req.artifact_path).name
        if self._model is not None:
            if self._model.ref == ref and self._model.manifest.digest == manifest.digest:
                return m.LOADED(
                    req_id=req.req_id,
                    model_ref=ref,
                    dims=_dims(manifest),
                    cold_load_ms=0.0,
                    device=self._model.device,
                    refuses=_refusals(self._model),
                    max_item_tokens=_longest(self._model),
                )
            raise EngineError(
                "invalid_request", f"one model per Core ML worker: unload {self._model.ref!r} first"
            )
        phases = _Forward(progress, ("setup", "control"))
        try:
            backend = open_backend(backend_name, compute_units)  # coreml: imports coremltools
        except (BackendUnavailable, ImportError) as e:
            raise EngineError("config_invalid", f"backend {backend_name!r}: {e}") from None
        phases.advance("setup")
        root = Path(config.cache_root) if config.cache_root else self._cache_root or default_root()
        budget = config.cache_budget_bytes
        try:
            cache = CompileCache(root, budget_bytes=default_budget() if budget is None else budget)
        except (CompileCacheError, OSError) as e:
            raise EngineError("config_invalid", f"compile cache at {root}: {e}") from None
        model = _Model(
            ref, manifest, config, backend, cache, OrderedDict(), lane_device(compute_units)
        )
        self._model = model
        try:
            self._load_heads(model)
            for shape in self._initial_shapes(model):
                self._admit(model, shape, phases)
        except BaseException:
            self._drop_model()
            raise
        return m.LOADED(
            req_id=req.req_id,
            model_ref=ref,
            dims=_dims(manifest),
            cold_load_ms=(time.perf_counter() - start) * 1e3,
            device=model.device,
            refuses=_refusals(model),
            max_item_tokens=_longest(model),
        )

    def _load_heads(self, model: _Model) -> None:
        """The heads LOAD names (digests checked), and those the graph builds on token states:
        a model whose graphs give no token states keeps its heads only for what needs no
        forward (an inference-free query side); ENCODE says why the rest is refused."""
        files = model.config.heads
        model.heads = load_heads(files)
        model.head_limits = {k: f.limit for k, f in files.items() if f.limit is not None}
        if token_refusal(model.manifest) is None:
            model.graph_heads = GraphHeads.of(model.heads, model.manifest.config.hidden_size)

    def unload(self, req: m.UNLOAD, progress: Progress) -> None:
        self._require(req.model_ref)
        self._drop_model()

    def close(self) -> None:
        self._drop_model()

    def _drop_model(self) -> None:
        model, self._model = self._model, None
        if model is None:
            return
        for compiled in model.shapes.values():
            compiled.release()
        model.shapes.clear()
        model.cache.close()

    def _initial_shapes(self, model: _Model) -> list[Shape]:
        if model.config.shapes is None:
            cfg = model.manifest.config
            return [
                self._shape(model, rows, s, False, None)
                for rows, s in default_shapes(cfg.max_seq_length, cfg.max_positions)
            ]
        return [
            self._shape(model, s.rows, s.seq_len, s.packed, s.max_segments)
            for s in model.config.shapes
        ]

    # ---- shapes -----------------------------------------------------------------------------

    def _shape(
        self, model: _Model, rows: int, seq_len: int, packed: bool, max_segments: int | None
    ) -> Shape:
        cfg, limits = model.manifest.config, model.config
        if rows < 1 or seq_len < 1 or (max_segments is not None and max_segments < 1):
            raise EngineError(
                "invalid_request",
                f"shape {rows}x{seq_len} (max_segments {max_segments}): dims must be >= 1",
            )
        if not packed and max_segments not in (None, 1):
            raise EngineError("invalid_request", "max_segments needs packed=true")
        if packed and max_segments is None:
            max_segments = default_max_segments(seq_len)
        over = []
        if rows > limits.max_rows:
            over.append(f"rows {rows} > max_rows {limits.max_rows}")
        if seq_len > cfg.max_positions:
            over.append(f"seq_len {seq_len} > the model's {cfg.max_positions} positions")
        if rows * seq_len > limits.max_shape_tokens:
            over.append(
                f"rows*seq_len {rows * seq_len} > max_shape_tokens {limits.max_shape_tokens}"
            )
        if packed and max_segments is not None and max_segments > seq_len:
            over.append(f"max_segments {max_segments} > seq_len {seq_len}")
        splade = model.graph_heads.splade if model.graph_heads is not None else None
        compared = rows * seq_len * (max_segments or 1)
        if packed and splade is not None and splade.spec.pooling == "max":
            if compared > VOCAB_CHUNK_ELEMENTS:
                # Even one vocabulary entry per chunk would compare more than the bound.
                over.append(
                    f"rows*seq_len*max_segments {compared} > {VOCAB_CHUNK_ELEMENTS} "
                    "(SPLADE's per-segment max)"
                )
        if over:
            raise EngineError("shape_unsupported", "; ".join(over))
        return Shape(rows, seq_len, packed, max_segments if packed else 1)  # type: ignore[arg-type]

    def admit_shape(self, req: m.ADMIT_SHAPE, progress: Progress) -> m.SHAPE_ADMITTED:
        model = self._require(req.model_ref)
        shape = self._shape(model, req.rows, req.seq_len, req.packed, req.max_segments)
        compiled = self._admit(model, shape, _Forward(progress, ("setup", "control")))
        if compiled is None:  # already loaded: a hit that did nothing
            return m.SHAPE_ADMITTED(req_id=req.req_id, shape_id=shape.id, cache_hit=True)
        t = compiled.timings
        return m.SHAPE_ADMITTED(
            req_id=req.req_id,
            shape_id=shape.id,
            cache_hit=compiled.cache_hit,
            compile_ms=t.compile_ms,
            build_ms=t.build_ms,
            load_ms=t.load_ms,
            warmup_ms=t.warmup_ms,
        )

    def _admit(self, model: _Model, shape: Shape, progress: _Forward) -> CompiledShape | None:
        """Load `shape`; None if it already was."""
        if shape.id in model.shapes:
            model.shapes.move_to_end(shape.id)
            progress.advance("control")
            return None

        def on_stage(stage: str) -> None:  # graph, converted, compiled, loaded, warmed, placed
            progress.advance("control")

        name = model.backend.name
        try:
            compiled = admit(
                model.cache,
                model.manifest,
                shape,
                model.backend,
                self._options,
                on_stage,
                _warmup_feeds(shape, model.manifest) if model.backend.warms_up else None,
                model.graph_heads,
            )
        except CompileCacheError as e:  # BuildFailed carries the converter's/compiler's error
            cause = e.__cause__
            if isinstance(cause, UnsupportedOp):
                raise EngineError(
                    "compile_failed",
                    f"shape {shape.id}: the {name} backend "
                    f"cannot execute op {cause.op_type}"
                    + (f" ({cause.detail})" if cause.detail else ""),
                ) from None
            raise EngineError("compile_failed", f"shape {shape.id}: {e}") from None
        except UnsupportedOp as e:
            raise EngineError(
                "compile_failed",
                f"shape {shape.id}: the {name} backend "
                f"cannot execute op {e.op_type}" + (f" ({e.detail})" if e.detail else ""),
            ) from None
        except BackendOpenFailed as e:
            raise EngineError(
                "compile_failed", f"shape {shape.id}: opening the compiled form failed: {e}"
            ) from None
        except (PackageError, ProgramFormatError, BackendUnavailable, OSError) as e:
            raise EngineError("compile_failed", f"shape {shape.id}: {e}") from None
        stats = self.cache_stats
        if compiled.cache_hit:
            stats.hits += 1
        else:
            stats.misses += 1
        stats.bytes = model.cache.total_bytes()
        model.shapes[shape.id] = compiled
        # Over budget: drop the least recently used others (never the one just admitted).
        while len(model.shapes) > model.config.max_loaded_shapes:
            victim = next(iter(model.shapes))
            freed = model.shapes.pop(victim).release()
            log.info("evicted shape %s (LRU, %d bytes) to admit %s", victim, freed, shape.id)
        progress.advance("control")
        return compiled

    def evict(self, req: m.EVICT, progress: Progress) -> m.EVICTED:
        model = self._require(req.model_ref)
        if req.shape_id is None:
            victims = list(model.shapes)
        else:
            try:
                Shape.parse(req.shape_id)
            except ValueError as e:
                raise EngineError("invalid_request", str(e)) from None
            victims = [req.shape_id] if req.shape_id in model.shapes else []
        freed = sum(model.shapes.pop(v).release() for v in victims)
        return m.EVICTED(req_id=req.req_id, shape_ids=victims, freed_bytes=freed)

    def loaded_shapes(self) -> list[str]:
        """Loaded shape ids, least recently used first."""
        return list(self._model.shapes) if self._model is not None else []

    # ---- inference --------------------------------------------------------------------------

    def embed(self, req: m.EMBED_BATCH, ids: np.ndarray, progress: Progress) -> np.ndarray:
        model = self._require(req.model_ref)
        head = model.manifest.head
        if head.type not in EMBED_HEADS:
            raise EngineError("unsupported", f"{model.ref} is a {head.type}, not an embedder")
        if req.pooling != head.pooling:
            raise EngineError(
                "unsupported", f"pooling {req.pooling!r}: this graph pools {head.pooling!r}"
            )
        seqs = self._split(model, ids, [it.n_tokens for it in req.items])
        types = [np.zeros(len(s), np.int32) for s in seqs]
        output = "embedding_l2" if req.normalize else "embedding"
        vectors = self._run(model, seqs, types, output, model.manifest.config.hidden_size, progress)
        if req.normalize:
            # The graph's L2 output is fp16, so its norms are 1 only to ~1e-3; rescaling in
            # float32 makes dot products exact cosines without changing any direction.
            norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
            vectors = (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
        return vectors

    def rerank_sequences(
        self, req: m.RERANK_SEQUENCES, ids: np.ndarray, progress: Progress
    ) -> np.ndarray:
        """One raw score per composed sequence: a cross-encoder's logit, or a causal LM
        reranker's logit[true] - logit[false] at the sequence's last token (the host sends
        the pair rendered through the model's template, the assistant prefix last)."""
        model = self._require(req.model_ref)
        head = model.manifest.head
        rank = head.type in RANK_HEADS
        if not rank and (head.type != "cross_encoder" or head.num_labels != 1):
            raise EngineError("unsupported", f"{model.ref} is not a one-logit cross-encoder")
        seqs, types = self._composed(model, ids, req.sequences, typed=not rank)
        return self._run(model, seqs, types, "logits", 1, progress)[:, 0]

    def classify(self, req: m.CLASSIFY, ids: np.ndarray, progress: Progress) -> np.ndarray:
        """Every label's raw logit: the cross-encoder head is N outputs wide (the graph's
        `logits`, (rows, num_labels)); the host applies the model's activation."""
        model = self._require(req.model_ref)
        head = model.manifest.head
        if head.type != "cross_encoder":
            raise EngineError("unsupported", f"{model.ref} has no sequence-classification head")
        seqs, types = self._composed(model, ids, req.sequences)
        return self._run(model, seqs, types, "logits", head.num_labels, progress)

    def encode(self, req: m.ENCODE, ids: np.ndarray, progress: Progress) -> list[Section]:
        """Every requested output from ONE prediction per chunk of rows, on the admitted
        shapes, packed or not (`token_heads` says what their graphs output): `dense` the
        pooled vector, `tokens` the final states, `sparse` / `multivector` the heads' graph
        outputs finished by the same worker-side code as the llama.cpp lane's
        (workers.heads). A multi-vector query whose expansion tokens must be hidden from every
        position, themselves included, is served exactly: their attention-mask entries are 0,
        which the graph's key bias applies to every query row, their own included (on a packed
        row, within the item's segment, which no other segment sees anyway)."""
        model = self._require(req.model_ref)
        outputs = list(req.outputs)
        if not outputs or len(set(outputs)) != len(outputs):
            raise EngineError("invalid_request", f"outputs {outputs}: name each once")
        refusal = token_refusal(model.manifest)
        if refusal is not None:
            raise EngineError("unsupported", f"{model.ref}: {refusal}")
        missing = [k for k in outputs if k in ("sparse", "multivector") and k not in model.heads]
        if missing:
            raise EngineError("unsupported", f"{model.ref} has no {missing[0]} head")
        pooling = model.config.pooling
        if "dense" in outputs and pooling is not None and pooling != model.manifest.head.pooling:
            raise EngineError(
                "unsupported",
                f"pooling {pooling!r}: this graph pools {model.manifest.head.pooling!r}",
            )
        cfg = model.manifest.config
        seqs = self._split(model, ids, [it.n_tokens for it in req.items])
        attended: list[int] | None = None
        mv = model.heads.get("multivector") if "multivector" in outputs else None
        if mv is not None:
            own = model.head_limits.get("multivector") or cfg.max_positions
            limit = min(own, cfg.max_positions)
            prepared = [mv.prepare(s, req.side, limit) for s in seqs]
            same = all(np.array_equal(p, s) for (p, _), s in zip(prepared, seqs, strict=True))
            if not same and outputs != ["multivector"]:
                raise EngineError(
                    "unsupported",
                    f"{model.ref}'s multi-vector input is not its text's tokens (a prefix or "
                    "query expansion): ask for the multi-vector output alone",
                )
            seqs = [p for p, _ in prepared]
            if mv.needs_owned_mask(req.side):
                attended = [n for _, n in prepared]
        head = model.heads["sparse"].for_route(req.side) if "sparse" in outputs else None
        names = [_GRAPH_OUTPUT[k] for k in outputs if k != "sparse"]
        if isinstance(head, sparse.SpladeHead):
            names.append(SPARSE_POOLED)
        elif isinstance(head, sparse.TokenWeightHead):
            names.append(TOKEN_WEIGHTS)
        # An inference-free query side alone weighs its ids: no prediction at all.
        got = self._run_tokens(model, seqs, attended, names, progress) if names else {}
        sections: list[Section] = []
        for kind in outputs:
            if kind == "dense":
                dense = np.stack(got["embedding"])
                if req.normalize:  # in float32: the graph's fp16 norm is 1 only to ~1e-3
                    norms = np.linalg.norm(dense.astype(np.float64), axis=1, keepdims=True)
                    dense = (dense / np.maximum(norms, 1e-12)).astype(np.float32)
                sections.append(dense_section(dense))
            elif kind == "tokens":
                sections.append(ragged_section("tokens", got[TOKEN_STATES], cfg.hidden_size))
            elif kind == "multivector":
                assert mv is not None
                owned = attended is not None
                vecs = [
                    mv.select(v, s, req.side, owned_mask=owned)
                    for v, s in zip(got[MULTIVECTOR], seqs, strict=True)
                ]
                sections.append(ragged_section("multivector", vecs, mv.spec.dim))
            else:
                sections.append(_sparse_section(head, got, seqs))
        return sections

    def _run_tokens(
        self,
        model: _Model,
        seqs: list[np.ndarray],
        attended: list[int] | None,
        names: list[str],
        progress: Progress,
    ) -> dict[str, list[np.ndarray]]:
        """Per graph output in `names`, per item: its pooled row (its segment's, packed), or
        its (n_tokens, C) columns of a per-token output, sliced at its offset in the row.
        `attended[i]`: item i's key mask ends there (its query expansion is hidden from every
        position of its segment, itself included)."""
        if not model.shapes:
            raise EngineError("shape_unsupported", "no shape is admitted (ADMIT_SHAPE first)")
        shapes = [c.shape for c in model.shapes.values()]  # every shape gives them (packed too)
        try:
            chunks = plan([len(s) for s in seqs], shapes)
        except NoShapeFits as e:
            raise EngineError("shape_unsupported", str(e)) from None
        types = [np.zeros(len(s), np.int32) for s in seqs]
        result: dict[str, list[np.ndarray]] = {n: [np.empty(0)] * len(seqs) for n in names}
        for chunk in chunks:
            sid = chunk.shape.id
            model.shapes.move_to_end(sid)
            feeds = _feeds(model.manifest, chunk, seqs, types)
            placed = list(_placements(chunk, seqs))
            if attended is not None:
                for r, _, i, at in placed:
                    feeds["attention_mask"][r, at + attended[i] : at + len(seqs[i])] = 0
            out = model.shapes[sid].runner.run(feeds)
            absent = [n for n in names if n not in out]
            if absent:
                raise EngineError(
                    "unsupported", f"shape {sid}'s compiled graph has no {absent[0]!r} output"
                )
            for r, k, i, at in placed:
                stop = at + len(seqs[i])
                for n in names:
                    v = out[n][r]
                    if n in (TOKEN_STATES, MULTIVECTOR):
                        v = v[:, at:stop].T  # (C, S) channels-first -> the item's (k, C)
                    elif n == TOKEN_WEIGHTS:
                        v = v[at:stop]
                    elif chunk.shape.packed:  # pooled: (K, C) per row, the item's segment
                        v = v[k]
                    result[n][i] = np.ascontiguousarray(v, dtype=np.float32)
            progress.advance("inference")
        return result

    def _composed(
        self,
        model: _Model,
        ids: np.ndarray,
        sequences: list[m.RerankSequence],
        typed: bool = True,
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The sequences and their token types: segment A ([CLS] a [SEP]) type 0, segment B
        (b [SEP]) type 1; a single text is all segment A. A decoder has no token types
        (`typed` False): n_first is checked, never read."""
        seqs = self._split(model, ids, [s.n_tokens for s in sequences])
        types = []
        for i, s in enumerate(sequences):
            if not 1 <= s.n_first <= s.n_tokens:
                raise EngineError(
                    "invalid_request", f"sequence {i}: n_first {s.n_first} outside 1..{s.n_tokens}"
                )
            tt = np.zeros(s.n_tokens, np.int32)
            if typed:
                tt[s.n_first :] = 1
            types.append(tt)
        return seqs, types

    def _split(self, model: _Model, ids: np.ndarray | None, counts: list[int]) -> list[np.ndarray]:
        if not counts:
            raise EngineError("invalid_request", "no items")
        flat = np.asarray(ids if ids is not None else np.empty(0, np.int32)).reshape(-1)
        if flat.size != sum(counts):
            raise EngineError(
                "invalid_request", f"{flat.size} token ids for {sum(counts)} declared tokens"
            )
        cfg = model.manifest.config
        for i, n in enumerate(counts):
            if not 1 <= n <= cfg.max_positions:
                raise EngineError(
                    "invalid_request", f"item {i}: {n} tokens outside 1..{cfg.max_positions}"
                )
        if flat.min() < 0 or flat.max() >= cfg.vocab_size:
            raise EngineError("invalid_request", f"token id outside [0, {cfg.vocab_size})")
        return np.split(flat.astype(np.int32, copy=False), np.cumsum(counts)[:-1])

    def _run(
        self,
        model: _Model,
        seqs: list[np.ndarray],
        types: list[np.ndarray],
        output: str,
        dims: int,
        progress: Progress,
    ) -> np.ndarray:
        if not model.shapes:
            raise EngineError("shape_unsupported", "no shape is admitted (ADMIT_SHAPE first)")
        shapes = [compiled.shape for compiled in model.shapes.values()]
        try:
            chunks = plan([len(s) for s in seqs], shapes)
        except NoShapeFits as e:
            raise EngineError("shape_unsupported", str(e)) from None
        result = np.empty((len(seqs), dims), dtype=np.float32)
        for chunk in chunks:
            sid = chunk.shape.id
            model.shapes.move_to_end(sid)
            out = model.shapes[sid].runner.run(_feeds(model.manifest, chunk, seqs, types))[output]
            for i, vec in gather_rows(chunk, out):
                result[i] = vec
            progress.advance("inference")
        return result

    def _require(self, model_ref: str) -> _Model:
        model = self._model
        if model is None or model.ref != model_ref:
            raise EngineError("model_not_loaded", f"{model_ref!r} is not loaded")
        return model


# The graph output each ENCODE kind but sparse reads (sparse: by the route's head).
_GRAPH_OUTPUT = {"dense": "embedding", "tokens": TOKEN_STATES, "multivector": MULTIVECTOR}


def _refusals(model: _Model) -> list[m.Refusal]:
    """What LOADED declares this worker refuses of `model` (workers.ane.refusals)."""
    shapes = [c.shape for c in model.shapes.values()]
    return declared_refusals(model.manifest, shapes, model.heads)


def _longest(model: _Model) -> int | None:
    """What LOADED declares as the longest item this worker serves of `model`: its longest
    admitted shape's row (a packed row holds an item that long too); None without shapes."""
    return max((c.shape.seq_len for c in model.shapes.values()), default=None)


def _sparse_section(
    head: sparse.Head | None, got: dict[str, list[np.ndarray]], seqs: list[np.ndarray]
) -> Section:
    """The route's sparse vectors: SPLADE's pooled scores or bge-m3's token weights from the
    graph, finished as the llama.cpp lane finishes them; an inference-free query side from
    its ids alone."""
    if isinstance(head, sparse.SpladeHead):
        vecs = [head.from_pooled(v) for v in got[SPARSE_POOLED]]
    elif isinstance(head, sparse.TokenWeightHead):
        vecs = [head.from_weights(w, s) for w, s in zip(got[TOKEN_WEIGHTS], seqs, strict=True)]
    else:
        assert isinstance(head, sparse.StaticSparseHead)
        vecs = [head.apply(s) for s in seqs]
    return sparse_section([(v.indices, v.values) for v in vecs], head.spec.vocab_size)


def _warmup_feeds(shape: Shape, manifest: Manifest) -> dict[str, np.ndarray]:
    """One real run's inputs: a two-token sequence in the first row (ids 101, 102: [CLS],
    [SEP] in BERT vocabularies; any valid ids serve a warm-up), one token in a 1-wide shape."""
    cfg = manifest.config
    n = min(2, shape.seq_len)
    ids = np.array([min(101, cfg.vocab_size - 1), min(102, cfg.vocab_size - 1)][:n], np.int32)
    return _feeds(manifest, Chunk(shape, [[0]]), [ids], [np.zeros(n, np.int32)])


def _placements(chunk: Chunk, seqs: Sequence[np.ndarray]) -> Iterator[tuple[int, int, int, int]]:
    """(row, segment index, item index, first column) of every item of a run: one item at
    column 0 per unpacked row, a packed row's items side by side in plan order (as
    `feeds_for` lays them out)."""
    for r, items in enumerate(chunk.rows):
        at = 0
        for k, i in enumerate(items):
            yield r, k, i, at
            at += len(seqs[i])


def _feeds(
    manifest: Manifest, chunk: Chunk, seqs: Sequence[np.ndarray], types: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    feeds = feeds_for(chunk, seqs, types, manifest.config.pad_token_id)
    if manifest.config.type_vocab_size == 0:
        # A decoder's graph (Qwen3) has no token-type input: feed exactly the graph's inputs.
        del feeds["token_type_ids"]
    if chunk.shape.packed and has_token_outputs(manifest):
        # An embedder's packed graph also takes a key mask: every token of a segment, until
        # ENCODE hides an item's query expansion.
        feeds["attention_mask"] = (feeds["segment_ids"] != 0).astype(np.int32)
    return feeds


def _dims(manifest: Manifest) -> int:
    head = manifest.head
    if head.type == "cross_encoder" or head.type in RANK_HEADS:
        return head.num_labels
    return manifest.config.hidden_size
