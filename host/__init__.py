"""The module: supervisor, lanes, scheduler, tokenizers, API, CLI, HTTP.

Low-level public API (tests and foreign workers use these names):
    HostConfig, LaneConfig, Lane, LaneState, and `host.errors`.
"""

from host.config import HostConfig, LaneConfig
from host.lane import Lane, LaneState

__all__ = ["HostConfig", "Lane", "LaneConfig", "LaneState"]
