"""Which lane serves a model when the caller names none, and may a loaded lane serve.

The Module does not read certificates itself: it asks a `LanePolicy` it is given. The
certification package implements it (`certification.lane_policy.CertificateLanePolicy`) and
builds every entry point's Module with it (`certification.modules.build_module`), so host
never imports certification (the dependency runs host <- certification). Without a policy
the Module serves every model on llama.cpp and says so.

A policy is given what it reads explicitly: where its certificates are when it is built, and
at each check the `LoadedLanes` view of the Module (a loaded lane's identity, a model's
manifest). This module imports nothing of host.module, so neither imports the other.

Choice rule, per model on this machine: a Core ML lane whose
certificate is `certified` for this machine and whose exact identity still matches once
loaded; otherwise the llama.cpp lane, on the GPU where the build offloads, else the CPU.

Two lanes at once: a model whose lanes are all certified here (`lanes = "auto"`, the
default) or listed in the serve config (`lanes = ["ane", "llama"]`) is served by both, each
request routed to the lane expected to finish it first (host.lane_router), but only when the
lanes' vectors agree (`Agreement`, min cosine >= `AGREEMENT_MIN_COS` on the certification
corpus; rerank: the same order): else one index would mix two models. The agreement comes
from a certificate that recorded it for exactly these two lanes, else it is measured once
the lanes are loaded (`LanePolicy.measure`). When they disagree, or one cannot load, the
better certified lane serves alone (host.lane_router.better_certified).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from host.lane_router import LatencyCurve, ReferenceFit

if TYPE_CHECKING:
    from ingest.store import ModelRecord

# Two lanes serve one model only when their vectors are this close on every corpus item:
# a cosine of 0.9998 is an angle of about 1.1 degrees, below what retrieval rankings notice,
# so an index may hold vectors of either lane.
AGREEMENT_MIN_COS = 0.9998


class Agreement(msgspec.Struct, frozen=True, kw_only=True):
    """How closely two lanes of one model agree on the certification corpus."""

    lanes: list[str]  # the lanes compared, e.g. ["ane", "llama"]
    n_items: int  # corpus items (embed) or documents (rerank) compared
    min_cosine: float | None = None  # embedding models: the least cosine between the lanes
    same_order: bool | None = None  # rerank models: every query's documents in one order
    threshold: float = AGREEMENT_MIN_COS
    # The certificate ids of the lanes compared ("" for a lane run without one).
    certificates: list[str] = []
    source: str = "certification"  # "certification" | "load" (measured as the lanes loaded)

    @property
    def passed(self) -> bool:
        if self.same_order is not None:
            return self.same_order
        return self.min_cosine is not None and self.min_cosine >= self.threshold

    def describe(self) -> str:
        if self.same_order is not None:
            what = "same order" if self.same_order else "different orders"
        else:
            op = ">=" if self.passed else "<"
            value = "n/a" if self.min_cosine is None else f"{self.min_cosine:.6f}"
            what = f"min cos {value} {op} {self.threshold:g}"
        where = "measured at load" if self.source == "load" else "certified"
        return f"{what} on {self.n_items} items, {where}"


@dataclass(frozen=True)
class LaneSet:
    """The lanes a policy would serve a model with together, and what it knows of them."""

    lanes: tuple[str, ...]  # preference order: ties in routing go to the first
    # Per lane: LOAD extras (a certified Core ML lane's shapes and settings), its certificate
    # id ("" without one) and its latency curve (None: measure at load).
    runtime_config_extra: dict[str, dict] = field(default_factory=dict)
    certificates: dict[str, str] = field(default_factory=dict)
    curves: dict[str, LatencyCurve | None] = field(default_factory=dict)
    agreement: Agreement | None = None  # recorded for exactly these lanes, else None
    # Per lane certified here: how close its certificate found it to the reference (what
    # picks the one lane that serves when the lanes cannot serve together).
    fits: dict[str, ReferenceFit] = field(default_factory=dict)


@dataclass(frozen=True)
class AneCandidate:
    """A certified Core ML certificate fit for this machine, and how to load what it covers."""

    certificate_id: str
    certified_at: str  # ISO timestamp of the certificate
    runtime_config_extra: dict = field(default_factory=dict)  # e.g. the certified shapes


@dataclass(frozen=True)
class LaneChoice:
    lane: str  # "ane" | "llama": the one lane, or the first of a routed pair
    device: str | None  # "ane", "cpu", "metal", ...; None until a worker said so
    reason: str  # "ane: certified 2026-11-30 (certificate 3fa9...)", "llama/cpu: no ANE ..."
    lanes: tuple[str, ...] = ()  # two or more: every request is routed among these

    def to_dict(self) -> dict:
        out: dict[str, object] = {"lane": self.lane, "device": self.device, "reason": self.reason}
        if self.lanes:
            out["lanes"] = list(self.lanes)
        return out


class LoadedLanes(Protocol):
    """What a policy may read of the Module that asks it (host.module.Module is one)."""

    def lane_identity(self, model: str, lane: str | None = None) -> dict:
        """The loaded lane's identity: artifact, manifest, kernel, engine, device, OS."""
        ...

    def record(self, name: str) -> ModelRecord:
        """The manifest `name` is served with."""
        ...


class LanePolicy(Protocol):
    def ane_candidate(self, model: str) -> AneCandidate | str:
        """A certified Core ML certificate of `model` for this machine, or why there is none
        (one short phrase: "no ANE certificate", "ANE certificate 3fa9 is provisional ...")."""
        ...

    def require(self, lanes: LoadedLanes, model: str, lane: str, runtime_config_extra: dict | None):
        """The loaded lane's exact identity against the certificates: returns the covering
        certificate, or raises `host.errors.CertificateRequired` saying what is missing."""
        ...

    def lane_set(self, model: str, lanes: list[str] | None) -> LaneSet | str:
        """The lanes to serve `model` with together: `lanes` as the serve config lists them,
        or (None) every lane certified for this machine; or why not two (one short phrase)."""
        ...

    async def measure(
        self, loaded: Any, model: str, lanes: LaneSet
    ) -> tuple[Agreement, dict[str, LatencyCurve]]:
        """The loaded lanes' agreement on the certification corpus (when `lanes` records
        none) and each lane's latency curve (when it has none). `loaded` is the Module
        (host.module.Module), which embeds and reranks on a named lane."""
        ...


class NoLanePolicy:
    """No certificates consulted: llama.cpp serves everything; strict mode cannot pass."""

    def ane_candidate(self, model: str) -> AneCandidate | str:
        return "no certificate policy configured"

    def lane_set(self, model: str, lanes: list[str] | None) -> LaneSet | str:
        return "no certificate policy configured"

    async def measure(
        self, loaded: Any, model: str, lanes: LaneSet
    ) -> tuple[Agreement, dict[str, LatencyCurve]]:
        raise NotImplementedError("no certificate policy: no corpus to measure with")

    def require(self, lanes: LoadedLanes, model: str, lane: str, runtime_config_extra: dict | None):
        from host.errors import CertificateRequired

        raise CertificateRequired(
            f"{model} on the {lane} lane: require_certificate is set but this Module was given "
            "no lane policy to check certificates with (build it with "
            "certification.modules.build_module)",
            model=model,
            lane=lane,
        )


def llama_reason(device: str | None, why: str) -> str:
    return f"llama/{device or 'unknown device'}: {why}"


def ane_reason(candidate: AneCandidate) -> str:
    return f"ane: certified {candidate.certified_at[:10]} (certificate {candidate.certificate_id})"
