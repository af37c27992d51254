"""A Ray of our own on this machine (`serve --ray`, `batch embed --ray` without an address):
reachable from this machine only, and only with Ray's token.

Ray itself would listen on every interface: `ray.init(_node_ip_address="127.0.0.1")`
rewrites a loopback address to the machine's routable one (`resolve_ip_for_localhost`),
unless Ray runs as a single-machine instance — the mode it picks by itself on macOS and
Windows (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` off). In that mode the node's address stays
127.0.0.1, and every server Ray starts with the node's address binds it: the GCS, the raylet
(node manager and object manager), every worker's and actor's gRPC server, the dashboard
agent, the runtime-env agent and the metrics ports. What Ray binds to all interfaces in any
mode: Serve's per-replica gRPC server for calls between deployments (`[::]:0`, fixed in
ray/serve/_private/replica.py); it carries Ray's token interceptor, so it refuses a caller
without the token like the rest.

Token authentication: a new local Ray turns it on by itself when `RAY_AUTH_MODE` is unset
(and writes a token to ~/.ray/auth_token if there is none); an explicit
`RAY_AUTH_MODE=disabled` would start it open, which we refuse. The variable, once set to
`token` by `ray.init`, is inherited by the processes we start, so a `--ray ADDRESS` driver
started from here presents the same token.

Free of any Ray import at module level: Ray is optional.
"""

from __future__ import annotations

import os

from host.errors import ConfigInvalid

LOOPBACK = "127.0.0.1"
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"
# Ray reads this once, when `ray._private.ray_constants` is imported; "0" means the
# single-machine mode (node address 127.0.0.1). Set for the processes the local Ray starts.
SINGLE_MACHINE_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def check_token_auth() -> None:
    """Refuse to start a local Ray that any local user could drive without a token."""
    mode = os.environ.get(AUTH_MODE_VARIABLE)
    if mode is not None and mode.strip().lower() != "token":
        raise ConfigInvalid(
            f"{AUTH_MODE_VARIABLE}={mode}: the local Ray runs with token authentication "
            f"only (anyone who reaches an open Ray runs code as you); unset it or set it to "
            f"'token'"
        )


def start_local_ray(**init_kwargs) -> None:
    """`ray.init` of a new local instance, bound to loopback, token authentication on.

    `init_kwargs` are `ray.init`'s (num_cpus, resources, log_to_driver, _temp_dir...); the
    address, node address and dashboard are ours to choose."""
    import ray
    from ray._private import ray_constants

    check_token_auth()
    os.environ[SINGLE_MACHINE_VARIABLE] = "0"
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    # Read at call time by `services.get_node_ip_address`, which `ray.init` asks while it
    # resolves "127.0.0.1": off, the answer is loopback instead of the routable address.
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        # "local": a new instance even if RAY_ADDRESS or a running Ray is found.
        ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, **init_kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
