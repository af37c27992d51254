"""service.disconnect: a client gone while its request waits cancels it; a request answered
within `after_s` is never watched (a timer, no task, no receive). Real asyncio, fake ASGI
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
    disconnect.watch(request, after_s=30)
    watch = request.scope[disconnect._KEY]
    assert watch.timer.when() - asyncio.get_running_loop().time() > 29
    receive.gone.set()  # even a client already gone: nothing looks before the delay
    for _ in range(5):
        await asyncio.sleep(0)
    assert disconnect.stop(request) is False
    assert watch.watcher is None and watch.timer.cancelled() and receive.calls == 0


async def test_a_client_gone_while_the_request_waits_cancels_it():
    receive = _Receive()
    request = _request(receive)
    waiting = asyncio.get_running_loop().create_future()  # e.g. a queued batch slot

    async def handler() -> None:
        disconnect.watch(request, after_s=0.01)
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
        disconnect.watch(request, after_s=0.01)
        await receive.called.wait()
        assert disconnect.stop(request) is False  # the answer is being sent
        receive.gone.set()
        for _ in range(5):  # turns in which a live watcher would have cancelled us
            await asyncio.sleep(0)
        done.set()

    await asyncio.wait_for(handler(), 5)
    assert done.is_set()
