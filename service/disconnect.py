"""A client that closes its connection while its request waits cancels that request.

uvicorn does not cancel a handler when its client goes away. Without this, a request whose
client has left keeps its queue place, its admission tokens and its rerank/completion slot,
and its batch is computed for nobody while live requests wait behind it.

Once a POST handler has read its body, `watch` starts one task that waits for the ASGI
`http.disconnect`. When it comes, the handler's task is cancelled: the scheduler skips a
cancelled request that is still queued (and drops its rows if its batch is running), and a lane
drains a reply nobody waits for. The handler's wrapper then answers 499 ("client closed
request", nginx's code), which only the request metrics see. `stop` ends the watch before the
response is sent, so finishing a response never cancels anything.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import Receive

from host.errors import SynapseError

_KEY = "synapse.disconnect"


class ClientClosedRequest(SynapseError):
    """The client closed its connection before its answer was ready."""

    code = "client_closed_request"
    http_status = 499


class _Watch:
    __slots__ = ("handler", "watcher", "active", "closed")

    def __init__(self, handler: asyncio.Task, receive: Receive) -> None:
        self.handler = handler
        self.active = True  # False once stopped: a late disconnect must cancel nothing
        self.closed = False
        self.watcher = asyncio.ensure_future(_until_disconnect(receive))
        self.watcher.add_done_callback(self._on_done)

    def _on_done(self, watcher: asyncio.Future) -> None:
        if self.active and not watcher.cancelled() and watcher.exception() is None:
            self.closed = True
            self.handler.cancel()


async def _until_disconnect(receive: Receive) -> None:
    while True:  # the body is read: the next message that matters is the disconnect
        if (await receive())["type"] == "http.disconnect":
            return


def watch(request: Request) -> None:
    """Cancel the current task if the client disconnects; call after the body is read."""
    task = asyncio.current_task()
    if task is not None and _KEY not in request.scope:
        request.scope[_KEY] = _Watch(task, request.receive)


def stop(request: Request) -> bool:
    """End the watch; True when the client had gone away (the task was cancelled for it)."""
    w: _Watch | None = request.scope.pop(_KEY, None)
    if w is None:
        return False
    w.active = False
    w.watcher.cancel()
    return w.closed
