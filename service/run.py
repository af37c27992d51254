"""Run the app under uvicorn on a socket we bind ourselves.

Binding here (not in uvicorn) lets `--port 0` pick a free port and lets us print the real
address once the models are loaded — the line `synapse serve: listening on http://H:P` is the
readiness signal scripts and tests wait for. SIGTERM/SIGINT: uvicorn stops accepting and
drains in-flight requests (up to `graceful_timeout_s`); we mark the server draining so
`/health` turns 503 at once; then the lifespan stops the workers and reaps them and prints
`synapse serve: stopped; workers reaped`. Uvicorn then re-raises the signal, so the exit
status says "terminated by SIGTERM" as a supervisor expects.
"""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn

from common.errors import SynapseError
from host.eventloop import http_name, loop_name
from host.malloc_arenas import limit_malloc_arenas
from service.app import create_app
from service.auth import exposure_warning
from service.config import ServeConfig
from service.state import ServerState

log = logging.getLogger("synapse.serve")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state_ref: list[ServerState]) -> None:
        super().__init__(config)
        self._state_ref = state_ref

    def handle_exit(self, sig: int, frame) -> None:
        for state in self._state_ref:
            state.draining = True
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only when it does, and
    # without it Nagle + delayed ACK add ~40 ms to every small response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: ServeConfig, log_level: str = "warning") -> int:
    limit_malloc_arenas()  # before any thread starts: a server's RSS must not creep
    states: list[ServerState] = []

    def ready(state: ServerState) -> None:
        states.append(state)
        print(f"synapse serve: listening on {url}", flush=True)

    def stopped(state: ServerState) -> None:
        print("synapse serve: stopped; workers reaped", flush=True)

    try:
        app = create_app(config, on_ready=ready, on_stopped=stopped)
    except SynapseError as exc:  # e.g. an unreadable API key file: never start open
        print(f"error[{exc.code}]: {exc.message}", file=sys.stderr)
        return 2
    warning = exposure_warning(config.host, app.state.keys)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    loop, http = loop_name(), http_name()
    print(f"synapse serve: event loop {loop}, http {http}", flush=True)
    try:
        sock = bind(config.host, config.port)
    except OSError as exc:  # in use, not ours to bind, no such address: one line, not a trace
        reason = exc.strerror or str(exc)
        print(
            f"synapse serve: cannot listen on {config.host}:{config.port}: {reason}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    uv_config = uvicorn.Config(
        app,
        loop=loop,
        http=http,
        log_level=log_level,
        access_log=False,
        # Nothing here reads the client's address or scheme, so X-Forwarded-* rewriting
        # would only add a layer to every request.
        proxy_headers=False,
        lifespan="on",
        # uvicorn annotates int but waits with it as an asyncio timeout, where a float works.
        timeout_graceful_shutdown=config.graceful_timeout_s,  # type: ignore[arg-type]
        timeout_keep_alive=30,
    )
    server = _Server(uv_config, states)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        print("synapse serve: failed to start (see the log above)", file=sys.stderr)
        return 3
    return 0
