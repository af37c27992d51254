"""Host policy: may this lane serve without a certificate for its exact identity?

    check_certificate(store, identity, mode) -> Certificate | None

`mode` (the lane option `require_certificate`):
- "strict": a `certified` certificate whose key matches the lane's identity exactly must
  exist, else `CertificateRequired` (code `certificate_required`, HTTP 503) naming the
  missing certificate and why (never certified / certified for another kernel revision,
  artifact, shape... / only provisional or failed). A `provisional` one is not enough:
  placement from an estimate proves nothing about where Core ML runs the graph.
  Nor is one whose run LOOSENED a gating threshold (`--threshold min_cosine=0.9`).
- "warn": the same check, logged as a warning; the lane serves.
- "off": no check.

Hook in the host (`Module.load`, for the lanes in `ModuleConfig.certificate_lanes`): the
module imports this file LATE, inside the function, because the dependency direction is
`host <- certification` (certification imports host at import time; the reverse would be a
cycle). `enforce` is that entry point.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec

from certification.certificate import Certificate
from certification.identity import CertificateKey, LaneIdentity, key_for
from certification.store import CertificateStore
from certification.thresholds import thresholds_for
from host.errors import SynapseError

if TYPE_CHECKING:
    from host.module import Module

log = logging.getLogger("synapse.certification")

MODES = ("strict", "warn", "off")


class CertificateRequired(SynapseError):
    """Strict mode: the lane has no certified certificate for its exact identity."""

    code = "certificate_required"
    http_status = 503


def check_certificate(
    store: CertificateStore,
    identity: LaneIdentity,
    mode: str,
    accept: Collection[str] = ("certified",),
) -> Certificate | None:
    if mode not in MODES:
        raise ValueError(f"require_certificate {mode!r}: expected one of {MODES}")
    if mode == "off":
        return None
    key = key_for(identity)
    cert = store.get(key.id)
    if cert is not None and cert.status in accept and not loosened(cert):
        return cert
    message = _missing(store, key, cert)
    if mode == "strict":
        raise CertificateRequired(
            message,
            model=identity.model,
            lane=identity.lane,
            certificate_id=key.id,
            found_status=cert.status if cert is not None else None,
            key=msgspec.to_builtins(key),
        )
    log.warning("%s (require_certificate=warn: serving anyway)", message)
    return cert


def enforce(
    module: Module, name: str, lane: str, runtime_config_extra: dict | None = None
) -> Certificate | None:
    """The Module's hook: the identity of the lane just loaded, against the certificates in
    `<cache dir>/certificates` beside the module's artifact store."""
    from certification.lane_client import lane_identity

    extra = runtime_config_extra or {}
    identity = lane_identity(module, name, lane, extra.get("shapes"), extra.get("build_options"))
    store = CertificateStore(module.store.root.parent / "certificates")
    return check_certificate(store, identity, module.config.require_certificate)


# Gating thresholds and the direction that makes them stricter.
_AT_LEAST = ("min_cosine", "mean_cosine", "retrieval_top10", "placement_share")
_AT_MOST = ("rerank_max_abs", "tokenizer_mismatches")


def loosened(cert: Certificate) -> list[str]:
    """Overrides that made a gate easier than the table: such a run proves nothing the table
    asks for, so it cannot satisfy the policy (stricter overrides are fine)."""
    try:
        table = thresholds_for(cert.key.lane, cert.key.precision)
    except ValueError:
        return ["no table row for this lane/precision"]
    out = []
    for name, value in cert.overrides.items():
        base = getattr(table, name, None)
        if base is None:
            continue
        if (name in _AT_LEAST and value < base) or (name in _AT_MOST and value > base):
            out.append(f"{name} {value:g} vs table {base:g}")
    return out


def _missing(store: CertificateStore, key: CertificateKey, found: Certificate | None) -> str:
    head = (f"certificate {key.id} required for {key.model} on the {key.lane} lane "
            f"(artifact {key.artifact_digest[:12]}, kernel_revision {key.kernel_revision}, "
            f"shapes {','.join(key.shapes) or '-'}, {key.engine} {key.engine_version}, "
            f"{key.os})")
    if found is not None:
        why = f"certificate {found.id} is {found.status}"
        if loosened(found):
            why += " but with loosened thresholds (" + "; ".join(loosened(found)) + ")"
        elif found.failing:
            why += f" (failing: {', '.join(found.failing)})"
        elif found.status == "provisional":
            detail = next((c.detail for c in found.checks if c.name == "placement.share"), "")
            why += f" (placement {detail})" if detail else " (placement not proven)"
    else:
        other = store.latest_for(key.model, key.lane)
        if other is not None:
            why = (f"certificate {other.id} was issued for a different identity: "
                   + "; ".join(key.differences(other.key)))
        else:
            why = "this model was never certified on this lane"
    shapes = f" --shapes {','.join(key.shapes)}" if key.lane == "ane" and key.shapes else ""
    hint = f"run `synapse certify --model {key.model} --lane {key.lane}{shapes}`"
    return f"{head}: {why}; {hint}"
