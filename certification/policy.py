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
Module never imports this package (the dependency runs `host <- certification`); it calls
the `host.lane_policy.LanePolicy` it was given, which certification.lane_policy implements
with `check_certificate` in strict mode; the Module applies strict/warn itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection

import msgspec

from certification.certificate import Certificate
from certification.identity import CertificateKey, LaneIdentity, key_for
from certification.store import CertificateStore
from certification.thresholds import thresholds_for
from host.errors import CertificateRequired

log = logging.getLogger("synapse.certification")

MODES = ("strict", "warn", "off")


__all__ = ["CertificateRequired", "check_certificate", "loosened"]


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
    message, why = _missing(store, key, cert)
    if mode == "strict":
        raise CertificateRequired(
            message,
            reason=why,
            model=identity.model,
            lane=identity.lane,
            certificate_id=key.id,
            found_status=cert.status if cert is not None else None,
            key=msgspec.to_builtins(key),
        )
    log.warning("%s (require_certificate=warn: serving anyway)", message)
    return cert


# Gating thresholds and the direction that makes them stricter.
_AT_LEAST = ("min_cosine", "mean_cosine", "retrieval_top10", "placement_share")
_AT_MOST = ("rerank_max_abs", "llm_rerank_rel", "tokenizer_mismatches")


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
        if (
            not math.isfinite(value)
            or (name in _AT_LEAST and value < base)
            or (name in _AT_MOST and value > base)
        ):
            out.append(f"{name} {value:g} vs table {base:g}")
    return out


def _missing(
    store: CertificateStore, key: CertificateKey, found: Certificate | None
) -> tuple[str, str]:
    """(the full message, the short why) for a key without a certificate that applies."""
    head = (
        f"certificate {key.id} required for {key.model} on the {key.lane} lane "
        f"(artifact {key.artifact_digest[:12]}, kernel_revision {key.kernel_revision}, "
        f"shapes {','.join(key.shapes) or '-'}, {key.engine} {key.engine_version}, "
        f"{key.os})"
    )
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
            why = f"certificate {other.id} was issued for a different identity: " + "; ".join(
                key.differences(other.key)
            )
        else:
            why = "this model was never certified on this lane"
    shapes = f" --shapes {','.join(key.shapes)}" if key.lane == "ane" and key.shapes else ""
    hint = f"run `synapse certify --model {key.model} --lane {key.lane}{shapes}`"
    return f"{head}: {why}; {hint}", why
