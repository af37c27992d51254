"""service.disconnect: a client gone while its request waits cancels it; a request answered
within `after_s` is never watched (no task, no receive), and one loop timer serves every
request's delay. Real asyncio, fake ASGI
receive (the live server's case is tests/test_serve_faults.py)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from service import disconnect


class _Receive:
    """An ASGI receive whose next message is `http.disconnect` once `gone` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = asyncio.Event()
        self.gone = asyncio.Event()

    async def __call__(self) -> dict:
        self.calls += 1
        self.called.set()
        await self.gone.wait()
        return {"type": "http.disconnect"}


def _request(receive: _Receive) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


async def test_a_request_answered_before_the_delay_is_never_watched():
    receive = _Receive()
    request = _request(receive)
    watches = disconnect.Watches(after_s=30)
    watches.watch(request)
    watch = request.scope[disconnect._KEY]
    assert watches._timer.when() - asyncio.get_running_loop().time() > 29
    receive.gone.set()  # even a client already gone: nothing looks before the delay
    for _ in range(5):
        await asyncio.sleep(0)
    assert disconnect.stop(request) is False
    assert watch.watcher is None and len(watches) == 0 and receive.calls == 0


async def test_a_client_gone_while_the_request_waits_cancels_it():
    receive = _Receive()
    request = _request(receive)
    waiting = asyncio.get_running_loop().create_future()  # e.g. a queued batch slot

    async def handler() -> None:
        disconnect.Watches(after_s=0.01).watch(request)
        await waiting

    task = asyncio.create_task(handler())
    await asyncio.wait_for(receive.called.wait(), 5)  # the timer fired: the watcher reads
    receive.gone.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert disconnect.stop(request) is True


async def test_a_disconnect_after_stop_cancels_nothing():
    receive = _Receive()
    request = _request(receive)
    done = asyncio.Event()

    async def handler() -> None:
        disconnect.Watches(after_s=0.01).watch(request)
        await receive.called.wait()
        assert disconnect.stop(request) is False  # the answer is being sent
        receive.gone.set()
        for _ in range(5):  # turns in which a live watcher would have cancelled us
            await asyncio.sleep(0)
        done.set()

    await asyncio.wait_for(handler(), 5)
    assert done.is_set()


async def test_one_timer_starts_each_watch_at_its_own_time_in_order():
    loop = asyncio.get_running_loop()
    watches = disconnect.Watches(after_s=0.05)
    receives = [_Receive() for _ in range(3)]
    requests = [_request(r) for r in receives]
    started: list[float] = []
    parked = loop.create_future()

    async def handler(i: int) -> None:
        watches.watch(requests[i])
        await parked

    tasks = [asyncio.create_task(handler(0)), asyncio.create_task(handler(1))]
    await asyncio.sleep(0)
    timer = watches._timer
    assert timer is not None and len(watches) == 2
    disconnect.stop(requests[0])  # answered in time: leaves the registry, the timer stays
    assert watches._timer is timer and len(watches) == 1
    await asyncio.sleep(0.02)  # the third falls due 20 ms after the second
    registered = loop.time()
    tasks.append(asyncio.create_task(handler(2)))
    await asyncio.sleep(0)
    for i in (1, 2):
        await asyncio.wait_for(receives[i].called.wait(), 5)
        started.append(loop.time())
    assert receives[0].calls == 0  # never watched
    assert started[1] - registered >= 0.05 - 1e-3  # not before its own delay
    assert len(watches) == 0 and watches._timer is None  # nothing left: no timer either
    for r in requests[1:]:
        assert disconnect.stop(r) is False
    parked.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
