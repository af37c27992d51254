"""One model on two lanes: starting the pair, the lane that serves alone when the pair cannot,
and the lane each call goes to.

- `choose`: load every lane of a `LaneSet`, confirm each certified lane's exact identity, and
  check that their vectors agree (recorded by a certificate, else measured now); then the
  choice names them all and every call without `lane=` is routed.
- When they cannot serve together — their vectors disagree, or a lane cannot load or no
  longer matches its certificate — the better certified lane serves alone
  (host.lane_router.better_certified: a lane certified for this machine, the one its
  certificate found closer to the reference, a tie to the lane listed first); a lane that
  cannot load is passed over for the next. Vectors of one lane only, so an index never mixes
  two models; and of two lanes that disagree, the one proved closer to the model is the one
  to trust. Without a certified lane there is nothing to prefer either by, and the Module's
  single-lane rule decides.
- `predict`: the same choice as far as certificates tell, without starting a worker (what
  `synapse doctor` and `/v1/models` show before a model is used).
- `lane_for`: per call, the loaded, unquarantined lane expected to finish it first
  (host.lane_router.route), from the lanes' latency curves and the inputs each has in flight,
  which `in_flight` counts around every request a lane's worker is sent; a call for
  token-level outputs only among the lanes that serve them (what each worker's LOADED
  declared it refuses), and a call with an item longer than a lane takes (LOADED's
  `max_item_tokens`) only among the others.

The Module owns one `RoutedLanes` and gives it itself (`PairHost`); this module imports
nothing of host.module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from common.errors import SynapseError
from host.lane_policy import Agreement, LaneChoice, LanePolicy, LaneSet, LoadedLanes
from host.lane_router import Ask, LatencyCurve, better_certified, refusal, route
from workers.protocol import messages as m

if TYPE_CHECKING:
    from host.lane import Lane
    from ingest.store import ModelRecord

log = logging.getLogger("synapse.certification")  # the certificate policy's outcomes


class PairHost(LoadedLanes, Protocol):
    """What `RoutedLanes` needs of the Module that owns it (host.module.Module is one)."""

    lane_policy: LanePolicy

    async def load(
        self, name: str, lane: str | None = None, runtime_config_extra: dict | None = None
    ) -> ModelRecord: ...

    async def unload(self, name: str, lane: str | None = None) -> None: ...

    def supervisor(self, name: str, lane: str | None = None) -> Lane | None: ...

    def refusals(self, name: str, lane: str) -> tuple[m.Refusal, ...]: ...

    def max_item_tokens(self, name: str, lane: str) -> int | None: ...


class RoutedLanes:
    def __init__(self, host: PairHost) -> None:
        self.host = host
        self._curves: dict[str, dict[str, LatencyCurve]] = {}  # routed models: lane -> curve
        # Inputs sent to a lane's worker and not yet answered, by supervisor (absent: none,
        # so the table holds only lanes busy now).
        self._busy: dict[Lane, int] = {}

    # ---- the choice -------------------------------------------------------------------------

    async def choose(self, name: str, lanes: LaneSet) -> LaneChoice | str:
        """The lanes of `lanes` serving `name` together, else the better certified one alone
        (the reason says why not together), else why neither (nothing stays loaded)."""
        loaded: list[str] = []
        unavailable: set[str] = set()
        tried = await self._together(name, lanes, loaded, unavailable)
        if isinstance(tried, LaneChoice):
            return tried
        alone = await self._alone(name, lanes, loaded, unavailable)
        if alone is None:
            return tried
        device = self.device(name, alone)
        return LaneChoice(
            alone, device, alone_reason(alone, device, lanes) + f"; not routed: {tried}"
        )

    async def _together(
        self, name: str, lanes: LaneSet, loaded: list[str], unavailable: set[str]
    ) -> LaneChoice | str:
        """Load and agree the whole set: a LaneChoice naming every lane, or why not (`loaded`
        then lists the lanes left loaded, `unavailable` those that could not load as
        certified)."""
        together = "+".join(lanes.lanes)
        if lanes.agreement is not None and not lanes.agreement.passed:
            return f"lanes {together} disagree ({lanes.agreement.describe()})"
        try:
            for lane in lanes.lanes:
                extra = lanes.runtime_config_extra.get(lane) or None
                unavailable.add(lane)  # until it is loaded and matches its certificate
                await self.host.load(name, lane, extra)
                loaded.append(lane)
                if lanes.certificates.get(lane):
                    self.host.lane_policy.require(self.host, name, lane, extra)
                unavailable.discard(lane)
            agreement: Agreement | None = lanes.agreement
            curves = {lane: c for lane, c in lanes.curves.items() if c is not None}
            if agreement is None or len(curves) < len(lanes.lanes):
                measured, more = await self.host.lane_policy.measure(self.host, name, lanes)
                agreement = agreement or measured
                curves = {**more, **curves}
        except SynapseError as exc:
            log.warning("%s: lanes %s cannot serve together: %s", name, together, exc.message)
            return f"lanes {together} could not be loaded together ({exc.code}: {exc.message})"
        if not agreement.passed:
            log.warning("%s: lanes %s disagree: %s", name, together, agreement.describe())
            return f"lanes {together} disagree ({agreement.describe()})"
        self._curves[name] = {lane: curves[lane] for lane in lanes.lanes}
        first = lanes.lanes[0]
        certs = [c for c in (lanes.certificates.get(lane) for lane in lanes.lanes) if c]
        by = f"; certificates {', '.join(certs)}" if certs else ""
        return LaneChoice(
            first,
            self.device(name, first),
            f"routed {together}: vectors agree ({agreement.describe()}){by}",
            tuple(lanes.lanes),
        )

    async def _alone(
        self, name: str, lanes: LaneSet, loaded: list[str], unavailable: set[str]
    ) -> str | None:
        """The better certified lane of `lanes` that loads, as certified, and serves alone;
        every other lane in `loaded` is unloaded. None: no certified lane could (and none
        stays loaded)."""
        chosen = None
        for lane in better_certified(lanes.lanes, lanes.fits):
            if lane in unavailable:
                continue
            if lane not in loaded:  # loaded lanes were confirmed against their certificate
                extra = lanes.runtime_config_extra.get(lane) or None
                try:
                    await self.host.load(name, lane, extra)
                    loaded.append(lane)
                    self.host.lane_policy.require(self.host, name, lane, extra)
                except SynapseError as exc:
                    log.warning(
                        "%s: the certified %s lane cannot serve: %s", name, lane, exc.message
                    )
                    continue
            supervisor = self.host.supervisor(name, lane)
            if supervisor is not None and not supervisor.state().quarantined:
                chosen = lane
                break
        await self._unload_quietly(name, [lane for lane in loaded if lane != chosen])
        return chosen

    async def _unload_quietly(self, name: str, lanes: list[str]) -> None:
        for lane in lanes:
            try:
                await self.host.unload(name, lane)
            except SynapseError as exc:
                log.warning("%s: unloading the %s lane: %s", name, lane, exc.message)

    def device(self, name: str, lane: str) -> str:
        """What the loaded `lane`'s worker said it runs on."""
        return str(self.host.lane_identity(name, lane)["device"])

    # ---- each call --------------------------------------------------------------------------

    def lane_for(
        self,
        name: str,
        choice: LaneChoice,
        items: int,
        ask: Ask | None = None,
        longest: int = 0,
    ) -> str:
        """The lane a call of `items` inputs without `lane=` goes to: the chosen lane, or for
        a routed model the loaded, unquarantined lane expected to finish it first among
        those that serve what it asks (`ask`: token-level outputs and their sides) and take
        its longest item (`longest` tokens: a Core ML lane's longest admitted shape may hold
        fewer than the model's limit); each lane's worker declared both when it loaded."""
        curves = self._curves.get(name)
        if not choice.lanes or not curves:
            return choice.lane
        ready = {}
        in_flight = {}
        refused = {}
        for lane in choice.lanes:
            supervisor = self.host.supervisor(name, lane)
            if supervisor is None or supervisor.state().quarantined or lane not in curves:
                continue
            ready[lane] = curves[lane]
            in_flight[lane] = self._busy.get(supervisor, 0)
            why = refusal(self.host.refusals(name, lane), ask)
            limit = self.host.max_item_tokens(name, lane)
            if why is None and limit is not None and longest > limit:
                why = f"an item of {longest} tokens: the lane takes {limit} at most"
            if why is not None:
                refused[lane] = why
        return route(ready, in_flight, items, refused) if ready else choice.lane

    @contextmanager
    def in_flight(self, supervisor: Lane, items: int) -> Iterator[None]:
        """Count `items` inputs as in flight on `supervisor`'s worker while the body runs (what
        `lane_for` sees a lane busy with)."""
        self._busy[supervisor] = self._busy.get(supervisor, 0) + items
        try:
            yield
        finally:
            left = self._busy[supervisor] - items
            if left:
                self._busy[supervisor] = left
            else:
                del self._busy[supervisor]

    def busy(self) -> int:
        """Lanes with inputs in flight now (the table's size: idle lanes are not kept)."""
        return len(self._busy)

    def curves(self, name: str) -> dict[str, LatencyCurve]:
        """A routed model's latency curve per lane (empty for a model on one lane)."""
        return dict(self._curves.get(name, {}))

    def forget(self, name: str) -> None:
        """`name` is routed no more (one of its lanes was unloaded: it chooses again)."""
        self._curves.pop(name, None)

    def clear(self) -> None:
        self._curves.clear()


def alone_reason(lane: str, device: str | None, lanes: LaneSet) -> str:
    """Why `lane` serves alone, naming what every certified lane of `lanes` measured."""
    fits = "; ".join(
        f"{other}: {lanes.fits[other].describe()}"
        for other in better_certified(lanes.lanes, lanes.fits)
    )
    where = f"{lane}/{device}" if device else lane
    return (
        f"{where}: the better certified of {'+'.join(lanes.lanes)} against the reference ({fits})"
    )


def predict(lanes: LaneSet, llama_device: str | None) -> LaneChoice | str:
    """Without starting a worker, what `choose` will make of `lanes` as far as certificates
    tell: routed (once the agreement measured at load passes, when none is recorded), or the
    better certified lane alone when a certificate recorded that they disagree; else why they
    are not routed (no certified lane to prefer: the single-lane rule decides)."""
    together = "+".join(lanes.lanes)
    agreement = lanes.agreement
    if agreement is None:
        reason = f"routed {together} once their vectors agree (measured at load)"
        return LaneChoice(lanes.lanes[0], None, reason, lanes.lanes)
    if agreement.passed:
        reason = f"routed {together}: vectors agree ({agreement.describe()})"
        return LaneChoice(lanes.lanes[0], None, reason, lanes.lanes)
    why = f"lanes {together} disagree ({agreement.describe()})"
    order = better_certified(lanes.lanes, lanes.fits)
    if not order:
        return why
    lane = order[0]
    device = "ane" if lane == "ane" else llama_device
    return LaneChoice(lane, device, alone_reason(lane, device, lanes) + f"; not routed: {why}")
