"""The ASGI app: routes, typed error mapping, request metrics, and the module's lifespan.

Every request is authenticated and counted in the request metrics, then routed. The POST API
routes (embeddings, rerank, completions) are dispatched by exact path straight to their
handler, with the authentication and the metrics done inline; everything else (the GET
routes, 404, 405 and the lifespan) goes through two pure ASGI middlewares and Starlette.
Why: at small inputs the HTTP path is a real share of a request's CPU, taken from the engine
workers on the same cores. Starlette's layers around a handler (error middleware, exception
middleware, router, request wrapper) measured 13% of the host's CPU for 16-token embedding
requests at concurrency 32 (py-spy); the two middlewares' coroutine frames and the closure
around every `send` about another 5%.

Startup installs the default models (idempotent), starts the `Module` and the scheduler and
preloads the configured models, so the first request does not pay a worker start. Shutdown
(after uvicorn has drained in-flight requests) stops the batchers, then `Module.close()`
stops and reaps every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import NotFound, SynapseError
from host.errors import ConfigInvalid
from host.module import Module
from service import disconnect, lifecycle, routes
from service.auth import AuthenticationFailed, presented_key
from service.config import ServeConfig
from service.disconnect import ClientClosedRequest
from service.errors import MethodNotAllowed, error_response
from service.scheduler import Scheduler
from service.state import ServerState

log = logging.getLogger("synapse.serve")

Handler = Callable[[Request, ServerState], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def _endpoint(state: ServerState, handler: Handler) -> Endpoint:
    async def run(request: Request) -> Response:
        try:
            return await handler(request, state)
        except asyncio.CancelledError:
            if not disconnect.stop(request):
                raise  # the server's own cancellation (shutdown): not ours to answer
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            state.metrics.observe_error(ClientClosedRequest.code)
            return error_response(ClientClosedRequest("the client closed the connection"))
        except SynapseError as exc:
            state.metrics.observe_error(exc.code)
            return error_response(exc)
        except Exception as exc:  # a bug still answers in the error contract
            log.exception("unhandled error on %s", request.url.path)
            state.metrics.observe_error("internal")
            return error_response(SynapseError(f"internal error: {type(exc).__name__}"))
        finally:
            disconnect.stop(request)  # before the response is sent: finishing it cancels nothing

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        response = error_response(MethodNotAllowed(f"{request.method} is not allowed here"))
        if exc.headers and "Allow" in exc.headers:  # RFC 9110: say what is allowed
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    if exc.status_code == 404:
        return error_response(NotFound(f"no route {request.url.path}"))
    err = SynapseError(str(exc.detail))
    err.http_status = exc.status_code
    return error_response(err)


class _RequestMetrics:
    """Pure ASGI middleware: count and time every HTTP request by endpoint and status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        self.state.metrics.in_flight.inc()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            _answered(self.state, scope["path"], status, start)


def _answered(state: ServerState, path: str, status: int, start: float) -> None:
    """A request's end in the metrics (both paths in: the middleware and `SynapseApp._post`):
    out of the in-flight gauge, counted and timed under a bounded endpoint label."""
    state.metrics.in_flight.dec()
    state.metrics.observe_request(routes.metric_label_of(path), status, time.perf_counter() - start)


class _Authenticate:
    """Pure ASGI middleware: a request to a protected path needs a configured API key.

    Runs before routing, so an unauthenticated client learns nothing about which paths exist.
    Failures are counted by reason only; the presented key goes nowhere.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state
        self.open_paths = _open_paths(state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = _refusal(self.state, scope, self.open_paths) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await refused(scope, receive, send)


def _open_paths(state: ServerState) -> frozenset[str]:
    return routes.open_paths(state.config)


def _refusal(state: ServerState, scope: Scope, open_paths: frozenset[str]) -> Response | None:
    """The 401 for an HTTP request that needs a key and lacks a valid one; else None."""
    keys = state.keys
    if not keys.enabled or scope["path"] in open_paths:
        return None
    key = presented_key(dict(scope["headers"]))
    if key is not None and keys.accepts(key):
        return None
    reason = "missing" if key is None else "invalid"
    state.metrics.observe_auth_failure(reason)
    message = (
        "no API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
        if key is None
        else "the API key is not valid"
    )
    return error_response(AuthenticationFailed(message))


def _install_key_reload(state: ServerState) -> Callable[[], object]:
    """SIGHUP re-reads the key file; returns the undo. Silently absent where the loop cannot
    take signals (not the main thread, e.g. when another server hosts this app)."""

    def reload() -> None:
        ok = state.keys.reload()
        word = f"reloaded ({len(state.keys)} keys)" if ok else "NOT reloaded (see the log)"
        print(f"synapse serve: API keys {word}", flush=True)

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGHUP)


def _check_aliases(config: ServeConfig, module: Module) -> None:
    """Every alias names an installed model, and none hides one: a model's own name always
    means that model (else /v1/models would list it twice and route it elsewhere)."""
    installed = {r.name for r in module.store.ls()}
    for alias, target in config.aliases.items():
        if alias in installed:
            raise ConfigInvalid(
                f"alias {alias!r} is the name of an installed model; choose another name"
            )
        try:
            module.store.get(target)
        except Exception:  # any failure means the alias cannot serve
            raise ConfigInvalid(
                f"alias {alias!r} names {target!r}, which is not an installed model"
            ) from None


class SynapseApp:
    """What uvicorn (or Ray Serve) runs; `state` is the server's shared `ServerState`."""

    def __init__(self, state: ServerState, starlette: Starlette, posts: dict[str, Endpoint]):
        self.state = state
        self.starlette = starlette
        self._posts = posts
        self._open_paths = _open_paths(state)
        # Authentication inside the metrics: 401s are counted too.
        self._stack = _RequestMetrics(_Authenticate(starlette, state), state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._posts.get(scope["path"])
            if endpoint is not None:
                await self._post(endpoint, scope, receive, send)
                return
        await self._stack(scope, receive, send)

    async def _post(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        """A POST API route: what the middleware stack does (authentication inside the request
        metrics), inline."""
        start = time.perf_counter()
        status = 500
        self.state.metrics.in_flight.inc()
        try:
            response = _refusal(self.state, scope, self._open_paths)
            if response is None:  # never raises: `_endpoint` answers every error typed
                response = await endpoint(Request(scope, receive))
            status = response.status_code
            # What `Response.__call__` sends; these responses never carry a background task.
            await send(
                {"type": "http.response.start", "status": status, "headers": response.raw_headers}
            )
            await send({"type": "http.response.body", "body": response.body})
        finally:
            _answered(self.state, scope["path"], status, start)


def create_app(
    config: ServeConfig,
    on_ready: Callable[[ServerState], None] | None = None,
    on_stopped: Callable[[ServerState], None] | None = None,
) -> SynapseApp:
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if config.install_defaults:
            from ingest.defaults import ensure_defaults

            ensure_defaults(config.module.store_root)
        # Certified Core ML lanes, else llama.cpp: the lane choice every entry point makes.
        # Imported here: importing the app loads no certification code until it starts.
        from certification.modules import build_module

        module = build_module(config.module, config.residency)
        state.module = module
        state.scheduler = Scheduler(module, config.scheduler, state.metrics.observe_batch)
        # Embedding requests queued for a model keep it busy: no keep-alive or budget unload.
        depth = state.scheduler.queue_depth
        module.residency.busy_probes.append(lambda name: depth().get(name, 0))
        undo_reload = _install_key_reload(state)
        try:
            try:
                _check_aliases(config, module)
                lifecycle.check_models(state)
            except ConfigInvalid as exc:
                print(f"synapse serve: error[{exc.code}]: {exc.message}", file=sys.stderr)
                raise
            for name in config.preloaded:
                try:
                    await module.load(name)
                except SynapseError as exc:
                    print(
                        f"synapse serve: cannot preload {name!r}: error[{exc.code}]: {exc.message}",
                        file=sys.stderr,
                        flush=True,
                    )
                    raise
            # Everything alive now lives as long as the server: keep it out of the collector's
            # scans. A full collection over it took ~200 ms on the request path (measured
            # with gc.callbacks, one every few thousand requests); young garbage is still
            # collected as before.
            gc.collect()
            gc.freeze()
            if on_ready is not None:
                on_ready(state)
            yield
        finally:
            undo_reload()
            state.draining = True
            await state.scheduler.close()
            await module.close()
            if on_stopped is not None:
                on_stopped(state)

    direct = {r.path: _endpoint(state, r.handler) for r in routes.ROUTES if r.direct}
    # Starlette keeps the direct routes too: a GET to one of them is its 405, with Allow.
    table = [
        Route(r.path, direct[r.path], methods=["POST"])
        if r.direct
        else Route(r.path, _endpoint(state, r.handler), methods=[r.method.upper()])
        for r in routes.ROUTES
    ]
    starlette = Starlette(
        routes=table,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    return SynapseApp(state, starlette, direct)
