"""`GET /health`, `GET /v1/models`, `GET /metrics`: answered from cached state only.

Health never touches a worker (the lanes' background PINGs keep the cache fresh): 200 when
every lane is ready or busy, 503 with the per-lane details otherwise, while draining, or while
a lane is quarantined (then with Retry-After).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from common.errors import ModelNotFound
from ingest.precision import lane_precisions
from service.state import ServerState

_OK = ("ready", "busy")


def _json(payload: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(
        msgspec.json.encode(payload), status, headers=headers, media_type="application/json"
    )


async def health(request: Request, state: ServerState) -> Response:
    lanes: dict[str, dict[str, Any]] = {}
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
    # Which lane serves each model (chosen when first used) and why.
    models = {name: c.to_dict() for name, c in (module.chosen_lanes() if module else {}).items()}
    return _json({"status": status, "lanes": lanes, "models": models}, code, headers)


def _model_entry(record, loaded: set[str], module) -> dict:
    man = record.manifest
    choice = module.default_lane(record.name)  # the lane that serves (or would) and why
    return {
        "id": record.name,
        "object": "model",
        "created": 0,
        "owned_by": "synapse",
        "kind": man.kind,
        "dims": man.dims if man.kind != "generate" else None,
        "max_tokens": man.max_tokens,
        # What the model does with a text: the hard limit a request may raise the cut to,
        # its pooling, the prompts `prompt_name` / Cohere's `input_type` choose from, the
        # default prompt, and the widths `dimensions` may cut to.
        "max_tokens_limit": man.max_tokens_limit,
        "pooling": man.pooling,
        "prompts": dict(man.prompts or {}),
        "default_prompt_name": man.default_prompt_name,
        "matryoshka_dims": list(man.matryoshka_dims or []),
        "precision": lane_precisions(man.kind, man.dtype),  # what each lane computes with
        # Where its files came from: a Hub repository at a commit, an Ollama model... (None:
        # a local directory or file), with the sha256 of each file read.
        "provenance": msgspec.to_builtins(man.provenance),
        "loaded": record.name in loaded,
        "lane": choice.lane,
        "lane_reason": choice.reason,
        # Lanes loaded, workers' RSS, size estimate, in-flight calls, last use, keep-alive.
        **module.residency.describe(record.name, choice.lane, record),
    }


def _alias_entry(alias: str, target: dict) -> dict:
    """An alias is listed like the model it names, plus `alias_for`."""
    return {**target, "id": alias, "alias_for": target["id"]}


def _all_entries(state: ServerState) -> list[dict]:
    assert state.module is not None
    loaded = {served.model for served in state.module.served_lanes()}
    entries = [_model_entry(r, loaded, state.module) for r in state.module.store.ls()]
    by_name = {e["id"]: e for e in entries}
    for alias, target in sorted(state.config.aliases.items()):
        if target in by_name:  # start-up refuses aliases to models that are not installed
            entries.append(_alias_entry(alias, by_name[target]))
    return entries


async def list_models(request: Request, state: ServerState) -> Response:
    assert state.module is not None
    memory = state.module.residency.summary()
    return _json({"object": "list", "data": _all_entries(state), "memory": memory})


async def get_model(request: Request, state: ServerState) -> Response:
    name = request.path_params["model"]
    for entry in _all_entries(state):
        if entry["id"] == name:
            return _json(entry)
    raise ModelNotFound(
        f"model {name!r} does not exist; available: {', '.join(state.available_names())}",
        param="model",
    )


async def metrics(request: Request, state: ServerState) -> Response:
    return Response(state.metrics.render(), media_type=state.metrics.content_type)
