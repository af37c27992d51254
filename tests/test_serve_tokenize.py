"""`POST /tokenize`, `/detokenize` and `/decode` in TEI's and vLLM's shapes against a real
server: the ids are what embedding feeds the model, offsets index the sanitized text, and the
embedding limits apply."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MINILM = "minilm-l6-v2"
MAX_INPUT_BYTES = 4096


@pytest.fixture(scope="module")
def server(store_root, prompted_model):
    cfg = server_config(
        store_root,
        preload=[MINILM],
        module={"budgets": {"max_inputs": 8, "max_input_bytes": MAX_INPUT_BYTES}},
        scheduler={"max_queue_items": 8},
    )
    srv = ServerProcess(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _ok(resp: httpx.Response):
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_tei_shape_tokens_with_text_offsets_and_specials(http):
    (tokens,) = _ok(http.post("/tokenize", json={"inputs": "Héllo [SEP] world"}))
    assert [t["text"] for t in tokens] == ["[CLS]", "Héllo", "[", "SEP", "]", "world", "[SEP]"]
    assert [t["special"] for t in tokens] == [True] + [False] * 5 + [True]
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert (tokens[1]["start"], tokens[1]["stop"]) == (0, 5)
    assert (tokens[5]["start"], tokens[5]["stop"]) == (12, 17)
    bare = _ok(http.post("/tokenize", json={"inputs": ["a", "b c"], "add_special_tokens": False}))
    assert [[t["text"] for t in seq] for seq in bare] == [["a"], ["b", "c"]]


def test_the_ids_are_what_embedding_feeds_the_model(http):
    text = "The cat sits on the mat."
    (tokens,) = _ok(http.post("/tokenize", json={"inputs": text}))
    ids = [t["id"] for t in tokens]
    emb = lambda x: np.array(  # noqa: E731
        _ok(http.post("/v1/embeddings", json={"input": x}))["data"][0]["embedding"]
    )
    assert float(emb(text) @ emb(ids)) >= 0.9999
    n = _ok(http.post("/v1/embeddings", json={"input": text}))["data"][0]["n_tokens"]
    assert n == len(ids)


def test_the_models_prompt_is_tokenized_as_embedding_prepends_it(http, prompted_model):
    body = {"inputs": "x", "model": prompted_model}
    (default,) = _ok(http.post("/tokenize", json=body))
    (passage,) = _ok(http.post("/tokenize", json={**body, "prompt_name": "passage"}))
    assert [t["text"] for t in default] == ["[CLS]", "query", ":", "x", "[SEP]"]
    assert [t["text"] for t in passage][1] == "passage"
    bad = http.post("/tokenize", json={**body, "prompt_name": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_name"


def test_vllm_shape(http):
    got = _ok(http.post("/tokenize", json={"prompt": "a cat", "return_token_strs": True}))
    assert got == {
        "count": 4,
        "max_model_len": 256,
        "tokens": [101, 1037, 4937, 102],
        "token_strs": ["[CLS]", "a", "cat", "[SEP]"],
    }
    plain = _ok(http.post("/tokenize", json={"prompt": "a cat", "add_special_tokens": False}))
    assert plain == {"count": 2, "max_model_len": 256, "tokens": [1037, 4937], "token_strs": None}
    text = _ok(http.post("/detokenize", json={"tokens": [101, 1037, 4937, 102]}))
    assert text == {"prompt": "[CLS] a cat [SEP]"}  # vLLM keeps special tokens by default
    skip = {"tokens": [101, 1037, 4937, 102], "skip_special_tokens": True}
    assert _ok(http.post("/detokenize", json=skip)) == {"prompt": "a cat"}


def test_tei_decode(http):
    for path in ("/decode", "/detokenize"):
        assert _ok(http.post(path, json={"ids": [101, 1037, 4937, 102]})) == ["a cat"]
        batch = {"ids": [[1037, 4937], [4937]], "skip_special_tokens": False}
        assert _ok(http.post(path, json=batch)) == ["a cat", "cat"]


def test_sanitizing_and_limits_are_embeddings(http):
    (tokens,) = _ok(http.post("/tokenize", json={"inputs": "a\x00b"}))
    assert [t["text"] for t in tokens[1:-1]] == ["a", "b"]  # the control became a space
    raw = _ok(
        http.post(
            "/tokenize",
            content=b'{"inputs": "caf\xe9 x"}',
            headers={"content-type": "application/json"},
        )
    )
    assert raw == _ok(http.post("/tokenize", json={"inputs": "caf\ufffd x"}))  # U+FFFD
    long = "word " * 1000  # never cut: the count says it is over the limit
    got = _ok(http.post("/tokenize", json={"prompt": long[: MAX_INPUT_BYTES - 5]}))
    assert got["count"] > got["max_model_len"]

    def error(path: str, body: dict) -> dict:
        resp = http.post(path, json=body)
        assert resp.status_code == 400, resp.text
        return resp.json()["error"]

    assert error("/tokenize", {"inputs": ["x"] * 9})["param"] == "inputs"
    assert error("/tokenize", {"prompt": "x" * (MAX_INPUT_BYTES + 1)})["param"] == "prompt"
    assert error("/tokenize", {})["param"] == "inputs"
    assert error("/tokenize", {"inputs": "a", "prompt": "b"})["param"] == "inputs"
    assert error("/tokenize", {"inputs": []})["param"] == "inputs"
    assert error("/detokenize", {"tokens": [10**6]})["param"] == "tokens"
    assert error("/decode", {"ids": [[1], [10**6]]})["param"] == "ids"
    assert error("/decode", {"ids": [[1]] * 9})["param"] == "ids"
    assert error("/detokenize", {})["param"] == "tokens"
    assert http.post("/tokenize", json={"inputs": "x", "model": "nope"}).status_code == 404
