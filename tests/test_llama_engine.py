"""LlamaEngine in-process against real llama.cpp and real model files.

Fidelity is checked against the certification reference (an independent fp32 numpy BERT);
generation against llama-cpp-python's own high-level greedy loop on the same ids.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from tokenizers import Tokenizer

from certification.reference.bert import BertReference
from formats.digest import sha256_file
from ingest import ArtifactStore, convert_bert_dir
from ingest.model_packages import minilm_dir
from workers.engine import EngineError, NullProgress
from workers.llama import cpu_quirks, native
from workers.llama.decode_plan import (
    ENC_DECODE_TOKENS,
    ENC_DECODE_TOKENS_BLAS,
    WIDE_DECODE_MIN_TOKENS,
    pack,
    plan_decodes,
    wide_decode,
)
from workers.llama.engine import UNSAFE_ENV, LlamaEngine
from workers.llama.native import registered_backends
from workers.protocol import messages as m

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MINILM = minilm_dir()
THREADS = 2
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street.",
    "Quarterly revenue grew by twelve percent, beating analyst expectations.",
    "hello",
    "Die Katze sitzt auf der Matte und schläft.",
]


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(store_root: str) -> ArtifactStore:
    return ArtifactStore(store_root)  # the session's installed defaults


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaEngine]:
    e = LlamaEngine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def tokenizer(store: ArtifactStore) -> Tokenizer:
    path = store.get("minilm-l6-v2").tokenizer_path
    assert path is not None
    return Tokenizer.from_file(str(path))


def _load(engine: LlamaEngine, path: Path, ref: str, **cfg: object) -> m.LOADED:
    return engine.load(
        m.LOAD(
            req_id=1,
            artifact_path=str(path),
            artifact_digest=sha256_file(path),
            format="gguf",
            runtime_config={"model_ref": ref, "n_threads": THREADS, **cfg},
        ),
        NullProgress(),
    )


@pytest.fixture(scope="module")
def embedders(engine: LlamaEngine, store: ArtifactStore) -> dict[str, str]:
    refs = {}
    for dtype, name in (("f16", "minilm-l6-v2-f16"), ("f32", "minilm-l6-v2-f32")):
        loaded = _load(engine, store.get(name).artifact_path, f"mini-{dtype}")
        assert loaded.dims == 384
        refs[dtype] = loaded.model_ref
    return refs


@pytest.fixture(scope="module")
def gemma(engine: LlamaEngine, store: ArtifactStore) -> str:
    return _load(engine, store.get("gemma3-270m").artifact_path, "gemma").model_ref


def _embed(
    engine: LlamaEngine,
    ref: str,
    seqs: list[list[int]],
    normalize: bool = True,
    progress: NullProgress | None = None,
) -> np.ndarray:
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
    req = m.EMBED_BATCH(
        req_id=2,
        model_ref=ref,
        normalize=normalize,
        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)],
    )
    return engine.embed(req, ids, progress or NullProgress())


# ---- embeddings -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embeddings_match_numpy_reference(engine, embedders, tokenizer, dtype: str) -> None:
    seqs = [tokenizer.encode(s).ids for s in SENTENCES]
    got = _embed(engine, embedders[dtype], seqs)
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 384)
    want = BertReference.from_dir(MINILM).embed(seqs, pooling="mean", normalize=True)
    cos = np.sum(got * want, axis=1)
    assert np.all(cos >= 0.9999), cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_unnormalized_embeddings_are_mean_pooled(engine, embedders, tokenizer) -> None:
    seqs = [tokenizer.encode(s).ids for s in SENTENCES[:2]]
    raw = _embed(engine, embedders["f32"], seqs, normalize=False)
    want = BertReference.from_dir(MINILM).embed(seqs, pooling="mean", normalize=False)
    np.testing.assert_allclose(raw, want, rtol=0, atol=2e-3)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)


def test_batching_invariance_and_packing(engine, store, tokenizer) -> None:
    # A small context forces several decodes; vectors must not depend on the packing.
    ref = _load(
        engine,
        store.get("minilm-l6-v2-f32").artifact_path,
        "mini-packed",
        n_batch=60,
        n_ubatch=60,
        n_seq_max=3,
    ).model_ref
    try:
        seqs = [tokenizer.encode(s).ids for s in SENTENCES * 2]
        progress = NullProgress()
        together = _embed(engine, ref, seqs, progress=progress)
        expected = plan_decodes([len(s) for s in seqs], 60, 3)
        assert progress.completed == len(expected) > 2  # every decode counted in PROGRESS
        assert all(len(g) <= 3 and sum(len(seqs[i]) for i in g) <= 60 for g in expected)
        alone = np.concatenate([_embed(engine, ref, [s]) for s in seqs])
        # With a BLAS backend, ggml sends matmuls of >= 32 rows to sgemm and smaller ones to
        # its own kernels: packed and alone then round differently (measured 7.8e-5).
        blas = "BLAS" in registered_backends()
        np.testing.assert_allclose(together, alone, rtol=0, atol=2e-4 if blas else 1e-5)
        # The big default context packs them into one decode per stream. Another micro-batch
        # size takes other kernel paths, so only near-equality holds across contexts.
        one = NullProgress()
        big = _embed(engine, "mini-f32", seqs, progress=one)
        lengths = [len(s) for s in seqs]
        assert one.completed == len(plan_decodes(lengths, 512, 64, 10**6, THREADS)) == THREADS
        assert np.min(np.sum(big * alone, axis=1)) >= 0.99999
    finally:
        engine.unload(m.UNLOAD(req_id=9, model_ref=ref), NullProgress())


def test_encode_streams_split_decodes_without_changing_vectors(engine, store, tokenizer) -> None:
    # Two single-threaded contexts share the weights and take decodes off one queue. With the
    # 60-token context the packing is the same either way, so the vectors agree to float
    # rounding: exactly on some CPUs, within 7.2e-5 on an AVX-512 AMD EPYC, whose BLAS
    # kernels sum in another order when a matmul is split over two threads.
    path = store.get("minilm-l6-v2-f32").artifact_path
    small = {"n_batch": 60, "n_ubatch": 60, "n_seq_max": 3}  # many decodes
    one = _load(engine, path, "mini-1stream", encode_streams=1, **small).model_ref
    two = _load(engine, path, "mini-2streams", **small).model_ref  # default: one per thread
    try:
        # What llama.cpp itself was given: all threads in one context, or one per context.
        for ref, contexts, threads in ((one, 1, THREADS), (two, THREADS, 1)):
            slots = engine._models[ref].slots
            assert len(slots) == contexts
            for slot in slots:
                assert llama_cpp.llama_n_threads(slot.ctx) == threads
                assert llama_cpp.llama_n_threads_batch(slot.ctx) == threads
        seqs = [tokenizer.encode(s).ids for s in SENTENCES * 6]
        progress = NullProgress()
        alone = _embed(engine, one, seqs)
        split = _embed(engine, two, seqs, progress=progress)
        assert progress.completed == len(plan_decodes([len(s) for s in seqs], 60, 3)) > 4
        np.testing.assert_allclose(split, alone, atol=2e-4)
    finally:
        for ref in (one, two):
            engine.unload(m.UNLOAD(req_id=9, model_ref=ref), NullProgress())


def test_a_decode_failing_in_one_stream_fails_the_request_typed(
    engine, store, tokenizer, monkeypatch
) -> None:
    # Validation off, an out-of-vocabulary id reaches llama.cpp, whose batch check refuses
    # that one decode: the request fails with that typed error, the other stream stops, and
    # both streams serve the next request.
    path = store.get("minilm-l6-v2-f32").artifact_path
    ref = _load(engine, path, "mini-streams-fail", n_batch=60, n_ubatch=60, n_seq_max=3).model_ref
    try:
        seqs = [tokenizer.encode(s).ids for s in SENTENCES * 6]
        good = _embed(engine, ref, seqs)
        bad = [list(s) for s in seqs]
        bad[-1][1] = 10**6  # the longest sequences are decoded last
        monkeypatch.setenv(UNSAFE_ENV, "1")
        with pytest.raises(EngineError) as e:
            _embed(engine, ref, bad)
        assert e.value.code == "invalid_request" and "rejected" in e.value.msg
        monkeypatch.delenv(UNSAFE_ENV)
        np.testing.assert_array_equal(_embed(engine, ref, seqs), good)
    finally:
        engine.unload(m.UNLOAD(req_id=9, model_ref=ref), NullProgress())


def test_a_lone_long_decode_runs_with_every_thread_then_gives_them_back(
    engine, store, tokenizer, monkeypatch
) -> None:
    # A request that is one decode would leave the second stream idle: from
    # WIDE_DECODE_MIN_TOKENS tokens on it runs with both threads on the first context, which
    # gets its one thread back afterwards, also when the decode fails. Shorter ones, and
    # requests of several decodes, keep one thread per context.
    path = store.get("minilm-l6-v2-f32").artifact_path
    one = _load(engine, path, "mini-wide-1stream", encode_streams=1).model_ref
    two = _load(engine, path, "mini-wide-2streams").model_ref
    mdl = engine._models[two]
    threads_seen: list[int] = []
    decode = native.decode

    def watched(slot, batch) -> None:  # the real decode, with the threads it was given noted
        threads_seen.append(llama_cpp.llama_n_threads(slot.ctx))
        decode(slot, batch)

    monkeypatch.setattr(native, "decode", watched)
    long = tokenizer.encode(" ".join(SENTENCES * 4)).ids
    short = tokenizer.encode("hello there").ids
    assert len(long) >= WIDE_DECODE_MIN_TOKENS > len(short)
    try:
        streams = len(mdl.slots)
        assert wide_decode(streams, [len(long)]) and not wide_decode(streams, [len(short)])
        # One context: nothing idles.
        assert not wide_decode(len(engine._models[one].slots), [len(long)])
        wide = _embed(engine, two, [long])
        assert threads_seen == [THREADS]
        threads_seen.clear()
        _embed(engine, two, [short])
        _embed(engine, two, [long, long])  # two decodes, one per stream
        assert threads_seen == [1, 1, 1]
        assert llama_cpp.llama_n_threads(mdl.slots[0].ctx) == 1
        # The same vector to float rounding (see the test above).
        np.testing.assert_allclose(wide, _embed(engine, one, [long]), atol=2e-4)
        bad = list(long)
        bad[1] = 10**6  # past the vocabulary: llama.cpp refuses the decode (validation off)
        monkeypatch.setenv(UNSAFE_ENV, "1")
        with pytest.raises(EngineError):
            _embed(engine, two, [bad])
        assert llama_cpp.llama_n_threads(mdl.slots[0].ctx) == 1
        assert llama_cpp.llama_n_threads_batch(mdl.slots[0].ctx) == 1
    finally:
        for ref in (one, two):
            engine.unload(m.UNLOAD(req_id=9, model_ref=ref), NullProgress())


def test_encode_streams_apply_to_encoders_only(engine, store) -> None:
    path = store.get("gemma3-270m").artifact_path
    with pytest.raises(EngineError) as e:
        _load(engine, path, "gemma-streams", encode_streams=2)
    assert e.value.code == "config_invalid" and "embed/rerank only" in e.value.msg


def test_default_n_seq_max_fits_llama_cpp_reservation(engine, store, tokenizer) -> None:
    # llama.cpp aborts at context creation unless n_seq_max divides the reserved token count
    # (here 100); the default must pick a divisor, an explicit bad value is refused.
    path = store.get("minilm-l6-v2").artifact_path
    ref = _load(engine, path, "mini-odd", n_batch=100).model_ref
    try:
        assert engine._models[ref].n_seq_max == 50
        seqs = [tokenizer.encode(s).ids for s in SENTENCES]
        assert _embed(engine, ref, seqs).shape == (len(SENTENCES), 384)
    finally:
        engine.unload(m.UNLOAD(req_id=9, model_ref=ref), NullProgress())
    with pytest.raises(EngineError) as e:
        _load(engine, path, "mini-odd", n_batch=100, n_seq_max=64)
    assert e.value.code == "config_invalid" and "divide" in e.value.msg


def test_a_decoder_served_as_an_embedder_reserves_as_llama_cpp_does(engine, store) -> None:
    # Causal: llama.cpp clamps n_batch to the n_ctx asked for (1000), not to n_ctx padded to
    # 1024, so the default n_seq_max must divide 1000. Taking 64 aborted the process at LOAD
    # (GGML_ASSERT(ggml_can_mul_mat)).
    path = store.get("gemma3-270m").artifact_path
    ref = _load(engine, path, "gemma-embed", embedding=True, pooling="mean", n_ctx=1000).model_ref
    try:
        mdl = engine._models[ref]
        assert (mdl.n_batch, mdl.n_seq_max) == (1000, 50)
        vectors = _embed(engine, ref, [[2, 818, 5279], [2, 9259]])
        assert vectors.shape == (2, mdl.n_embd) and np.isfinite(vectors).all()
    finally:
        engine.unload(m.UNLOAD(req_id=9, model_ref=ref), NullProgress())
    with pytest.raises(EngineError) as e:  # one sequence's cells would be n_ctx / n_seq_max
        _load(engine, path, "gemma-two", n_seq_max=2)
    assert e.value.code == "config_invalid" and "n_seq_max must be 1" in e.value.msg


def test_pack_respects_limits() -> None:
    assert pack([3, 3, 3, 3], 6, 8) == [[0, 1], [2, 3]]
    assert pack([1] * 5, 100, 2) == [[0, 1], [2, 3], [4]]
    assert pack([10, 1], 4, 8) == [[0], [1]]  # oversize items travel alone
    assert pack([], 4, 4) == []


def test_plan_decodes_groups_similar_lengths_in_small_decodes() -> None:
    lengths = [100, 5, 300, 7, 60, 6]
    groups = plan_decodes(lengths, 512, 64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each once
    assert [[lengths[i] for i in g] for g in groups] == [[5, 6, 7, 60], [100], [300]]
    for g in groups:  # a decode holds ENC_DECODE_TOKENS, or one longer item alone
        assert sum(lengths[i] for i in g) <= ENC_DECODE_TOKENS or len(g) == 1
    assert plan_decodes([3, 3, 3], 4, 64) == [[0], [1], [2]]  # the context's limit still rules
    assert plan_decodes([1] * 5, 512, 2) == [[0, 1], [2, 3], [4]]


def test_embed_validation_errors_leave_engine_usable(engine, embedders, tokenizer) -> None:
    ref = embedders["f16"]
    good = [tokenizer.encode("still works").ids]
    before = _embed(engine, ref, good)
    cases = {
        "id out of vocab": [[101, 30522, 102]],
        "negative id": [[101, -1, 102]],
        "too long": [[101] + [1000] * 600 + [102]],
        "empty item": [[101, 102], []],
    }
    for why, seqs in cases.items():
        with pytest.raises(EngineError) as e:
            _embed(engine, ref, seqs)
        assert e.value.code == "invalid_request", why
    with pytest.raises(EngineError) as e:  # checked before the cast: not token 5
        engine.embed(
            m.EMBED_BATCH(req_id=3, model_ref=ref, items=[m.EmbedItem(id=0, n_tokens=3)]),
            np.array([101, 2**32 + 5, 102], np.int64),
            NullProgress(),
        )
    assert e.value.code == "invalid_request" and str(2**32 + 5) in e.value.msg
    with pytest.raises(EngineError) as e:  # header and payload disagree
        engine.embed(
            m.EMBED_BATCH(req_id=3, model_ref=ref, items=[m.EmbedItem(id=0, n_tokens=5)]),
            np.arange(4, dtype=np.int32),
            NullProgress(),
        )
    assert e.value.code == "invalid_request"
    with pytest.raises(EngineError) as e:
        engine.embed(
            m.EMBED_BATCH(
                req_id=3, model_ref=ref, pooling="cls", items=[m.EmbedItem(id=0, n_tokens=2)]
            ),
            np.array([101, 102], np.int32),
            NullProgress(),
        )
    assert e.value.code == "invalid_request"
    with pytest.raises(EngineError) as e:
        _embed(engine, "nope", good)
    assert e.value.code == "model_not_loaded"
    # 512 tokens (the position limit) is fine; the engine is unharmed.
    assert _embed(engine, ref, [[101] + [1000] * 510 + [102]]).shape == (1, 384)
    np.testing.assert_array_equal(_embed(engine, ref, good), before)


def test_unsafe_flag_lets_a_real_ggml_assert_through(store, tmp_path) -> None:
    path = store.get("minilm-l6-v2").artifact_path
    script = textwrap.dedent(f"""
        import numpy as np
        from workers.engine import NullProgress, EngineError
        from formats.digest import sha256_file
        from workers.llama.engine import LlamaEngine
        from workers.protocol import messages as m
        e = LlamaEngine()
        p = {str(path)!r}
        e.load(m.LOAD(req_id=1, artifact_path=p, artifact_digest=sha256_file(p), format="gguf",
                      runtime_config={{"model_ref": "x", "n_ctx": 512, "n_threads": 1}}),
               NullProgress())
        # 600 tokens: over n_batch = n_ubatch = 512 (the defaults) and over BERT's positions.
        req = m.EMBED_BATCH(req_id=2, model_ref="x", items=[m.EmbedItem(id=0, n_tokens=600)])
        try:
            e.embed(req, np.full(600, 1000, np.int32), NullProgress())
        except EngineError as err:
            print("REFUSED", err.code, flush=True)
            raise SystemExit(0)
        print("SURVIVED", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    safe = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert safe.returncode == 0 and "REFUSED invalid_request" in safe.stdout, safe.stderr[-2000:]
    env["SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE"] = "1"
    crash = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert crash.returncode < 0, (crash.returncode, crash.stdout, crash.stderr[-2000:])
    assert "GGML_ASSERT" in crash.stderr and "n_ubatch" in crash.stderr


# ---- LOAD ---------------------------------------------------------------------------------


def test_build_flags_name_the_backends_and_the_decode_size_follows_blas(engine) -> None:
    # BLAS or not changes speed and rounding: HELLO's flags (hence certificates) say which.
    backends = registered_backends()
    assert "CPU" in backends
    assert f"| backends={','.join(backends)} |" in engine.info().build_flags
    blas = "BLAS" in backends
    assert engine._decode_tokens == (ENC_DECODE_TOKENS_BLAS if blas else ENC_DECODE_TOKENS)
    lengths = [20] * 40
    assert all(
        sum(lengths[i] for i in g) <= ENC_DECODE_TOKENS_BLAS
        for g in plan_decodes(lengths, 512, 64, ENC_DECODE_TOKENS_BLAS)
    )
    assert len(plan_decodes(lengths, 512, 64, ENC_DECODE_TOKENS_BLAS)) < len(
        plan_decodes(lengths, 512, 64)
    )


def test_plan_decodes_gives_every_stream_work() -> None:
    # 16 x 16 tokens fit one 256-token decode; with two streams it runs as two at once.
    assert [len(g) for g in plan_decodes([16] * 16, 512, 64, 256, streams=2)] == [8, 8]
    for lengths in ([12, 12, 13, 3, 18, 12, 12, 12, 18, 30], [1, 50, 2, 49, 3], [5] * 7):
        for streams in (2, 3):
            groups = plan_decodes(lengths, 512, 64, 10**6, streams)
            assert len(groups) <= streams and sorted(sum(groups, [])) == list(range(len(lengths)))
    assert len(plan_decodes([16] * 32, 512, 64, 256, streams=2)) == 2  # already 2 decodes
    assert plan_decodes([100, 5], 512, 64, 256, streams=2) == [[1, 0]]  # no item is ever cut
    assert plan_decodes([7], 512, 64, 256, streams=2) == [[0]]
    # Over one round: at most whole rounds of one decode per stream, evenly filled, so
    # 48 x 16 tokens run as 4 x 192, not as 256 + 256 + 256 (the last one alone).
    assert [len(g) for g in plan_decodes([16] * 48, 512, 64, 256, streams=2)] == [12] * 4
    for lengths in ([16] * 48, [30, 2, 250, 17] * 9, list(range(1, 80)), [16] * 33):
        for streams in (2, 3):
            groups = plan_decodes(lengths, 512, 64, 256, streams)
            rounds = -(-sum(lengths) // (streams * 256))
            assert len(groups) <= rounds * streams, (lengths, streams)
            assert all(sum(lengths[i] for i in g) <= 256 for g in groups)
            assert sorted(sum(groups, [])) == list(range(len(lengths)))


def test_load_rejects_bad_digest_config_and_files(engine, store, tmp_path) -> None:
    path = store.get("minilm-l6-v2").artifact_path

    def load(p: Path, digest: str, cfg: dict) -> m.LOADED:
        return engine.load(
            m.LOAD(
                req_id=5,
                artifact_path=str(p),
                artifact_digest=digest,
                format="gguf",
                runtime_config=cfg,
            ),
            NullProgress(),
        )

    good = sha256_file(path)
    codes = {
        "wrong digest": (path, "0" * 64, {}),
        "not a digest": (path, "abc", {}),
        "missing file": (tmp_path / "none.gguf", good, {}),
        "NUL in path": (f"{path}\x00.gguf", good, {}),
        "unknown key": (path, good, {"n_thread": 2}),
        "bad type": (path, good, {"n_ctx": "512"}),
        "bool as int": (path, good, {"n_batch": True}),
        "n_ubatch > n_batch": (path, good, {"n_batch": 64, "n_ubatch": 128}),
        "n_seq_max not dividing": (path, good, {"n_batch": 64, "n_seq_max": 3}),
        "encoder asked to generate": (path, good, {"kind": "generate"}),
    }
    for why, (p, d, cfg) in codes.items():
        with pytest.raises(EngineError) as e:
            load(p, d, {"model_ref": "bad", **cfg})
        want = (
            "artifact_invalid"
            if why in ("wrong digest", "not a digest", "missing file", "NUL in path")
            else "config_invalid"
        )
        assert e.value.code == want, (why, e.value)

    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(path.read_bytes()[:10_000_000])
    with pytest.raises(EngineError) as e:
        load(truncated, sha256_file(truncated), {"model_ref": "bad"})
    assert e.value.code == "artifact_invalid" and "outside the file" in e.value.msg

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(EngineError) as e:
        load(garbage, sha256_file(garbage), {"model_ref": "bad"})
    assert e.value.code == "artifact_invalid"

    unknown_arch = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(unknown_arch), "not-an-arch")
    w.add_tensor("x", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineError) as e:
        load(unknown_arch, sha256_file(unknown_arch), {"model_ref": "bad"})
    assert e.value.code == "artifact_invalid"

    with pytest.raises(EngineError) as e:
        load(path, good, {"model_ref": "mini-f16"})  # already loaded by the module fixture
    assert e.value.code == "config_invalid"
    assert "bad" not in engine.models_loaded()


def test_qwen3_reranker_without_its_two_rows_refused_at_load(engine, tmp_path) -> None:
    path = tmp_path / "qwen3-reranker.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineError) as e:
        engine.load(
            m.LOAD(
                req_id=6,
                artifact_path=str(path),
                artifact_digest=sha256_file(path),
                format="gguf",
                runtime_config={},
            ),
            NullProgress(),
        )
    # An LLM reranker is scored from its two classifier rows: without them, nothing to score.
    assert e.value.code == "unsupported" and "two-row head" in e.value.msg


def test_info_and_several_models_at_once(engine, embedders, gemma) -> None:
    import llama_cpp

    info = engine.info()
    assert info.engine == "llama.cpp" and info.version == llama_cpp.__version__
    assert "CPU" in info.build_flags
    assert {"mini-f16", "mini-f32", "gemma"} <= set(engine.models_loaded())
    with pytest.raises(EngineError) as e:
        engine.embed(
            m.EMBED_BATCH(req_id=1, model_ref="gemma", items=[m.EmbedItem(id=0, n_tokens=1)]),
            np.array([2], np.int32),
            NullProgress(),
        )
    assert e.value.code == "invalid_request"


def test_unload(engine, store) -> None:
    ref = _load(engine, store.get("minilm-l6-v2").artifact_path, "to-unload").model_ref
    assert ref in engine.models_loaded()
    engine.unload(m.UNLOAD(req_id=1, model_ref=ref), NullProgress())
    assert ref not in engine.models_loaded()
    with pytest.raises(EngineError) as e:
        engine.unload(m.UNLOAD(req_id=2, model_ref=ref), NullProgress())
    assert e.value.code == "model_not_loaded"


# ---- rerank -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(engine, test_cross_encoder_dir, module_tmp) -> tuple[str, Path, Tokenizer]:
    d, src = module_tmp, test_cross_encoder_dir
    convert_bert_dir(src, d / "ce.gguf", "f32")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return _load(engine, d / "ce.gguf", "ce").model_ref, src, tok


def test_rerank_scores_pairs_composed_by_the_worker(engine, cross_encoder) -> None:
    ref, src, tok = cross_encoder
    query = tok.encode("what is the capital of france", add_special_tokens=False).ids
    docs = [
        tok.encode(t, add_special_tokens=False).ids
        for t in ("Paris is the capital of France.", "Bananas are yellow.", "the eiffel tower")
    ]
    req = m.RERANK(
        req_id=3,
        model_ref=ref,
        query_n_tokens=len(query),
        candidates=[m.RerankCandidate(n_tokens=len(d)) for d in docs],
    )
    progress = NullProgress()
    scores = engine.rerank(req, np.asarray(query + sum(docs, []), np.int32), progress)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    # one PROGRESS step per decode; the two streams each take a share of the three pairs
    pairs = [len(query) + len(d) + 3 for d in docs]
    decodes = plan_decodes(pairs, 512, 64, engine._decode_tokens, THREADS)
    assert np.all(np.isfinite(scores)) and progress.completed == len(decodes) > 1
    assert len(set(scores.tolist())) == 3
    # The pair is [CLS] q [SEP] d [SEP] with token type 1 on `d [SEP]`, as the model was
    # trained; llama.cpp's BERT graph alone would give every position type 0, so the worker
    # feeds the types as input embeddings. The scores match the typed forward, far from the
    # type-0 one. (The random head amplifies llama.cpp's GELU/attention rounding: rel 3e-3.)
    bert = BertReference.from_dir(src)
    for d, s in zip(docs, scores, strict=True):
        pair = [101, *query, 102, *d, 102]
        type0 = float(bert.score(pair, [0] * len(pair)))
        typed = float(bert.score(pair, [0] * (len(query) + 2) + [1] * (len(d) + 1)))
        assert s == pytest.approx(typed, rel=3e-3)
        assert abs(s - typed) * 10 < abs(s - type0), (s, typed, type0)
    # A candidate of no tokens (a text of only spaces) is scored as "[CLS] q [SEP] [SEP]",
    # as the reference scores it; an over-long pair is refused, nothing breaks.
    empty = engine.rerank(
        m.RERANK(
            req_id=4,
            model_ref=ref,
            query_n_tokens=len(query),
            candidates=[m.RerankCandidate(n_tokens=0)],
        ),
        np.asarray(query, np.int32),
        NullProgress(),
    )
    pair = [101, *query, 102, 102]
    assert empty[0] == pytest.approx(
        float(bert.score(pair, [0] * (len(query) + 2) + [1])), rel=3e-3
    )
    with pytest.raises(EngineError) as e:
        engine.rerank(
            m.RERANK(
                req_id=5,
                model_ref=ref,
                query_n_tokens=len(query),
                candidates=[m.RerankCandidate(n_tokens=600)],
            ),
            np.asarray(query + [1000] * 600, np.int32),
            NullProgress(),
        )
    assert e.value.code == "invalid_request"
    again = engine.rerank(req, np.asarray(query + sum(docs, []), np.int32), NullProgress())
    np.testing.assert_array_equal(again, scores)


# ---- generation ---------------------------------------------------------------------------


def _chat(user: str) -> str:
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


GEMMA_PROMPT = _chat("Name three colours of the rainbow.")
YES_NO_PROMPT = _chat("Is the sky blue? Answer yes or no.")


@pytest.fixture(scope="module")
def gemma_llm(store):
    import llama_cpp

    with cpu_quirks.high_level_llama_follows_policy():  # the worker's kernels
        return llama_cpp.Llama(
            model_path=str(store.get("gemma3-270m").artifact_path),
            n_ctx=2048,
            n_batch=512,
            n_threads=THREADS,
            flash_attn=True,
            verbose=False,
        )


def _tok(llm, text: str) -> np.ndarray:
    return np.asarray(llm.tokenize(text.encode(), add_bos=True, special=True), np.int32)


def _gen(
    engine,
    ref: str,
    ids: np.ndarray,
    max_tokens: int,
    grammar: str | None = None,
    progress: NullProgress | None = None,
):
    return engine.generate(
        m.GENERATE(req_id=7, model_ref=ref, max_tokens=max_tokens, grammar=grammar),
        ids,
        progress or NullProgress(),
    )


def test_greedy_generation_equals_llama_cpp_python(engine, gemma, gemma_llm) -> None:
    import llama_cpp

    ids = _tok(gemma_llm, GEMMA_PROMPT)
    progress = NullProgress()
    got = _gen(engine, gemma, ids, 24, progress=progress)
    want: list[int] = []
    for tok in gemma_llm.generate(ids.tolist(), temp=0.0, repeat_penalty=1.0, top_k=1):
        if llama_cpp.llama_vocab_is_eog(gemma_llm._model.vocab, tok):
            break
        want.append(tok)
        if len(want) == 24:
            break
    assert got.text == gemma_llm.detokenize(want).decode("utf-8", "ignore")
    assert got.n_gen == len(want) and got.n_prompt == len(ids)
    assert got.finish_reason == ("length" if len(want) == 24 else "stop")
    assert progress.completed == 1 + got.n_gen - (got.finish_reason == "length")
    short = _gen(engine, gemma, ids, 3)
    assert (short.n_gen, short.finish_reason) == (3, "length")
    assert got.text.startswith(short.text)


def test_grammar_constrains_output(engine, gemma, gemma_llm) -> None:
    ids = _tok(gemma_llm, YES_NO_PROMPT)
    out = _gen(engine, gemma, ids, 10, grammar='root ::= ("yes" | "no")')
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    num = _gen(engine, gemma, ids, 20, grammar='root ::= "Answer: " [0-9]+ "."')
    assert re.fullmatch(r"Answer: [0-9]+\.", num.text), num


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= (",  # syntax error: our validator
        'root ::= "a" | undefined',  # undefined rule: our validator
        'root ::= root "a"',  # left recursion: llama.cpp returns NULL
        'root ::= "' + "a" * 65000 + '"{2000}',  # ~2 GB once llama.cpp expands it: refused first
        "root ::= <not-a-token>",  # not one token: llama.cpp returns NULL
        "",  # llama.cpp would silently run unconstrained
    ],
)
def test_bad_grammar_is_invalid_request(engine, gemma, gemma_llm, grammar: str) -> None:
    ids = _tok(gemma_llm, YES_NO_PROMPT)
    with pytest.raises(EngineError) as e:
        _gen(engine, gemma, ids, 5, grammar=grammar)
    assert e.value.code == "invalid_request"
    assert _gen(engine, gemma, ids, 2).n_gen >= 1  # still serving


def test_generate_validation(engine, gemma, gemma_llm) -> None:
    for ids, max_tokens in (
        (np.array([2, 262144], np.int32), 4),
        (np.zeros(0, np.int32), 4),
        (np.full(2040, 107, np.int32), 64),
    ):
        with pytest.raises(EngineError) as e:
            _gen(engine, gemma, ids, max_tokens)
        assert e.value.code == "invalid_request"
    zero = _gen(engine, gemma, _tok(gemma_llm, YES_NO_PROMPT), 0)
    assert (zero.text, zero.n_gen, zero.finish_reason) == ("", 0, "length")


def test_long_prompt_is_prefilled_in_n_batch_chunks(engine, store, gemma, gemma_llm) -> None:
    # A 32-token n_batch makes an ordinary prompt span several prefill decodes; the greedy
    # continuation must equal the one-chunk context's (itself checked against llama-cpp-python).
    ref = _load(
        engine, store.get("gemma3-270m").artifact_path, "gemma-b32", n_ctx=256, n_batch=32
    ).model_ref
    try:
        ids = _tok(gemma_llm, _chat("Continue the list of colours: " + "red, orange, " * 20))
        assert len(ids) > 2 * 32
        progress = NullProgress()
        got = _gen(engine, ref, ids, 6, progress=progress)
        chunks = -(-len(ids) // 32)
        assert progress.completed == chunks + got.n_gen - (got.finish_reason == "length")
        assert got == _gen(engine, gemma, ids, 6)
    finally:
        engine.unload(m.UNLOAD(req_id=8, model_ref=ref), NullProgress())
