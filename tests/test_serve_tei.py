"""TEI's shapes against a real server, with httpx as TEI's own clients speak it: `POST /embed`
(bare vectors, per-input facts in headers) and `GET /info`."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MINILM = "minilm-l6-v2"
LONG = " ".join(f"word{i}" for i in range(400))


@pytest.fixture(scope="module")
def server(store_root, prompted_model):
    srv = ServerProcess(server_config(store_root, preload=[MINILM, prompted_model]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _openai(http, **body) -> np.ndarray:
    resp = http.post("/v1/embeddings", json=body)
    assert resp.status_code == 200, resp.text
    return np.array([d["embedding"] for d in resp.json()["data"]], np.float32)


def _embed(http, **body) -> tuple[np.ndarray, httpx.Response]:
    resp = http.post("/embed", json=body)
    assert resp.status_code == 200, resp.text
    return np.array(resp.json(), np.float32), resp


def test_embed_is_a_bare_list_of_the_served_vectors(http):
    texts = ["The cat sits on the mat.", "Stocks fell."]
    got, resp = _embed(http, inputs=texts)
    assert got.shape == (2, 384)
    assert np.array_equal(got, _openai(http, input=texts))  # the same floats, bit for bit
    one, _ = _embed(http, inputs=texts[0])
    assert one.shape == (1, 384) and float(one[0] @ got[0]) >= 0.9999  # alone, not batched
    assert resp.headers["x-synapse-model"] == MINILM
    assert int(resp.headers["x-synapse-tokens"]) > 2 and resp.headers["x-synapse-truncated"] == ""
    raw, _ = _embed(http, inputs=texts, normalize=False)
    assert np.array_equal(raw, _openai(http, input=texts, normalize=False))
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 1e-2


def test_embed_truncation_direction_and_refusal(http):
    right, resp = _embed(http, inputs=["short", LONG])
    assert resp.headers["x-synapse-truncated"] == "1"
    left, _ = _embed(http, inputs=["short", LONG], truncation_direction="Left")
    assert np.array_equal(left, _openai(http, input=["short", LONG], truncation_direction="left"))
    assert float(left[1] @ right[1]) < 0.999  # the other end of the text was kept
    default, _ = _embed(http, inputs=LONG, truncate=None)  # null: the default, true
    assert np.array_equal(default[0], right[1])
    refused = http.post("/embed", json={"inputs": ["short", LONG], "truncate": False})
    assert refused.status_code == 400
    err = refused.json()["error"]
    assert err["param"] == "inputs" and "input 1 has" in err["message"]


def test_embed_prompts_and_dimensions(http, prompted_model):
    texts = ["where do cats sleep?"]
    for name in ("query", "passage"):
        got, _ = _embed(http, inputs=texts, model=prompted_model, prompt_name=name)
        assert np.array_equal(
            got, _openai(http, input=texts, model=prompted_model, prompt_name=name)
        )
    literal, _ = _embed(http, inputs=texts, model=prompted_model, prompt="passage: ")
    passage, _ = _embed(http, inputs=texts, model=prompted_model, prompt_name="passage")
    assert np.array_equal(literal, passage)
    bad = http.post("/embed", json={"inputs": "x", "model": prompted_model, "prompt_name": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_name"
    cut, _ = _embed(http, inputs=texts, model=prompted_model, dimensions=128)
    assert cut.shape == (1, 128) and abs(np.linalg.norm(cut) - 1) < 1e-5
    refused = http.post("/embed", json={"inputs": "x", "dimensions": 128})  # not Matryoshka
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


def test_embed_token_arrays_and_bad_inputs(http):
    ids = [[101, 4937, 102], [101, 3899, 102]]
    got, _ = _embed(http, inputs=ids)
    assert np.array_equal(got, _openai(http, input=ids))
    for inputs in (5, [], ["a", 1], None):
        resp = http.post("/embed", json={"inputs": inputs})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "inputs", resp.text


def test_info_has_teis_fields(http, prompted_model):
    info = http.get("/info").json()
    assert info["model_id"] == MINILM
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["max_tokens_limit"] == 512
    assert info["max_client_batch_size"] == 2048 and info["auto_truncate"] is True
    assert info["prompts"] is None and info["dims"] == 384
    for field in (
        "model_sha",
        "model_dtype",
        "max_concurrent_requests",
        "max_batch_tokens",
        "max_batch_requests",
        "tokenization_workers",
        "version",
        "sha",
        "docker_label",
    ):
        assert field in info, field
    prompted = http.get("/info", params={"model": prompted_model}).json()
    assert prompted["prompts"] == {"query": "query: ", "passage": "passage: "}
    assert prompted["default_prompt_name"] == "query" and prompted["model_dtype"] == "f16"
    assert http.get("/info", params={"model": "nope"}).status_code == 404
    generate = http.get("/info", params={"model": "gemma3-270m"})
    assert generate.status_code == 400 and generate.json()["error"]["param"] == "model"


def test_embed_all_and_encode_give_every_tokens_state_from_one_pass(http):
    """TEI's /embed_all: one unnormalized state per token (specials included) per input; /encode
    returns them with the pooled vector of the same pass, which is /embed's."""
    texts = ["The cat sits on the mat.", "Stocks fell."]
    resp = http.post("/embed_all", json={"inputs": texts})
    assert resp.status_code == 200, resp.text
    states = [np.array(x, np.float32) for x in resp.json()]
    lengths = [len(x) for x in http.post("/tokenize", json={"inputs": texts}).json()]
    assert [s.shape for s in states] == [(n, 384) for n in lengths]
    assert int(resp.headers["x-synapse-tokens"]) == sum(lengths)
    assert np.abs(np.linalg.norm(states[0], axis=1) - 1).min() > 1e-2  # not normalized
    both = http.post("/encode", json={"inputs": texts, "outputs": ["tokens", "dense"]})
    assert both.status_code == 200, both.text
    data = both.json()["data"]
    assert np.allclose(np.array(data[1]["tokens"], np.float32), states[1], atol=1e-6)
    dense = np.array([d["dense"] for d in data], np.float32)
    embedded, _ = _embed(http, inputs=texts)
    assert float((dense * embedded).sum(axis=1).min()) >= 0.99999
    assert both.json()["usage"]["total_tokens"] == sum(lengths)


def test_token_outputs_refuse_what_the_model_has_not(http):
    resp = http.post("/embed_sparse", json={"inputs": "a"})
    assert resp.status_code == 400 and "no sparse head" in resp.text, resp.text
    resp = http.post("/encode", json={"inputs": "a", "outputs": ["dense", "dense"]})
    assert resp.status_code == 400 and "once" in resp.text, resp.text
    resp = http.post("/encode", json={"inputs": "a", "outputs": []})
    assert resp.status_code == 400, resp.text
    resp = http.post("/embed_all", json={"inputs": []})
    assert resp.status_code == 400 and "non-empty" in resp.text, resp.text


def test_late_chunking_on_v1_embeddings(http):
    """Jina's `late_chunking`: one vector per chunk of one document, not the chunks alone;
    usage counts every token read, n_tokens each chunk's own."""
    chunks = ["The cat sat on the mat. ", "It purred softly. ", "Then it slept."]
    resp = http.post("/v1/embeddings", json={"input": chunks, "late_chunking": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    late = np.array([d["embedding"] for d in body["data"]], np.float32)
    alone = _openai(http, input=chunks)
    assert late.shape == alone.shape == (3, 384)
    assert float((late * alone).sum(axis=1).max()) < 0.9999
    assert body["usage"]["total_tokens"] >= sum(d["n_tokens"] for d in body["data"])
    resp = http.post("/v1/embeddings", json={"input": [[1, 2]], "late_chunking": True})
    assert resp.status_code == 400 and "chunks as texts" in resp.text
