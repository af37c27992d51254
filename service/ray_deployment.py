"""`synapse serve --ray [ADDRESS]`: the same ASGI app as a Ray Serve deployment.

Each replica builds the app with `create_app` (so the routes, error shapes and lifespan are
the ones `synapse serve` runs) and owns one `Module` and its supervised workers: Ray Serve
runs the app's lifespan at replica start (preloads the models) and at replica stop
(`Module.close()` stops and reaps every worker). Ray's HTTP proxy serves the routes. Every
response carries `x-synapse-replica`, so `/health` is read per replica: its body is that
replica's own lanes.

Replica count (`num_replicas` or `autoscaling`), `max_ongoing_requests` and the CPUs a
replica reserves come from the config's `[ray]` table (`service.ray_settings`).
Shutdown (`serve.shutdown()`, or SIGTERM/SIGINT of `synapse serve --ray`) stops every
replica gracefully, which reaps every engine worker; a worker whose replica dies abruptly
exits on its own when its socket closes.

Without an ADDRESS the Ray is our own (`host.local_ray`): bound to loopback, token
authentication on. Ray's HTTP proxy binds the config's `host` (loopback unless the operator
says otherwise).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import msgspec
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.app import create_app
from service.config import ServeConfig, install_defaults

# Ray reports usage statistics to its authors by default; ours never phones home (an
# operator may still opt in by setting the variable).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPLICA_HEADER = "x-synapse-replica"
APP_NAME = "synapse"


class _ReplicaHeader:
    """Pure ASGI middleware: name the replica on every HTTP response."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((REPLICA_HEADER.encode(), self.replica))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class SynapseReplica:
    """One replica: the config travels as JSON (plain bytes pickle anywhere)."""

    def __init__(self, config_json: bytes) -> None:
        self._config = msgspec.json.decode(config_json, type=ServeConfig)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # create_app builds the Module as `synapse serve` does (certification.modules): the
        # lane its certificates choose on this node.
        app = create_app(self._config)
        return _ReplicaHeader(app, replica=serve.get_replica_context().replica_tag)


def synapse_deployment(config: ServeConfig):
    """The bound application, ready for `serve.run`."""
    settings = config.ray
    options: dict = {
        "name": "synapse",
        "max_ongoing_requests": settings.max_ongoing_requests,
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_s,
        "ray_actor_options": {"num_cpus": settings.replica_cpus},
    }
    if settings.autoscaling is not None:
        options["autoscaling_config"] = settings.autoscaling
    else:
        options["num_replicas"] = settings.num_replicas
    deployment = serve.deployment(SynapseReplica, **options)
    # ray's overloads resolve **options to the decorator form; given a class it returns a
    # Deployment, which has bind.
    return deployment.bind(msgspec.json.encode(config))  # type: ignore[attr-defined]


def start(config: ServeConfig, address: str | None = None) -> str:
    """Connect to (or start) Ray, run the deployment behind Ray's proxy; return its URL."""
    import ray

    from host.local_ray import start_local_ray
    from host.node_resources import node_resources

    config = install_defaults(config)  # once here, not racing in every replica
    if not ray.is_initialized():
        if address is None:
            start_local_ray(resources=node_resources())  # loopback, token on
        else:
            ray.init(address=address)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(synapse_deployment(config), name=APP_NAME, route_prefix="/")
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"http://{host}:{config.port}"


def stop() -> None:
    """Every replica stops gracefully: each app's lifespan reaps its workers."""
    serve.shutdown()


def serve_on_ray(config: ServeConfig, address: str | None) -> int:
    import ray

    try:
        url = start(config, address)
    except Exception as exc:  # one line, not a Ray traceback
        print(f"synapse serve: Ray Serve failed to start: {exc}", file=sys.stderr)
        return 3
    # After ray.init, which installs its own SIGTERM handler (exit at once, no reaping).
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    n = config.ray.autoscaling or config.ray.num_replicas
    print(f"synapse serve: listening on {url} (Ray Serve, replicas: {n})", flush=True)
    stopping.wait()
    stop()
    if address is None:
        ray.shutdown()  # the local Ray we started
    print("synapse serve: stopped; workers reaped", flush=True)
    return 0
