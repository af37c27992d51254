"""Compact embedding types: ingest.quantization against sentence-transformers'
`quantize_embeddings` (byte for byte), the JSON forms of service.encoding, the int8 ranges a
manifest records, and what the types keep of retrieval on the certification corpus with the
default model (binary top-10 agreement by Hamming distance, int8 cosine agreement)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import tempfile

import msgspec
import numpy as np
import pytest

from certification.calibration import Calibrations, calibration_set
from certification.corpus import corpus, queries
from common.errors import StorageFull
from host.config import HostConfig
from host.module import Module, ModuleConfig
from ingest.quantization import (
    PRECISIONS,
    SCHEME,
    QuantizationRanges,
    WidthRanges,
    calibration_ranges,
    packed_width,
    quantize,
    record_ranges,
    stored_ranges,
    truncate,
)
from ingest.store import ArtifactStore, Manifest
from service.embeddings import apply_dimensions
from service.encoding import EMBEDDING_TYPES, encode_embeddings
from tests.encoding_support import hamming, private_store, st_quantize, top_k

MODEL = "minilm-l6-v2"


def _unit(rng: np.random.Generator, n: int, dims: int) -> np.ndarray:
    v = rng.standard_normal((n, dims)).astype(np.float32)
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _calibration(rng: np.random.Generator, dims: int) -> np.ndarray:
    cal = _unit(rng, 300, dims)
    cal[:, 3] = 0.25  # a constant dimension: its step is 0, sentence-transformers uses 1
    return cal


# ---- the arithmetic, against sentence-transformers ---------------------------------------------


@pytest.mark.parametrize("dims", [384, 100, 7])  # 100 and 7: the last packed byte is padded
@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_precision_is_quantize_embeddings_exactly(precision, dims):
    rng = np.random.default_rng(dims)
    cal = _calibration(rng, dims)
    ranges = np.vstack((cal.min(axis=0), cal.max(axis=0)))
    # Vectors outside the calibration ranges (clipped to buckets 0 and 255), exact zeros
    # (no bit set) and ones sitting on the range ends.
    v = np.concatenate([_unit(rng, 50, dims) * 1.7, np.zeros((2, dims), np.float32), cal[:5]])
    want = st_quantize(v, precision, ranges=ranges if precision.endswith("int8") else None)
    got = quantize(v, precision, ranges)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    if precision.endswith("binary"):
        assert got.shape == (len(v), packed_width(dims))


def test_calibrated_ranges_are_symmetric_with_one_scale_and_round_to_nearest():
    rng = np.random.default_rng(1)
    cal, v = _calibration(rng, 384), _unit(rng, 40, 384)
    ranges = calibration_ranges(cal, 384)
    scale = float(np.abs(cal).max()) / 127
    assert np.allclose(ranges[0], -128.5 * scale) and np.allclose(ranges[1], 126.5 * scale)
    assert len(set(ranges[0].tolist())) == 1 and len(set(ranges[1].tolist())) == 1
    for precision in ("int8", "uint8"):  # quantize_embeddings given these ranges, byte for byte
        want = st_quantize(v, precision, ranges=ranges)
        assert np.array_equal(quantize(v, precision, ranges), want)
    codes = quantize(cal, "int8", ranges).astype(np.int64)
    # Each code is its value over the one scale, rounded: 0 stays 0, the peak is +-127.
    assert np.abs(codes - cal / scale).max() <= 0.5 + 1e-3
    assert np.abs(codes).max() == 127
    assert np.array_equal(
        quantize(np.zeros((1, 384), np.float32), "int8", ranges), np.zeros((1, 384), np.int8)
    )


def test_a_manifest_of_per_dimension_ranges_is_calibrated_anew(tmp_path):
    """Ranges recorded before the symmetric scheme rank int8 dot products badly: they are
    not served, and the next calibration replaces them whole."""
    store = _fake_model(tmp_path)
    old = QuantizationRanges(
        calibration="c",
        lane="llama",
        created_at="t0",
        widths={8: WidthRanges(min=[-0.1] * 8, max=[0.2] * 8)},
    )
    path = tmp_path / "m" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["quantization"] = json.loads(msgspec.json.encode(old))
    assert "scheme" not in raw["quantization"]  # what older manifests hold
    path.write_text(json.dumps(raw))
    assert stored_ranges(store.get("m").manifest, 8) is None
    new = {4: calibration_ranges(_unit(np.random.default_rng(9), 20, 8), 4)}
    kept = record_ranges(store, "m", "d" * 64, new, "c", "llama", "t1")
    q = store.get("m").manifest.quantization
    assert q.scheme == SCHEME and sorted(q.widths) == [4] and q.created_at == "t1"
    assert np.array_equal(kept[4], new[4])


def test_a_matryoshka_width_is_cut_and_renormalized_as_the_http_route_does():
    v = _unit(np.random.default_rng(2), 30, 384)
    for width in (384, 256, 64):
        assert np.array_equal(truncate(v, width), apply_dimensions(v, width, "m", True))
    # The ranges of a width are those of the cut vectors, not a slice of the full ones.
    cut = calibration_ranges(v, 64)
    peak = float(np.abs(truncate(v, 64)).max())
    assert np.allclose(cut[1], 126.5 * peak / 127)
    assert not np.array_equal(cut, calibration_ranges(v, 384)[:, :64])


def test_ranged_precisions_refuse_to_guess():
    v = _unit(np.random.default_rng(3), 2, 8)
    with pytest.raises(ValueError, match="calibration ranges"):
        quantize(v, "int8")
    with pytest.raises(ValueError, match="width"):
        quantize(v, "uint8", np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="unknown precision"):
        quantize(v, "int4")


# ---- service.encoding: the JSON forms ----------------------------------------------------------


def test_encode_embeddings_gives_every_type_in_its_json_form():
    rng = np.random.default_rng(4)
    cal = _calibration(rng, 384)
    ranges = calibration_ranges(cal, 384)
    v = _unit(rng, 3, 384)
    out = encode_embeddings(v, EMBEDDING_TYPES, ranges)
    assert list(out) == list(EMBEDDING_TYPES)
    body = json.loads(msgspec.json.encode(out))  # as a route encodes it
    assert np.array_equal(np.array(body["float"], np.float32), v)  # float32 exactly
    assert max(len(x) for x in msgspec.json.encode(out["float"][0]).split(b",")) <= 16
    assert np.array_equal(
        np.stack([np.frombuffer(base64.b64decode(s), "<f4") for s in body["base64"]]), v
    )
    for t in ("int8", "uint8", "binary", "ubinary"):
        want = st_quantize(v, t, ranges=ranges if t.endswith("int8") else None)
        assert body[t] == want.tolist(), t
        assert all(type(x) is int for x in body[t][0])
    assert len(body["binary"][0]) == len(body["ubinary"][0]) == 48

    one = encode_embeddings(v[0], ["ubinary", "base64", "ubinary"])  # 1-D: one value a type
    assert list(one) == ["ubinary", "base64"]
    assert one["ubinary"] == out["ubinary"][0] and one["base64"] == out["base64"][0]


def test_encode_embeddings_refuses_what_it_cannot_do():
    v = _unit(np.random.default_rng(5), 2, 16)
    with pytest.raises(ValueError, match="calibration ranges"):
        encode_embeddings(v, ["float", "uint8"])
    with pytest.raises(ValueError, match="unknown embedding type"):
        encode_embeddings(v, ["float16"])


async def test_ranges_are_refused_for_vectors_left_unnormalized():
    from common.errors import InvalidRequest
    from service.encoding import quantization_ranges

    # No module needed to say no, nor to need nothing.
    assert await quantization_ranges(None, MODEL, 384, ["float", "ubinary"], False) is None
    with pytest.raises(InvalidRequest, match="normalized") as info:
        await quantization_ranges(
            None, MODEL, 384, ["uint8"], normalize=False, param="embedding_types"
        )
    assert info.value.details["param"] == "embedding_types"


# ---- the manifest ------------------------------------------------------------------------------


def _fake_model(root, name="m", digest="d" * 64, dims=8) -> ArtifactStore:
    store = ArtifactStore(root)
    (store.root / name).mkdir()
    manifest = Manifest(
        name=name,
        format="gguf",
        kind="embed",
        digest=digest,
        size_bytes=1,
        dims=dims,
        n_ctx=8,
        n_ctx_train=8,
        max_tokens=8,
        max_tokens_limit=8,
        source="test",
        created_at="2026-01-01T00:00:00Z",
    )
    (store.root / name / "manifest.json").write_bytes(msgspec.json.encode(manifest))
    return store


def test_an_old_manifest_reads_and_recorded_ranges_come_back_exactly(tmp_path):
    store = _fake_model(tmp_path, dims=384)
    old = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert "quantization" not in old  # what manifests written before this field look like
    rec = store.get("m")
    assert rec.manifest.quantization is None and stored_ranges(rec.manifest, 384) is None
    rng = np.random.default_rng(6)
    ranges = {
        384: calibration_ranges(_unit(rng, 50, 384), 384),
        128: calibration_ranges(_unit(rng, 50, 384), 128),
    }
    kept = record_ranges(store, "m", "d" * 64, ranges, calibration_set(), "llama", "now")
    fresh = store.get("m").manifest
    for width, r in ranges.items():
        assert np.array_equal(stored_ranges(fresh, width), r)  # float32 for float32
        assert np.array_equal(kept[width], r)
    assert fresh.quantization.calibration.startswith("certification corpus sha256:")
    assert fresh.quantization.lane == "llama"
    assert stored_ranges(fresh, 64) is None
    # Shortest float32 forms on disk: a few KB a width, not float64's 17 digits a number.
    text = (tmp_path / "m" / "manifest.json").read_text()
    numbers = json.loads(text)["quantization"]["widths"]["384"]["min"]
    assert max(len(repr(x)) for x in numbers) <= 15


def test_the_first_recorded_ranges_win_and_a_replaced_model_keeps_its_manifest(
    tmp_path, caplog, monkeypatch
):
    store = _fake_model(tmp_path)
    first = {8: np.array([np.full(8, -0.5), np.full(8, 0.5)], np.float32)}
    second = {
        8: np.array([np.full(8, -0.4), np.full(8, 0.4)], np.float32),
        4: np.array([np.full(4, -0.3), np.full(4, 0.3)], np.float32),
    }
    record_ranges(store, "m", "d" * 64, first, "c", "llama", "t1")
    kept = record_ranges(store, "m", "d" * 64, second, "c", "ane", "t2")
    # Another process calibrated width 8 first: adopted, so all quantize alike; width 4 added.
    assert np.array_equal(kept[8], first[8]) and np.array_equal(kept[4], second[4])
    q = store.get("m").manifest.quantization
    assert sorted(q.widths) == [4, 8] and q.lane == "llama" and q.created_at == "t1"

    before = (tmp_path / "m" / "manifest.json").read_bytes()
    mine = record_ranges(store, "m", "e" * 64, second, "c", "llama", "t3")  # not its artifact
    assert np.array_equal(mine[8], second[8])
    assert (tmp_path / "m" / "manifest.json").read_bytes() == before

    # A store this process cannot write (read-only, full): the ranges serve it alone.
    for failure in (PermissionError(13, "Permission denied"), StorageFull("no space left")):

        def fail(*a, exc=failure, **k):
            raise exc

        monkeypatch.setattr(ArtifactStore, "update_manifest", fail)
        with caplog.at_level(logging.WARNING, "synapse.ingest"):
            mine = record_ranges(store, "m", "d" * 64, {2: second[4][:, :2]}, "c", "l", "t")
        assert np.array_equal(mine[2], second[4][:, :2]) and "not recorded" in caplog.text
        caplog.clear()


class _SlowModule:
    """What Calibrations asks of a Module, with an embedding that takes `delay_s`."""

    def __init__(self, store: ArtifactStore, delay_s: float) -> None:
        self.store, self.delay_s, self.embedded = store, delay_s, 0

    def record(self, name):
        return self.store.get(name)

    def default_lane(self, name):
        return type("Choice", (), {"lane": "llama"})()

    async def embed(self, texts, model, lane=None):
        self.embedded += 1
        await asyncio.sleep(self.delay_s)
        vectors = _unit(np.random.default_rng(len(texts)), len(texts), 8)
        return type("Result", (), {"vectors": vectors})()


async def test_a_request_waits_a_bounded_time_and_the_calibration_goes_on(tmp_path, monkeypatch):
    import service.encoding as encoding
    from service.errors import error_response

    mod = _SlowModule(_fake_model(tmp_path, dims=8), delay_s=0.5)
    monkeypatch.setattr(encoding, "CALIBRATION_WAIT_S", 0.05)
    with pytest.raises(encoding.Calibrating) as info:
        await encoding.quantization_ranges(mod, "m", 8)
    response = error_response(info.value)
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert json.loads(response.body)["error"]["code"] == "calibrating"
    # Nobody waits now, yet the calibration finishes and is recorded.
    await asyncio.sleep(1.0)
    recorded = stored_ranges(mod.store.get("m").manifest, 8)
    assert recorded is not None and mod.embedded == 1
    got = await encoding.quantization_ranges(mod, "m", 8)
    assert np.array_equal(got, recorded)


async def test_concurrent_callers_share_one_corpus_embedding(tmp_path):
    mod = _SlowModule(_fake_model(tmp_path, dims=8), delay_s=0.2)
    book = Calibrations(mod)
    a, b, c = await asyncio.gather(book.ranges("m", 8), book.ranges("m", 8), book.ranges("m", 4))
    assert mod.embedded == 1 and np.array_equal(a, b) and c.shape == (2, 4)
    assert sorted(mod.store.get("m").manifest.quantization.widths) == [4, 8]


# ---- with the default model: the calibration corpus through the lane ---------------------------


def _module(root: str, runtime: str) -> Module:
    return Module(
        ModuleConfig(store_root=root, host=HostConfig(runtime_dir=runtime, ping_interval_s=0))
    )


@pytest.fixture(scope="module")
def calibrated(store_root, module_tmp):
    """A private store's default model, calibrated once through its llama.cpp lane: the
    corpus vectors, the query vectors, the ranges at 384 and 128, and the manifest after."""
    root = private_store(store_root, module_tmp / "models", [MODEL])
    assert ArtifactStore(root).get(MODEL).manifest.quantization is None
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")

    async def run():
        async with _module(root, runtime) as mod:
            book = Calibrations(mod)
            full, cut = await asyncio.gather(book.ranges(MODEL, 384), book.ranges(MODEL, 128))
            docs = await book.corpus_vectors(MODEL)
            qs = (await mod.embed(queries(), MODEL)).vectors
            return docs, np.asarray(qs, np.float32), full, cut

    try:
        docs, qs, full, cut = asyncio.run(run())
    finally:
        import shutil

        shutil.rmtree(runtime, ignore_errors=True)
    return {
        "root": root,
        "docs": docs,
        "queries": qs,
        "ranges": full,
        "ranges128": cut,
        "manifest": ArtifactStore(root).get(MODEL).manifest,
    }


@pytest.mark.model
def test_calibration_is_recorded_once_and_read_back_without_embedding(calibrated, monkeypatch):
    docs, manifest = calibrated["docs"], calibrated["manifest"]
    assert docs.shape == (len(corpus()), 384)
    q = manifest.quantization
    assert q is not None and q.calibration == calibration_set() and q.lane == "llama"
    assert sorted(q.widths) == [128, 384]  # asked for together: one corpus embedding
    assert np.array_equal(calibrated["ranges"], calibration_ranges(docs, 384))
    assert np.array_equal(calibrated["ranges128"], calibration_ranges(docs, 128))
    assert np.array_equal(stored_ranges(manifest, 384), calibrated["ranges"])

    async def refuse(*a, **k):
        raise AssertionError("a recorded model must not embed the corpus again")

    monkeypatch.setattr(Module, "embed", refuse)
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")

    async def again():  # another process: a new Module, nothing in memory
        async with _module(calibrated["root"], runtime) as mod:
            return await Calibrations(mod).ranges(MODEL, 128)

    assert np.array_equal(asyncio.run(again()), calibrated["ranges128"])


@pytest.mark.model
def test_the_corpus_quantizes_as_sentence_transformers_does(calibrated):
    docs, ranges = calibrated["docs"], calibrated["ranges"]
    for precision in PRECISIONS:
        ranged = precision.endswith("int8")
        want = st_quantize(docs, precision, ranges=ranges if ranged else None)
        assert np.array_equal(quantize(docs, precision, ranges), want), precision
    cut = truncate(docs, 128)
    want = st_quantize(cut, "int8", ranges=calibration_ranges(docs, 128))
    assert np.array_equal(quantize(cut, "int8", calibrated["ranges128"]), want)


def _agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b, strict=True)]))


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a @ b.T) / np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))


@pytest.mark.model
def test_retrieval_quality_on_the_certification_corpus(calibrated):
    """What each type keeps of float retrieval: the certification queries against the whole
    corpus (335 texts), the top 10 by cosine of the float vectors as the truth.

    binary: Hamming distance of the packed bits. int8, three ways: cosine of the vectors the
    codes stand for (dequantized with the recorded ranges, as sentence-transformers restores
    them), cosine straight on the int8 codes, and the plain integer dot product a vector store
    ranks int8 rows by (top 1 and top 5 against float's). The ranges are the corpus's own, as
    for every model here: the documents are in range, the queries (not in the corpus) may
    clip."""
    docs, qs, ranges = calibrated["docs"], calibrated["queries"], calibrated["ranges"]
    float_scores = qs @ docs.T
    truth = top_k(float_scores, 10)

    by_hamming = -hamming(quantize(qs, "ubinary"), quantize(docs, "ubinary")).astype(np.float64)
    binary_top10 = _agreement(truth, top_k(by_hamming, 10))

    i8_docs, i8_qs = quantize(docs, "int8", ranges), quantize(qs, "int8", ranges)
    steps = (ranges[1] - ranges[0]) / 255

    def restore(codes):
        return (codes.astype(np.float64) + 128) * steps + ranges[0]

    restored = _cosines(restore(i8_qs), restore(i8_docs))
    on_codes = _cosines(i8_qs, i8_docs)
    # What a vector store does with int8 rows: the plain integer dot product of the codes.
    dot = i8_qs.astype(np.int64) @ i8_docs.astype(np.int64).T
    truth5 = top_k(float_scores, 5)
    self_cos = np.diag(_cosines(restore(i8_docs), docs))

    def pearson(scores):
        return float(np.corrcoef(float_scores.ravel(), scores.ravel())[0, 1])

    figures = {
        "binary_top10_agreement": round(binary_top10, 4),
        "int8_top10_agreement": round(_agreement(truth, top_k(restored, 10)), 4),
        "int8_cosine_pearson": round(pearson(restored), 5),
        "int8_vector_cosine_min": round(float(self_cos.min()), 5),
        "int8_codes_top10_agreement": round(_agreement(truth, top_k(on_codes, 10)), 4),
        "int8_codes_cosine_pearson": round(pearson(on_codes), 4),
        "int8_dot_top1_agreement": round(_agreement(truth[:, :1], top_k(dot, 1)), 4),
        "int8_dot_top5_overlap": round(_agreement(truth5, top_k(dot, 5)), 4),
    }
    print("retrieval figures:", json.dumps(figures))
    # Bounds a little under what this corpus gives MiniLM (docs/operations.md lists the
    # figures), so broken arithmetic fails here and the model's own noise does not.
    assert figures["binary_top10_agreement"] >= 0.70, figures
    assert figures["int8_top10_agreement"] >= 0.97, figures
    assert figures["int8_cosine_pearson"] >= 0.999, figures
    assert figures["int8_vector_cosine_min"] >= 0.999, figures
    assert figures["int8_codes_top10_agreement"] >= 0.95, figures
    assert figures["int8_dot_top1_agreement"] >= 0.95, figures
    assert figures["int8_dot_top5_overlap"] >= 0.9, figures
