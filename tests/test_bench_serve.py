"""bench.serve's load client against real loopback servers: its figures are only as good as
its framing (a response counted before it has fully arrived would inflate throughput)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from bench.serve import _Conn, _vector

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
