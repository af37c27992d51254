"""host.routed_lanes' count of inputs in flight per lane: what the router reads, kept only for
lanes busy now (the two-lane choice and its fallback are proved on real lanes in
tests/test_lane_route.py)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from host.routed_lanes import RoutedLanes


def test_in_flight_counts_keep_no_idle_lane():
    routing = RoutedLanes(cast(Any, None))  # counting reads nothing of the Module
    one, two = cast(Any, object()), cast(Any, object())  # two lanes' supervisors
    with routing.in_flight(one, 3):
        with routing.in_flight(one, 2), routing.in_flight(two, 1):
            assert routing.busy() == 2
        assert routing.busy() == 1
        with pytest.raises(RuntimeError), routing.in_flight(two, 4):
            raise RuntimeError("the worker died mid-request")
        assert routing.busy() == 1
    # A lane that went idle is not kept: a supervisor replaced by a reload (a new object each
    # time) would otherwise stay referenced for the life of the server.
    assert routing.busy() == 0
