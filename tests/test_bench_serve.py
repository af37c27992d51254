"""bench.serve's load client against real loopback servers: its figures are only as good as
its framing (a response counted before it has fully arrived would inflate throughput)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import psutil
import pytest

from bench.serve import _Conn, _vector

REPO = Path(__file__).resolve().parent.parent

REQUEST = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


async def _server(answer) -> tuple[asyncio.Server, str]:
    """A loopback server: `answer(reader, writer)` handles each connection."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    return server, f"http://{host}:{port}"


async def _read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(2)


async def test_response_split_into_single_bytes_completes_only_when_whole() -> None:
    body = b'{"data": "' + b"x" * 3000 + b'"}'
    response = b"HTTP/1.1 200 OK\r\nCONTENT-length: %d\r\n\r\n%s" % (len(body), body)
    sent_last_byte = asyncio.Event()

    async def answer(reader, writer):
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            for i in range(len(response)):
                if i == len(response) - 1:
                    sent_last_byte.set()
                writer.write(response[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)  # let each byte arrive as its own read

    server, url = await _server(answer)
    async with server:
        conn = await _Conn.open(url)
        try:
            for _ in range(3):  # the buffer is consumed exactly: the next response parses too
                sent_last_byte.clear()
                assert await conn.request(REQUEST) == 200
                assert sent_last_byte.is_set()
                assert not conn.framing.buffer
        finally:
            conn.close()


async def test_connection_closed_after_each_response_is_reopened() -> None:
    connections = 0

    async def answer(reader, writer):
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server, url = await _server(answer)
    async with server:
        conn = await _Conn.open(url)
        try:
            statuses = [await conn.request(REQUEST) for _ in range(3)]
        finally:
            conn.close()
    assert statuses == [404, 404, 404]
    assert connections == 3


async def test_server_that_never_answers_counts_as_an_error_not_a_hang() -> None:
    async def answer(reader, writer):
        await _read_request(reader)
        writer.close()

    server, url = await _server(answer)
    async with server:
        conn = await _Conn.open(url)
        try:
            assert await conn.request(REQUEST) == 0  # one retry on a fresh connection, then 0
        finally:
            conn.close()


async def test_response_without_content_length_is_refused() -> None:
    async def answer(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        await writer.drain()

    server, url = await _server(answer)
    async with server:
        conn = await _Conn.open(url)
        try:
            with pytest.raises(ValueError, match="no Content-Length"):
                await conn.request(REQUEST)
        finally:
            conn.close()


def test_vector_decodes_base64_as_little_endian_float32() -> None:
    values = np.array([0.1, -2.5, 3.0e-8, 1.0], dtype="<f4")
    encoded = base64.b64encode(values.tobytes()).decode()
    assert np.array_equal(_vector(encoded), values.astype(np.float64))
    assert np.array_equal(_vector(values.tolist()), values.astype(np.float64))


# A bench that started a server (in a session of its own, as bench.serve starts both), then
# waits in a `finally` that stops it: what every bench does around its measurements.
_BENCH_WITH_A_SERVER = textwrap.dedent(
    """
    import sys, tempfile, time
    from bench.serve import _Proc
    server = _Proc(
        [sys.executable, "-c", "import time; time.sleep(120)"], None, tempfile.mkdtemp(), "s"
    )
    try:
        print(server.proc.pid, flush=True)
        time.sleep(120)
    finally:
        server.stop()
    """
)


def test_sigterm_to_a_bench_stops_the_servers_it_started() -> None:
    """SIGTERM (timeout, a CI runner) must not orphan a server: under the default action the
    bench died at once and its servers, in their own sessions, kept running."""
    bench = subprocess.Popen(
        [sys.executable, "-c", _BENCH_WITH_A_SERVER],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bench.stdout is not None
    server = psutil.Process(int(bench.stdout.readline()))
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
        server.wait(10)  # raises TimeoutExpired if the server outlived the bench
    finally:
        for proc in (bench, server):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                proc.kill()
        bench.wait()
