"""HostConfig's own rules: the values the host refuses before starting any worker."""

from __future__ import annotations

import msgspec
import pytest

from host.config import MIN_MAX_FRAME, HostConfig
from host.errors import ConfigInvalid
from workers.protocol import messages as m
from workers.protocol.messages import DEFAULT_MAX_FRAME
from workers.protocol.session import HostSession


@pytest.mark.parametrize("max_frame", [MIN_MAX_FRAME, 1 << 20, DEFAULT_MAX_FRAME])
def test_max_frame_within_what_workers_accept_is_kept(max_frame):
    assert HostConfig(max_frame=max_frame).max_frame == max_frame


@pytest.mark.parametrize("max_frame", [0, -1, MIN_MAX_FRAME - 1, DEFAULT_MAX_FRAME + 1, 1 << 31])
def test_max_frame_outside_what_workers_accept_is_refused(max_frame):
    with pytest.raises(ConfigInvalid, match="max_frame must be within"):
        HostConfig(max_frame=max_frame)


def test_max_frame_refused_from_a_config_file_too():
    # The serve config's [module.host] table decodes into HostConfig: same rule, same error.
    with pytest.raises(ConfigInvalid, match="max_frame"):
        msgspec.convert({"max_frame": 128 << 20}, HostConfig)


def test_the_host_budget_is_the_frame_every_connection_agrees_on():
    # The module plans with HostConfig.max_frame before a connection exists; a worker offers
    # DEFAULT_MAX_FRAME in its HELLO and the session agrees on the smaller, so every accepted
    # value is exactly the frame the connection then enforces.
    for max_frame in (MIN_MAX_FRAME, 1 << 20, DEFAULT_MAX_FRAME):
        session = HostSession("N", HostConfig(max_frame=max_frame).max_frame)
        offer = m.HELLO(v=3, nonce="N", engine=m.EngineInfo(engine="t", version="0"), pid=1)
        assert offer.max_frame == DEFAULT_MAX_FRAME  # what a worker offers unless told less
        session.receive_frame(m.encode(offer))
        assert session.accept_hello().max_frame == max_frame == session.max_frame
