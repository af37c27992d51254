"""`synapse serve --ray` on the session's local Ray: two replicas behind Ray's HTTP proxy,
the official `openai` client, a real worker SIGKILL under concurrent load, a SIGTERM of the
driver that leaves no worker behind, and nothing listening beyond loopback but the one
server Ray binds to every interface whatever it is told (a replica's gRPC server)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.ray_support import is_loopback, listening_sockets, wait_gone

MODEL = "minilm-l6-v2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_by_replica(url: str, replicas: int, timeout_s: float = 60) -> dict[str, dict]:
    """GET /health until every replica answered once (the proxy picks one per request)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas:
        assert time.monotonic() < deadline, f"only replicas {sorted(seen)} answered"
        r = httpx.get(f"{url}/health", timeout=10)
        seen[r.headers["x-synapse-replica"]] = {"code": r.status_code, **r.json()}
    return seen


@pytest.fixture
def ray_serve(ray_session, store_root, tmp_path):
    """`synapse serve --ray ADDRESS` in a subprocess, joined to the session's Ray; stopped
    with SIGTERM, which must shut Serve down and reap every worker of every replica."""
    runtime_dir = tempfile.mkdtemp(prefix="syns-", dir="/tmp")
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(
        f"port = {port}\ninstall_defaults = false\n"
        f'[module]\nstore_root = "{store_root}"\n'
        f'[module.host]\nruntime_dir = "{runtime_dir}"\n'
        f"[ray]\nnum_replicas = 2\nreplica_cpus = 0.5\nmax_ongoing_requests = 32\n"
    )
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--ray", address, "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in proc.stdout:  # the readiness line, once both replicas are up
            if line.startswith("synapse serve: listening on"):
                break
        else:
            raise AssertionError(f"serve --ray exited {proc.wait()} before listening")
        yield f"http://127.0.0.1:{port}", runtime_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    left = wait_gone(runtime_dir, timeout_s=30)
    shutil.rmtree(runtime_dir, ignore_errors=True)
    assert proc.returncode == 0 and "stopped; workers reaped" in out, out
    assert not left, "an engine worker outlived the shutdown"


@pytest.mark.model
def test_two_replicas_answer_openai_survive_a_worker_sigkill_and_leave_no_worker(ray_serve):
    import openai  # here: its import costs the fast loop, which collects this module

    url, runtime_dir = ray_serve
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model=MODEL, input=["hello", "world"])
    assert [len(d.embedding) for d in result.data] == [384, 384]
    assert result.usage.prompt_tokens > 2

    health = health_by_replica(url, 2)
    pids = {h["lanes"][MODEL]["pid"] for h in health.values()}
    assert len(pids) == 2 and all(h["code"] == 200 and h["status"] == "ok" for h in health.values())
    # Serve's proxy binds the config's host; every other Ray server the node address
    # (loopback, host.local_ray) — except each replica's gRPC server for calls between
    # deployments, which Ray binds to [::] (ray/serve/_private/replica.py) and guards with
    # the same token interceptor.
    sockets = listening_sockets()
    port = int(url.rsplit(":", 1)[1])
    assert any(
        name.startswith("ray::ProxyActor") and p == port and is_loopback(ip)
        for name, ip, p in sockets
    ), sockets
    beyond = [s for s in sockets if not is_loopback(s[1])]
    assert all(name.startswith("ray::ServeReplica") for name, _, _ in beyond), beyond
    assert len(beyond) <= 2  # one per replica at most

    victim, before = next(iter(health.items()))
    victim_pid = before["lanes"][MODEL]["pid"]

    texts = [f"sentence number {i} about cats and markets " * 8 for i in range(16)]

    def call(i: int) -> httpx.Response:
        return httpx.post(
            f"{url}/v1/embeddings", json={"model": MODEL, "input": texts}, timeout=120
        )

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(call, i) for i in range(32)]
        while not any(f.done() for f in futures):  # the load is flowing
            time.sleep(0.01)
        os.kill(victim_pid, signal.SIGKILL)
        responses = [f.result() for f in futures]
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "engine_crashed", r.text
    assert codes.count(200) >= len(codes) // 2

    deadline = time.monotonic() + 60
    while True:  # the victim replica replaced its worker by itself
        after = health_by_replica(url, 2)[victim]
        lane = after["lanes"][MODEL]
        if after["status"] == "ok" and lane["pid"] not in (None, victim_pid):
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert lane["restarts"] >= 1
    assert len(client.embeddings.create(model=MODEL, input=["after"]).data) == 1


def test_the_ray_table_of_the_serve_config_is_checked(tmp_path):
    from host.errors import ConfigInvalid
    from service.config import load_config
    from service.ray_deployment import synapse_deployment

    for body, message in [
        ("num_replicas = 0", "num_replicas must be >= 1"),
        ("max_ongoing_requests = 0", "max_ongoing_requests must be >= 1"),
        ("replicas = 2", "replicas"),
    ]:
        (tmp_path / "c.toml").write_text(f"[ray]\n{body}\n")
        with pytest.raises(ConfigInvalid, match=message):
            load_config(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text(
        "[ray]\nmax_ongoing_requests = 8\nautoscaling = {min_replicas = 1, max_replicas = 3}\n"
    )
    app = synapse_deployment(load_config(tmp_path / "c.toml"))
    config = app._bound_deployment._deployment_config
    assert config.max_ongoing_requests == 8
    assert config.autoscaling_config.max_replicas == 3
