"""`/openapi.json` fuzzed against a REAL `synapse serve` (real llama.cpp workers), and raw hostile
bodies thrown at every route.

schemathesis generates requests from the live document (valid and invalid) with and without
the API key: no 500, every status documented, every body conforms to its schema. Hypothesis
then sends what no schema describes (random bytes, invalid UTF-8, 10,000-deep nesting, 1e308
and NaN, a body over the limit, a client that never finishes its body): each must get a 4xx or
a typed 503/504 within a bound, and no worker may be restarted by any of it.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from service.routes import ROUTES as TABLE
from tests.encoding_support import private_store
from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

KEY = "fuzz-key-0123456789"
MAX_BODY = 64 * 1024
BODY_TIMEOUT_S = 1.5
ROUTES = [
    "/v1/embeddings",
    "/v1/rerank",
    "/rerank",
    "/v1/completions",
    "/v2/embed",
    "/v2/rerank",
    "/embed",
    "/tokenize",
    "/detokenize",
]
REPLY_BOUND_S = 30.0  # every answer comes well within this; a hang fails the test


SERVED = ["minilm-l6-v2", "gemma3-270m"]


@pytest.fixture(scope="module")
def server(store_root, module_tmp):
    # A store of its own: the int8 warm-up below records the models' calibration in their
    # manifests, which the session's store must keep as ingest wrote them for other modules.
    root = private_store(store_root, module_tmp / "models", SERVED)
    cfg = server_config(
        root,
        preload=SERVED,
        api_keys=[KEY],
        aliases={"text-embedding-3-small": "minilm-l6-v2"},
        max_body_bytes=MAX_BODY,
        body_timeout_s=BODY_TIMEOUT_S,
        module={"max_generate_tokens": 4},  # generation stays short under fuzzing
    )
    srv = ServerProcess(cfg)
    # The first int8/uint8 answer of a model embeds its calibration corpus (service/encoding.py):
    # tens of seconds on a loaded machine, answered 503 `calibrating` with Retry-After until
    # done. Paid here, once, for the model the fuzzing embeds with (the alias's too), so the
    # fuzzing sees the answers themselves.
    for _ in range(120):
        warm = httpx.post(
            f"{srv.url}/v1/embeddings",
            timeout=60,
            headers={"Authorization": f"Bearer {KEY}"},
            json={"input": "x", "encoding_format": "int8"},
        )
        if warm.status_code != 503:
            break
        time.sleep(float(warm.headers["Retry-After"]))
    assert warm.status_code == 200, warm.text
    srv.restarts_at_start = _restarts(srv)
    yield srv
    srv.stop()


def _restarts(srv: ServerProcess) -> dict[str, int]:
    return {name: lane["restarts"] for name, lane in srv.health()["lanes"].items()}


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# Every documented operation, from the same table the document is built from.
OPERATIONS = [(op.path, op.method.upper()) for op in TABLE]
# Invalid data can only be generated where there is a body to make invalid.
WITH_BODY = [(op.path, op.method.upper()) for op in TABLE if op.request]
OPEN_PATHS = {"/health", "/openapi.json", "/metrics"}

# Schema-valid but refused is right for limits the types cannot state (a token id outside
# the model's vocabulary, an unknown model name): positive_data_acceptance does not apply.
_EXCLUDED = [positive_data_acceptance]
_FUZZ = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,  # the same cases every run: a failure reproduces
    suppress_health_check=list(HealthCheck),
    database=None,
)


def _fuzz(api_schema, path: str, method: str, mode: GenerationMode, headers: dict) -> list:
    """Run one operation's generated cases (schemathesis strategy, hypothesis engine) with
    every response check; returns the statuses seen."""
    statuses: list[int] = []

    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    @_FUZZ
    def run(case) -> None:
        response = case.call_and_validate(
            headers=headers, excluded_checks=_EXCLUDED, timeout=REPLY_BOUND_S
        )
        statuses.append(response.status_code)

    run()
    return statuses


@pytest.mark.parametrize(
    ("path", "method", "mode"),
    [(*op, GenerationMode.POSITIVE) for op in OPERATIONS]
    + [(*op, GenerationMode.NEGATIVE) for op in WITH_BODY],
)
def test_live_document_with_a_key(api_schema, path, method, mode):
    statuses = _fuzz(api_schema, path, method, mode, {"Authorization": f"Bearer {KEY}"})
    assert statuses and all(s < 500 or s in (503, 504) for s in statuses), statuses
    assert 401 not in statuses
    # Invalid data answered 2xx fails schemathesis' negative_data_rejection check.


@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_live_document_without_a_key(api_schema, path, method):
    statuses = _fuzz(api_schema, path, method, GenerationMode.POSITIVE, {})
    assert statuses and all(s < 500 or s in (503, 504) for s in statuses), statuses
    if path not in OPEN_PATHS:
        assert set(statuses) == {401}, statuses


# ---- raw hostile bodies ------------------------------------------------------------------------

_DEEP = b"[" * 10_000 + b"]" * 10_000
_HOSTILE = [
    _DEEP,
    b'{"input": ' + _DEEP + b"}",
    b'{"query": "q", "documents": ' + _DEEP + b"}",
    b'{"prompt": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"}",
    b"\xff\xfe\x00{",
    b'{"input": "x", "dimensions": 1e308}',
    b'{"input": [1e308]}',
    b'{"input": [[101, 1e308, 102]]}',
    b'{"input": NaN}',
    b'{"input": [NaN, Infinity, -Infinity]}',
    b'{"query": "q", "documents": ["a"], "top_n": 1e308}',
    b'{"query": "q", "texts": ["a"], "raw_scores": NaN}',
    b'{"prompt": "x", "max_tokens": 1e308}',
    b'{"prompt": "x", "temperature": 1e308}',
    b'{"prompt": "x", "max_tokens": -1e308}',
    b'{"input": ' + b'"a", ' * 3 + b"}",
    b"",
    b"null",
    b"[]",
    b'"just a string"',
]


def _assert_refused_cleanly(resp: httpx.Response) -> None:
    assert resp.status_code < 500 or resp.status_code in (503, 504), resp.text[:500]
    assert 400 <= resp.status_code, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert err["code"] and err["message"] and err["type"]


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=REPLY_BOUND_S) as client:
        yield client


@pytest.mark.parametrize("route", ROUTES)
def test_named_hostile_bodies_are_4xx(http, route):
    for body in _HOSTILE:
        if route == "/tokenize" and body.startswith(b'{"prompt": "x"'):
            continue  # vLLM's tokenize shape: a valid request there
        _assert_refused_cleanly(http.post(route, content=body))
    over = b'{"input": "' + b"a" * MAX_BODY + b'"}'
    resp = http.post(route, content=over)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_invalid_utf8_in_text_follows_the_sanitization_rule(http):
    """Inside a string it becomes U+FFFD (host/sanitize.py's rule), anywhere else a 400."""
    raw = http.post("/v1/embeddings", content=b'{"input": "caf\xe9 \xff"}')
    clean = http.post("/v1/embeddings", json={"input": "caf\ufffd \ufffd"})
    assert raw.status_code == clean.status_code == 200, raw.text
    assert raw.json()["data"] == clean.json()["data"]
    _assert_refused_cleanly(http.post("/v1/embeddings", content=b'{"input": "x"\xff}'))


_JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    ["input", "query", "documents", "texts", "prompt", "model", "max_tokens", "top_n",
     "dimensions", "encoding_format", "grammar", "truncate"]
)  # fmt: skip
_BODIES = st.one_of(
    st.binary(max_size=512),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.dictionaries(_FIELDS, _JSONISH, max_size=5).map(lambda d: json.dumps(d).encode()),
    _JSONISH.map(lambda v: json.dumps(v).encode()),
)


@given(route=st.sampled_from(ROUTES), body=_BODIES)
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_bodies_never_break_the_server(http, route, body):
    resp = http.post(route, content=body)
    if resp.status_code == 200:  # random fields can form a valid request: fine
        return
    _assert_refused_cleanly(resp)


def _raw_exchange(url: str, head: bytes, body: bytes, bound_s: float) -> bytes:
    """Send `head` and a partial `body`, then stall; return what the server answers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=bound_s) as sock:
        sock.sendall(head + body)
        reply = b""
        while chunk := sock.recv(65536):  # the server closes after its answer
            reply += chunk
        return reply


@pytest.mark.parametrize(
    "framing",
    [b"Content-Length: 1000\r\n", b"Transfer-Encoding: chunked\r\n"],
    ids=["content-length", "chunked"],
)
def test_a_client_that_never_finishes_its_body_gets_408(server, framing):
    def stall(route: str) -> bytes:
        head = (
            (
                f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                "Content-Type: application/json\r\n"
            ).encode()
            + framing
            + b"\r\n"
        )
        partial = b'{"input": "' if b"Length" in framing else b'b\r\n{"input": "\r\n'
        return _raw_exchange(server.url, head, partial, BODY_TIMEOUT_S + REPLY_BOUND_S)

    with ThreadPoolExecutor(len(ROUTES)) as pool:  # all routes stall at once
        replies = list(pool.map(stall, ROUTES))
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:300]
        assert b'"code":"request_timeout"' in reply


def test_a_declared_oversize_body_that_stalls_gets_413_not_408(server):
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
    ).encode()
    reply = _raw_exchange(server.url, head, b'{"input": "', BODY_TIMEOUT_S + REPLY_BOUND_S)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:300]  # what the client must change
    assert b"connection: close" in reply.lower()


def test_a_streamed_body_over_the_limit_is_read_to_its_end_then_refused(server):
    """A chunked body has no size to refuse up front: the server reads it to the limit, then
    drains the rest before its 413, so a client still sending sees the answer, not a reset."""
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    piece = b"a" * 65536
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=REPLY_BOUND_S) as sock:
        sock.sendall(head + b'b\r\n{"input": "\r\n')
        for _ in range(4 * 1024 * 1024 // len(piece)):  # 64 x the limit, in 64 KiB chunks
            sock.sendall(chunk)
        sock.sendall(b'2\r\n"}\r\n0\r\n\r\n')
        reply = b""
        while part := sock.recv(65536):
            reply += part
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:300]
    assert b'"code":"request_too_large"' in reply


def test_after_all_of_it_the_server_is_healthy_and_no_worker_restarted(server):
    health = server.health()
    assert health["status"] == "ok", health
    assert _restarts(server) == server.restarts_at_start
    assert all(lane["strikes"] == 0 for lane in health["lanes"].values()), health
