"""Host and lane configuration. Every protocol window is here, so tests shorten them."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import msgspec

from host.errors import ConfigInvalid
from workers.cpus import usable_cpu_count
from workers.protocol.messages import DEFAULT_MAX_FRAME

_LANE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")
# The smallest max_frame the host accepts: a control frame (LOAD with a model's heads, an ERR
# with its message) is a few KiB of JSON and must fit with room to spare.
MIN_MAX_FRAME = 32 * 1024


class HostConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    runtime_dir: str | None = None  # default: $XDG_RUNTIME_DIR, else a private temp dir
    hello_timeout_s: float = 10.0
    inference_window_s: float = 120.0  # silence window once the worker computes
    setup_window_s: float = 600.0  # inference request still preparing input (phase setup)
    control_window_s: float = 600.0  # LOAD, ADMIT_SHAPE, EVICT, UNLOAD
    ping_window_s: float = 5.0
    strike_limit: int = 2
    quarantine_s: float = 600.0
    shutdown_grace_s: float = 5.0  # after SHUTDOWN, before SIGTERM
    term_grace_s: float = 2.0  # after SIGTERM, before SIGKILL
    ping_interval_s: float = 15.0  # background health refresher; 0 disables it
    log_ring_bytes: int = 256 * 1024
    log_tail_bytes: int = 8192
    max_frame: int = DEFAULT_MAX_FRAME
    device_permits: dict[str, int] = {}  # default: {"ane": 1, "gpu": 1, "cpu": cores}

    def __post_init__(self) -> None:
        for name in (
            "hello_timeout_s",
            "inference_window_s",
            "setup_window_s",
            "control_window_s",
            "ping_window_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigInvalid(f"{name} must be > 0")
        if self.strike_limit < 1:
            raise ConfigInvalid("strike_limit must be >= 1")
        # Workers offer DEFAULT_MAX_FRAME in HELLO and a connection agrees on the smaller of
        # both sides. The module sizes its requests and their replies with this value before
        # any connection exists, so a larger one would plan frames the connection then refuses
        # (or a reply the worker may not send, which costs it its life and the lane a strike).
        if not MIN_MAX_FRAME <= self.max_frame <= DEFAULT_MAX_FRAME:
            raise ConfigInvalid(
                f"max_frame must be within {MIN_MAX_FRAME}..{DEFAULT_MAX_FRAME} bytes "
                f"(workers accept frames up to {DEFAULT_MAX_FRAME}); got {self.max_frame}"
            )

    def resolved_runtime_dir(self) -> Path:
        if self.runtime_dir:  # an explicit choice is used as given (and created)
            return Path(self.runtime_dir)
        base = os.environ.get("XDG_RUNTIME_DIR")
        if base is None or not os.access(base, os.W_OK):
            base = os.path.join(tempfile.gettempdir(), f"synapse-{os.getuid()}")
        return Path(base)

    def permits(self) -> dict[str, int]:
        # The ANE runs one inference at a time, and so does the GPU (on Apple silicon one
        # device shared by every offloaded llama.cpp lane); CPU permits match the cores.
        return {"ane": 1, "gpu": 1, "cpu": usable_cpu_count(), **self.device_permits}


class LaneConfig(msgspec.Struct, kw_only=True):
    lane_id: str
    argv: list[str]  # any worker command; the host appends --socket and --nonce
    env: dict[str, str] = {}
    device: str = "cpu"  # which execution permit inference requests take
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not _LANE_ID.match(self.lane_id):
            raise ConfigInvalid(
                f"lane_id {self.lane_id!r}: use 1-48 of letters, digits, '_', '.', '-'"
            )
        if not self.argv:
            raise ConfigInvalid("argv must name the worker command")
