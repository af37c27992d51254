"""The local Ray that `serve --ray` and `batch embed --ray` start (`host.local_ray`, which the
session's `ray_session` is): every socket it listens on is loopback, and a client without
its token is refused.

What Ray binds to all interfaces whatever we ask: only Serve's per-replica gRPC server
(`[::]:0`, hard-coded in ray/serve/_private/replica.py); tests/test_serve_ray.py checks it is
the one exception while replicas run, and it carries Ray's token interceptor like the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from host.errors import ConfigInvalid
from host.local_ray import check_token_auth
from tests.batch_support import batch_cli, cli_env, write_jsonl
from tests.ray_support import is_loopback, listening_sockets

pytestmark = pytest.mark.model  # starts Ray and model workers


def test_the_local_ray_listens_on_loopback_only(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0.1)
    class Probe:  # an actor: its own core-worker gRPC server, started by the raylet
        def pid(self) -> int:
            return os.getpid()

    probe = Probe.remote()
    actor_pid = ray.get(probe.pid.remote())
    try:
        node = ray.nodes()[0]
        assert node["NodeManagerAddress"] == "127.0.0.1"
        sockets = listening_sockets()
        ports = {port for _, _, port in sockets}
        gcs_port = int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
        # Not vacuous: the GCS, the raylet's two servers and the actor are all in the list.
        assert {gcs_port, node["NodeManagerPort"], node["ObjectManagerPort"]} <= ports
        assert any(name.startswith("ray::Probe") for name, _, _ in sockets)
        open_ = [s for s in sockets if not is_loopback(s[1])]
        assert open_ == [], f"listening beyond loopback: {open_}"
        assert is_loopback("::ffff:127.0.0.1") and not is_loopback("::")  # the check bites
        assert not is_loopback("0.0.0.0")
    finally:
        ray.kill(probe)
    assert actor_pid > 0


REFUSED_CODE = """
import ray
try:
    ray.init(address={address!r}, log_to_driver=False)
except Exception as exc:
    print("REFUSED", type(exc).__name__)
else:
    print("CONNECTED")
"""


def test_a_client_without_the_token_is_refused(ray_session, synapse_cache_dir, tmp_path):
    address = ray_session.get_runtime_context().gcs_address
    # RAY_gcs_server_port_wait_time_s: give up after 2 attempts, not Ray's 20.
    base = {**os.environ, "RAY_gcs_server_port_wait_time_s": "2"}
    base.pop("RAY_AUTH_TOKEN", None)
    code = [sys.executable, "-c", REFUSED_CODE.format(address=address)]
    write_jsonl(tmp_path / "c.jsonl", 3)
    out = tmp_path / "o.parquet"
    cli = [
        sys.executable,
        "-m",
        "cli.main",
        "batch",
        "embed",
        str(tmp_path / "c.jsonl"),
        "-o",
        str(out),
        "--ray",
        address,
    ]
    clients = {
        "no token (auth disabled)": (code, {**base, "RAY_AUTH_MODE": "disabled"}),
        "a wrong token": (code, {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}),
        "batch embed --ray ADDRESS without the token": (
            cli,
            cli_env(synapse_cache_dir, extra={**base, "RAY_AUTH_MODE": "disabled"}),
        ),
    }

    def attempt(client):
        argv, env = client
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)

    with ThreadPoolExecutor(len(clients)) as pool:
        results = dict(zip(clients, pool.map(attempt, clients.values()), strict=True))
    for who, proc in results.items():
        # Refused for the token, not for an unreachable address.
        assert "InvalidAuthToken" in proc.stderr or "Unauthenticated" in proc.stderr, (
            who,
            proc.stderr[-2000:],
        )
        if proc.args is cli:  # one line, exit 1, and no checkpoint of a job never begun
            assert proc.returncode == 1, (who, proc.stderr[-2000:])
            assert f"cannot join the Ray cluster at {address}" in proc.stderr
            assert not (tmp_path / "o.parquet.partial").exists()
        else:
            assert "REFUSED" in proc.stdout, (who, proc.stdout, proc.stderr[-2000:])


def test_a_local_ray_without_token_auth_is_refused(monkeypatch, synapse_cache_dir, tmp_path):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ConfigInvalid, match="RAY_AUTH_MODE=disabled"):
        check_token_auth()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    check_token_auth()
    monkeypatch.delenv("RAY_AUTH_MODE")
    check_token_auth()  # unset: Ray turns token authentication on by itself

    # The CLI says so before it starts anything, and leaves no checkpoint behind.
    write_jsonl(tmp_path / "c.jsonl", 3)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    out = tmp_path / "o.parquet"
    proc = batch_cli(synapse_cache_dir, str(tmp_path / "c.jsonl"), "-o", str(out), "--ray")
    assert proc.returncode == 2, proc.stderr
    assert "token authentication only" in proc.stderr
    assert not (tmp_path / "o.parquet.partial").exists()

    (tmp_path / "serve.toml").write_text("install_defaults = false\n")
    serve = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "serve",
            "--ray",
            "--config",
            str(tmp_path / "serve.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(synapse_cache_dir),
    )
    assert serve.returncode == 3, serve.stderr
    assert "Ray Serve failed to start" in serve.stderr
    assert "token authentication only" in serve.stderr
