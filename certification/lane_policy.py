"""The certificate-backed `host.lane_policy.LanePolicy`: which lane serves a model by default,
and whether a loaded lane's exact identity is certified.

Default choice: a Core ML lane is chosen only for a certificate that is `certified` (both
gates, no loosened threshold, no test-only graph degradation) AND was issued on a machine
like this one — the machine fields of its key (OS and architecture, macOS version on a Mac,
the host tokenizer library) equal this machine's. That is checked before any worker starts;
the rest of the identity (artifact, kernel revision, engine, shapes) needs the lane's HELLO,
so the Module loads the lane with the certificate's shapes and confirms with `require`.

The policy reads the certificate store it is built with; `certification.modules` builds it
with the store beside the Module's artifact store (`<cache dir>/certificates`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from certification.certificate import Certificate
from certification.identity import CertificateKey, os_name, runtime_versions
from certification.lane_client import lane_identity
from certification.policy import check_certificate, loosened
from certification.shapes import parse_shapes
from certification.store import CertificateStore
from host.lane_policy import AneCandidate

if TYPE_CHECKING:
    from host.lane_policy import LoadedLanes


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
    def __init__(self, certificates: CertificateStore) -> None:
        self.certificates = certificates

    def ane_candidate(self, model: str) -> AneCandidate | str:
        certs = [c for c in self.certificates.ls() if c.key.model == model and c.key.lane == "ane"]
        if not certs:
            return "no ANE certificate"
        usable = [c for c in certs if _certified(c)]
        for cert in usable:  # newest first
            if not machine_differences(cert.key):
                shapes = parse_shapes(",".join(cert.key.shapes))
                # Load it as it was certified: its shapes and its runtime settings.
                extra = json.loads(cert.key.settings) if cert.key.settings else {}
                if shapes:
                    extra["shapes"] = shapes
                return AneCandidate(cert.id, cert.created_at, extra)
        if usable:
            diffs = "; ".join(machine_differences(usable[0].key))
            return f"ANE certificate {usable[0].id} was issued on another machine ({diffs})"
        return f"ANE certificate {certs[0].id} is {_why_not(certs[0])}"

    def require(
        self, lanes: LoadedLanes, model: str, lane: str, runtime_config_extra: dict | None
    ) -> Certificate | None:
        extra = runtime_config_extra or {}
        identity = lane_identity(
            lanes, model, lane, extra.get("shapes"), extra.get("build_options"), extra
        )
        return check_certificate(self.certificates, identity, "strict")


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
