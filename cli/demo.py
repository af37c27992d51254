"""`synapse demo`: the host supervising real worker processes, narrated.

Temporary main job until the llama.cpp lane lands: it starts a lane on the fault-injection
worker, serves a request, then injects real faults (SIGKILL, os.abort) and shows the typed
errors, the log tail, the recovery on a fresh worker and the quarantine.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import cast

import numpy as np
from rich.console import Console

from host.config import HostConfig, LaneConfig
from host.errors import EngineCrashed
from host.lane import Lane
from workers.protocol import messages as m

console = Console()


def _embed(model_ref: str) -> tuple[m.EMBED_BATCH, np.ndarray]:
    items = [m.EmbedItem(id=0, n_tokens=3), m.EmbedItem(id=1, n_tokens=2)]
    return m.EMBED_BATCH(req_id=0, model_ref=model_ref, items=items), np.arange(1, 6)


async def _try(lane: Lane, model_ref: str) -> None:
    req, ids = _embed(model_ref)
    try:
        reply, vectors = await lane.request(req, ids)
        shown = vectors.tolist() if vectors is not None else None
        console.print(f"  [green]ok[/] {reply} -> {shown}")
    except EngineCrashed as exc:
        console.print(f"  [red]{type(exc).__name__}[/] code={exc.code} {exc.message}")
        console.print(f"    quarantined={exc.quarantined} retry_after_s={exc.retry_after_s}")
        for line in exc.log_tail.strip().splitlines()[-2:]:
            console.print(f"    [dim]log: {line}[/]")
    state = lane.state()
    console.print(
        f"  state: pid={state.pid} strikes={state.strikes} quarantined={state.quarantined} "
        f"restarts={state.restarts} health={state.health.status}"
    )


async def run_demo() -> int:
    with tempfile.TemporaryDirectory(prefix="syn-") as runtime_dir:
        host = HostConfig(runtime_dir=runtime_dir, quarantine_s=30, ping_interval_s=0)
        lane = Lane(LaneConfig(lane_id="demo", argv=["python", "-m", "workers.faulty"]), host)
        console.rule("start a supervised worker")
        await lane.start()
        assert lane.worker is not None and lane.hello is not None  # started
        console.print(f"  worker pid {lane.worker.pid}, HELLO {lane.hello.engine}")
        console.rule("serve a request")
        await _try(lane, "ok")
        pong, _ = await lane.request(m.PING(req_id=0))
        console.print(f"  PONG rss={cast(m.PONG, pong).rss_mb:.1f} MiB")
        console.rule("the worker SIGKILLs itself mid-request")
        await _try(lane, "fault:sigkill")
        console.rule("the next request runs on a fresh worker (strike cleared)")
        await _try(lane, "ok")
        console.rule("two consecutive crashes (SIGKILL, os.abort) quarantine the lane")
        await _try(lane, "fault:sigkill")
        await _try(lane, "fault:abort")
        console.rule("while quarantined, requests fail at once")
        await _try(lane, "ok")
        console.rule("shutdown: SHUTDOWN, grace, SIGTERM, SIGKILL; every child reaped")
        lane.clear_quarantine()
        await _try(lane, "ok")
        worker = lane.worker
        assert worker is not None  # running again after the quarantine was cleared
        await lane.stop()
        console.print(f"  worker {worker.pid}: {worker.process.exit_status()}")
    return 0


def main() -> int:
    return asyncio.run(run_demo())
