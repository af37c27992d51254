"""uvloop + httptools where installed, asyncio + h11 where not (host/eventloop.py): the choice,
and a REAL server started with both made unimportable, as on a platform without wheels."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import httpx
import pytest

from host import eventloop
from tests.test_serve_support import ServerProcess, server_config

HAVE_FAST = all(importlib.util.find_spec(n) for n in ("uvloop", "httptools"))

# `None` in sys.modules makes `import uvloop` raise ImportError: what a platform without the
# wheel does. Then the real CLI entry point runs.
WITHOUT_FAST = [
    sys.executable,
    "-c",
    "import sys; sys.modules['uvloop'] = None; sys.modules['httptools'] = None; "
    "from service.__main__ import main; sys.exit(main())",
]


@pytest.mark.skipif(not HAVE_FAST, reason="uvloop/httptools have no wheel on this platform")
def test_installed_fast_path_is_chosen():
    assert eventloop.loop_name() == "uvloop" and eventloop.http_name() == "httptools"

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert eventloop.run(which()).startswith("uvloop")


def test_unimportable_modules_fall_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert eventloop.loop_name() == "asyncio" and eventloop.http_name() == "h11"

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert eventloop.run(which()).startswith("asyncio")


@pytest.mark.model
def test_server_without_uvloop_and_httptools_serves_and_warns_when_open(store_root):
    # Not loopback and no key: the exposure warning. Only loopback traffic is sent.
    cfg = {**server_config(store_root, preload=[]), "host": "0.0.0.0"}
    srv = ServerProcess(cfg, command=WITHOUT_FAST)
    try:
        assert "event loop asyncio, http h11" in srv.wait_for_line("event loop")
        port = srv.url.rsplit(":", 1)[1]
        local = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{local}/health", timeout=30).json()["status"] == "ok"
        resp = httpx.post(f"{local}/v1/embeddings", json={"input": "h11 works"}, timeout=120)
        assert resp.status_code == 200 and len(resp.json()["data"][0]["embedding"]) == 384
        warnings = [line for line in srv.log().splitlines() if "WARNING: no API key" in line]
        assert len(warnings) == 1 and "0.0.0.0" in warnings[0]
    finally:
        srv.stop()
