"""Everything certification asks of the host, in one place.

Certification drives a REAL lane through `host.module.Module` — the same tokenization,
batching and worker as serving — never an engine in-process. This adapter is the only code
that knows the Module's lane API:

- llama lane (`lane="llama"`, always passed: a Module left to choose could serve another
  lane): `load(name, lane=)`, `tokenizer(name, lane=)`, `embed(..., model=name, lane=)`,
  `rerank(...)`; identity from `lane_identity(name, lane)` (HELLO, the device LOADED named)
  and the served `ModelRecord`.
- Core ML lane: the same calls with `lane="ane"`, plus `load(..., runtime_config_extra=)`
  (shapes, test-only build_options) and `placement(name, lane=)`.

`lane_identity` below reads only `host.lane_policy.LoadedLanes` (the loaded lane's identity
and its manifest), so the certificate policy can call it with what the Module hands it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import numpy as np

from certification.errors import LaneUnavailable
from certification.identity import LaneIdentity, canonical_json
from host.errors import WorkerError
from host.lane_policy import LoadedLanes
from host.module import Module, load_heads_spec
from host.token_outputs import TokenOutputs
from host.tokenization import Tokenizer
from ingest.owned import owned_dir
from ingest.store import ModelRecord

LANES = ("llama", "ane")
# A worker's ERR codes that mean "this lane does not compute that" (an output it has no head
# for, a query it cannot mask as the model does, an item longer than every shape a Core ML lane
# admitted): the output is not served on the lane as it is set up, which a
# certificate says with the lane's reason rather than failing or passing it.
REFUSAL_CODES = ("unsupported", "shape_unsupported")


class NotServed(Exception):
    """The lane refused an output; the message is its reason."""


class LaneClient:
    def __init__(self, module: Module, model: str, lane: str = "llama") -> None:
        if lane not in LANES:
            raise ValueError(f"lane {lane!r}: expected one of {LANES}")
        self.module = module
        self.model = model
        self.lane = lane
        # Always explicit: a Module left to choose might serve another lane than the one
        # being certified.
        self._kw: dict[str, Any] = {"lane": lane}
        self._tokenizer: Tokenizer | None = None
        self._shapes: list[dict] | None = None
        self._build_options: dict | None = None
        self._extra: dict | None = None
        self._cache_root: str | None = None

    @property
    def record(self) -> ModelRecord:
        return self.module.store.get(self.model)

    # ---- lifecycle ------------------------------------------------------------------------

    async def load(
        self, shapes: list[dict] | None = None, runtime_config_extra: dict | None = None
    ) -> None:
        if self.module.supervisor(self.model, self.lane) is not None:
            # Module.load is idempotent and would ignore the requested shapes/options, so the
            # certificate could name a configuration that is not the one running.
            raise ValueError(
                f"{self.model} is already loaded on the {self.lane} lane of this "
                "Module; certify on a fresh Module"
            )
        if self.lane == "llama":
            if shapes or runtime_config_extra:
                raise ValueError("shapes and runtime_config_extra apply to the ane lane only")
            await self.module.load(self.model, lane="llama")
            return
        extra = dict(runtime_config_extra or {})
        if shapes:
            extra["shapes"] = shapes
        self._shapes = shapes
        self._extra = extra
        self._build_options = extra.get("build_options")
        self._cache_root = extra.get("cache_root")
        kwargs: dict[str, Any] = dict(self._kw)
        if extra:
            kwargs["runtime_config_extra"] = extra
        await self.module.load(self.model, **kwargs)

    # ---- inference ------------------------------------------------------------------------

    async def tokenizer(self) -> Tokenizer:
        """The lane's module-side tokenizer (the one whose ids reach the worker)."""
        if self._tokenizer is None:
            self._tokenizer = await self.module.tokenizer(self.model, lane=self.lane)
        return self._tokenizer

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, float]:
        """Normalized embeddings through Module.embed, and the request's latency in ms."""
        start = time.perf_counter()
        # No model prompt: the reference embeds the corpus's own ids, and fidelity is judged
        # on the same input.
        result = await self.module.embed(
            texts, model=self.model, normalize=True, truncate=True, prompt="", **self._kw
        )
        return result.vectors, (time.perf_counter() - start) * 1e3

    async def rerank(self, query: str, docs: list[str]) -> tuple[np.ndarray, float]:
        """Scores in document order through Module.rerank, and the latency in ms."""
        start = time.perf_counter()
        result = await self.module.rerank(query, docs, model=self.model, **self._kw)
        ms = (time.perf_counter() - start) * 1e3
        if result.method != "cross-encoder":
            raise ValueError(f"{self.model} reranked by {result.method}, not a cross-encoder")
        scores = np.empty(len(docs), dtype=np.float32)
        for index, score in result.results:
            scores[index] = score
        return scores, ms

    async def encode(
        self, texts: list[str], outputs: list[str], side: str = "document"
    ) -> tuple[TokenOutputs, float]:
        """Token-level outputs through Module.encode_outputs (no model prompt, as `embed`),
        and the request's latency in ms; `NotServed` when the lane refuses them."""
        start = time.perf_counter()
        try:
            result = await self.module.encode_outputs(
                texts,
                outputs,
                model=self.model,
                normalize=True,
                truncate=True,
                prompt="",
                side=cast(Any, side),
                **self._kw,
            )
        except WorkerError as exc:
            if exc.code in REFUSAL_CODES:
                raise NotServed(exc.message) from None
            raise
        return result, (time.perf_counter() - start) * 1e3

    async def late_chunk(self, chunks: list[str]) -> np.ndarray:
        """One normalized vector per chunk of one document through Module.late_chunk (no
        model prompt); `NotServed` when the lane refuses the token states it pools."""
        try:
            result = await self.module.late_chunk(
                chunks, model=self.model, normalize=True, prompt="", **self._kw
            )
        except WorkerError as exc:
            if exc.code in REFUSAL_CODES:
                raise NotServed(exc.message) from None
            raise
        return result.vectors

    async def classify(self, texts: list[str]) -> tuple[np.ndarray, float]:
        """Every label's score (the model's activation) through Module.classify, in label-id
        order, and the request's latency in ms."""
        start = time.perf_counter()
        result = await self.module.classify(texts, self.model, truncate=True, **self._kw)
        return result.scores(), (time.perf_counter() - start) * 1e3

    async def placement(self) -> tuple[float | None, str | None]:
        if self.lane == "llama":
            return None, None
        share, source = await self.module.placement(self.model, **self._kw)
        return share, source

    # ---- identity -------------------------------------------------------------------------

    def identity(self) -> LaneIdentity:
        return lane_identity(
            self.module, self.model, self.lane, self._shapes, self._build_options, self._extra
        )

    async def placement_ops(self) -> dict[str, dict[str, float]] | None:
        """Per-op placement: from the lane's identity if it carries `placement_ops`, else the
        static estimate over the admitted packages (certification.placement_ops)."""
        if self.lane == "llama":
            return None
        ops = dict(self.module.lane_identity(self.model, self.lane)).get("placement_ops")
        if isinstance(ops, dict):
            return {str(k): {str(d): float(c) for d, c in v.items()} for k, v in ops.items()}
        from certification.placement_ops import per_op_estimate

        record = self.record
        # The heads LOAD named: the worker builds them into the graph, and its packages are
        # keyed by them.
        return await asyncio.to_thread(
            per_op_estimate,
            owned_dir(self.module.store, record),
            self._shapes or default_ane_shapes(record),
            self._build_options,
            self._cache_root,
            load_heads_spec(record),
        )


def lane_identity(
    module: LoadedLanes,
    model: str,
    lane: str,
    shapes: list[dict] | None = None,
    build_options: dict | None = None,
    runtime_config_extra: dict | None = None,
) -> LaneIdentity:
    """The identity of a loaded lane. `shapes`/`build_options`/`runtime_config_extra`: what
    LOAD was asked for, used when `Module.lane_identity` does not report them itself."""
    settings = load_settings(lane, runtime_config_extra)
    if lane == "llama":
        return llama_identity(module, model, settings)
    raw = dict(module.lane_identity(model, lane))
    if not raw.get("shapes"):
        raw["shapes"] = shapes or default_ane_shapes(module.record(model))
    if build_options and not raw.get("build_options"):
        raw["build_options"] = build_options
    raw["settings"] = settings
    raw["heads"] = head_digests(module.record(model))
    return LaneIdentity.from_mapping(model, lane, raw)


def head_digests(record: ModelRecord) -> dict[str, str]:
    """{kind: digest} of the heads LOAD hands the worker beside the artifact (both lanes)."""
    return {kind: h.digest for kind, h in record.manifest.heads.items()}


# Keys of a LOAD's runtime_config that are in the identity by other fields, or that cannot
# change a number (where files live, what the model is called).
_NOT_SETTINGS = frozenset({"shapes", "build_options", "cache_root", "model_ref"})


def load_settings(lane: str, runtime_config_extra: dict | None) -> dict:
    """The runtime settings that can change a lane's numbers: everything LOAD was given beyond
    the defaults (llama.cpp's flash_attn, n_seq_max...) and, for Core ML, the compute units
    the worker will resolve (its environment override included)."""
    settings = {k: v for k, v in (runtime_config_extra or {}).items() if k not in _NOT_SETTINGS}
    if lane == "ane":
        from workers.ane.config import AneRuntimeConfig, resolve_compute_units

        units = settings.get("compute_units")
        settings["compute_units"] = resolve_compute_units(
            AneRuntimeConfig(compute_units=cast(Any, units) if isinstance(units, str) else None)
        )
    return settings


def llama_identity(module: LoadedLanes, model: str, settings: dict | None = None) -> LaneIdentity:
    raw = module.lane_identity(model, "llama")  # KeyError when the lane is not loaded
    if raw.get("engine") is None:
        raise LaneUnavailable(f"lane for {model!r} has no live worker (no HELLO)")
    record = module.record(model)
    man = record.manifest
    return LaneIdentity(
        model=model,
        lane="llama",
        precision=man.dtype or "unknown",
        artifact_digest=record.digest,
        manifest_digest=raw["manifest_digest"],
        kernel_revision=raw["kernel_revision"],
        # What shapes the numbers: the runtime context and the default truncation limit.
        shapes=(f"n_ctx={man.n_ctx}", f"max_tokens={man.max_tokens}"),
        engine=raw["engine"],
        engine_version=raw["engine_version"],
        build_flags=raw["build_flags"],
        device=str(raw.get("device") or ""),
        settings=canonical_json(settings),
        heads=canonical_json(head_digests(record)),
    )


def default_ane_shapes(record: ModelRecord) -> list[dict]:
    """The shapes a Core ML LOAD admits when none are requested (the worker's defaults;
    seq_len 0 stands for the model's max_seq_length, the store's max_tokens)."""
    from workers.ane.config import default_shapes  # msgspec-only module: no coremltools

    man = record.manifest
    return [
        {"rows": rows, "seq_len": seq}
        for rows, seq in default_shapes(man.max_tokens, man.max_tokens_limit)
    ]
