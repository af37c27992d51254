"""`synapse serve` end to end: a real server process on a loopback port, real HTTP clients
(the official `openai` package and httpx), real llama.cpp workers."""

from __future__ import annotations

import asyncio
import base64
import re
import shutil
import tempfile

import httpx
import numpy as np
import openai
import pytest

from host.config import HostConfig
from host.module import Module, ModuleConfig
from tests.test_serve_support import ServerProcess, metric, server_config

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

TEXTS = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply on Monday.",
    "Le chat dort sur le tapis.",
    "",
    "emoji 🙂 and accents: café, naïve",
]


@pytest.fixture(scope="module")
def server(store_root):
    cfg = server_config(
        store_root,
        preload=["minilm-l6-v2"],
        matryoshka_models=["minilm-l6-v2-f32"],  # to exercise truncation; MiniLM stays refused
    )
    srv = ServerProcess(cfg)
    yield srv
    srv.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


async def _module_vectors(store_root: str, texts: list[str], model: str) -> np.ndarray:
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    try:
        cfg = ModuleConfig(
            store_root=store_root, host=HostConfig(runtime_dir=runtime, ping_interval_s=0)
        )
        async with Module(cfg) as mod:
            return (await mod.embed(texts, model=model)).vectors
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def _assert_error(resp: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code", "param"}
    assert err["code"] == code and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- embeddings --------------------------------------------------------------------------------


async def test_openai_client_gets_the_module_vectors_in_float_and_base64(client, store_root):
    expected = await _module_vectors(store_root, TEXTS, "minilm-l6-v2")
    resp = client.embeddings.create(input=TEXTS, model="minilm-l6-v2")
    got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], np.float32)
    assert got.shape == (len(TEXTS), 384) and resp.model == "minilm-l6-v2"
    assert _cosines(got, expected).min() >= 0.9999
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(TEXTS)

    b64 = client.embeddings.create(input=TEXTS, model="minilm-l6-v2", encoding_format="base64")
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data]
    )
    assert np.array_equal(decoded, got)  # same floats, bit for bit

    single = client.embeddings.create(input=TEXTS[0], model="minilm-l6-v2")
    assert len(single.data) == 1
    assert _cosines(np.array([single.data[0].embedding]), expected[:1])[0] >= 0.9999


def test_float_vectors_are_written_at_float32_precision(http):
    """Each JSON number is float32's shortest round-trip form: exactly the model's float32
    once parsed, with no float64 digits (at most 9 significant, where repr of the widened
    value writes 16-17)."""
    body = {"input": TEXTS[:2], "model": "minilm-l6-v2"}
    floats = http.post("/v1/embeddings", json=body)
    b64 = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    numbers = re.findall(rb'"embedding":\[([^\]]*)\]', floats.content)
    assert len(numbers) == 2
    for raw, item in zip(numbers, b64["data"], strict=True):
        tokens = raw.split(b",")
        exact = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert np.array_equal(np.array([float(t) for t in tokens], np.float32), exact)
        assert max(_significant_digits(t) for t in tokens) <= 9


def _significant_digits(number: bytes) -> int:
    mantissa = number.lstrip(b"-").lower().split(b"e")[0]
    return len(mantissa.replace(b".", b"").strip(b"0"))


async def test_token_array_inputs_embed_like_their_text(http, store_root):
    from host.tokenization import Tokenizer

    tok = Tokenizer.from_file(
        f"{store_root}/minilm-l6-v2/tokenizer.json", max_tokens=256, hard_limit=512
    )
    ids = [a.tolist() for a in tok.encode(TEXTS[:3], truncate=True).ids]
    by_text = http.post("/v1/embeddings", json={"input": TEXTS[:3]}).json()
    by_ids = http.post("/v1/embeddings", json={"input": ids}).json()
    one = http.post("/v1/embeddings", json={"input": ids[0]}).json()
    a = np.array([d["embedding"] for d in by_text["data"]])
    b = np.array([d["embedding"] for d in by_ids["data"]])
    assert _cosines(a, b).min() >= 0.9999
    assert by_ids["usage"]["prompt_tokens"] == sum(len(x) for x in ids)
    assert _cosines(np.array([one["data"][0]["embedding"]]), a[:1])[0] >= 0.9999


def test_dimensions_only_where_the_model_allows_it(http):
    refused = http.post("/v1/embeddings", json={"input": "x", "dimensions": 128})
    err = _assert_error(refused, 400, "invalid_request", "dimensions")
    assert "Matryoshka" in err["message"]
    full = http.post("/v1/embeddings", json={"input": "x", "dimensions": 384})
    assert full.status_code == 200 and len(full.json()["data"][0]["embedding"]) == 384
    too_big = http.post("/v1/embeddings", json={"input": "x", "dimensions": 385})
    _assert_error(too_big, 400, "invalid_request", "dimensions")

    model = "minilm-l6-v2-f32"  # listed in matryoshka_models by this server's config
    whole = http.post("/v1/embeddings", json={"input": TEXTS[:2], "model": model}).json()
    cut = http.post(
        "/v1/embeddings", json={"input": TEXTS[:2], "model": model, "dimensions": 64}
    ).json()
    v = np.array([d["embedding"] for d in whole["data"]])[:, :64]
    want = v / np.linalg.norm(v, axis=1, keepdims=True)
    got = np.array([d["embedding"] for d in cut["data"]])
    assert got.shape == (2, 64)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.abs(got - want).max() < 1e-4


def test_dimensions_for_a_model_ingested_with_matryoshka_dims(http, prompted_model):
    # Not in this server's matryoshka_models: its manifest's widths are what allow the cut.
    whole = http.post("/v1/embeddings", json={"input": TEXTS[:2], "model": prompted_model})
    cut = http.post(
        "/v1/embeddings", json={"input": TEXTS[:2], "model": prompted_model, "dimensions": 128}
    )
    assert whole.status_code == cut.status_code == 200, cut.text
    v = np.array([d["embedding"] for d in whole.json()["data"]])[:, :128]
    got = np.array([d["embedding"] for d in cut.json()["data"]])
    assert got.shape == (2, 128)
    assert np.abs(got - v / np.linalg.norm(v, axis=1, keepdims=True)).max() < 1e-4
    too_big = http.post(
        "/v1/embeddings", json={"input": "x", "model": prompted_model, "dimensions": 385}
    )
    _assert_error(too_big, 400, "invalid_request", "dimensions")


# ---- rerank ------------------------------------------------------------------------------------

QUERY = "where do cats sleep?"
DOCS = ["Stocks fell on Monday.", "The cat sleeps on the windowsill.", "def f(): pass"]


def test_rerank_jina_cohere_shape_says_it_is_a_bi_encoder(http):
    resp = http.post(
        "/v1/rerank",
        json={"model": "minilm-l6-v2", "query": QUERY, "documents": DOCS, "top_n": 2},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    results = body["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["document"] == {"text": DOCS[1]}
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert body["meta"]["method"] == "bi-encoder-cosine" and "cosine" in body["meta"]["warning"]
    assert body["model"] == "minilm-l6-v2" and body["usage"]["total_tokens"] > 0

    # The scores are the cosine of the served embeddings.
    emb = http.post("/v1/embeddings", json={"input": [QUERY, *DOCS]}).json()
    v = np.array([d["embedding"] for d in emb["data"]])
    cos = v[1:] @ v[0]
    for r in results:
        assert abs(r["relevance_score"] - cos[r["index"]]) < 1e-3

    objects = http.post(
        "/v1/rerank",
        json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False},
    ).json()
    assert [r["index"] for r in objects["results"]][0] == 1 and len(objects["results"]) == 3
    assert all("document" not in r for r in objects["results"])


def test_rerank_tei_shape(http):
    resp = http.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-synapse-rerank-method"] == "bi-encoder-cosine"
    body = resp.json()
    assert isinstance(body, list) and len(body) == 3
    assert body[0]["index"] == 1 and body[0]["text"] == DOCS[1]
    scores = [x["score"] for x in body]
    assert scores == sorted(scores, reverse=True)
    bare = http.post("/rerank", json={"query": QUERY, "texts": DOCS}).json()
    assert all("text" not in x for x in bare)
    _assert_error(http.post("/rerank", json={"query": QUERY, "texts": []}), 400, "invalid_request")


# ---- completions -------------------------------------------------------------------------------


def test_completions_with_and_without_grammar(client):
    plain = client.completions.create(
        model="gemma3-270m", prompt="The capital of France is", max_tokens=8
    )
    choice = plain.choices[0]
    assert plain.object == "text_completion" and choice.index == 0 and choice.text
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert plain.usage.completion_tokens <= 8
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    grammar = 'root ::= "answer: " ("yes" | "no") "."'
    constrained = client.completions.create(
        model="gemma3-270m",
        prompt="Is water wet?",
        max_tokens=16,
        extra_body={"grammar": grammar},
    )
    assert re.fullmatch(r"answer: (yes|no)\.", constrained.choices[0].text)

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="gemma3-270m", prompt="x", max_tokens=4, extra_body={"grammar": "root ::= nope"}
        )
    assert info.value.body["code"] == "invalid_request" and info.value.body["param"] == "grammar"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="gemma3-270m", prompt="x", max_tokens=65)
    with pytest.raises(openai.BadRequestError, match="greedy"):
        client.completions.create(model="gemma3-270m", prompt="x", max_tokens=4, temperature=0.8)
    with pytest.raises(openai.BadRequestError, match="not an embedding model"):
        client.embeddings.create(model="gemma3-270m", input="x")


# ---- bad inputs --------------------------------------------------------------------------------


def test_bad_inputs_get_the_right_4xx_and_the_server_stays_up(http):
    post = http.post
    headers = {"content-type": "application/json"}
    _assert_error(
        post("/v1/embeddings", content=b'{"input": [', headers=headers), 400, "invalid_request"
    )
    _assert_error(post("/v1/embeddings", content=b"", headers=headers), 400, "invalid_request")
    _assert_error(post("/v1/embeddings", json=[1, 2]), 400, "invalid_request")
    _assert_error(post("/v1/embeddings", json={"model": "minilm-l6-v2"}), 400, "invalid_request")
    _assert_error(post("/v1/embeddings", json={"input": 5}), 400, "invalid_request", "input")
    _assert_error(post("/v1/embeddings", json={"input": ["a", 1]}), 400, "invalid_request", "input")
    _assert_error(post("/v1/embeddings", json={"input": [1.5]}), 400, "invalid_request", "input")
    _assert_error(
        post("/v1/embeddings", json={"input": "x", "model": 3}), 400, "invalid_request", "model"
    )
    _assert_error(
        post("/v1/embeddings", json={"input": "x", "encoding_format": "hex"}),
        400,
        "invalid_request",
        "encoding_format",
    )
    _assert_error(post("/v1/embeddings", json={"input": []}), 400, "invalid_request", "input")
    _assert_error(post("/v1/embeddings", json={"input": [[]]}), 400, "invalid_request", "input")
    err = _assert_error(
        post("/v1/embeddings", json={"input": ["x"] * 2049}), 400, "invalid_request"
    )
    assert "2048" in err["message"]
    err = _assert_error(
        post("/v1/embeddings", json={"input": [[101, 10**6, 102]]}), 400, "invalid_request", "input"
    )
    assert "vocabulary" in err["message"]
    _assert_error(post("/v1/embeddings", json={"input": [[-1]]}), 400, "invalid_request")
    _assert_error(  # beyond int64: a 400 like any other id outside the vocabulary, not a 500
        post("/v1/embeddings", json={"input": [[101, 10**25]]}), 400, "invalid_request", "input"
    )
    _assert_error(
        post("/v1/embeddings", json={"input": [[1000] * 513]}), 400, "invalid_request", "input"
    )
    err = _assert_error(
        post("/v1/embeddings", json={"input": "x", "model": "no-such-model"}),
        404,
        "model_not_found",
        "model",
    )
    assert "no-such-model" in err["message"]
    _assert_error(
        post("/v1/embeddings", json={"input": "x", "model": "../Etc"}), 404, "model_not_found"
    )

    big = b'{"input": "' + b"a" * (10 * 1024 * 1024) + b'"}'
    resp = post("/v1/embeddings", content=big, headers=headers)
    err = _assert_error(resp, 413, "request_too_large")
    assert "limit" in err["message"]

    def chunks():
        yield b'{"input": "'
        for _ in range(10):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    _assert_error(
        post("/v1/embeddings", content=chunks(), headers=headers), 413, "request_too_large"
    )
    _assert_error(http.get("/v1/embeddings"), 405, "method_not_allowed")
    _assert_error(http.get("/v2/nothing"), 404, "not_found")
    _assert_error(post("/v1/rerank", json={"query": "q"}), 400, "invalid_request")
    _assert_error(
        post("/v1/rerank", json={"query": "q", "documents": "d"}),
        400,
        "invalid_request",
        "documents",
    )
    _assert_error(
        post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}),
        400,
        "invalid_request",
        "prompt",
    )
    _assert_error(
        post("/v1/completions", json={"prompt": "a", "stream": True}), 400, "unsupported", "stream"
    )
    err = _assert_error(  # over the model's limit: completions have no truncate to suggest
        post("/v1/completions", json={"prompt": "word " * 2100, "max_tokens": 1}),
        400,
        "invalid_request",
        "prompt",
    )
    assert "shorten it" in err["message"] and "truncate" not in err["message"]

    assert http.get("/health").status_code == 200
    ok = post("/v1/embeddings", json={"input": "still alive"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


# ---- concurrency -------------------------------------------------------------------------------


async def test_concurrent_clients_are_batched_and_get_their_own_vectors(server, http):
    texts = [f"sentence number {i} about topic {i % 7}" for i in range(64)]
    alone = {
        t: np.array(http.post("/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"])
        for t in texts[:8]
    }
    before = http.get("/metrics").text
    batches0 = metric(before, "synapse_batch_items_count", model="minilm-l6-v2") or 0

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
        sem = asyncio.Semaphore(32)

        async def one(t: str) -> tuple[str, np.ndarray]:
            async with sem:
                r = await ac.post("/v1/embeddings", json={"input": t})
                assert r.status_code == 200, r.text
                return t, np.array(r.json()["data"][0]["embedding"])

        results = await asyncio.wait_for(asyncio.gather(*(one(t) for t in texts * 2)), 120)

    for t, v in results:
        if t in alone:  # each caller got its own row back, not a neighbour's
            assert float(v @ alone[t]) >= 0.9999
    after = http.get("/metrics").text
    batches = metric(after, "synapse_batch_items_count", model="minilm-l6-v2") - batches0
    assert batches < len(results), "concurrent requests should have been coalesced"
    assert metric(after, "synapse_http_requests_total", endpoint="/v1/embeddings", status="200")


# ---- status endpoints --------------------------------------------------------------------------


def test_health_models_and_metrics(http, server):
    health = http.get("/health")
    assert health.status_code == 200
    lane = health.json()["lanes"]["minilm-l6-v2"]
    assert lane["status"] in ("ready", "busy") and lane["pid"] > 0 and not lane["quarantined"]
    # Which lane serves the model and why (Linux: llama.cpp on the CPU, never a certified ANE).
    served = health.json()["models"]["minilm-l6-v2"]
    assert served["lane"] == "llama" and served["device"] == "cpu"
    assert served["reason"].startswith("llama/cpu: ") and "ANE certificate" in served["reason"]

    models = http.get("/v1/models").json()
    ids = {m["id"]: m for m in models["data"]}
    assert models["object"] == "list" and {"minilm-l6-v2", "gemma3-270m"} <= set(ids)
    assert ids["minilm-l6-v2"]["loaded"] and ids["minilm-l6-v2"]["dims"] == 384
    assert ids["minilm-l6-v2"]["lane"] == "llama"
    assert ids["minilm-l6-v2"]["lane_reason"] == served["reason"]
    assert ids["gemma3-270m"]["lane_reason"] == "llama/cpu: generation runs on llama.cpp only"
    assert ids["minilm-l6-v2-f16"]["precision"] == {"llama": "f16", "ane": "fp16"}
    assert ids["gemma3-270m"]["precision"] == {"llama": "q4_k_m"}
    assert http.get("/v1/models/minilm-l6-v2").json()["id"] == "minilm-l6-v2"
    _assert_error(http.get("/v1/models/nope"), 404, "model_not_found")

    text = http.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    for name in (
        "synapse_http_requests_total",
        "synapse_http_request_duration_seconds_bucket",
        "synapse_queue_depth",
        "synapse_batch_items_bucket",
        "synapse_batch_tokens_bucket",
        "synapse_worker_restarts_total",
        "synapse_lane_strikes",
        "synapse_lane_quarantines_total",
        "synapse_compile_cache_hits_total",
    ):
        assert name in text.text, name
    assert metric(text.text, "synapse_compile_cache_hits_total") == 0
    assert metric(text.text, "synapse_worker_restarts_total", lane="llama.minilm-l6-v2") == 0
