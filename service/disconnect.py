"""A client that closes its connection while its request waits cancels that request.

uvicorn does not cancel a handler when its client goes away. Without this, a request whose
client has left keeps its queue place, its admission tokens and its rerank/completion slot,
and its batch is computed for nobody while live requests wait behind it.

Once a POST handler has read its body, `Watches.watch` registers it; a request still
unanswered after `WATCH_AFTER_S` gets one task that waits for the ASGI `http.disconnect`.
When it comes, the handler's task is cancelled: the scheduler skips a cancelled request that
is still queued (and drops its rows if its batch is running), and a lane drains a reply
nobody waits for. The handler's wrapper then answers 499 ("client closed request", nginx's
code), which only the request metrics see. `stop` ends the watch before the response is
sent, so finishing a response never cancels anything.

Why a delay first: most requests are answered within a batch or two (tens of milliseconds),
and a task per request cost the serving loop ~9 us of its ~180 us per small embedding (5%),
while finishing a request whose client left within the first quarter second costs at most
its share of one batch. A client gone later is noticed within the same quarter second.
Every request waits the same delay, so they fall due in the order they were registered: one
loop timer serves them all, and a request answered in time leaves with a dict deletion (a
loop timer of its own, armed and cancelled, costs 1.4 us on uvloop in a micro-benchmark,
more in the server, where each request's turn starts with the caches cold).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from starlette.requests import Request
from starlette.types import Receive

from common.errors import SynapseError

_KEY = "synapse.disconnect"


class ClientClosedRequest(SynapseError):
    """The client closed its connection before its answer was ready."""

    code = "client_closed_request"
    http_status = 499


WATCH_AFTER_S = 0.25  # a request answered sooner is never watched (see above)


class _Watch:
    __slots__ = ("handler", "receive", "watches", "watcher", "active", "closed")

    def __init__(self, handler: asyncio.Task, receive: Receive, watches: Watches) -> None:
        self.handler, self.receive, self.watches = handler, receive, watches
        self.active = True  # False once stopped: a late disconnect must cancel nothing
        self.closed = False
        self.watcher: asyncio.Future | None = None

    def start(self) -> None:  # never after stop(): it leaves the registry
        self.watcher = asyncio.ensure_future(_until_disconnect(self.receive))
        self.watcher.add_done_callback(self._on_done)

    def stop(self) -> None:
        self.active = False
        self.watches.discard(self)
        if self.watcher is not None:
            self.watcher.cancel()

    def _on_done(self, watcher: asyncio.Future) -> None:
        if self.active and not watcher.cancelled() and watcher.exception() is None:
            self.closed = True
            self.handler.cancel()


class Watches:
    """The requests of one server whose watch has not started, in the order they were
    registered, which is the order they fall due (see the module docstring)."""

    def __init__(self, after_s: float = WATCH_AFTER_S) -> None:
        self.after_s = after_s
        self._due: OrderedDict[_Watch, float] = OrderedDict()  # watch -> loop time it starts
        self._timer: asyncio.TimerHandle | None = None  # set while _due is not empty

    def watch(self, request: Request) -> None:
        """Cancel the current task if the client disconnects once it has waited `after_s`;
        call after the body is read."""
        task = asyncio.current_task()
        if task is None or _KEY in request.scope:
            return
        w = request.scope[_KEY] = _Watch(task, request.receive, self)
        loop = asyncio.get_running_loop()
        self._due[w] = due = loop.time() + self.after_s
        if self._timer is None:
            self._timer = loop.call_at(due, self._start_due)

    def discard(self, w: _Watch) -> None:
        self._due.pop(w, None)  # a stale timer finds nothing due and re-arms or ends

    def __len__(self) -> int:
        return len(self._due)

    def _start_due(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._due:
            w, due = next(iter(self._due.items()))
            if due > now:
                self._timer = loop.call_at(due, self._start_due)
                return
            del self._due[w]
            w.start()
        self._timer = None


async def _until_disconnect(receive: Receive) -> None:
    while True:  # the body is read: the next message that matters is the disconnect
        if (await receive())["type"] == "http.disconnect":
            return


def stop(request: Request) -> bool:
    """End the watch; True when the client had gone away (the task was cancelled for it)."""
    w: _Watch | None = request.scope.pop(_KEY, None)
    if w is None:
        return False
    w.stop()
    return w.closed
