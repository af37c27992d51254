"""Which models stay resident: in-use tracking, an idle keep-alive, and a memory budget.

Every model call of the `Module` (embed, embed_token_ids, rerank, generate, tokenizer) holds
its model for as long as it runs (`uses_model`, a few microseconds per call), so a model is
*busy* while any call is inside it and *idle* otherwise; "last used" is when the latest call
began or ended. A model is only
ever unloaded while idle, by one of:

- `keep_alive`: a model idle that long is unloaded (global, or per model; "forever" = never,
  the default; 0 = as soon as it is idle). One background task sleeps until the next expiry.
- `max_resident_mb`: before a worker starts, the model's size is estimated; if the resident
  workers plus that estimate would exceed the budget, the least recently used idle models are
  unloaded first. A model that cannot fit (larger than the budget, or the busy models leave no
  room) is refused with `InsufficientMemory` (503) before any worker starts, and nothing is
  unloaded for it.
- the machine: the same check against what the OS says is available (cgroup limit or
  MemAvailable) less `min_free_mb`, budget or not, so a load never runs the machine out of
  memory.
- an operator: `Residency.unload(name)` (`POST /v1/models/{model}/unload`) drains the model
  first: new calls wait at its gate, calls already inside finish, and so do embedding requests
  already queued in the scheduler (a busy probe); then every lane of it is unloaded and the
  waiting calls go on, loading it again.

Sizes. Before a model has ever been loaded: its artifact's size from the manifest plus a
per-kind overhead measured on the default models (a llama.cpp worker's interpreter, the
engine, compute buffers and, for generation, the KV cache: see `DEFAULT_OVERHEAD_MB`). Once
loaded, the real figure: the worker's RSS from PONG (one PING right after LOAD, then the lanes'
background PINGs). The largest RSS seen for a (model, lane) is its estimate for the next load.
A model's bytes count once at every moment: as its reservation while its load runs, as its
resident figure once served (the estimate until its first PONG, see `total_mb`), never both.
If the measured RSS proves a just-loaded model over the budget, idle models are unloaded to
make room; if that is not enough the new model is unloaded again and refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import psutil

from common.errors import ModelNotFound, SynapseError
from host.errors import ConfigInvalid, InsufficientMemory

if TYPE_CHECKING:
    from host.lane import Lane
    from ingest.store import ModelRecord

log = logging.getLogger("synapse.residency")


class ResidentLane(Protocol):
    """One loaded lane as residency reads it."""

    lane: Lane  # the supervisor of its worker
    device: str  # what the worker's LOADED said it runs on


class ResidentModels(Protocol):
    """What residency reads and does of the Module it keeps under budget
    (host.module.Module is one); this module imports nothing of host.module."""

    residency: Residency

    def residents(self) -> Mapping[str, Mapping[str, ResidentLane]]:
        """Loaded models by name, each with its lanes by kind."""
        ...

    async def unload(self, name: str, lane: str | None = None) -> None: ...


MIB = 2**20
# RSS of a loaded llama.cpp worker beyond its GGUF's size, measured on this project's default
# models after LOAD and a first request (compute buffers grow on first use), rounded up ~10%:
# MiniLM-L6 f32 (86.7 MB file) 175 MB, f16 (44.1 MB) 135 MB -> ~90 MB over the file;
# Gemma 3 270M q4_k_m (241.4 MB) 372 MB -> ~131 MB (its 2048-token KV cache included).
DEFAULT_OVERHEAD_MB = {"embed": 96.0, "rerank": 96.0, "generate": 144.0}
_MAX_SWEEP_S = 5.0  # the keep-alive task looks at least this often (budget growth too)
_MIN_SWEEP_S = 0.02
_DRAIN_POLL_S = 0.05  # a drain re-checks the scheduler's queue (which has no event) this often
_NEVER = {"forever", "never", "inf", "infinite", "-1"}
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")

KeepAlive = float | str | None


def parse_keep_alive(value: KeepAlive, what: str = "keep_alive") -> float:
    """Seconds, math.inf for never. Accepts a number of seconds (negative: never), or a
    string: "forever"/"never"/"-1", "0", "30", "500ms", "30s", "5m", "1h30m"."""
    if value is None:
        return math.inf
    if isinstance(value, bool):
        raise ConfigInvalid(f"{what}: expected seconds or a duration like '5m', got {value!r}")
    if isinstance(value, int | float):
        if math.isnan(value):
            raise ConfigInvalid(f"{what} must not be NaN")
        return math.inf if value < 0 else float(value)
    text = value.strip().lower()
    if text in _NEVER:
        return math.inf
    try:
        return parse_keep_alive(float(text), what)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ConfigInvalid(
            f"{what}: {value!r} is not a duration; use seconds, '500ms', '30s', '5m', '1h30m' "
            "or 'forever'"
        )
    return total


class ModelResidency(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    keep_alive: KeepAlive = None  # None: the global keep_alive

    def __post_init__(self) -> None:
        parse_keep_alive(self.keep_alive)


class ResidencyConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # How long an idle model stays loaded; None = forever (models stay until unloaded).
    keep_alive: KeepAlive = None
    # The sum of every worker's RSS this server may hold, in MiB; None = no budget (the
    # machine check still applies).
    max_resident_mb: float | None = None
    # A never-loaded model is estimated at its artifact size plus this (MiB); None = the
    # measured per-kind defaults (DEFAULT_OVERHEAD_MB).
    load_overhead_mb: float | None = None
    # A load must leave this much of the machine's available memory free (MiB).
    min_free_mb: float = 256.0
    models: dict[str, ModelResidency] = {}  # per model (or alias): keep_alive

    def __post_init__(self) -> None:
        parse_keep_alive(self.keep_alive)
        for name, value in (
            ("max_resident_mb", self.max_resident_mb),
            ("load_overhead_mb", self.load_overhead_mb),
        ):
            if value is not None and not 0 < value < math.inf:
                raise ConfigInvalid(f"residency.{name} must be finite and > 0")
        if not 0 <= self.min_free_mb < math.inf:
            raise ConfigInvalid("residency.min_free_mb must be finite and >= 0")

    def resolved(self, aliases: dict[str, str]) -> ResidencyConfig:
        """The same settings with per-model keys named by alias moved to the model."""
        models = {aliases.get(k, k): v for k, v in self.models.items()}
        return msgspec.structs.replace(self, models=models)

    def keep_alive_s(self, name: str) -> float:
        own = self.models.get(name)
        if own is not None and own.keep_alive is not None:
            return parse_keep_alive(own.keep_alive)
        return parse_keep_alive(self.keep_alive)


# ---- the machine's memory ------------------------------------------------------------------


def machine_available_mb() -> float | None:
    """What the OS would still give this process tree, in MiB: its available memory (psutil:
    MemAvailable on Linux, free + inactive on macOS), or less under a cgroup v2 limit (Linux:
    its limit less its usage, reclaimable page cache counted free); None if unreadable."""
    found: list[float] = []
    try:
        found.append(psutil.virtual_memory().available / MIB)
    except (OSError, RuntimeError):
        pass
    cgroup = _cgroup_available_mb()
    if cgroup is not None:
        found.append(cgroup)
    return min(found) if found else None


def _cgroup_available_mb() -> float | None:
    if sys.platform != "linux":  # cgroups are Linux's; elsewhere the OS figure is all there is
        return None
    try:
        rel = next(
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
        base = Path("/sys/fs/cgroup") / rel.strip().lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        usage = int((base / "memory.current").read_text())
        stat = dict(line.split() for line in (base / "memory.stat").read_text().splitlines())
        cache = int(stat.get("inactive_file", 0))
        return max(0.0, (int(limit) - usage + cache) / MIB)
    except (OSError, ValueError, StopIteration, IndexError):
        return None


# ---- in-use tracking -----------------------------------------------------------------------


@dataclass
class _Entry:
    busy: int = 0  # calls inside the model now
    holders: dict = field(default_factory=dict)  # asyncio.Task -> its calls inside
    used_mono: float | None = None  # monotonic: the latest call's start or end
    loaded_mono: float | None = None  # when its latest load completed (the idle clock's start)
    gate: asyncio.Event | None = None  # while it is being unloaded: new calls wait for this
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set when busy drops to 0

    def idle_since(self) -> float:
        return max(self.used_mono or 0.0, self.loaded_mono or 0.0)

    def last_used(self) -> float | None:
        """Unix seconds of the latest use (one clock on the request path, converted here)."""
        if self.used_mono is None:
            return None
        return time.time() - (time.monotonic() - self.used_mono)


def _enter(e: _Entry, task: object, use: bool) -> None:
    e.busy += 1
    e.holders[task] = e.holders.get(task, 0) + 1
    if use:
        e.used_mono = time.monotonic()


def _leave(res: Residency, name: str, e: _Entry, task: object, use: bool, unknown: bool) -> None:
    n = e.holders[task] - 1
    if n:
        e.holders[task] = n
    else:
        del e.holders[task]
    e.busy -= 1
    if use:
        e.used_mono = time.monotonic()
    if e.busy == 0:
        e.idle.set()
        if unknown and e.gate is None and not res.module.residents().get(name):
            del res._entries[name]  # no such model: unknown names must not grow the table
            return
        res._idle_now(name)


class _Hold:
    """`async with residency.hold(name)`: the model is busy inside. `entry=True` (a new call)
    waits while the model is being unloaded; `entry=False` (work already admitted, such as a
    scheduler batch) never waits, so a drain cannot wait for work that waits for the drain.
    A call made inside another call of the same model, in the same task, never waits either
    (its caller holds the model: waiting would deadlock the drain)."""

    __slots__ = ("res", "name", "entry", "use", "e", "task")

    def __init__(self, res: Residency, name: str, entry: bool, use: bool) -> None:
        self.res, self.name, self.entry, self.use = res, name, entry, use

    async def __aenter__(self) -> None:
        self.task = asyncio.current_task()
        self.e = await self.res._admit_call(self.name, self.entry, self.task)
        _enter(self.e, self.task, self.use)

    async def __aexit__(self, exc_type, exc, tb) -> None:
        _leave(self.res, self.name, self.e, self.task, self.use, exc_type is ModelNotFound)


def uses_model(default: str, entry: bool = True) -> Callable:
    """Decorate a `Module` coroutine method with a `model` parameter: the model it names (or
    `default`) is held while the method runs (see `_Hold` for `entry`). The same as
    `async with residency.hold(...)`, inline: it runs on every request."""

    def wrap(method: Callable) -> Callable:
        index = list(inspect.signature(method).parameters).index("model") - 1  # after self

        @functools.wraps(method)
        async def run(self: ResidentModels, *args: Any, **kwargs: Any) -> Any:
            name = (args[index] if len(args) > index else kwargs.get("model")) or default
            res = self.residency
            task = asyncio.current_task()
            e = res._entries.get(name)
            if e is None or (e.gate is not None and entry and task not in e.holders):
                e = await res._admit_call(name, entry, task)
            _enter(e, task, True)
            unknown = False
            try:
                return await method(self, *args, **kwargs)
            except ModelNotFound:
                unknown = True
                raise
            finally:
                _leave(res, name, e, task, True, unknown)

        return run

    return wrap


@dataclass
class Ticket:
    """A load admitted under the budget: its estimate is reserved until `commit` or
    `cancel` (counted as reserved only until the module serves the lane: see `total_mb`)."""

    key: str
    name: str
    lane: str
    estimate_mb: float
    source: str  # "estimate" (artifact + overhead) or "measured" (an earlier load's RSS)


# ---- the policy ----------------------------------------------------------------------------


class Residency:
    def __init__(self, module: ResidentModels, config: ResidencyConfig | None = None) -> None:
        self.module = module
        self.config = config or ResidencyConfig()
        self._entries: dict[str, _Entry] = {}
        self._reserved: dict[str, float] = {}  # "name@lane" -> MiB, while its load runs
        self._peak: dict[str, float] = {}  # "name@lane" -> the largest RSS seen
        self._fallback: dict[str, float] = {}  # "name@lane" -> MiB, a lane without a PONG yet
        self._admitting = asyncio.Lock()  # one decision (and its evictions) at a time
        self._sweeper: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._next_sweep = math.inf  # monotonic time the keep-alive task wakes next
        # Work the module cannot see that keeps a model busy (the scheduler's queue):
        # callables name -> how much is waiting.
        self.busy_probes: list[Callable[[str], int]] = []
        self.unloads: Counter[str] = Counter()  # by reason: keep_alive, budget, request
        self.refusals = 0  # loads refused with InsufficientMemory
        self._ttls: dict[str, float] = {}  # parsed once: read at the end of every call
        self._ttl_any = math.isfinite(self.keep_alive_s("")) or any(
            math.isfinite(self.keep_alive_s(n)) for n in self.config.models
        )

    def keep_alive_s(self, name: str) -> float:
        """Idle seconds before `name` is unloaded; math.inf for never."""
        ttl = self._ttls.get(name)
        if ttl is None:
            ttl = self._ttls[name] = self.config.keep_alive_s(name)
        return ttl

    # ---- holding --------------------------------------------------------------------------

    def hold(self, name: str, entry: bool = True, use: bool = True) -> _Hold:
        return _Hold(self, name, entry, use)

    async def _admit_call(self, name: str, entry: bool, task: object) -> _Entry:
        """`name`'s entry once a call may go in: a new call waits while it is unloaded."""
        e = self._entry(name)
        while entry and e.gate is not None and task not in e.holders:
            await e.gate.wait()
            e = self._entry(name)
        return e

    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            e = self._entries[name] = _Entry()
        return e

    def _idle_now(self, name: str) -> None:
        """A model just went idle: wake the keep-alive task if it would sleep past the
        model's expiry (a short keep_alive must not wait for a long sweep interval)."""
        if self._sweeper is None:
            return
        ttl = self.keep_alive_s(name)
        if time.monotonic() + ttl < self._next_sweep:
            self._wake.set()

    def is_unloading(self, name: str) -> bool:
        """`name` is being unloaded now: calls that arrive wait until it is done (then the
        model loads again for them)."""
        e = self._entries.get(name)
        return e is not None and e.gate is not None

    def is_idle(self, name: str) -> bool:
        e = self._entries.get(name)
        if e is not None and (e.busy or e.gate is not None):
            return False
        return not any(probe(name) for probe in self.busy_probes)

    # ---- sizes ----------------------------------------------------------------------------

    def estimate(self, name: str, lane: str, record: ModelRecord) -> tuple[float, str]:
        """(MiB, source) a load of `name` on `lane` is budgeted at."""
        peak = self._peak.get(_key(name, lane))
        if peak is not None:
            return peak, "measured"
        overhead = self.config.load_overhead_mb
        if overhead is None:
            overhead = DEFAULT_OVERHEAD_MB.get(record.kind, max(DEFAULT_OVERHEAD_MB.values()))
        return record.manifest.size_bytes / MIB + overhead, "estimate"

    def _lane_rss(self, name: str, lane_kind: str, lane: Lane) -> float | None:
        pong = lane.last_pong
        key = _key(name, lane_kind)
        if pong is None:
            return self._fallback.get(key)
        self._peak[key] = max(self._peak.get(key, 0.0), pong.rss_mb)
        return pong.rss_mb

    def resident_mb(self, name: str) -> float | None:
        """The model's workers' RSS summed over its lanes; None when not loaded."""
        lanes = self.module.residents().get(name)
        if not lanes:
            return None
        return sum(self._lane_rss(name, k, s.lane) or 0.0 for k, s in lanes.items())

    def total_mb(self) -> float:
        """Every resident worker's RSS, plus the estimates of loads under way.

        A lane's bytes count exactly once at every moment. Its reservation counts from
        `admit` until the module serves the lane; from then on its resident figure counts
        instead: the RSS of its latest PONG or, until the first one, the same estimate (the
        module serves a lane before `commit` PINGs it). Counting both while that PING runs
        would refuse or evict for memory nobody holds."""
        total, served = 0.0, set()
        for name, lanes in self.module.residents().items():
            for kind, s in lanes.items():
                served.add(_key(name, kind))
                total += self._lane_rss(name, kind, s.lane) or 0.0
        return total + sum(mb for key, mb in self._reserved.items() if key not in served)

    # ---- loading under the budget ---------------------------------------------------------

    async def admit(self, name: str, lane: str, record: ModelRecord) -> Ticket:
        """Reserve room for a load, unloading least recently used idle models if the budget
        (or the machine) needs it; `InsufficientMemory` if the model cannot fit."""
        need, source = self.estimate(name, lane, record)
        key = _key(name, lane)
        cfg = self.config
        how = (
            f"{need:.0f} MB (RSS of its last load)"
            if source == "measured"
            else f"~{need:.0f} MB (artifact {record.manifest.size_bytes / MIB:.0f} MB + "
            f"{need - record.manifest.size_bytes / MIB:.0f} MB worker overhead, estimated)"
        )
        budget = cfg.max_resident_mb
        async with self._admitting:
            while True:
                total = self.total_mb()
                machine = machine_available_mb()
                room = None if machine is None else machine - cfg.min_free_mb
                fits_budget = budget is None or total + need <= budget
                fits_machine = room is None or need <= room
                if fits_budget and fits_machine:
                    break
                victims = self._lru_idle(exclude=name)
                freeable = sum(self.resident_mb(v) or 0.0 for v in victims)
                if budget is not None and need > budget:
                    self._refuse(
                        f"model {name!r} needs {how}, more than max_resident_mb {budget:.0f}",
                        name,
                        need,
                        budget_mb=budget,
                    )
                if budget is not None and not fits_budget and total - freeable + need > budget:
                    busy = sorted(
                        n for n in self.module.residents() if n not in victims and n != name
                    )
                    self._refuse(
                        f"model {name!r} needs {how}; {total - freeable:.0f} MB of "
                        f"max_resident_mb {budget:.0f} are held by models in use or loading "
                        f"({', '.join(busy) or 'none'}); retry when they are idle",
                        name,
                        need,
                        budget_mb=budget,
                        resident_mb=round(total, 1),
                    )
                if (
                    machine is not None
                    and room is not None
                    and not fits_machine
                    and need > room + freeable
                ):
                    self._refuse(
                        f"model {name!r} needs {how}; the machine has {machine:.0f} MB "
                        f"available and {cfg.min_free_mb:.0f} MB must stay free",
                        name,
                        need,
                        available_mb=round(machine, 1),
                    )
                victim = victims[0]
                log.warning(
                    "unloading idle %r (least recently used) to make room for %r", victim, name
                )
                await self._evict(victim, "budget")
            self._reserved[key] = need
            self._fallback[key] = need
        return Ticket(key, name, lane, need, source)

    def cancel(self, ticket: Ticket) -> None:
        self._reserved.pop(ticket.key, None)

    async def commit(self, ticket: Ticket, lane: Lane) -> None:
        """The load succeeded and the module serves the lane: measure the worker (one PING),
        start the idle clock and hold the budget to the real figure. Raises
        `InsufficientMemory` after unloading the model again when even unloading every idle
        model leaves it over the budget."""
        with contextlib.suppress(SynapseError):
            await lane.ping()
        self._reserved.pop(ticket.key, None)
        e = self._entry(ticket.name)
        e.loaded_mono = time.monotonic()
        self._lane_rss(ticket.name, ticket.lane, lane)
        budget = self.config.max_resident_mb
        if budget is not None and self.total_mb() > budget:
            async with self._admitting:
                await self._shrink(budget, exclude=ticket.name)
                total = self.total_mb()
                if total > budget:
                    measured = self.resident_mb(ticket.name) or 0.0
                    with contextlib.suppress(SynapseError):
                        await self.module.unload(ticket.name, ticket.lane)
                    self._refuse(
                        f"model {ticket.name!r} measured {measured:.0f} MB once loaded "
                        f"(estimated {ticket.estimate_mb:.0f} MB): {total:.0f} MB would exceed "
                        f"max_resident_mb {budget:.0f}; it was unloaded again",
                        ticket.name,
                        measured,
                        budget_mb=budget,
                    )
        self._start()

    def _refuse(self, message: str, name: str, need: float, **details: float) -> None:
        self.refusals += 1
        raise InsufficientMemory(message, model=name, needed_mb=round(need, 1), **details)

    def _lru_idle(self, exclude: str) -> list[str]:
        """Loaded idle models, least recently used first (never `exclude`)."""
        names = [n for n in self.module.residents() if n != exclude and self.is_idle(n)]
        return sorted(names, key=lambda n: self._entry(n).idle_since())

    async def _shrink(self, budget: float, exclude: str | None = None) -> None:
        """Unload least recently used idle models while the total is over `budget`."""
        while self.total_mb() > budget:
            victims = self._lru_idle(exclude=exclude or "")
            if not victims:
                return
            log.warning(
                "resident workers over max_resident_mb %.0f: unloading idle %r", budget, victims[0]
            )
            await self._evict(victims[0], "budget")

    # ---- unloading ------------------------------------------------------------------------

    async def _evict(self, name: str, reason: str) -> None:
        """Unload an idle model now (the caller checked `is_idle` with no await since)."""
        e = self._entry(name)
        gate = e.gate = asyncio.Event()
        try:
            await self._unload_lanes(name, reason, drain=False)
        finally:
            e.gate = None
            gate.set()

    async def unload(self, name: str, reason: str = "request") -> bool:
        """Drain, then unload every lane of `name` (see the module docstring); False when it
        was not loaded. Calls arriving meanwhile wait, then load it again."""
        e = self._entry(name)
        while e.gate is not None:  # another unload of it is under way: that one does it
            await e.gate.wait()
        if not self.module.residents().get(name):
            return False
        gate = e.gate = asyncio.Event()
        try:
            await self._unload_lanes(name, reason, drain=True)
        finally:
            e.gate = None
            gate.set()
        return True

    async def _unload_lanes(self, name: str, reason: str, drain: bool) -> None:
        e = self._entries[name]
        self.unloads[reason] += 1  # counted when decided: /v1/models shows it with the change
        while lanes := self.module.residents().get(name):
            if drain:
                while e.busy or any(probe(name) for probe in self.busy_probes):
                    e.idle.clear()
                    if e.busy == 0:  # only the scheduler's queue: it has no event, poll it
                        await asyncio.sleep(_DRAIN_POLL_S)
                    else:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(_DRAIN_POLL_S * 20):
                                await e.idle.wait()
            lane_kind, served = next(iter(lanes.items()))
            self._lane_rss(name, lane_kind, served.lane)  # its peak, for the next estimate
            try:
                await self.module.unload(name, lane_kind)
            except ModelNotFound:
                pass  # unloaded meanwhile by someone else
            except SynapseError as exc:  # the lane is stopped either way
                log.warning("unloading %r (%s): %s", name, lane_kind, exc.message)
        e.loaded_mono = None
        log.info("model %r unloaded (%s)", name, reason)

    # ---- the keep-alive task --------------------------------------------------------------

    def _start(self) -> None:
        if self._sweeper is None and (self._ttl_any or self.config.max_resident_mb):
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="residency")

    async def _sweep_forever(self) -> None:
        while True:
            try:
                delay = await self.sweep()
            except Exception:  # logged; the next sweep tries again
                log.exception("residency sweep failed")
                delay = _MAX_SWEEP_S
            self._next_sweep = time.monotonic() + delay
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._next_sweep = math.inf

    async def sweep(self) -> float:
        """Unload idle models past their keep_alive, and idle ones over the budget (RSS grows
        with use); seconds until the next expiry (at most `_MAX_SWEEP_S`)."""
        delay = _MAX_SWEEP_S
        async with self._admitting:
            for name in list(self.module.residents()):
                ttl = self.keep_alive_s(name)
                if not math.isfinite(ttl):
                    continue
                if not self.is_idle(name):
                    continue  # re-checked when it goes idle (or at the next sweep)
                due = self._entry(name).idle_since() + ttl - time.monotonic()
                if due <= 0:
                    await self._evict(name, "keep_alive")
                else:
                    delay = min(delay, due)
            budget = self.config.max_resident_mb
            if budget is not None:
                await self._shrink(budget)
        return max(_MIN_SWEEP_S, delay)

    async def close(self) -> None:
        task, self._sweeper = self._sweeper, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---- what /v1/models says -------------------------------------------------------------

    def describe(self, name: str, lane: str, record: ModelRecord) -> dict:
        """A model's residency, for /v1/models (`lane`: the one that serves or would)."""
        e = self._entries.get(name)
        lanes = self.module.residents().get(name, {})
        workers = []
        for kind, served in lanes.items():
            state = served.lane.state()
            rss = self._lane_rss(name, kind, served.lane)
            workers.append(
                {
                    "lane": kind,
                    "device": served.device,
                    "pid": state.pid,
                    "status": state.health.status,
                    "rss_mb": None if rss is None else round(rss, 1),
                }
            )
        estimate, source = self.estimate(name, lane, record)
        ttl = self.keep_alive_s(name)
        expires = None
        if lanes and e is not None and math.isfinite(ttl) and self.is_idle(name):
            expires = round(time.time() + e.idle_since() + ttl - time.monotonic(), 3)
        resident = self.resident_mb(name)
        return {
            "loaded_lanes": sorted(lanes),
            "workers": workers,
            "resident_mb": None if resident is None else round(resident, 1),
            "estimated_mb": round(estimate, 1),
            "estimate_source": source,
            "in_flight": e.busy if e is not None else 0,
            "last_used": None if e is None or (last := e.last_used()) is None else round(last, 3),
            "keep_alive_s": ttl if math.isfinite(ttl) else None,
            "expires_at": expires,
        }

    def summary(self) -> dict:
        """The whole server's memory, for /v1/models."""
        machine = machine_available_mb()
        return {
            "resident_mb": round(self.total_mb(), 1),
            "max_resident_mb": self.config.max_resident_mb,
            "machine_available_mb": None if machine is None else round(machine, 1),
            "min_free_mb": self.config.min_free_mb,
            "unloads": dict(self.unloads),
            "refusals": self.refusals,
        }


def _key(name: str, lane: str) -> str:
    return f"{name}@{lane}"
