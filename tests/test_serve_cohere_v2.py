"""Cohere's shapes against a real server through the official `cohere` SDK: `ClientV2.embed`
and `ClientV2.rerank` (`/v2/embed`, `/v2/rerank`), and `Client.rerank` (v1, `/v1/rerank`).
Reranking is judged on the bi-encoder fallback and on a real cross-encoder lane (the test
cross-encoder: MiniLM with a seeded head, for fidelity only)."""

from __future__ import annotations

import cohere
import httpx
import numpy as np
import pytest
from cohere.errors import BadRequestError

from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MINILM = "minilm-l6-v2"
XENC = "test-xenc-f16"
LONG = " ".join(f"word{i}" for i in range(400))
QUERY = "where do cats sleep?"
DOCS = ["Stocks fell on Monday.", "The cat sleeps on the windowsill.", "def f(): pass"]


@pytest.fixture(scope="module")
def cross_encoder(store_root, test_cross_encoder_dir) -> str:
    from ingest.store import ArtifactStore

    store = ArtifactStore(store_root)
    if XENC not in {r.name for r in store.ls()}:
        store.ingest_hf_dir(test_cross_encoder_dir, name=XENC, dtype="f16")
    return XENC


@pytest.fixture(scope="module")
def server(store_root, prompted_model, cross_encoder):
    srv = ServerProcess(server_config(store_root, preload=[MINILM, prompted_model]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def co(server) -> cohere.ClientV2:
    return cohere.ClientV2(api_key="unused", base_url=server.url, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _served(http, **body) -> np.ndarray:
    resp = http.post("/v1/embeddings", json=body)
    assert resp.status_code == 200, resp.text
    return np.array([d["embedding"] for d in resp.json()["data"]], np.float32)


def _close(a, b) -> None:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() >= 0.9999, cos


def _extra(obj, name: str):
    return (obj.model_extra or {})[name]


# ---- embed -------------------------------------------------------------------------------------


def test_input_type_chooses_the_models_prompt(co, http, prompted_model):
    texts = ["where do cats sleep?", "Cats sleep on windowsills."]
    for input_type, prompt_name in [
        ("search_query", "query"),
        ("search_document", "passage"),  # no "document" prompt: "passage"
        ("classification", "query"),  # no such prompt: the model's default
        ("clustering", "query"),
    ]:
        resp = co.embed(
            model=prompted_model, texts=texts, input_type=input_type, embedding_types=["float"]
        )
        _close(
            resp.embeddings.float_,
            _served(http, input=texts, model=prompted_model, prompt_name=prompt_name),
        )
        assert _extra(resp, "prompt_name") == prompt_name, input_type
    assert resp.texts == texts and resp.response_type == "embeddings_by_type"
    assert resp.id and resp.meta.api_version.version == "2"
    n_tokens = _extra(resp, "n_tokens")
    assert resp.meta.billed_units.input_tokens == sum(n_tokens) == resp.meta.tokens.input_tokens
    assert _extra(resp, "truncated") == [False, False] and _extra(resp, "model") == prompted_model
    # A model without prompts: the text as sent.
    plain = co.embed(model=MINILM, texts=texts, input_type="search_query")
    _close(plain.embeddings.float_, _served(http, input=texts))
    assert "prompt_name" not in (plain.model_extra or {})


def test_truncate_start_end_none_and_max_tokens(co, http, store_root):
    from host.tokenization import Tokenizer

    tok = Tokenizer.from_file(
        f"{store_root}/{MINILM}/tokenizer.json", max_tokens=256, hard_limit=512
    )
    ids = tok.tokenize([LONG], add_special_tokens=False)[0].ids
    end = co.embed(model=MINILM, texts=[LONG, "a cat"], input_type="search_document", max_tokens=8)
    start = co.embed(
        model=MINILM,
        texts=[LONG, "a cat"],
        input_type="search_document",
        max_tokens=8,
        truncate="START",
    )
    for resp in (end, start):
        assert _extra(resp, "n_tokens") == [8, 4] and _extra(resp, "truncated") == [True, False]
    _close(end.embeddings.float_[:1], _served(http, input=[[101, *ids[:6], 102]]))
    _close(start.embeddings.float_[:1], _served(http, input=[[101, *ids[-6:], 102]]))
    whole = co.embed(model=MINILM, texts=[LONG], input_type="search_document")
    assert _extra(whole, "n_tokens") == [256]  # the model's own limit: never raised
    huge = co.embed(model=MINILM, texts=[LONG], input_type="search_document", max_tokens=10**6)
    assert _extra(huge, "n_tokens") == [256]
    with pytest.raises(BadRequestError) as info:
        co.embed(model=MINILM, texts=["a cat", LONG], input_type="search_document", truncate="NONE")
    err = info.value.body["error"]
    assert err["param"] == "texts" and f"input 1 has {len(ids) + 2} tokens" in err["message"]
    assert "truncate END or START" in err["message"]
    with pytest.raises(BadRequestError) as info:
        co.embed(model=MINILM, texts=["x"], input_type="search_document", max_tokens=2)
    assert info.value.body["error"]["param"] == "max_tokens"


def test_embedding_types_dimensions_and_refusals(co, http, prompted_model):
    cut = co.embed(
        model=prompted_model,
        texts=["a cat"],
        input_type="search_query",
        output_dimension=128,
        embedding_types=["float"],
    )
    assert len(cut.embeddings.float_[0]) == 128
    assert abs(np.linalg.norm(cut.embeddings.float_[0]) - 1) < 1e-5
    default = co.embed(model=MINILM, texts=["a cat"], input_type="search_query")
    assert len(default.embeddings.float_[0]) == 384  # no embedding_types: float

    def refused(**kw) -> dict:
        with pytest.raises(BadRequestError) as info:
            co.embed(**{"model": MINILM, "texts": ["x"], "input_type": "search_query", **kw})
        return info.value.body["error"]

    assert refused(output_dimension=128)["param"] == "output_dimension"  # not Matryoshka
    assert refused(embedding_types=["float16"])["param"].startswith("embedding_types")
    assert refused(images=["data:image/png;base64,AAAA"], texts=None)["param"] == "images"
    assert refused(input_type="image")["param"] == "input_type"
    too_many = http.post("/v2/embed", json={"texts": ["x"] * 2049})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "texts"
    missing = http.post("/v2/embed", json={"input_type": "search_query"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "texts"
    unknown = http.post("/v2/embed", json={"texts": ["x"], "model": "nope"})
    assert unknown.status_code == 404


# ---- rerank ------------------------------------------------------------------------------------


def test_v2_rerank_with_a_cross_encoder(co, http, cross_encoder):
    resp = co.rerank(model=cross_encoder, query=QUERY, documents=DOCS)
    scores = [r.relevance_score for r in resp.results]
    assert sorted(r.index for r in resp.results) == [0, 1, 2]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert resp.meta.billed_units.search_units == 1 and resp.meta.api_version.version == "2"
    assert resp.meta.warnings is None and _extra(resp, "method") == "cross-encoder"
    v1 = http.post(
        "/v1/rerank", json={"model": cross_encoder, "query": QUERY, "documents": DOCS}
    ).json()
    assert {r["index"]: r["relevance_score"] for r in v1["results"]} == pytest.approx(
        {r.index: r.relevance_score for r in resp.results}, abs=1e-6
    )
    assert sum(_extra(r, "n_tokens") for r in resp.results) == resp.meta.tokens.input_tokens
    top = co.rerank(model=cross_encoder, query=QUERY, documents=DOCS, top_n=1)
    assert [r.index for r in top.results] == [resp.results[0].index]


def test_v2_rerank_cuts_documents_as_asked(co, http, cross_encoder, store_root):
    from host.tokenization import Tokenizer

    tok = Tokenizer.from_file(
        f"{store_root}/{cross_encoder}/tokenizer.json", max_tokens=256, hard_limit=512
    )
    bare = lambda t: len(tok.tokenize([t], add_special_tokens=False)[0].ids)  # noqa: E731
    docs = ["word1 word2 word3", "a cat", LONG]
    q, pair = bare(QUERY), tok.n_special_pair
    whole = co.rerank(model=cross_encoder, query=QUERY, documents=docs)
    by_index = {r.index: r for r in whole.results}
    info = http.get("/info", params={"model": cross_encoder}).json()
    assert info["model_type"] == {
        "reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    }
    limit = info["max_input_length"]  # the pair limit: 512 for this cross-encoder
    assert _extra(by_index[2], "truncated") is True and _extra(by_index[2], "n_tokens") == limit
    assert _extra(by_index[0], "n_tokens") == q + bare(docs[0]) + pair
    assert not _extra(by_index[0], "truncated") and not _extra(by_index[1], "truncated")
    capped = co.rerank(model=cross_encoder, query=QUERY, documents=docs, max_tokens_per_doc=4)
    got = {r.index: (_extra(r, "n_tokens"), _extra(r, "truncated")) for r in capped.results}
    assert got == {
        0: (q + 4 + pair, True),
        1: (q + bare("a cat") + pair, False),
        2: (q + 4 + pair, True),
    }
    docs = ["word1 word2", LONG]
    body = {"model": cross_encoder, "query": QUERY, "documents": docs}
    left = http.post("/v2/rerank", json={**body, "truncation_direction": "left"}).json()
    score = lambda r: {x["index"]: x["relevance_score"] for x in r["results"]}  # noqa: E731
    right = http.post("/v2/rerank", json=body).json()
    assert score(left)[0] == pytest.approx(score(right)[0], abs=1e-6)
    assert score(left)[1] != pytest.approx(score(right)[1], abs=1e-6)
    refused = http.post("/v2/rerank", json={**body, "truncate": False})
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["param"] == "documents" and "pair 1 has" in err["message"]
    spans = http.post("/v2/rerank", json={**body, "relevant_spans": {"mode": "enabled"}})
    assert spans.status_code == 400 and spans.json()["error"]["param"] == "relevant_spans"


def test_v2_rerank_without_a_cross_encoder_says_so(co):
    resp = co.rerank(model=MINILM, query=QUERY, documents=DOCS)
    assert resp.results[0].index == 1
    assert _extra(resp, "method") == "bi-encoder-cosine"
    assert resp.meta.warnings and "cosine" in resp.meta.warnings[0]


def test_v1_client_rerank(server, cross_encoder):
    client = cohere.Client(api_key="unused", base_url=server.url, timeout=120)
    resp = client.rerank(
        model=cross_encoder, query=QUERY, documents=DOCS, top_n=2, return_documents=True
    )
    assert len(resp.results) == 2
    best = resp.results[0]
    assert best.document.text == DOCS[best.index] and 0 <= best.relevance_score <= 1
    assert resp.meta.billed_units.input_tokens > 0
    assert _extra(best, "truncated") is False and _extra(best, "n_tokens") > 0
