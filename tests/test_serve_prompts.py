"""Prompts, visible truncation and `normalize` over HTTP (`/v1/embeddings` through the official
`openai` client and httpx; the rerank routes' `truncate` / `truncation_direction`), against a
real server. Judged by exact construction: the served vector of a prompted or cut text equals
the served vector of the token array that prompt or cut should give."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from host.tokenization import Tokenizer
from tests.conftest import PROMPTS
from tests.test_serve_support import ServerProcess, server_config

MINILM = "minilm-l6-v2"
LONG = " ".join(f"word{i}" for i in range(400))  # well over MiniLM's 256-token limit


@pytest.fixture(scope="module")
def server(store_root, prompted_model):
    srv = ServerProcess(server_config(store_root, preload=[MINILM, prompted_model]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(store_root) -> Tokenizer:
    return Tokenizer.from_file(
        f"{store_root}/{MINILM}/tokenizer.json", max_tokens=256, hard_limit=512
    )


def _vectors(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    return np.array([d["embedding"] for d in resp.json()["data"]], np.float32)


def _embed_ids(http, ids: list[list[int]], model: str) -> np.ndarray:
    return _vectors(http.post("/v1/embeddings", json={"input": ids, "model": model}))


def _bare(tok: Tokenizer, text: str) -> list[int]:
    return tok.tokenize([text], add_special_tokens=False)[0].ids


CLS, SEP = 101, 102


def _close(a: np.ndarray, b: np.ndarray) -> None:
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() >= 0.9999, cos


# ---- prompts -----------------------------------------------------------------------------------


@pytest.mark.model
def test_prompt_name_prompt_and_the_default_prompt(http, tok, prompted_model):
    texts = ["where do cats sleep?", "Cats sleep on windowsills."]
    post = lambda **kw: http.post(  # noqa: E731
        "/v1/embeddings", json={"input": texts, "model": prompted_model, **kw}
    )
    default, query, passage = post(), post(prompt_name="query"), post(prompt_name="passage")
    literal, none = post(prompt="passage: "), post(prompt="")
    for name, resp in (("query", query), ("passage", passage)):
        want = [[CLS, *_bare(tok, PROMPTS[name] + t), SEP] for t in texts]
        _close(_vectors(resp), _embed_ids(http, want, prompted_model))
        assert [d["n_tokens"] for d in resp.json()["data"]] == [len(w) for w in want]
    # No prompt asked for: the model's default ("query"); "" asks for none.
    _close(_vectors(default), _vectors(query))
    _close(_vectors(literal), _vectors(passage))
    bare = [[CLS, *_bare(tok, t), SEP] for t in texts]
    _close(_vectors(none), _embed_ids(http, bare, prompted_model))
    assert not np.allclose(_vectors(query), _vectors(passage), atol=1e-3)
    usage = passage.json()["usage"]
    assert usage["prompt_tokens"] == sum(d["n_tokens"] for d in passage.json()["data"])


@pytest.mark.model
def test_openai_client_sends_prompts_and_reads_the_extension_fields(server, prompted_model):
    import openai  # here: its import costs the fast loop, which collects this module

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    resp = client.embeddings.create(
        input=["a text"], model=prompted_model, extra_body={"prompt_name": "passage"}
    )
    item = resp.data[0]
    assert len(item.embedding) == 384
    assert item.model_extra == {"n_tokens": 6, "truncated": False}  # [CLS] passage : a text [SEP]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(
            input="x", model=prompted_model, extra_body={"prompt_name": "nope"}
        )
    body = info.value.body
    assert body["param"] == "prompt_name" and body["prompts"] == ["passage", "query"]
    assert "'passage', 'query'" in body["message"]


@pytest.mark.model
def test_prompt_refusals(http, prompted_model):
    def error(body: dict) -> dict:
        resp = http.post("/v1/embeddings", json={"model": prompted_model, **body})
        assert resp.status_code == 400, resp.text
        return resp.json()["error"]

    err = error({"input": "x", "prompt_name": "classification"})
    assert err["param"] == "prompt_name" and "its prompts: 'passage', 'query'" in err["message"]
    assert error({"input": "x", "prompt_name": "query", "prompt": "q: "})["param"] == "prompt"
    # Token arrays are embedded as given: a prompt cannot be prepended to them.
    assert error({"input": [[101, 102]], "prompt_name": "query"})["param"] == "prompt_name"
    # A model without prompts knows no names.
    resp = http.post("/v1/embeddings", json={"input": "x", "prompt_name": "query"})
    assert resp.status_code == 400 and "its prompts: none" in resp.json()["error"]["message"]


# ---- truncation --------------------------------------------------------------------------------


@pytest.mark.model
def test_right_and_left_cuts_are_the_token_arrays_they_should_be(http, tok):
    ids = _bare(tok, LONG)
    right = http.post("/v1/embeddings", json={"input": [LONG, "short"]})
    left = http.post(
        "/v1/embeddings", json={"input": [LONG, "short"], "truncation_direction": "left"}
    )
    for resp in (right, left):
        data = resp.json()["data"]
        assert [(d["n_tokens"], d["truncated"]) for d in data] == [(256, True), (3, False)]
    _close(_vectors(right)[:1], _embed_ids(http, [[CLS, *ids[:254], SEP]], MINILM))
    _close(_vectors(left)[:1], _embed_ids(http, [[CLS, *ids[-254:], SEP]], MINILM))
    # TEI's capitalized spelling is the same request.
    tei = http.post("/v1/embeddings", json={"input": LONG, "truncation_direction": "Left"})
    _close(_vectors(tei), _vectors(left)[:1])


@pytest.mark.model
def test_a_left_cut_keeps_the_prompt(http, tok, prompted_model):
    resp = http.post(
        "/v1/embeddings",
        json={
            "input": LONG,
            "model": prompted_model,
            "prompt_name": "passage",
            "truncation_direction": "left",
        },
    )
    prompt, text = _bare(tok, "passage: "), _bare(tok, LONG)
    want = [CLS, *prompt, *text[-(254 - len(prompt)) :], SEP]
    _close(_vectors(resp), _embed_ids(http, [want], prompted_model))
    assert resp.json()["data"][0]["truncated"] is True


@pytest.mark.model
def test_truncate_false_names_the_input_and_its_token_count(http, tok):
    n = len(_bare(tok, LONG)) + 2
    resp = http.post("/v1/embeddings", json={"input": ["fine", LONG], "truncate": False})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "input" and err["code"] == "invalid_request"
    assert f"input 1 has {n} tokens, over the limit of 256" in err["message"]
    ok = http.post("/v1/embeddings", json={"input": ["fine"], "truncate": False})
    assert ok.status_code == 200 and ok.json()["data"][0]["truncated"] is False


@pytest.mark.model
def test_normalize_false_returns_the_pooled_vector(http):
    unit = _vectors(http.post("/v1/embeddings", json={"input": ["a cat"]}))
    raw = _vectors(http.post("/v1/embeddings", json={"input": ["a cat"], "normalize": False}))
    assert abs(np.linalg.norm(unit) - 1) < 1e-5 and abs(np.linalg.norm(raw) - 1) > 1e-2
    _close(raw, unit)


@pytest.mark.model
@pytest.mark.parametrize(("path", "field"), [("/v1/rerank", "documents"), ("/rerank", "texts")])
def test_rerank_routes_show_and_refuse_cuts(http, tok, path, field):
    body = {"query": "which word?", field: ["word1 word2", LONG]}
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    items = resp.json()["results"] if path == "/v1/rerank" else resp.json()
    by_index = {r["index"]: r for r in items}
    assert by_index[1]["truncated"] is True and by_index[1]["n_tokens"] == 256
    assert by_index[0]["truncated"] is False
    assert by_index[0]["n_tokens"] == len(_bare(tok, "word1 word2")) + 2  # embedded alone
    left = http.post(path, json={**body, "truncation_direction": "left"})

    def scores(r):
        return {
            x["index"]: x.get("relevance_score", x.get("score"))
            for x in (r.json()["results"] if path == "/v1/rerank" else r.json())
        }

    assert scores(left)[0] == pytest.approx(scores(resp)[0], abs=1e-5)
    assert scores(left)[1] != pytest.approx(scores(resp)[1], abs=1e-5)  # the other end kept
    refused = http.post(path, json={**body, "truncate": False})
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["param"] == field and "document 1 has" in err["message"]
    long_query = http.post(path, json={**body, "query": LONG, "truncate": False})
    assert long_query.json()["error"]["param"] == "query"


def test_the_document_describes_every_new_field():
    """No server needed: /openapi.json is built from the structs the handlers decode."""
    from service.config import ServeConfig
    from service.openapi import build_document
    from service.routes import ROUTES as TABLE

    schemas = build_document(TABLE, ServeConfig(), auth_enabled=False)["components"]["schemas"]
    fields = {
        "EmbeddingRequest": {
            "normalize",
            "truncate",
            "truncation_direction",
            "prompt_name",
            "prompt",
        },
        "TeiEmbedRequest": {
            "inputs",
            "normalize",
            "truncate",
            "truncation_direction",
            "prompt_name",
            "prompt",
            "dimensions",
            "model",
        },
        "RerankRequest": {"truncate", "truncation_direction"},
        "TeiRerankRequest": {"truncate", "truncation_direction"},
        "CohereEmbedRequest": {
            "texts",
            "input_type",
            "embedding_types",
            "max_tokens",
            "truncate",
            "output_dimension",
        },
        "CohereRerankRequest": {"max_tokens_per_doc", "truncate", "truncation_direction"},
        "TokenizeRequest": {"inputs", "prompt", "add_special_tokens", "return_token_strs"},
        "DetokenizeRequest": {"tokens", "ids", "skip_special_tokens"},
        "EmbeddingData": {"n_tokens", "truncated"},
        "RerankResult": {"n_tokens", "truncated"},
        "TeiRerankItem": {"n_tokens", "truncated"},
        "CohereRerankResult": {"n_tokens", "truncated"},
        "CohereEmbedResponse": {"n_tokens", "truncated", "prompt_name"},
        "TeiInfo": {"model_id", "max_input_length", "max_batch_tokens", "max_client_batch_size"},
    }
    for name, want in fields.items():
        assert want <= set(schemas[name]["properties"]), name
    direction = schemas["EmbeddingRequest"]["properties"]["truncation_direction"]
    assert direction["enum"] == ["Left", "Right", "left", "right"]
    assert schemas["EmbeddingData"]["required"][-2:] == ["n_tokens", "truncated"]


@pytest.mark.model
def test_v1_models_lists_what_a_model_does_with_a_text(http, prompted_model):
    # What a client needs to choose a prompt, a cut and a width, from the model itself.
    from tests.conftest import PROMPTS

    entry = http.get(f"/v1/models/{prompted_model}").json()
    assert entry["prompts"] == PROMPTS and entry["default_prompt_name"] == "query"
    assert entry["pooling"] == "mean" and entry["max_tokens_limit"] == 512
    plain = http.get(f"/v1/models/{MINILM}").json()
    assert plain["prompts"] == {} and plain["default_prompt_name"] is None
