"""The `[ray]` table of the serve config: how `synapse serve --ray` deploys on Ray Serve.

Kept free of Ray imports so the config loads without it. `autoscaling` (Ray Serve's
`autoscaling_config`, e.g. {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests":
8}) replaces `num_replicas` when set.
"""

from __future__ import annotations

from typing import Any

import msgspec

from host.errors import ConfigInvalid


class RaySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    num_replicas: int = 2
    autoscaling: dict[str, Any] | None = None
    max_ongoing_requests: int = 64  # per replica; Ray queues the rest at the proxy
    replica_cpus: float = 1.0  # logical CPUs a replica reserves (its engine workers' share)
    graceful_shutdown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigInvalid("ray.num_replicas must be >= 1")
        if self.max_ongoing_requests < 1:
            raise ConfigInvalid("ray.max_ongoing_requests must be >= 1")
        if self.replica_cpus < 0:
            raise ConfigInvalid("ray.replica_cpus must be >= 0")
