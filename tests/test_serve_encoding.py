"""`encoding_format`'s extension values over HTTP: a real server on a private store, the official
`openai` client and raw httpx. The first int8 request calibrates the model in the server
(the manifest records it); every quantized answer equals sentence-transformers'
`quantize_embeddings` of the same server's float vectors with those ranges."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import openai
import pytest

from ingest.quantization import stored_ranges, truncate
from ingest.store import ArtifactStore
from service.encoding import CALIBRATION_RETRY_S
from tests.encoding_support import private_store, st_quantize
from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MODEL = "minilm-l6-v2"
TEXTS = [
    "The cat sits on the mat.",
    "Stock markets fell sharply on Monday.",
    "Le chat dort sur le tapis.",
    "emoji 🙂 and accents: café, naïve",
]
QUANTIZED = ("int8", "uint8", "binary", "ubinary")


@pytest.fixture(scope="module")
def root(store_root, module_tmp):
    return private_store(store_root, module_tmp / "models", [MODEL])


@pytest.fixture(scope="module")
def server(root):
    # matryoshka_models: lets `dimensions` cut MiniLM, to see the cut come before quantizing.
    srv = ServerProcess(server_config(root, preload=[MODEL], matryoshka_models=[MODEL]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def _floats(http: httpx.Client, **extra) -> np.ndarray:
    """The server's float32 vectors, exactly (base64)."""
    body = http.post(
        "/v1/embeddings",
        json={"input": TEXTS, "model": MODEL, "encoding_format": "base64", **extra},
    ).json()
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]])


def _ranges(root: str, width: int) -> np.ndarray:
    found = stored_ranges(ArtifactStore(root).get(MODEL).manifest, width)
    assert found is not None, f"no ranges recorded for width {width}"
    return found


def _first_int8(http: httpx.Client, **extra) -> list[httpx.Response]:
    """int8 requests until one is answered, each 503 `calibrating` respected as told."""
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        body = {"input": TEXTS, "encoding_format": "int8", **extra}
        resp = http.post("/v1/embeddings", json=body)
        seen.append(resp)
        if resp.status_code == 200:
            return seen
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "calibrating"
        assert resp.headers["Retry-After"] == str(int(CALIBRATION_RETRY_S))
        # A 503 `calibrating` is itself the proof the wait was bounded: the answer came
        # while the calibration was still running (no wall-clock bar: CI machines are slow).
        time.sleep(float(resp.headers["Retry-After"]))
    raise AssertionError(f"not calibrated in 300 s: {[r.status_code for r in seen]}")


def test_openai_client_gets_every_extension_format(server, http, root):
    assert ArtifactStore(root).get(MODEL).manifest.quantization is None  # calibrated lazily
    answers = _first_int8(http)  # 200 at once where the corpus embeds within the wait
    assert ArtifactStore(root).get(MODEL).manifest.quantization is not None
    print(f"first int8 answered after {len(answers) - 1} x 503 calibrating")
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    want = _floats(http)
    for fmt in QUANTIZED:
        # The SDK types encoding_format as float|base64 but sends what it is given, and
        # decodes nothing it did not ask for.
        resp = client.embeddings.create(input=TEXTS, model=MODEL, encoding_format=fmt)
        got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
        ranges = _ranges(root, 384) if fmt.endswith("int8") else None
        expected = st_quantize(want, fmt, ranges=ranges)
        assert got.shape == expected.shape and np.array_equal(got, expected), fmt
        assert resp.usage.total_tokens > len(TEXTS)
    q = ArtifactStore(root).get(MODEL).manifest.quantization
    assert q.calibration.startswith("certification corpus") and sorted(q.widths) == [384]
    # Through extra_body, the way an SDK-typed caller would send it: the SDK asks for base64
    # and merges extra_body over it, and decodes only the strings it gets back.
    resp = client.embeddings.create(
        input=TEXTS, model=MODEL, extra_body={"encoding_format": "binary"}
    )
    got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
    assert np.array_equal(got, st_quantize(want, "binary"))


def test_cohere_client_v2_gets_every_embedding_type(server, http, root):
    import cohere

    _first_int8(http)  # calibrated (at once when the test above ran first)
    co = cohere.ClientV2(api_key="unused", base_url=server.url, timeout=300)
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    resp = co.embed(model=MODEL, texts=TEXTS, input_type="search_document", embedding_types=types)
    want = _floats(http)
    got = resp.embeddings
    np.testing.assert_allclose(np.array(got.float_), want, rtol=0, atol=1e-7)
    for fmt in QUANTIZED:
        ranges = _ranges(root, 384) if fmt.endswith("int8") else None
        assert np.array_equal(np.array(getattr(got, fmt)), st_quantize(want, fmt, ranges=ranges))
    decoded = np.stack([np.frombuffer(base64.b64decode(b), "<f4") for b in got.base64])
    assert np.array_equal(decoded, want)


def test_dimensions_are_cut_before_quantizing_with_that_widths_ranges(http, root):
    cut = _floats(http, dimensions=128)
    assert np.array_equal(cut, truncate(_floats(http), 128))
    # A width of its own is calibrated on its first use, as the full width was.
    body = _first_int8(http, model=MODEL, dimensions=128)[-1]
    got = np.array([d["embedding"] for d in body.json()["data"]])
    assert got.shape == (len(TEXTS), 128)
    assert np.array_equal(got, st_quantize(cut, "int8", ranges=_ranges(root, 128)))
    assert not np.array_equal(_ranges(root, 128), _ranges(root, 384)[:, :128])

    packed = http.post(
        "/v1/embeddings",
        json={"input": TEXTS, "model": MODEL, "encoding_format": "ubinary", "dimensions": 100},
    )
    rows = [d["embedding"] for d in packed.json()["data"]]
    assert all(len(r) == 13 for r in rows)  # ceil(100 / 8) bytes
    assert np.array_equal(np.array(rows), st_quantize(_floats(http, dimensions=100), "ubinary"))


def test_an_unknown_format_or_unnormalized_int8_is_a_400_naming_the_field(http):
    resp = http.post("/v1/embeddings", json={"input": "x", "encoding_format": "int4"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_request" and "encoding_format" in err["message"], err
    # The ranges are those of normalized vectors; signs need none.
    resp = http.post(
        "/v1/embeddings", json={"input": "x", "encoding_format": "uint8", "normalize": False}
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "encoding_format"
    resp = http.post(
        "/v1/embeddings", json={"input": "x", "encoding_format": "binary", "normalize": False}
    )
    assert resp.status_code == 200 and len(resp.json()["data"][0]["embedding"]) == 48


def test_openapi_json_describes_the_extension_values(http):
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    fmt = schemas["EmbeddingRequest"]["properties"]["encoding_format"]
    assert set(fmt["enum"]) == {"float", "base64", "int8", "uint8", "binary", "ubinary"}
    assert fmt["default"] == "float" and "quantize_embeddings" in fmt["description"]
    embedding = schemas["EmbeddingData"]["properties"]["embedding"]
    assert "int8" in embedding["description"] and "ubinary" in embedding["description"]
