"""`Module`: the async API callers use — load, embed, rerank, generate, health, unload.

The module owns everything a caller sees: tokenization (module-side, from the artifact's
tokenizer.json; workers receive ids only), admission budgets, batching into protocol-sized
requests, and the typed error contract. Each loaded model is served by its own lane (one
supervised worker); llama.cpp workers get `n_threads = cores / workers`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from host.admission import Admission, Budgets
from host.artifacts.errors import ArtifactError, ArtifactNotFound
from host.artifacts.store import ArtifactStore, ModelRecord
from host.batching import plan_chunks
from host.config import HostConfig, LaneConfig
from host.errors import ConfigInvalid, InvalidRequest, ModelNotFound
from host.lane import Lane, LaneState
from host.tokenization import Tokenizer
from workers.protocol import messages as m

DEFAULT_EMBED = "minilm-l6-v2"
DEFAULT_GENERATE = "gemma3-270m"


class ModuleConfig(msgspec.Struct, kw_only=True):
    host: HostConfig = msgspec.field(default_factory=HostConfig)
    store_root: str | None = None  # default: the user cache dir (see host.artifacts.store)
    budgets: Budgets = msgspec.field(default_factory=Budgets)
    max_batch_tokens: int = 4096  # ids per EMBED_BATCH; the worker splits into decodes
    max_batch_items: int = 256
    max_generate_tokens: int = 64  # policy: short generation only
    planned_workers: int = 2  # llama.cpp threads per worker = cores // planned_workers
    worker_argv: dict[str, list[str]] = msgspec.field(
        default_factory=lambda: {"llama": ["python", "-m", "workers.llama"]}
    )


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class EmbedResult:
    vectors: np.ndarray  # float32 (n, dims)
    usage: Usage
    model: str
    truncated: list[bool]


@dataclass(frozen=True)
class RerankResult:
    results: list[tuple[int, float]]  # (document index, score), best first
    usage: Usage
    model: str
    method: str  # "cross-encoder" or "bi-encoder-cosine"


@dataclass(frozen=True)
class GenerateResult:
    text: str
    n_prompt: int
    n_gen: int
    finish_reason: str
    model: str


@dataclass
class _Served:
    record: ModelRecord
    tokenizer: Tokenizer
    lane: Lane
    dims: int


class Module:
    def __init__(self, config: ModuleConfig | None = None) -> None:
        self.config = config or ModuleConfig()
        self.store = ArtifactStore(self.config.store_root)
        self.admission = Admission(self.config.budgets)
        self._served: dict[str, _Served] = {}
        self._loading: dict[str, asyncio.Lock] = {}

    async def __aenter__(self) -> Module:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- models ---------------------------------------------------------------------------

    async def load(self, name: str) -> ModelRecord:
        """Start a lane for model `name` from the artifact store and LOAD it (idempotent)."""
        lock = self._loading.setdefault(name, asyncio.Lock())
        async with lock:
            if name in self._served:
                return self._served[name].record
            try:
                record = self.store.get(name)
            except ArtifactNotFound as exc:
                raise ModelNotFound(exc.msg, model=name) from None
            except ArtifactError as exc:
                raise ConfigInvalid(f"model {name!r}: {exc.msg}") from None
            tokenizer = self._tokenizer(record)
            lane = Lane(
                LaneConfig(
                    lane_id=f"llama.{name}"[:48],
                    argv=list(self.config.worker_argv["llama"]),
                    device="cpu",
                ),
                self.config.host,
            )
            await lane.start()
            try:
                threads = max(1, (os.cpu_count() or 1) // max(1, self.config.planned_workers))
                load = m.LOAD(
                    req_id=0,
                    artifact_path=str(record.artifact_path),
                    artifact_digest=record.digest,
                    format=record.manifest.format,
                    runtime_config={
                        "model_ref": name,
                        "n_ctx": record.manifest.n_ctx,
                        "n_threads": threads,
                        "n_threads_batch": threads,
                    },
                )
                reply, _ = await lane.request(load)
            except BaseException:
                await lane.stop()
                raise
            self._served[name] = _Served(record, tokenizer, lane, reply.dims)
            return record

    def _tokenizer(self, record: ModelRecord) -> Tokenizer:
        path = record.tokenizer_path
        if path is None or not path.is_file():
            raise ConfigInvalid(f"model {record.name!r} has no tokenizer.json")
        man = record.manifest
        return Tokenizer.from_file(path, max_tokens=man.max_tokens, hard_limit=man.max_tokens_limit)

    async def unload(self, name: str) -> None:
        """UNLOAD and stop the lane; a reload starts fresh (clears any quarantine)."""
        served = self._served.pop(name, None)
        if served is None:
            raise ModelNotFound(f"model {name!r} is not loaded", model=name)
        try:
            if not served.lane.state().quarantined:
                await served.lane.request(m.UNLOAD(req_id=0, model_ref=name))
        finally:
            await served.lane.stop()

    async def close(self) -> None:
        lanes = [s.lane for s in self._served.values()]
        self._served.clear()
        await asyncio.gather(*(lane.stop() for lane in lanes), return_exceptions=True)

    def models(self) -> list[str]:
        return sorted(self._served)

    def health(self) -> dict[str, LaneState]:
        """Cached lane states; never talks to a worker."""
        return {name: s.lane.state() for name, s in self._served.items()}

    async def _get(self, name: str | None, default: str, kind: str | None = None) -> _Served:
        name = name or default
        if name not in self._served:
            await self.load(name)
        served = self._served[name]
        if kind is not None and served.record.kind != kind:
            raise InvalidRequest(
                f"model {name!r} is a {served.record.kind} model, not {kind}", model=name
            )
        return served

    # ---- embeddings -----------------------------------------------------------------------

    async def embed(
        self,
        texts: str | bytes | Sequence[str | bytes],
        model: str | None = None,
        normalize: bool = True,
        truncate: bool = True,
        deadline_s: float | None = None,
    ) -> EmbedResult:
        batch = [texts] if isinstance(texts, str | bytes) else list(texts)
        self.admission.check_inputs(batch)
        served = await self._get(model, DEFAULT_EMBED, "embed")
        encoded = served.tokenizer.encode(batch, truncate=truncate)
        with self.admission.reserve(encoded.total_tokens):
            vectors = await self._embed_ids(served, encoded.ids, normalize, deadline_s)
        usage = Usage(prompt_tokens=encoded.total_tokens, total_tokens=encoded.total_tokens)
        return EmbedResult(vectors, usage, served.record.name, encoded.truncated)

    async def tokenizer(self, model: str | None = None) -> Tokenizer:
        """The module-side tokenizer of `model` (loading it if needed)."""
        return (await self._get(model, DEFAULT_EMBED)).tokenizer

    async def embed_token_ids(
        self,
        ids: list[np.ndarray],
        model: str | None = None,
        normalize: bool = True,
        deadline_s: float | None = None,
    ) -> np.ndarray:
        """Embed already-tokenized inputs (a scheduler's coalesced batch); no admission here:
        the caller admitted them."""
        served = await self._get(model, DEFAULT_EMBED, "embed")
        return await self._embed_ids(served, ids, normalize, deadline_s)

    def lanes(self) -> dict[str, Lane]:
        return {name: s.lane for name, s in self._served.items()}

    def dims(self, model: str) -> int:
        return self._served[model].dims

    async def _embed_ids(
        self,
        served: _Served,
        ids: list[np.ndarray],
        normalize: bool,
        deadline_s: float | None,
    ) -> np.ndarray:
        lengths = [len(x) for x in ids]
        chunks = plan_chunks(
            lengths,
            self.config.max_batch_tokens,
            self.config.max_batch_items,
            self.config.host.max_frame,
            served.dims,
        )
        out = np.empty((len(ids), served.dims), dtype=np.float32)
        for chunk in chunks:
            req = m.EMBED_BATCH(
                req_id=0,
                model_ref=served.record.name,
                pooling=served.record.manifest.pooling or "mean",
                normalize=normalize,
                items=[m.EmbedItem(id=i, n_tokens=lengths[i]) for i in chunk],
            )
            payload = np.concatenate([ids[i] for i in chunk])
            _, vectors = await served.lane.request(req, payload, deadline_s=deadline_s)
            out[chunk.start : chunk.stop] = vectors
        return out

    # ---- rerank ---------------------------------------------------------------------------

    async def rerank(
        self,
        query: str | bytes,
        documents: Sequence[str | bytes],
        model: str | None = None,
        top_n: int | None = None,
        truncate: bool = True,
        deadline_s: float | None = None,
    ) -> RerankResult:
        docs = list(documents)
        self.admission.check_inputs([query], "query")
        self.admission.check_inputs(docs, "document")
        served = await self._get(model, DEFAULT_EMBED)
        if served.record.kind == "rerank":
            scores, tokens = await self._cross_encode(served, query, docs, truncate, deadline_s)
            method = "cross-encoder"
        elif served.record.kind == "embed":
            # No cross-encoder: rank by the embedding model's cosine (a bi-encoder).
            result = await self.embed(
                [query, *docs], served.record.name, True, truncate, deadline_s
            )
            scores = result.vectors[1:] @ result.vectors[0]
            tokens = result.usage.total_tokens
            method = "bi-encoder-cosine"
        else:
            raise InvalidRequest(f"model {served.record.name!r} cannot rerank")
        order = np.argsort(-scores, kind="stable")
        if top_n is not None:
            if top_n < 1:
                raise InvalidRequest("top_n must be >= 1")
            order = order[:top_n]
        results = [(int(i), float(scores[i])) for i in order]
        return RerankResult(results, Usage(tokens, tokens), served.record.name, method)

    async def _cross_encode(
        self, served: _Served, query, docs, truncate: bool, deadline_s: float | None
    ) -> tuple[np.ndarray, int]:
        seg = served.tokenizer.rerank_segments(query, docs, truncate=truncate)
        with self.admission.reserve(seg.total_tokens):
            scores = np.empty(len(docs), dtype=np.float32)
            doc_lengths = [len(d) for d in seg.docs]
            budget = max(1, self.config.max_batch_tokens - len(seg.query))
            for chunk in plan_chunks(
                doc_lengths, budget, self.config.max_batch_items, self.config.host.max_frame, 1
            ):
                req = m.RERANK(
                    req_id=0,
                    model_ref=served.record.name,
                    query_n_tokens=len(seg.query),
                    candidates=[m.RerankCandidate(n_tokens=doc_lengths[i]) for i in chunk],
                )
                payload = np.concatenate([seg.query, *(seg.docs[i] for i in chunk)])
                _, got = await served.lane.request(req, payload, deadline_s=deadline_s)
                scores[chunk.start : chunk.stop] = got
        return scores, seg.total_tokens

    # ---- generation -----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | bytes,
        max_tokens: int = 64,
        grammar: str | None = None,
        model: str | None = None,
        deadline_s: float | None = None,
    ) -> GenerateResult:
        if not 1 <= max_tokens <= self.config.max_generate_tokens:
            raise InvalidRequest(
                f"max_tokens must be 1..{self.config.max_generate_tokens} (short generation)"
            )
        if grammar is not None and not isinstance(grammar, str):
            raise InvalidRequest("grammar must be a GBNF string")
        self.admission.check_inputs([prompt], "prompt")
        served = await self._get(model, DEFAULT_GENERATE, "generate")
        encoded = served.tokenizer.encode([prompt], truncate=False)
        ids = encoded.ids[0]
        with self.admission.reserve(len(ids) + max_tokens):
            req = m.GENERATE(
                req_id=0, model_ref=served.record.name, max_tokens=max_tokens, grammar=grammar
            )
            reply, _ = await served.lane.request(req, ids, deadline_s=deadline_s)
        assert isinstance(reply, m.TEXT)
        return GenerateResult(
            reply.text, reply.n_prompt, reply.n_gen, reply.finish_reason, served.record.name
        )
