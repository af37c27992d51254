"""`POST /v1/models/{model}/load` and `POST /v1/models/{model}/unload`: an operator's say over
which models are resident (the keep-alive and the memory budget are host/residency.py).

Both take the model's name or an alias, answer with its `/v1/models/{model}` entry as it is
afterwards, and are idempotent: loading a loaded model or unloading one that is not loaded
is a 200 that changes nothing. An unknown model is a 404, a model that does not fit the
memory budget a 503 `insufficient_memory` that says why. Unload drains first: requests
already inside the model (or queued for it) finish, new ones wait and then load it again,
so an unload never fails a request.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from host.errors import ConfigInvalid
from service import status
from service.state import ServerState


def _model(request: Request, state: ServerState) -> str:
    name = request.path_params["model"]
    return state.resolve(name, name)  # alias -> model; unknown -> 404


async def load_model(request: Request, state: ServerState) -> Response:
    model = _model(request, state)
    module = state.module
    assert module is not None
    # Waits while the model is being unloaded; keeps it from being evicted while it loads.
    async with module.residency.hold(model, use=False):
        await module.load(model)
    return await status.get_model(request, state)


async def unload_model(request: Request, state: ServerState) -> Response:
    model = _model(request, state)
    module = state.module
    assert module is not None
    await module.residency.unload(model, "request")
    return await status.get_model(request, state)


def check_models(state: ServerState) -> None:
    """Every model the residency table names is installed (a typo must not silently leave a
    model on the global keep_alive)."""
    assert state.module is not None
    installed = {r.name for r in state.module.store.ls()}
    for name in state.config.residency.models:
        if name not in installed:
            raise ConfigInvalid(f"residency.models: {name!r} is not an installed model")
