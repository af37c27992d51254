"""The certificate-backed `host.lane_policy.LanePolicy`: which lane serves a model by default,
and whether a loaded lane's exact identity is certified.

Default choice: a Core ML lane is chosen only for a certificate that is `certified` (both
gates, no loosened threshold, no test-only graph degradation) AND was issued on a machine
like this one — the machine fields of its key (OS and architecture, macOS version on a Mac,
the host tokenizer library) equal this machine's. That is checked before any worker starts;
the rest of the identity (artifact, kernel revision, engine, shapes) needs the lane's HELLO,
so the Module loads the lane with the certificate's shapes and confirms with `require`.

Two lanes (`lane_set`): with `lanes = "auto"` every lane certified for this machine (both
the Core ML and the llama.cpp lane, or no pair); with an explicit list, those lanes, certified
or not. Their agreement is the one a certificate recorded for exactly these two certificates,
else it is measured once they are loaded (`measure`, on the certification corpus), and so is
the latency curve of a lane whose certificate has none. Each lane certified here also carries
how close its certificate found it to the reference (`reference_fit`): when the lanes cannot
serve together, the closer one serves alone (host.lane_router.better_certified).

The policy reads the certificate store it is built with; `certification.modules` builds it
with the store beside the Module's artifact store (`<cache dir>/certificates`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from certification.agreement import measure_agreement, measure_curve
from certification.certificate import Certificate
from certification.identity import CertificateKey, os_name, runtime_versions
from certification.lane_client import lane_identity
from certification.policy import check_certificate, loosened
from certification.shapes import parse_shapes
from certification.store import CertificateStore
from host.lane_policy import Agreement, AneCandidate, LaneSet
from host.lane_router import LatencyCurve, ReferenceFit

if TYPE_CHECKING:
    from host.lane_policy import LoadedLanes
    from host.module import Module


def machine_fields() -> dict[str, object]:
    """The key fields that describe the machine rather than the lane. (The Core ML side adds
    chip and macOS build to the key; they belong here too.)"""
    return {"os": os_name(), "runtime": runtime_versions()}


def machine_differences(key: CertificateKey) -> list[str]:
    here = machine_fields()
    return [
        f"{name}: {getattr(key, name)} here {value}"
        for name, value in here.items()
        if getattr(key, name) != value
    ]


class CertificateLanePolicy:
    def __init__(self, certificates: CertificateStore, agreement_stride: int = 1) -> None:
        self.certificates = certificates
        # Every k-th corpus item when agreement is measured at load (1: the whole corpus;
        # more only in tests and smoke runs).
        self.agreement_stride = agreement_stride

    def ane_candidate(self, model: str) -> AneCandidate | str:
        certs = [c for c in self.certificates.ls() if c.key.model == model and c.key.lane == "ane"]
        if not certs:
            return "no ANE certificate"
        usable = [c for c in certs if _certified(c)]
        for cert in usable:  # newest first
            if not machine_differences(cert.key):
                return AneCandidate(cert.id, cert.created_at, certified_load_extra(cert))
        if usable:
            diffs = "; ".join(machine_differences(usable[0].key))
            return f"ANE certificate {usable[0].id} was issued on another machine ({diffs})"
        return f"ANE certificate {certs[0].id} is {_why_not(certs[0])}"

    def certified_here(self, model: str, lane: str) -> Certificate | None:
        """The newest `certified` certificate of `model`'s `lane` issued on a machine like
        this one, or None."""
        for cert in self.certificates.ls():  # newest first
            if cert.key.model == model and cert.key.lane == lane and _certified(cert):
                if not machine_differences(cert.key):
                    return cert
        return None

    def lane_set(self, model: str, lanes: list[str] | None) -> LaneSet | str:
        if lanes is None:
            found = [lane for lane in ("ane", "llama") if self.certified_here(model, lane)]
            if len(found) < 2:
                return f"certified lanes here: {', '.join(found) or 'none'}"
            lanes = found
        if len(lanes) < 2:
            return f"one lane configured ({lanes[0]})"
        certs = {lane: self.certified_here(model, lane) for lane in lanes}
        extra: dict[str, dict] = {}
        for lane, cert in certs.items():
            if lane == "ane" and cert is not None:
                extra[lane] = certified_load_extra(cert)
        ids = {lane: cert.id if cert else "" for lane, cert in certs.items()}
        curves = {
            lane: cert.measurements.latency_curve if cert else None for lane, cert in certs.items()
        }
        fits = {lane: fit for lane, cert in certs.items() if cert and (fit := reference_fit(cert))}
        return LaneSet(tuple(lanes), extra, ids, curves, _recorded_agreement(certs), fits)

    async def measure(
        self, loaded: Module, model: str, lanes: LaneSet
    ) -> tuple[Agreement, dict[str, LatencyCurve]]:
        agreement = lanes.agreement or await measure_agreement(
            loaded,
            model,
            lanes.lanes,
            self.agreement_stride,
            [lanes.certificates.get(lane, "") for lane in lanes.lanes],
            source="load",
        )
        curves = {}
        for lane in lanes.lanes:
            if lanes.curves.get(lane) is None:
                curves[lane] = await measure_curve(loaded, model, lane)
        return agreement, curves

    def require(
        self, lanes: LoadedLanes, model: str, lane: str, runtime_config_extra: dict | None
    ) -> Certificate | None:
        extra = runtime_config_extra or {}
        identity = lane_identity(
            lanes, model, lane, extra.get("shapes"), extra.get("build_options"), extra
        )
        return check_certificate(self.certificates, identity, "strict")


def certified_load_extra(cert: Certificate) -> dict:
    """LOAD extras that load a Core ML lane as it was certified: its shapes and settings."""
    shapes = parse_shapes(",".join(cert.key.shapes))
    extra = json.loads(cert.key.settings) if cert.key.settings else {}
    if shapes:
        extra["shapes"] = shapes
    return extra


# The check whose value says how far a certified lane is from the reference, per model kind,
# and how it becomes an error (lower: closer): the worst item, the same corpus on every lane.
_FIT_CHECKS = {
    "quality.min_cosine": ("1 - min cos", lambda v: 1.0 - v),
    "quality.rerank_max_abs_error": ("max score error", lambda v: v),
    "quality.label_score_max_abs_error": ("max label score error", lambda v: v),
}


def reference_fit(cert: Certificate) -> ReferenceFit | None:
    """How close `cert`'s lane came to the reference: its first measured worst-item check
    (embedders: min cosine; rerankers: max score error; classifiers: max label score error),
    or None when it has none."""
    for check in cert.checks:
        fit = _FIT_CHECKS.get(check.name)
        if fit is not None and check.status == "pass" and check.value is not None:
            measure, error = fit
            return ReferenceFit(
                certificate=cert.id, error=float(error(float(check.value))), measure=measure
            )
    return None


def _recorded_agreement(certs: dict[str, Certificate | None]) -> Agreement | None:
    """An agreement a certificate of these lanes recorded for exactly these certificates."""
    if any(cert is None for cert in certs.values()):
        return None
    ids = {cert.id for cert in certs.values() if cert is not None}
    for cert in certs.values():
        agreement = cert.agreement if cert is not None else None
        if agreement is not None and set(agreement.certificates) == ids:
            return agreement
    return None


def _certified(cert: Certificate) -> bool:
    return cert.status == "certified" and not loosened(cert) and not cert.key.build_options


def _why_not(cert: Certificate) -> str:
    if cert.status == "provisional":
        return "provisional (placement from an estimate, not Core ML's compute plan)"
    if cert.status == "failed":
        return f"failed ({', '.join(cert.failing)})"
    if loosened(cert):
        return "certified with loosened thresholds"
    return "certified for a degraded test graph (build_options)"
