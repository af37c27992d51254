"""What the output file says about how it was made: model, lane, artifact, certificate."""

from __future__ import annotations

import logging

from batch.embedder import LaneEmbedder

log = logging.getLogger("synapse.batch")


def describe(emb: LaneEmbedder, normalize: bool) -> dict[str, str]:
    identity = emb.identity()
    return {
        "model": emb.model,
        "lane": emb.lane,
        "artifact_digest": identity.get("artifact_digest") or "",
        "certificate": certificate_for(emb, identity),
        "normalize": "true" if normalize else "false",
        "dims": str(emb.dims),
        "prompt": emb.prompt,  # "" when none: the rows' text was embedded as it is
    }


def certificate_for(emb: LaneEmbedder, identity: dict) -> str:
    """`ID (status)` of the certificate issued for this lane's exact identity, or ""."""
    try:
        from certification.identity import key_for
        from certification.lane_client import lane_identity
        from certification.modules import certificate_store

        lane_id = lane_identity(emb.module, emb.model, emb.lane)
        # The store the Module's lane policy reads: the one `build_module` gave it.
        cert = certificate_store(emb.module.config).get(key_for(lane_id).id)
    except Exception as exc:  # provenance is best effort, never fatal
        log.info("no certificate lookup: %s", exc)
        return ""
    return f"{cert.id} ({cert.status})" if cert is not None else ""
