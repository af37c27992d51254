"""What the output file says about how it was made: model, lane, artifact, certificate.

A job that ran on two lanes (a model served by both, or `--lane ane,llama`) lists each:
`lane` "ane,llama", and its artifacts and certificates comma-separated in the same order."""

from __future__ import annotations

import logging

from batch.embedder import LaneEmbedder

log = logging.getLogger("synapse.batch")


def describe(embedders: list[LaneEmbedder], normalize: bool) -> dict[str, str]:
    by_lane: dict[str, LaneEmbedder] = {}
    for emb in embedders:
        by_lane.setdefault(emb.lane, emb)  # one per lane kind: every Module's is alike
    first = embedders[0]
    identities = {lane: emb.identity() for lane, emb in by_lane.items()}
    certificates = [certificate_for(by_lane[lane], identities[lane]) for lane in by_lane]
    return {
        "model": first.model,
        "lane": ",".join(by_lane),
        "artifact_digest": ",".join(i.get("artifact_digest") or "" for i in identities.values()),
        # One entry per lane ("" for a lane without one), unless no lane has any.
        "certificate": ",".join(certificates) if any(certificates) else "",
        "normalize": "true" if normalize else "false",
        "dims": str(first.dims),
        "prompt": first.prompt,  # "" when none: the rows' text was embedded as it is
    }


def certificate_for(emb: LaneEmbedder, identity: dict) -> str:
    """`ID (status)` of the certificate issued for this lane's exact identity, or ""."""
    try:
        from certification.identity import key_for
        from certification.lane_client import lane_identity
        from certification.modules import certificate_store

        # As the lane was loaded (a certified Core ML lane: its certificate's shapes and
        # settings), or the identity would not be the one its certificate keys.
        extra = emb.module.load_extra(emb.model, emb.lane)
        lane_id = lane_identity(
            emb.module, emb.model, emb.lane, extra.get("shapes"), extra.get("build_options"), extra
        )
        # The store the Module's lane policy reads: the one `build_module` gave it.
        cert = certificate_store(emb.module.config).get(key_for(lane_id).id)
    except Exception as exc:  # provenance is best effort, never fatal
        log.info("no certificate lookup: %s", exc)
        return ""
    return f"{cert.id} ({cert.status})" if cert is not None else ""
