"""Execution permits: one device's semaphore, and a lane on two devices ("ane+gpu": Core ML
allowed on the GPU) holding both, taken in one global order and given back on cancellation."""

from __future__ import annotations

import asyncio

import pytest

from host.module import permit_for
from host.permits import DevicePermits, JointPermit


async def test_a_joint_permit_holds_every_device_it_names():
    permits = DevicePermits({"ane": 1, "gpu": 1, "cpu": 2})
    joint = permits.for_device("gpu+ane")
    assert isinstance(joint, JointPermit) and permits.for_device("gpu+ane") is joint
    async with joint:
        assert permits.for_device("ane").locked() and permits.for_device("gpu").locked()
        assert joint.locked()
    assert not permits.for_device("ane").locked() and not permits.for_device("gpu").locked()
    async with permits.for_device("gpu"):  # a llama.cpp lane offloaded to the GPU
        assert joint.locked()  # the Core ML lane on the GPU waits for it


async def test_two_joint_lanes_never_deadlock_and_a_cancelled_wait_gives_back():
    permits = DevicePermits({"ane": 1, "gpu": 1})
    a, b = permits.for_device("ane+gpu"), permits.for_device("gpu+ane")  # same sorted order
    order: list[str] = []

    async def run(name: str, permit) -> None:
        async with permit:
            order.append(name)
            await asyncio.sleep(0)

    await asyncio.wait_for(
        asyncio.gather(*(run(f"{n}{i}", p) for i in range(5) for n, p in (("a", a), ("b", b)))), 10
    )
    assert len(order) == 10
    await permits.for_device("gpu").acquire()  # gpu busy: the joint waiter holds ane, waits
    waiter = asyncio.create_task(a.acquire())
    for _ in range(5):
        await asyncio.sleep(0)
    assert permits.for_device("ane").locked() and not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not permits.for_device("ane").locked()  # given back, not leaked
    permits.for_device("gpu").release()


def test_an_unknown_device_fails_at_once():
    permits = DevicePermits({"ane": 1})
    with pytest.raises(KeyError, match="device 'gpu'"):
        permits.for_device("ane+gpu")


def test_the_core_ml_lane_takes_the_gpu_permit_when_its_compute_units_reach_the_gpu():
    assert permit_for("ane", "ane") == "ane"
    assert permit_for("ane", "ane+gpu") == "ane+gpu"
    assert permit_for("llama", "metal") == "gpu" and permit_for("llama", "cpu") == "cpu"
