"""`GET /health`, `GET /v1/models`, `GET /metrics`: answered from cached state only.

Health never touches a worker (the lanes' background PINGs keep the cache fresh): 200 when
every lane is ready or busy, 503 with the per-lane details otherwise, while draining, or while
a lane is quarantined (then with Retry-After).
"""

from __future__ import annotations

import math

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from host.artifacts.precision import lane_precisions
from host.errors import ModelNotFound
from host.serve.state import ServerState

_OK = ("ready", "busy")


def _json(payload: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(
        msgspec.json.encode(payload), status, headers=headers, media_type="application/json"
    )


async def health(request: Request, state: ServerState) -> Response:
    lanes = {}
    module = state.module
    for model, s in (module.health() if module is not None else {}).items():
        lanes[model] = {
            "lane_id": s.lane_id,
            "status": s.health.status,
            "pid": s.pid,
            "strikes": s.strikes,
            "quarantined": s.quarantined,
            "retry_after_s": s.retry_after_s,
            "restarts": s.restarts,
            "checked_age_s": s.health.checked_age_s,
        }
    if state.draining or module is None:
        status = "draining" if state.draining else "starting"
    elif all(v["status"] in _OK for v in lanes.values()):
        status = "ok"
    else:
        status = "degraded"
    headers = None
    waits = [v["retry_after_s"] for v in lanes.values() if v["quarantined"] and v["retry_after_s"]]
    if waits:
        headers = {"Retry-After": str(max(1, math.ceil(max(waits))))}
    code = 200 if status == "ok" else 503
    return _json({"status": status, "lanes": lanes}, code, headers)


def _model_entry(record, loaded: set[str]) -> dict:
    man = record.manifest
    return {
        "id": record.name,
        "object": "model",
        "created": 0,
        "owned_by": "synapse",
        "kind": man.kind,
        "dims": man.dims if man.kind != "generate" else None,
        "max_tokens": man.max_tokens,
        "precision": lane_precisions(man.kind, man.dtype),  # what each lane computes with
        "loaded": record.name in loaded,
    }


async def list_models(request: Request, state: ServerState) -> Response:
    assert state.module is not None
    loaded = set(state.module.models())
    data = [_model_entry(r, loaded) for r in state.module.store.ls()]
    return _json({"object": "list", "data": data})


async def get_model(request: Request, state: ServerState) -> Response:
    assert state.module is not None
    name = request.path_params["model"]
    for record in state.module.store.ls():
        if record.name == name:
            return _json(_model_entry(record, set(state.module.models())))
    raise ModelNotFound(f"model {name!r} does not exist", param="model")


async def metrics(request: Request, state: ServerState) -> Response:
    return Response(state.metrics.render(), media_type=state.metrics.content_type)
