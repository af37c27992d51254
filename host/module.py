"""`Module`: the async API callers use — load, embed, rerank, generate, health, unload.

The module owns everything a caller sees: tokenization (module-side, from the artifact's
tokenizer.json; workers receive ids only), admission budgets, batching into protocol-sized
requests, and the typed error contract. Each loaded model is served by its own lane (one
supervised worker); llama.cpp workers get `n_threads = cores / workers`.

Lane choice: a call that names no lane (`lane=None`, the default) is served by the lane the
`LanePolicy` the Module was given picks for that model — a certified Core ML lane for this
machine, else llama.cpp (GPU where the build offloads, else CPU); see host.lane_policy.
Build a Module with `certification.modules.build_module` to get the certificate-backed
policy. All lanes of a Module share one set of execution permits (`cpu` = cores, `gpu` 1,
`ane` 1).

Two lanes for one model: when the policy offers a set of lanes (every lane certified here,
or `ModuleConfig.model_lanes[name]`) and their vectors agree (host.lane_policy.Agreement),
the choice names both (`LaneChoice.lanes`) and each call without `lane=` goes to the lane
expected to finish it first; when they cannot serve together, the better certified lane
serves alone (host.routed_lanes). Results say which lane served them (`EmbedResult.lane`).

What a caller can ask about lanes, each answering one question:
- `load_default_lane(name)` -> LaneChoice: decide (once) and load the lane a call without
  `lane=` reaches;
- `default_lane(name)` -> LaneChoice: which lane serves or would serve it, never starting a
  worker; `chosen_lanes()`: the choices made so far, by model;
- `served_lanes()` -> [ServedLane]: every loaded (model, lane) and its supervisor;
- `supervisor(name, lane=None)` -> Lane | None: the supervisor of one loaded lane.
"""

from __future__ import annotations

import asyncio
import json
import logging
import platform
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import msgspec
import numpy as np

from common.errors import InvalidRequest, ModelNotFound, StorageFull, SynapseError
from host.admission import Admission, Budgets
from host.batching import plan_chunks
from host.call_args import check_prompt_args, check_served, renamed
from host.call_args import resolve_prompt as resolve_prompt  # re-exported: bench.embed
from host.chat_pairs import ChatPairs
from host.classify import ClassifyInput, ClassifyResult, activation_for, split_inputs
from host.config import HostConfig, LaneConfig
from host.cpu_lane import llama_worker_env
from host.errors import CertificateRequired, ConfigInvalid
from host.keyed_locks import KeyedLocks
from host.lane import Lane, LaneState
from host.lane_policy import (
    AneCandidate,
    LaneChoice,
    LanePolicy,
    LaneSet,
    NoLanePolicy,
    ane_reason,
    llama_reason,
)
from host.lane_router import Ask, LatencyCurve
from host.permits import DevicePermits
from host.residency import Residency, ResidencyConfig, uses_model
from host.results import EmbedResult as EmbedResult
from host.results import GenerateResult as GenerateResult
from host.results import RerankResult as RerankResult
from host.results import Usage as Usage
from host.routed_lanes import RoutedLanes, predict
from host.served import Served
from host.token_calls import MAXSIM_ASK, TokenCalls, late_interaction
from host.token_outputs import TokenOutputs
from host.tokenization import Encoded, EncodedPairs, Tokenizer
from ingest.owned import ensure_owned
from ingest.store import (
    DEFAULT_EMBED,
    DEFAULT_GENERATE,
    ArtifactStore,
    ModelRecord,
)
from workers.cpus import usable_cpu_count
from workers.protocol import messages as m

log = logging.getLogger("synapse.certification")  # the certificate policy's outcomes


class ModuleConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: HostConfig = msgspec.field(default_factory=HostConfig)
    store_root: str | None = None  # default: the user cache dir (see ingest.store)
    budgets: Budgets = msgspec.field(default_factory=Budgets)
    # Token ids per EMBED_BATCH / RERANK request the host sends one worker; the worker splits
    # them into decodes. Not the scheduler's coalescing size (`scheduler.max_batch_tokens`).
    max_worker_batch_tokens: int = 4096
    max_batch_items: int = 256
    max_generate_tokens: int = 64  # policy: short generation only
    planned_workers: int = 2  # llama.cpp threads per worker = cores // planned_workers
    worker_argv: dict[str, list[str]] = msgspec.field(
        default_factory=lambda: {
            "llama": ["python", "-m", "workers.llama"],
            "ane": ["python", "-m", "workers.ane"],
        }
    )
    # Certificates before serving (an uncertified lane may give wrong vectors): "strict"
    # refuses a lane of `certificate_lanes` that has no certified certificate for its exact
    # identity (`certificate_required`), "warn" logs and serves.
    # Checked by the Module's LanePolicy (certification provides it).
    require_certificate: Literal["strict", "warn", "off"] = "off"
    certificate_lanes: list[str] = msgspec.field(default_factory=lambda: ["ane"])
    # Per model, the lanes that serve it (the serve config's `[models."NAME"] lanes`): one
    # lane serves alone; two or more serve together, without certificates, once their
    # vectors agree. A model not listed: every lane certified for this machine.
    model_lanes: dict[str, list[str]] = {}

    def __post_init__(self) -> None:
        for name in (
            "max_worker_batch_tokens",
            "max_batch_items",
            "max_generate_tokens",
            "planned_workers",
        ):
            if getattr(self, name) < 1:
                raise ConfigInvalid(f"module.{name} must be >= 1")
        for model, lanes in self.model_lanes.items():
            check_lane_list(model, lanes)


@dataclass(frozen=True)
class ServedLane:
    """One loaded lane: the model, the lane kind serving it and the supervisor of its worker."""

    model: str
    lane: str  # "llama" | "ane"
    supervisor: Lane


# Lane kinds and the device whose execution permit their inference takes by default.
LANES = {"llama": "cpu", "ane": "ane"}


def served_key(name: str, lane: str) -> str:
    """The label of a loaded lane in `health()` (and so in /health): `name` for llama.cpp,
    `name@lane` for another lane."""
    return name if lane == "llama" else f"{name}@{lane}"


def permit_for(lane: str, device: str) -> str:
    """The execution permit a lane's inference takes: the Core ML lane `ane` (and `gpu` too,
    "ane+gpu", when its compute units let Core ML use the GPU), a llama.cpp lane `cpu` on
    the CPU and `gpu` when offloaded (the Apple GPU is one shared device)."""
    if lane == "ane":
        return "ane+gpu" if device == "ane+gpu" else "ane"
    return "cpu" if device == "cpu" else "gpu"


def _kind_and_pooling(record: ModelRecord) -> dict:
    man = record.manifest
    out: dict = {"kind": man.kind}
    if man.kind != "generate" and man.pooling:
        out["pooling"] = man.pooling
    return out | _heads_config(record)


def load_heads_spec(record: ModelRecord) -> dict[str, dict]:
    """LOAD's `heads` ({kind: {path, digest, limit}}): the worker loads each head beside the
    model and checks its digest; the same for both lanes, and what a Core ML package's key is
    built from (certification's placement estimate reads it too)."""
    man = record.manifest
    return {
        kind: {"path": str(record.dir / h.file), "digest": h.digest, "limit": man.max_tokens}
        for kind, h in man.heads.items()
    }


def _heads_config(record: ModelRecord) -> dict:
    heads = load_heads_spec(record)
    return {"heads": heads} if heads else {}


def hello_device(build_flags: str | None) -> str | None:
    """The `device=` a llama.cpp worker's HELLO names (what gpu_layers "auto" uses there)."""
    for part in (build_flags or "").split("|"):
        name, sep, value = part.strip().partition("=")
        if sep and name == "device":
            return value.strip() or None
    return None


class Module:
    def __init__(
        self,
        config: ModuleConfig | None = None,
        lane_policy: LanePolicy | None = None,
        residency: ResidencyConfig | None = None,  # keep-alive and memory budget
    ) -> None:
        self.config = config or ModuleConfig()
        self.store = ArtifactStore(self.config.store_root)
        self.admission = Admission(self.config.budgets)
        self.lane_policy: LanePolicy = lane_policy or NoLanePolicy()
        self.permits = DevicePermits(self.config.host.permits())
        self._served: dict[str, Served] = {}
        self._loading = KeyedLocks()  # by served_key: one load of a lane at a time
        self._choices: dict[str, LaneChoice] = {}
        self._choosing = KeyedLocks()  # by model: one lane choice at a time
        self.routing = RoutedLanes(self)  # models served by two lanes, and each call's lane
        self.llama_device: str | None = None  # from the last llama.cpp HELLO
        # Fault counts of lanes already unloaded, by lane id, so that /metrics' counters never
        # go back when a model is unloaded (by the memory budget or keep_alive): a worker
        # replaced after a crash must stay counted after its lane is gone.
        self.retired_restarts: Counter[str] = Counter()
        self.retired_quarantines: Counter[str] = Counter()
        self.residency = Residency(self, residency)
        budgets = (c := self.config).max_worker_batch_tokens, c.max_batch_items, c.host.max_frame
        self.token_calls = TokenCalls(self, budgets)  # encode_outputs, late_chunk, MaxSim

    async def __aenter__(self) -> Module:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- models ---------------------------------------------------------------------------

    async def load(
        self, name: str, lane: str | None = None, runtime_config_extra: dict | None = None
    ) -> ModelRecord:
        """Start a lane for model `name` and LOAD it (idempotent per (name, lane)).

        `lane`: "llama" (GGUF through llama.cpp), "ane" (the owned Core ML graph, built from
        the same Hugging Face weights) or None: the lane the policy chooses
        (`load_default_lane`).
        `runtime_config_extra` merges into LOAD's runtime_config (explicit lanes only); for
        "ane" its `build_options` (test-only graph degradation) go to the worker's argv.
        """
        if lane is None:
            if runtime_config_extra:
                raise InvalidRequest("runtime_config_extra needs an explicit lane")
            await self.load_default_lane(name)
            return self._record(name)
        _check_lane(lane)
        key = served_key(name, lane)
        async with self._loading.hold(key):
            if key in self._served:
                return self._served[key].record
            try:
                record = self.store.get(name)
                artifact, digest, fmt = str(record.artifact_path), record.digest, "gguf"
                if lane == "ane":
                    # A first load builds the owned artifact (seconds of numpy and disk
                    # work for a real model): in a thread, so the server keeps answering.
                    owned, digest = await asyncio.to_thread(ensure_owned, self.store, record)
                    artifact, fmt = str(owned), "coreml-owned"
            except ModelNotFound as exc:
                raise ModelNotFound(exc.message, model=name) from None
            except StorageFull as exc:
                raise StorageFull(exc.message, model=name) from None
            except SynapseError as exc:
                raise ConfigInvalid(f"model {name!r}: {exc.message}") from None
            tokenizer = self._tokenizer(record)
            extra = dict(runtime_config_extra or {})
            argv = list(self.config.worker_argv[lane])
            if lane == "ane":
                argv += ["--artifact", artifact]
                if "build_options" in extra:
                    argv += ["--build-options", json.dumps(extra.pop("build_options"))]
                runtime_config = {"model_ref": name, **_heads_config(record), **extra}
                if record.kind == "embed" and record.manifest.pooling:
                    # ENCODE names no pooling: the worker checks its dense output's by this.
                    runtime_config.setdefault("pooling", record.manifest.pooling)
            else:
                threads = max(1, usable_cpu_count() // max(1, self.config.planned_workers))
                runtime_config = {
                    "model_ref": name,
                    "n_ctx": record.manifest.n_ctx,
                    "n_threads": threads,
                    "n_threads_batch": threads,
                    # What ingest established (a GGUF may not say its pooling, or that it
                    # reranks): the worker serves the model as the manifest describes it.
                    **_kind_and_pooling(record),
                    **extra,
                }
            # A CPU lane's worker starts with Metal switched off (see host.cpu_lane).
            env = llama_worker_env(extra.get("gpu_layers")) if lane == "llama" else {}
            lane_obj = Lane(
                LaneConfig(lane_id=f"{lane}.{name}"[:48], argv=argv, env=env, device=LANES[lane]),
                self.config.host,
                self.permits,
            )
            # Room for it under the memory budget (idle models may be unloaded), or a 503.
            ticket = await self.residency.admit(name, lane, record)
            try:
                await lane_obj.start()
            except BaseException:
                self.residency.cancel(ticket)
                raise
            try:
                load = m.LOAD(
                    req_id=0,
                    artifact_path=artifact,
                    artifact_digest=digest,
                    format=fmt,
                    runtime_config=runtime_config,
                )
                reply, _ = await lane_obj.request(load)
            except BaseException:
                self.residency.cancel(ticket)
                await lane_obj.stop()
                raise
            loaded = cast(m.LOADED, reply)  # a LOAD's reply; the worker's ERR raised
            device = loaded.device or ("ane" if lane == "ane" else "cpu")
            lane_obj.set_device(permit_for(lane, device))
            if lane == "llama":
                self.llama_device = (
                    hello_device(lane_obj.hello.engine.build_flags if lane_obj.hello else None)
                    or self.llama_device
                )
            self._served[key] = Served(
                record,
                tokenizer,
                lane_obj,
                loaded.dims,
                lane,
                digest,
                device,
                load_extra=dict(runtime_config_extra or {}),
                refuses=tuple(loaded.refuses),
                max_item_tokens=loaded.max_item_tokens,
            )
            await self.residency.commit(ticket, lane_obj)  # its real RSS, held to the budget
            if self.config.require_certificate != "off" and lane in self.config.certificate_lanes:
                await self._enforce_certificate(name, lane, runtime_config_extra)
            return record

    async def _enforce_certificate(self, name: str, lane: str, extra: dict | None) -> None:
        # The identity needs HELLO, hence after LOAD; refused in strict mode -> unloaded.
        try:
            self.lane_policy.require(self, name, lane, extra)
        except CertificateRequired as exc:
            if self.config.require_certificate == "strict":
                await self.unload(name, lane)
                raise
            log.warning("%s (require_certificate=warn: serving anyway)", exc.message)
        except BaseException:
            await self.unload(name, lane)
            raise

    # ---- lane choice ----------------------------------------------------------------------

    async def load_default_lane(self, name: str) -> LaneChoice:
        """The lane that serves `name` when a call names none, and why; decided once per
        model (until unloaded) and loaded before this returns. See host.lane_policy for the
        rule."""
        choice = self._choices.get(name)
        if choice is not None:  # every request asks: answer without the lock once decided
            return choice
        async with self._choosing.hold(name):
            choice = self._choices.get(name)
            if choice is None:
                choice = self._choices[name] = await self._choose(name)
            return choice

    async def _choose(self, name: str) -> LaneChoice:
        record = self._record(name)
        if record.kind == "generate":
            await self.load(name, "llama")
            device = self._served[name].device
            return LaneChoice(
                "llama", device, llama_reason(device, "generation runs on llama.cpp only")
            )
        configured = self.config.model_lanes.get(name)
        if configured is not None and len(configured) == 1:
            return await self._configured_lane(name, configured[0])
        not_routed = ""
        lane_set = self.lane_policy.lane_set(name, configured)
        if isinstance(lane_set, LaneSet):
            routed = await self.routing.choose(name, lane_set)
            if isinstance(routed, LaneChoice):
                return routed
            not_routed = f"; not routed: {routed}"
        elif configured is not None:
            not_routed = f"; not routed: {lane_set}"
        choice = await self._single_lane(name)
        return LaneChoice(choice.lane, choice.device, choice.reason + not_routed)

    async def _single_lane(self, name: str) -> LaneChoice:
        """One lane: a certified Core ML lane for this machine, else llama.cpp."""
        candidate = self.lane_policy.ane_candidate(name)
        if isinstance(candidate, AneCandidate):
            refused = await self._try_ane(name, candidate)
            if refused is None:
                return LaneChoice("ane", "ane", ane_reason(candidate))
            why = refused
        else:
            why = candidate
        await self.load(name, "llama")
        device = self._served[name].device
        return LaneChoice("llama", device, llama_reason(device, why))

    async def _configured_lane(self, name: str, lane: str) -> LaneChoice:
        await self.load(name, lane)
        device = self._served[served_key(name, lane)].device
        return LaneChoice(lane, device, f"{lane}/{device}: configured (lanes = [{lane!r}])")

    def pick_lane(
        self, name: str, items: int, ask: Ask | None = None, *, longest: int = 0
    ) -> str | None:
        """The lane a call of `items` inputs without `lane=` (asking `ask` of it: token-level
        outputs; its longest input `longest` tokens) would go to now (None: not chosen yet);
        a caller that names it gets the routed lane and knows which it is."""
        choice = self._choices.get(name)
        if choice is None:
            return None
        return self.routing.lane_for(name, choice, items, ask, longest)

    def max_item_tokens(self, name: str, lane: str) -> int | None:
        """The most tokens one input may have on the loaded `lane` of `name`, as its worker's
        LOADED declared it (None: the model's own limit, or the lane is not loaded)."""
        served = self._served.get(served_key(name, _check_lane(lane)))
        return served.max_item_tokens if served else None

    def refusals(self, name: str, lane: str) -> tuple[m.Refusal, ...]:
        """The ENCODE outputs the loaded `lane` of `name` refuses whatever the items, as its
        worker's LOADED declared them (none when the lane is not loaded)."""
        served = self._served.get(served_key(name, _check_lane(lane)))
        return served.refuses if served else ()

    def latency_curves(self, name: str) -> dict[str, LatencyCurve]:
        """A routed model's latency curve per lane (empty for a model on one lane)."""
        return self.routing.curves(name)

    def serving_lanes(self, name: str) -> tuple[str, ...]:
        """The lanes calls without `lane=` reach for `name` (two or more when routed)."""
        choice = self._choices.get(name)
        if choice is None:
            return ()
        return choice.lanes or (choice.lane,)

    async def _try_ane(self, name: str, candidate: AneCandidate) -> str | None:
        """Load the Core ML lane as certified and confirm its exact identity; None when it
        serves, else why not (the lane is unloaded again)."""
        cert = candidate.certificate_id
        try:
            await self.load(name, "ane", candidate.runtime_config_extra)
        except SynapseError as exc:
            log.warning("%s: certified Core ML lane failed to load: %s", name, exc.message)
            return f"ANE certificate {cert} applies but its lane failed to load ({exc.code})"
        try:
            self.lane_policy.require(self, name, "ane", candidate.runtime_config_extra)
        except CertificateRequired as exc:
            await self.unload(name, "ane")
            return f"ANE certificate {cert} does not cover the loaded lane: " + str(
                exc.details.get("reason") or exc.message
            )
        return None

    def default_lane(self, name: str) -> LaneChoice:
        """Which lane serves (or would serve) `name` when a call names none, and why — never
        starts a worker. For a model not chosen yet: the policy's answer, and the llama.cpp
        device a worker named."""
        if name in self._choices:
            return self._choices[name]
        record = self._record(name)
        if record.kind == "generate":
            return LaneChoice(
                "llama",
                self.llama_device,
                llama_reason(self.llama_device, "generation runs on llama.cpp only"),
            )
        configured = self.config.model_lanes.get(name)
        if configured is not None and len(configured) == 1:
            lane = configured[0]
            return LaneChoice(lane, None, f"{lane}: configured (lanes = [{lane!r}])")
        not_routed = ""
        lane_set = self.lane_policy.lane_set(name, configured)
        if isinstance(lane_set, LaneSet):
            predicted = predict(lane_set, self.llama_device)
            if isinstance(predicted, LaneChoice):
                return predicted
            not_routed = f"; not routed: {predicted}"
        elif configured is not None:
            not_routed = f"; not routed: {lane_set}"
        candidate = self.lane_policy.ane_candidate(name)
        if isinstance(candidate, AneCandidate):
            return LaneChoice("ane", "ane", ane_reason(candidate) + not_routed)
        return LaneChoice(
            "llama", self.llama_device, llama_reason(self.llama_device, candidate) + not_routed
        )

    def chosen_lanes(self) -> dict[str, LaneChoice]:
        """By model: the lane chosen for calls that name none, and why (models not used that
        way yet are absent; `default_lane` answers for them)."""
        return dict(self._choices)

    def served_lanes(self) -> list[ServedLane]:
        """Every loaded lane, by model then lane kind."""
        return sorted(
            (ServedLane(s.record.name, s.lane_kind, s.lane) for s in self._served.values()),
            key=lambda s: (s.model, s.lane),
        )

    def supervisor(self, name: str, lane: str | None = None) -> Lane | None:
        """The supervisor of `name`'s worker on `lane` (None: the lane a call without `lane=`
        reaches), or None when that lane is not loaded."""
        served = self._served.get(served_key(name, self._resolve_lane(name, lane)))
        return served.lane if served else None

    def _record(self, name: str) -> ModelRecord:
        try:
            return self.store.get(name)
        except ModelNotFound as exc:
            raise ModelNotFound(exc.message, model=name) from None
        except SynapseError as exc:
            raise ConfigInvalid(f"model {name!r}: {exc.message}") from None

    def _resolve_lane(self, name: str, lane: str | None) -> str:
        """The lane kind a call with `lane=` reaches: that one (checked), else the chosen
        default, else llama.cpp."""
        if lane is not None:
            return _check_lane(lane)
        choice = self._choices.get(name)
        return choice.lane if choice else "llama"

    def _tokenizer(self, record: ModelRecord) -> Tokenizer:
        path = record.tokenizer_path
        if path is None or not path.is_file():
            raise ConfigInvalid(f"model {record.name!r} has no tokenizer.json")
        man = record.manifest
        return Tokenizer.from_file(path, max_tokens=man.max_tokens, hard_limit=man.max_tokens_limit)

    async def unload(self, name: str, lane: str | None = None) -> None:
        """UNLOAD and stop the lane (default: the chosen one, else llama); a reload starts
        fresh (clears any quarantine) and chooses again."""
        lane = self._resolve_lane(name, lane)
        choice = self._choices.get(name)
        if choice is not None and lane in (choice.lanes or (choice.lane,)):
            del self._choices[name]  # a routed pair without one of its lanes chooses again
            self.routing.forget(name)
        served = self._served.pop(served_key(name, lane), None)
        if served is None:
            raise ModelNotFound(f"model {name!r} is not loaded", model=name)
        try:
            if not served.lane.state().quarantined:
                await served.lane.request(m.UNLOAD(req_id=0, model_ref=name))
        finally:
            await served.lane.stop()
            lane_id = served.lane.config.lane_id
            self.retired_restarts[lane_id] += served.lane.restarts
            self.retired_quarantines[lane_id] += served.lane.quarantines

    async def close(self) -> None:
        await self.residency.close()
        lanes = [s.lane for s in self._served.values()]
        self._served.clear()
        self._choices.clear()
        self.routing.clear()
        await asyncio.gather(*(lane.stop() for lane in lanes), return_exceptions=True)

    def residents(self) -> dict[str, dict[str, Served]]:
        """Loaded models by name, each with its lanes by kind (what host.residency sizes)."""
        out: dict[str, dict[str, Served]] = {}
        for s in self._served.values():
            out.setdefault(s.record.name, {})[s.lane_kind] = s
        return out

    def health(self) -> dict[str, LaneState]:
        """Cached lane states by `served_key` label; never talks to a worker."""
        return {name: s.lane.state() for name, s in self._served.items()}

    async def _load_for_call(
        self,
        name: str | None,
        default: str,
        kind: str | None = None,
        lane: str | None = None,
        items: int = 1,
        ask: Ask | None = None,
        longest: int = 0,
    ) -> Served:
        """The loaded lane a call of `items` inputs reaches (`name` or `default`, on `lane`
        or the default lane: for a routed model, the one expected to finish first of those
        that serve what it asks, `ask`, and take its longest input, `longest` tokens),
        loading it first when it is not; refused when the model is not of `kind`."""
        name = name or default
        if lane is None:
            choice = await self.load_default_lane(name)
            lane = self.routing.lane_for(name, choice, items, ask, longest)
        key = served_key(name, _check_lane(lane))
        if key not in self._served:
            await self.load(name, lane)
        served = self._served[key]
        if kind is not None and served.record.kind != kind:
            raise InvalidRequest(
                f"model {name!r} is a {served.record.kind} model, not {kind}", model=name
            )
        return served

    # ---- embeddings -----------------------------------------------------------------------

    @uses_model(DEFAULT_EMBED)
    async def embed(
        self,
        texts: str | bytes | Sequence[str | bytes],
        model: str | None = None,
        normalize: bool = True,
        truncate: bool = True,
        deadline_s: float | None = None,
        lane: str | None = None,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        truncation_direction: str = "right",
    ) -> EmbedResult:
        """Embed `texts` with a prompt prepended to each, as sentence-transformers'
        `encode(prompt_name=..., prompt=...)` does: `prompt` as given (`""`: none), else the
        model's prompt named `prompt_name`, else its default prompt, else none. The prompt's
        tokens count against the limit and in `usage`. An input over the limit is cut at the
        `truncation_direction` end ("right" or "left"; see host.tokenization)."""
        batch = [texts] if isinstance(texts, str | bytes) else list(texts)
        check_prompt_args(prompt_name, prompt)  # before a worker starts for a bad call
        self.admission.check_inputs(batch)
        served = await self._load_for_call(model, DEFAULT_EMBED, "embed", lane, len(batch))
        check_served(served.record, ["dense"])
        text_prompt = resolve_prompt(served.record, prompt_name, prompt)
        encoded = served.tokenizer.encode(
            batch, truncate=truncate, prompt=text_prompt, direction=truncation_direction
        )
        longest = max(encoded.n_tokens, default=0)
        limit = self.max_item_tokens(served.record.name, served.lane_kind)
        if lane is None and longest > (limit or longest):
            # Routed before its lengths were known, to a lane whose shapes are shorter.
            served = await self._load_for_call(
                model, DEFAULT_EMBED, "embed", None, len(batch), longest=longest
            )
        with self.admission.reserve(encoded.total_tokens):
            vectors = await self._embed_ids(served, encoded.ids, normalize, deadline_s)
        usage = Usage(prompt_tokens=encoded.total_tokens, total_tokens=encoded.total_tokens)
        return EmbedResult(
            vectors,
            usage,
            served.record.name,
            encoded.truncated,
            text_prompt,
            encoded.n_tokens,
            served.lane_kind,
        )

    @uses_model(DEFAULT_EMBED)
    async def encode_outputs(
        self,
        texts: str | bytes | Sequence[str | bytes],
        outputs: Sequence[str],
        model: str | None = None,
        normalize: bool = True,
        truncate: bool = True,
        deadline_s: float | None = None,
        lane: str | None = None,
        *,
        side: Literal["query", "document"] = "document",
        prompt_name: str | None = None,
        prompt: str | None = None,
        truncation_direction: str = "right",
    ) -> TokenOutputs:
        """Several outputs of `texts` from one forward pass (host.token_outputs): the pooled
        vector (`dense`, what `embed` returns), every token's final state (`tokens`), and a
        model's `sparse` / `multivector` heads. Prompts, truncation and usage as `embed`."""
        return await self.token_calls.encode_outputs(
            texts,
            outputs,
            model,
            normalize,
            truncate,
            deadline_s,
            lane,
            side,
            prompt_name,
            prompt,
            truncation_direction,
        )

    @uses_model(DEFAULT_EMBED, entry=False)  # admitted work: a drain waits for it
    async def encode_token_ids(
        self,
        ids: list[np.ndarray],
        outputs: Sequence[str],
        model: str | None = None,
        normalize: bool = True,
        deadline_s: float | None = None,
        lane: str | None = None,
        side: Literal["query", "document"] = "document",
    ) -> dict[str, list]:
        """`encode_outputs` of already-tokenized inputs (bulk jobs): per kind asked, per
        input, a dense row, a (k, dims) array or a sparse (indices, values). No admission
        here: the caller admitted them."""
        return await self.token_calls.encode_token_ids(
            ids, outputs, model, normalize, deadline_s, lane, side
        )

    @uses_model(DEFAULT_EMBED)
    async def late_chunk(
        self,
        chunks: Sequence[str | bytes],
        model: str | None = None,
        normalize: bool = True,
        deadline_s: float | None = None,
        lane: str | None = None,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> EmbedResult:
        """One vector per chunk of ONE document, from states that read the whole document
        (host.late_chunking states the rule). `n_tokens` is each chunk's own tokens; usage
        counts every token read, window overlaps included."""
        return await self.token_calls.late_chunk(
            chunks, model, normalize, deadline_s, lane, prompt_name, prompt
        )

    def prompt(
        self, model: str | None = None, prompt_name: str | None = None, prompt: str | None = None
    ) -> str:
        """The text `embed` prepends for these arguments (for callers that tokenize
        themselves, such as bulk jobs); reads the manifest, never starts a worker."""
        check_prompt_args(prompt_name, prompt)
        return resolve_prompt(self.record(model or DEFAULT_EMBED), prompt_name, prompt)

    def record(self, name: str) -> ModelRecord:
        """The manifest `name` is served with: the loaded one, else the store's."""
        for lane in LANES:
            served = self._served.get(served_key(name, lane))
            if served is not None:
                return served.record
        return self._record(name)

    @uses_model(DEFAULT_EMBED)
    async def tokenizer(self, model: str | None = None, lane: str | None = None) -> Tokenizer:
        """The module-side tokenizer of `model` (loading it if needed)."""
        return (await self._load_for_call(model, DEFAULT_EMBED, lane=lane)).tokenizer

    @uses_model(DEFAULT_EMBED, entry=False)  # admitted work: a drain waits for it
    async def embed_token_ids(
        self,
        ids: list[np.ndarray],
        model: str | None = None,
        normalize: bool = True,
        deadline_s: float | None = None,
        lane: str | None = None,
    ) -> np.ndarray:
        """Embed already-tokenized inputs (a scheduler's coalesced batch); no admission here:
        the caller admitted them."""
        longest = max((len(x) for x in ids), default=0)
        served = await self._load_for_call(
            model, DEFAULT_EMBED, "embed", lane, len(ids), longest=longest
        )
        check_served(served.record, ["dense"])
        return await self._embed_ids(served, ids, normalize, deadline_s)

    def dims(self, model: str, lane: str | None = None) -> int:
        return self._served[served_key(model, self._resolve_lane(model, lane))].dims

    async def placement(self, model: str, lane: str = "ane") -> tuple[float | None, str | None]:
        """(placement_share, source) from a fresh PONG; (None, None) where it means nothing."""
        served = await self._load_for_call(model, DEFAULT_EMBED, lane=lane)
        pong = await served.lane.ping()
        return pong.placement_share, pong.placement_source

    def load_extra(self, model: str, lane: str) -> dict:
        """The runtime_config_extra the loaded `lane` of `model` was given (shapes, settings):
        with its identity, what a certificate of it is keyed by."""
        served = self._served.get(served_key(model, _check_lane(lane)))
        return dict(served.load_extra or {}) if served else {}

    def lane_identity(self, model: str, lane: str | None = None) -> dict:
        """What a certificate is keyed by: artifact, manifest, kernel, engine, device, OS."""
        lane = self._resolve_lane(model, lane)
        served = self._served[served_key(model, lane)]
        hello = served.lane.hello
        return {
            "model": model,
            "lane": lane,
            "artifact_digest": served.artifact_digest,  # what LOAD verified
            "manifest_digest": (hello.manifest_digest if hello else None)
            or (served.artifact_digest if lane == "ane" else None),
            "kernel_revision": hello.kernel_revision if hello else None,
            "engine": hello.engine.engine if hello else None,
            "engine_version": hello.engine.version if hello else None,
            "build_flags": hello.engine.build_flags if hello else None,
            "device": served.device,  # numerics differ by device: CPU, Metal, Neural Engine
            "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        }

    async def _embed_ids(
        self,
        served: Served,
        ids: list[np.ndarray],
        normalize: bool,
        deadline_s: float | None,
    ) -> np.ndarray:
        lengths = [len(x) for x in ids]

        def request(chunk: range) -> tuple[m.Request, np.ndarray]:
            req = m.EMBED_BATCH(
                req_id=0,
                model_ref=served.record.name,
                pooling=served.record.manifest.pooling or "mean",
                normalize=normalize,
                items=[m.EmbedItem(id=i, n_tokens=lengths[i]) for i in chunk],
            )
            return req, np.concatenate([ids[i] for i in chunk])

        out = np.empty((len(ids), served.dims), dtype=np.float32)
        return await self._request_in_chunks(served, lengths, served.dims, out, request, deadline_s)

    async def _request_in_chunks(
        self,
        served: Served,
        lengths: Sequence[int],
        width: int,
        out: np.ndarray,
        request: Callable[[range], tuple[m.Request, np.ndarray]],
        deadline_s: float | None,
        max_tokens: int | None = None,
    ) -> np.ndarray:
        """Send inputs of `lengths` ids to `served`'s worker in protocol-sized chunks
        (host.batching: at most `max_tokens` ids, default `max_worker_batch_tokens`, and
        `max_batch_items` inputs a request, and a reply of `width` floats an input under
        `max_frame`); `request(chunk)` builds a chunk's message and its i32 payload, and the
        reply's rows land in `out[chunk]`. Returns `out`."""
        with self.routing.in_flight(served.lane, len(lengths)):  # what the router sees
            for chunk in plan_chunks(
                list(lengths),
                max_tokens or self.config.max_worker_batch_tokens,
                self.config.max_batch_items,
                self.config.host.max_frame,
                width,
            ):
                req, payload = request(chunk)
                _, got = await served.lane.request(req, payload, deadline_s=deadline_s)
                out[chunk.start : chunk.stop] = got
        return out

    # ---- rerank ---------------------------------------------------------------------------

    @uses_model(DEFAULT_EMBED)
    async def rerank(
        self,
        query: str | bytes,
        documents: Sequence[str | bytes],
        model: str | None = None,
        top_n: int | None = None,
        truncate: bool = True,
        deadline_s: float | None = None,
        lane: str | None = None,
        *,
        truncation_direction: str = "right",
        max_doc_tokens: int | None = None,
        instruction: str | None = None,
    ) -> RerankResult:
        """Over-long pairs are cut at the `truncation_direction` end (document first, see
        host.tokenization); `max_doc_tokens` caps every document's own tokens first.
        `instruction`: an LLM reranker's instruction (its chat template's system message;
        default: the model's), refused for any other model. An LLM reranker's score is the
        raw `logit[true] - logit[false]` (host.chat_pairs)."""
        docs = list(documents)
        self.admission.check_inputs([query], "query")
        self.admission.check_inputs(docs, "document")
        if instruction is not None:
            self.admission.check_inputs([instruction], "instruction")
        if max_doc_tokens is not None and max_doc_tokens < 1:
            raise InvalidRequest("max_tokens_per_doc must be >= 1", param="max_tokens_per_doc")
        record = self.record(model or DEFAULT_EMBED)
        _refuse_classifier(record)
        ask = MAXSIM_ASK if late_interaction(record) else None  # both sides on one lane
        served = await self._load_for_call(
            model, DEFAULT_EMBED, lane=lane, items=len(docs), ask=ask
        )
        cut = (truncate, truncation_direction, max_doc_tokens)
        llm = served.record.manifest.llm_rerank
        if instruction is not None and llm is None:
            raise InvalidRequest(
                f"model {served.record.name!r} takes no instruction (LLM rerankers do)",
                param="instruction",
            )
        if llm is not None:
            scores, encoded = await self._llm_rerank(
                served, query, docs, instruction, cut, deadline_s
            )
            tokens = encoded.total_tokens
            method: Literal["cross-encoder", "bi-encoder-cosine", "multi-vector-maxsim"] = (
                "cross-encoder"
            )
        elif served.record.kind == "rerank" and (
            served.lane_kind == "ane" or served.record.manifest.pooling == "last"
        ):
            scores, encoded = await self._cross_encode_owned(served, query, docs, cut, deadline_s)
            tokens = encoded.total_tokens
            method = "cross-encoder"
        elif served.record.kind == "rerank":
            scores, encoded = await self._cross_encode(served, query, docs, cut, deadline_s)
            tokens = encoded.total_tokens
            method = "cross-encoder"
        elif late_interaction(served.record):
            scores, encoded, tokens = await self.token_calls.late_interaction(
                served, query, docs, cut, deadline_s
            )
            method = "multi-vector-maxsim"
        elif served.record.kind == "embed":
            # No cross-encoder: rank by the embedding model's cosine (a bi-encoder).
            scores, encoded, tokens = await self._bi_encode(served, query, docs, cut, deadline_s)
            method = "bi-encoder-cosine"
        else:
            raise InvalidRequest(f"model {served.record.name!r} cannot rerank")
        order = np.argsort(-scores, kind="stable")
        if top_n is not None:
            if top_n < 1:
                raise InvalidRequest("top_n must be >= 1")
            order = order[:top_n]
        results = [(int(i), float(scores[i])) for i in order]
        return RerankResult(
            results,
            Usage(tokens, tokens),
            served.record.name,
            method,
            list(encoded.n_tokens),
            list(encoded.truncated),
            served.lane_kind,
        )

    async def _bi_encode(
        self, served: Served, query, docs, cut: tuple, deadline_s: float | None
    ) -> tuple[np.ndarray, Encoded, int]:
        """The cosine of the query's and each document's embedding (each with the model's
        default prompt, as `embed` applies it); (scores, the documents' encoding, tokens)."""
        truncate, direction, max_doc_tokens = cut
        tok = served.tokenizer
        prompt = resolve_prompt(served.record, None, None)
        try:
            q = tok.encode([query], truncate, prompt=prompt, direction=direction)
        except InvalidRequest as exc:
            raise renamed(exc, "input 0", "the query", "query") from None
        try:
            d = tok.encode(docs, truncate, prompt=prompt, direction=direction)
        except InvalidRequest as exc:
            raise renamed(exc, "input ", "document ", "documents") from None
        if max_doc_tokens is not None:
            cap = max(tok.n_special_pair + 2, max_doc_tokens + tok.n_special_single)
            if cap < tok.max_tokens and cap < max(d.n_tokens, default=0):
                capped = tok.encode(docs, True, cap, prompt=prompt, direction=direction)
                was = d.truncated
                d = Encoded(
                    capped.ids,
                    capped.n_tokens,
                    [a or b for a, b in zip(was, capped.truncated, strict=True)],
                )
        with self.admission.reserve(q.total_tokens + d.total_tokens):
            vectors = await self._embed_ids(served, [*q.ids, *d.ids], True, deadline_s)
        return vectors[1:] @ vectors[0], d, q.total_tokens + d.total_tokens

    def _chat_pairs(self, served: Served) -> ChatPairs:
        if served.chat_pairs is None:
            spec = served.record.manifest.llm_rerank
            path = served.record.tokenizer_path
            if spec is None or path is None or not path.is_file():
                raise ConfigInvalid(f"model {served.record.name!r} has no chat template to render")
            served.chat_pairs = ChatPairs(spec, path.read_text(encoding="utf-8"))
        return served.chat_pairs

    async def _llm_rerank(
        self, served: Served, query, docs, instruction, cut: tuple, deadline_s: float | None
    ):
        """An LLM reranker: each pair rendered through the model's chat template here
        (host.chat_pairs), sent composed (RERANK_SEQUENCES); the worker reads the two-row
        head at each sequence's last token."""
        truncate, direction, max_doc_tokens = cut
        pairs_of = self._chat_pairs(served)
        spec = pairs_of.spec
        instr = instruction if instruction is not None else spec.default_instruction
        pairs = await asyncio.to_thread(
            pairs_of.compose,
            query,
            docs,
            instr,
            limit=served.record.manifest.max_tokens,
            truncate=truncate,
            direction=direction,
            max_doc_tokens=max_doc_tokens,
        )
        return await self._send_sequences(served, pairs, len(docs), deadline_s), pairs

    async def _send_sequences(
        self, served: Served, pairs: EncodedPairs, n: int, deadline_s: float | None
    ) -> np.ndarray:
        def request(chunk: range) -> tuple[m.Request, np.ndarray]:
            req = m.RERANK_SEQUENCES(
                req_id=0,
                model_ref=served.record.name,
                sequences=[
                    m.RerankSequence(n_tokens=pairs.n_tokens[i], n_first=pairs.n_first[i])
                    for i in chunk
                ],
            )
            return req, np.concatenate([pairs.ids[i] for i in chunk])

        with self.admission.reserve(pairs.total_tokens):
            return await self._request_in_chunks(
                served, pairs.n_tokens, 1, np.empty(n, dtype=np.float32), request, deadline_s
            )

    async def _cross_encode_owned(
        self, served: Served, query, docs, cut: tuple, deadline_s: float | None
    ):
        """Pairs composed here by the model's tokenizer (RERANK_SEQUENCES): the owned graphs'
        (with real token types), and a decoder sequence classifier's (pooling "last": its
        head reads the last non-pad token, workers/llama/llm_head.py) without a chat
        template, which sentence-transformers tokenizes as a plain pair."""
        truncate, direction, max_doc_tokens = cut
        pairs = served.tokenizer.encode_pairs(
            query, docs, truncate=truncate, direction=direction, max_doc_tokens=max_doc_tokens
        )
        return await self._send_sequences(served, pairs, len(docs), deadline_s), pairs

    async def _cross_encode(
        self, served: Served, query, docs, cut: tuple, deadline_s: float | None
    ):
        truncate, direction, max_doc_tokens = cut
        seg = served.tokenizer.rerank_segments(
            query, docs, truncate=truncate, direction=direction, max_doc_tokens=max_doc_tokens
        )
        doc_lengths = [len(d) for d in seg.docs]

        def request(chunk: range) -> tuple[m.Request, np.ndarray]:
            req = m.RERANK(
                req_id=0,
                model_ref=served.record.name,
                query_n_tokens=len(seg.query),
                candidates=[m.RerankCandidate(n_tokens=doc_lengths[i]) for i in chunk],
            )
            return req, np.concatenate([seg.query, *(seg.docs[i] for i in chunk)])

        with self.admission.reserve(seg.total_tokens):
            # Every request carries the query too: the documents get the rest of the budget.
            scores = await self._request_in_chunks(
                served,
                doc_lengths,
                1,
                np.empty(len(docs), dtype=np.float32),
                request,
                deadline_s,
                max_tokens=max(1, self.config.max_worker_batch_tokens - len(seg.query)),
            )
        return scores, seg

    # ---- sequence classification ----------------------------------------------------------

    @uses_model(DEFAULT_EMBED)
    async def classify(
        self,
        inputs: Sequence[ClassifyInput],
        model: str | None = None,
        truncate: bool = True,
        deadline_s: float | None = None,
        lane: str | None = None,
        *,
        truncation_direction: str = "right",
    ) -> ClassifyResult:
        """Every label's raw logit for each input (a text, or a (text, text_pair) pair composed
        through the model's pair template as a cross-encoder's is), from a sequence
        classifier's head; `ClassifyResult.scores()` applies the model's activation."""
        if model is None:
            raise InvalidRequest(
                "classify needs a model: name a sequence classifier", param="model"
            )
        batch = list(inputs)
        kinds, singles, pairs = split_inputs(batch)
        self.admission.check_inputs([*singles, *(t for p in pairs for t in p)])
        record = self.record(model)
        if record.kind != "rerank":
            raise InvalidRequest(
                f"model {model!r} is a {record.kind} model, not a sequence classifier",
                param="model",
                model=model,
            )
        # llama.cpp unless the caller asks for the Core ML graph: both heads are N wide, and
        # no certificate policy covers classifiers yet to choose between them.
        served = await self._load_for_call(model, DEFAULT_EMBED, "rerank", lane or "llama")
        tok = served.tokenizer
        single = tok.encode(singles, truncate, direction=truncation_direction)
        ids: list[np.ndarray] = []
        n_first: list[int] = []
        cut: list[bool] = []
        it_single, it_pair = iter(range(len(singles))), iter(pairs)
        for kind in kinds:
            if kind == 0:
                j = next(it_single)
                ids.append(single.ids[j])
                n_first.append(single.n_tokens[j])
                cut.append(single.truncated[j])
                continue
            text, text_pair = next(it_pair)
            try:
                enc = tok.encode_pairs(text, [text_pair], truncate, direction=truncation_direction)
            except InvalidRequest as exc:
                raise renamed(exc, "pair 0", f"input {len(ids)}", "inputs") from None
            ids.append(enc.ids[0])
            n_first.append(enc.n_first[0])
            cut.append(enc.truncated[0])
        with self.admission.reserve(sum(len(x) for x in ids)):
            logits = await self._classify_ids(served, ids, n_first, deadline_s)
        return self._classified(served, logits, [len(x) for x in ids], cut)

    @uses_model(DEFAULT_EMBED, entry=False)  # admitted work: a drain waits for it
    async def classify_token_ids(
        self,
        ids: list[np.ndarray],
        model: str,
        n_first: Sequence[int] | None = None,
        deadline_s: float | None = None,
        lane: str | None = None,
    ) -> ClassifyResult:
        """Classify already-tokenized sequences (special tokens included; `n_first`: segment
        A's tokens of each, default all of them), as a bulk job does; the caller admitted
        them. The lane as `classify` picks it."""
        served = await self._load_for_call(model, DEFAULT_EMBED, "rerank", lane or "llama")
        firsts = list(n_first) if n_first is not None else [len(x) for x in ids]
        logits = await self._classify_ids(served, ids, firsts, deadline_s)
        return self._classified(served, logits, [len(x) for x in ids], [False] * len(ids))

    def labels(self, model: str) -> list[str]:
        """A sequence classifier's label names by id (generic ones when its record has none)."""
        man = self.record(model).manifest
        n_labels = man.n_labels or len(man.labels) or 1
        return list(man.labels) or [f"LABEL_{i}" for i in range(n_labels)]

    async def _classify_ids(
        self,
        served: Served,
        ids: list[np.ndarray],
        n_first: Sequence[int],
        deadline_s: float | None,
    ) -> np.ndarray:
        lengths = [len(x) for x in ids]

        def request(chunk: range) -> tuple[m.Request, np.ndarray]:
            req = m.CLASSIFY(
                req_id=0,
                model_ref=served.record.name,
                sequences=[
                    m.RerankSequence(n_tokens=lengths[i], n_first=n_first[i]) for i in chunk
                ],
            )
            return req, np.concatenate([ids[i] for i in chunk])

        n_labels = len(self.labels(served.record.name))
        out = np.empty((len(ids), n_labels), dtype=np.float32)
        return await self._request_in_chunks(served, lengths, n_labels, out, request, deadline_s)

    def _classified(
        self, served: Served, logits: np.ndarray, lengths: list[int], cut: list[bool]
    ) -> ClassifyResult:
        labels = self.labels(served.record.name)
        return ClassifyResult(
            logits=logits,
            labels=labels,
            activation=activation_for(served.record.manifest.problem_type, len(labels)),
            model=served.record.name,
            n_tokens=lengths,
            truncated=cut,
        )

    # ---- generation -----------------------------------------------------------------------

    @uses_model(DEFAULT_GENERATE)
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
        served = await self._load_for_call(model, DEFAULT_GENERATE, "generate")
        try:
            encoded = served.tokenizer.encode([prompt], truncate=False)
        except InvalidRequest as exc:  # generation has no truncate option to point at
            n, limit = exc.details.get("n_tokens"), exc.details.get("max_tokens")
            if n is None:
                raise
            raise InvalidRequest(
                f"prompt has {n} tokens, over {served.record.name!r}'s limit of {limit}; "
                "shorten it",
                param="prompt",
                n_tokens=n,
                max_tokens=limit,
            ) from None
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


def _refuse_classifier(record: ModelRecord) -> None:
    """Rerank ranks by one relevance logit; a head of several labels has none to rank by."""
    n = record.manifest.n_labels or 1
    if record.kind == "rerank" and n != 1:
        labels = ", ".join(record.manifest.labels) or f"{n} labels"
        raise InvalidRequest(
            f"model {record.name!r} is a sequence classifier with {n} labels ({labels}), not a "
            "reranker: rerank needs a single relevance score; score its labels with /predict "
            "or `synapse classify`",
            param="model",
            model=record.name,
        )


def _check_lane(lane: str) -> str:
    if lane not in LANES:
        raise InvalidRequest(f"lane {lane!r}: expected one of {sorted(LANES)}")
    return lane


def check_lane_list(model: str, lanes: list[str]) -> list[str]:
    """A configured lane list: known lanes, each once, at least one (else `config_invalid`)."""
    if not lanes:
        raise ConfigInvalid(f'models.{model}.lanes: name at least one lane, or "auto"')
    unknown = [lane for lane in lanes if lane not in LANES]
    if unknown:
        raise ConfigInvalid(
            f"models.{model}.lanes: unknown lane {unknown[0]!r}; expected some of {sorted(LANES)}"
        )
    if len(set(lanes)) != len(lanes):
        raise ConfigInvalid(f"models.{model}.lanes: a lane is listed twice: {lanes}")
    return lanes
