"""Per-key locks that keep no entry for a key nobody holds: one load and one lane choice at a
time per name, and a Module asked for hundreds of models that do not exist keeps nothing of
them (before, one lock per name asked for stayed for the life of the server)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest

from common.errors import ModelNotFound
from host.config import HostConfig
from host.keyed_locks import KeyedLocks
from host.module import Module, ModuleConfig


async def test_one_holder_per_key_and_no_entry_once_released():
    locks = KeyedLocks()
    inside: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}
    sizes = []

    async def enter(key: str) -> None:
        async with locks.hold(key):
            inside[key] += 1
            most[key] = max(most[key], inside[key])
            sizes.append(len(locks))
            await asyncio.sleep(0)  # let the others queue up behind this holder
            inside[key] -= 1

    await asyncio.gather(*(enter(k) for k in "ababab"))
    assert most == {"a": 1, "b": 1}  # exclusive per key
    assert max(sizes) == 2  # both keys were held at once: not one global lock
    assert len(locks) == 0  # and nothing is kept once they are released


async def test_a_released_key_is_kept_while_someone_waits_for_it():
    locks = KeyedLocks()
    entered = asyncio.Event()
    release = asyncio.Event()

    async def first() -> None:
        async with locks.hold("m"):
            entered.set()
            await release.wait()

    order = []

    async def second() -> None:
        async with locks.hold("m"):
            order.append("second")

    one = asyncio.create_task(first())
    await entered.wait()
    two = asyncio.create_task(second())
    await asyncio.sleep(0)
    assert len(locks) == 1 and order == []  # waiting: the same lock, not a new one
    release.set()
    await asyncio.gather(one, two)
    assert order == ["second"] and len(locks) == 0


async def test_a_failed_holder_releases_its_key():
    locks = KeyedLocks()
    with pytest.raises(ValueError):
        async with locks.hold("m"):
            raise ValueError("the load failed")
    assert len(locks) == 0


async def test_requests_for_unknown_models_leave_no_lock_behind():
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    store = tempfile.mkdtemp(prefix="syn-store-")
    cfg = ModuleConfig(store_root=store, host=HostConfig(runtime_dir=runtime))
    try:
        async with Module(cfg) as mod:
            for i in range(200):  # each name once, as a client trying names would send them
                name = f"no-such-model-{i}"
                for call in (
                    mod.embed(["x"], model=name),
                    mod.rerank("q", ["d"], model=name),
                    mod.load(name, "llama"),
                ):
                    with pytest.raises(ModelNotFound):
                        await call
            assert len(mod._loading) == 0 and len(mod._choosing) == 0
            assert mod.served_lanes() == [] and mod.chosen_lanes() == {}
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
