"""The host process's library: worker supervision (lanes, workers, connections, permits) and
the `Module` API (tokenization, admission, batching, lane choice, residency). The CLI lives in
cli/, the HTTP service in service/, bulk jobs in batch/; each sits on this package.

Low-level public API (tests and foreign workers use these names):
    HostConfig, LaneConfig, Lane, LaneState, and `host.errors`.
"""

from host.config import HostConfig, LaneConfig
from host.lane import Lane, LaneState

__all__ = ["HostConfig", "Lane", "LaneConfig", "LaneState"]
