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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ingest.store import ModelRecord


@dataclass(frozen=True)
class AneCandidate:
    """A certified Core ML certificate fit for this machine, and how to load what it covers."""

    certificate_id: str
    certified_at: str  # ISO timestamp of the certificate
    runtime_config_extra: dict = field(default_factory=dict)  # e.g. the certified shapes


@dataclass(frozen=True)
class LaneChoice:
    lane: str  # "ane" | "llama"
    device: str | None  # "ane", "cpu", "metal", ...; None until a worker said so
    reason: str  # "ane: certified 2026-11-30 (certificate 3fa9...)", "llama/cpu: no ANE ..."

    def to_dict(self) -> dict:
        return {"lane": self.lane, "device": self.device, "reason": self.reason}


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


class NoLanePolicy:
    """No certificates consulted: llama.cpp serves everything; strict mode cannot pass."""

    def ane_candidate(self, model: str) -> AneCandidate | str:
        return "no certificate policy configured"

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
