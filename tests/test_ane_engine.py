"""AneEngine in-process on the reference backend (fp16-emulating executor of the SAVED package),
against the independent fp32 numpy reference forward."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from compile_cache import CompileCache
from host import HostConfig, Lane, LaneConfig
from tests import test_ane_helpers as h
from workers.ane import builder
from workers.ane.backends import PLACEMENT_DELAY_ENV, ReferenceBackend, placement_delay_s
from workers.ane.builder import KERNEL_REVISION, BuildOptions, convert_and_save
from workers.ane.compiler import cache_key
from workers.ane.config import ENV_COMPUTE_UNITS, parse_runtime_config, resolve_compute_units
from workers.ane.ct_quiet import Function, Program, ct, mb, types
from workers.ane.engine import AneEngine
from workers.ane.executor import SUPPORTED_OPS
from workers.ane.packing import plan
from workers.ane.shapes import Shape
from workers.engine import EngineError, NullProgress
from workers.protocol import messages as m

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker


class RecordingProgress:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.completed = 0

    def advance(self, phase: str, completed: int = 1) -> None:
        self.completed += completed
        self.events.append((phase, self.completed))


@pytest.fixture(scope="module")
def embed_engine() -> AneEngine:
    engine = h.new_engine(h.minilm(), [h.EMBED_UNPACKED, h.EMBED_PACKED])
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def rerank_engine() -> AneEngine:
    engine = h.new_engine(h.cross_encoder(), [h.RERANK_UNPACKED, h.RERANK_PACKED])
    yield engine
    engine.close()


def _embed(
    engine: AneEngine,
    seqs: list[np.ndarray],
    normalize: bool = False,
    progress: object | None = None,
) -> np.ndarray:
    req, ids = h.embed_request(h.minilm(), seqs, normalize=normalize)
    return engine.embed(req, ids, progress or NullProgress())


# ---- fidelity -----------------------------------------------------------------------------------


def test_embeddings_match_fp32_reference(embed_engine: AneEngine) -> None:
    texts = h.embed_corpus()
    seqs = [h.encode(t) for t in texts]
    assert len(seqs) >= 100
    assert sum(len(s) >= 200 for s in seqs) >= 5
    progress = RecordingProgress()
    got = _embed(embed_engine, seqs, normalize=False, progress=progress)
    want = h.minilm_reference().embed(seqs, pooling="mean", normalize=True)
    cos = h.cosines(got, want)
    print(
        f"\nembed fidelity over {len(seqs)} items: min cos {cos.min():.7f}, mean {cos.mean():.7f}"
    )
    assert cos.min() >= 0.9995, texts[int(cos.argmin())]
    assert cos.mean() >= 0.9999
    # Progress: one "inference" unit per executed chunk, strictly increasing.
    assert [p for p, _ in progress.events] == ["inference"] * len(progress.events)
    assert [c for _, c in progress.events] == list(range(1, len(progress.events) + 1))
    assert len(progress.events) >= 2  # long items ran unpacked, short ones packed


def test_normalized_output_is_unit_length(embed_engine: AneEngine) -> None:
    seqs = [h.encode(t) for t in h.embed_corpus()[:12]]
    raw = _embed(embed_engine, seqs, normalize=False)
    unit = _embed(embed_engine, seqs, normalize=True)
    assert np.abs(np.linalg.norm(unit, axis=1) - 1.0).max() < 1e-5
    assert h.cosines(raw, unit).min() > 0.99999


def test_packed_and_unpacked_agree() -> None:
    texts = h.embed_corpus()[:48:4]
    seqs = [h.encode(t, limit=120) for t in texts]
    unpacked = h.new_engine(h.minilm(), [h.EMBED_UNPACKED])
    packed = h.new_engine(h.minilm(), [h.EMBED_PACKED])
    try:
        # The served (L2-normalised) vectors: components of O(0.1), where 1e-3 is a few fp16
        # ulps. The two graphs round differently only where they differ (positions gathered
        # per segment vs a folded constant; zero-weight keys of other segments).
        a = _embed(unpacked, seqs, normalize=True)
        b = _embed(packed, seqs, normalize=True)
    finally:
        unpacked.close()
        packed.close()
    diff = np.abs(a - b).max()
    print(f"\npacked vs unpacked: max |diff| {diff:.2e} over {len(seqs)} items")
    assert diff <= 1e-3
    assert h.cosines(a, b).min() > 0.99999
    assert np.abs(a).max() > 0.05  # not trivially equal


def test_cross_encoder_scores_match_reference(rerank_engine: AneEngine) -> None:
    tok = h.tokenizer()
    encs = [tok.encode(q, d) for q, d in h.pairs()]
    encs = [e for e in encs if len(e.ids) <= 128]
    assert len(encs) >= 20
    assert all(0 < e.type_ids.count(0) < len(e.ids) for e in encs)  # real segment B
    req, ids = h.rerank_request(h.cross_encoder(), encs)
    ref = h.cross_encoder_reference()
    want = np.array([ref.score(e.ids, e.type_ids) for e in encs])
    # Unpacked only, then packed only (evicting the other), so both graphs are checked.
    for keep in ("4x128", "2x128p8"):
        other = "2x128p8" if keep == "4x128" else "4x128"
        rerank_engine.evict(
            m.EVICT(req_id=9, model_ref=req.model_ref, shape_id=other), NullProgress()
        )
        got = rerank_engine.rerank_sequences(req, ids, NullProgress())
        err = np.abs(got - want).max()
        print(f"\ncross-encoder ({keep}): max |score error| {err:.2e}, score std {want.std():.2f}")
        assert err <= 5e-3
        spec = h.RERANK_UNPACKED if other == "4x128" else h.RERANK_PACKED
        rerank_engine.admit_shape(
            m.ADMIT_SHAPE(req_id=10, model_ref=req.model_ref, **spec), NullProgress()
        )
    # Token types matter for this head: a lane that dropped them would fail the 5e-3 gate.
    no_types = ref.score_many([e.ids for e in encs])
    assert np.abs(no_types - want).max() > 4 * 5e-3


# ---- shapes: cache, evict, budget ---------------------------------------------------------------


def test_second_engine_hits_the_cache_and_compiles_nothing(monkeypatch) -> None:
    first = h.new_engine(h.minilm(), [h.EMBED_UNPACKED])
    first.close()

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache hit must not build or convert anything")

    monkeypatch.setattr(builder, "build_program", no_compile)
    monkeypatch.setattr(builder, "convert_and_save", no_compile)
    monkeypatch.setattr(ReferenceBackend, "compile", no_compile)
    second = h.new_engine(h.minilm(), [])
    try:
        progress = RecordingProgress()
        reply = second.admit_shape(
            m.ADMIT_SHAPE(req_id=5, model_ref="minilm", **h.EMBED_UNPACKED), progress
        )
        assert reply.shape_id == "4x256"
        assert reply.cache_hit is True
        assert reply.compile_ms == 0.0 and reply.build_ms == 0.0
        assert reply.load_ms > 0
        assert reply.warmup_ms == 0  # the reference backend has nothing to warm up
        # Opened ("loaded"), placed (the placement share, computed at admission so PING only
        # reads it), then admitted: each a completed stage.
        assert progress.events == [("control", 1), ("control", 2), ("control", 3)]
        # Admitting a loaded shape again is a no-op hit.
        again = second.admit_shape(
            m.ADMIT_SHAPE(req_id=6, model_ref="minilm", **h.EMBED_UNPACKED), NullProgress()
        )
        assert again.cache_hit is True and second.loaded_shapes() == ["4x256"]
    finally:
        second.close()


def test_evict_frees_the_shape() -> None:
    engine = h.new_engine(h.minilm(), [h.EMBED_UNPACKED, h.EMBED_PACKED])
    try:
        seqs = [h.encode("the engine still works")]
        reply = engine.evict(
            m.EVICT(req_id=7, model_ref="minilm", shape_id="4x256p16"), NullProgress()
        )
        assert reply.shape_ids == ["4x256p16"]
        assert reply.freed_bytes > 1_000_000  # the package: weights + program
        assert engine.loaded_shapes() == ["4x256"]
        assert _embed(engine, seqs).shape == (1, 384)
        # Evicting a shape that is not loaded is a no-op; a malformed id is refused.
        none = engine.evict(
            m.EVICT(req_id=8, model_ref="minilm", shape_id="4x256p16"), NullProgress()
        )
        assert none.shape_ids == [] and none.freed_bytes == 0
        with pytest.raises(EngineError) as bad:
            engine.evict(m.EVICT(req_id=9, model_ref="minilm", shape_id="four"), NullProgress())
        assert bad.value.code == "invalid_request"
        everything = engine.evict(m.EVICT(req_id=10, model_ref="minilm"), NullProgress())
        assert everything.shape_ids == ["4x256"] and engine.loaded_shapes() == []
        with pytest.raises(EngineError) as gone:
            _embed(engine, seqs)
        assert gone.value.code == "shape_unsupported"
        assert engine.placement() == (None, None)
    finally:
        engine.close()


def test_shape_budget_evicts_least_recently_used() -> None:
    engine = h.new_engine(h.minilm(), [h.EMBED_UNPACKED], max_loaded_shapes=1)
    try:
        assert engine.loaded_shapes() == ["4x256"]
        reply = engine.admit_shape(
            m.ADMIT_SHAPE(req_id=4, model_ref="minilm", **h.EMBED_PACKED), NullProgress()
        )
        assert reply.cache_hit is True
        assert engine.loaded_shapes() == ["4x256p16"]
        share, source = engine.placement()
        assert source == "estimate" and 0.9 < share <= 1.0
    finally:
        engine.close()


def test_shapes_over_the_limits_are_refused(embed_engine: AneEngine) -> None:
    for rows, seq_len in ((65, 64), (4, 513), (64, 256)):
        with pytest.raises(EngineError) as e:
            embed_engine.admit_shape(
                m.ADMIT_SHAPE(req_id=11, model_ref="minilm", rows=rows, seq_len=seq_len),
                NullProgress(),
            )
        assert e.value.code == "shape_unsupported"
    with pytest.raises(EngineError) as e:
        embed_engine.admit_shape(
            m.ADMIT_SHAPE(req_id=12, model_ref="minilm", rows=2, seq_len=0), NullProgress()
        )
    assert e.value.code == "invalid_request"


# ---- an op the executor lacks ----------------------------------------------------------------


def _package_with_sin(out_dir: Path) -> None:
    ph = {"input_ids": mb.placeholder(shape=(1, 8), dtype=types.int32)}
    with Function(ph, ct.target.macOS14) as func:
        x = mb.cast(x=func.inputs["input_ids"], dtype="fp32")
        func.set_outputs([mb.sin(x=x, name="embedding")])
    prog = Program()
    prog.add_function("main", func)
    convert_and_save(prog, out_dir)


def test_unknown_op_is_a_typed_compile_failure_and_the_engine_survives() -> None:
    manifest = h.minilm()
    bogus = Shape(1, 8)
    # Plant a package using `sin` under the cache key the engine computes for shape 1x8.
    with CompileCache(h.CACHE_ROOT) as cache:
        cache.get_or_build(cache_key(manifest, bogus, BuildOptions()), _package_with_sin)
    engine = h.new_engine(manifest, [h.EMBED_UNPACKED])
    try:
        with pytest.raises(EngineError) as e:
            engine.admit_shape(
                m.ADMIT_SHAPE(req_id=13, model_ref="minilm", rows=1, seq_len=8), NullProgress()
            )
        assert e.value.code == "compile_failed"
        assert "sin" in e.value.msg
        assert engine.loaded_shapes() == ["4x256"]
        assert _embed(engine, [h.encode("still serving")]).shape == (1, 384)
    finally:
        engine.close()


# ---- requests and errors ------------------------------------------------------------------------


def test_load_refusals() -> None:
    manifest = h.minilm()
    engine = AneEngine(backend="reference")
    good = h.load_request(manifest, shapes=[])
    cases = [
        (
            m.LOAD(
                req_id=1, artifact_path=manifest.dir, artifact_digest=manifest.digest, format="gguf"
            ),
            "artifact_invalid",
        ),
        (
            m.LOAD(
                req_id=1,
                artifact_path=manifest.dir,
                artifact_digest="0" * 64,
                format="coreml-owned",
            ),
            "artifact_invalid",
        ),
        (
            m.LOAD(
                req_id=1,
                artifact_path=str(h.ROOT / "missing"),
                artifact_digest="0" * 64,
                format="coreml-owned",
            ),
            "artifact_invalid",
        ),
        (
            m.LOAD(
                req_id=1,
                artifact_path=manifest.dir,
                artifact_digest=manifest.digest,
                format="coreml-owned",
                runtime_config={"max_loaded_shape": 2},
            ),
            "config_invalid",
        ),
        (
            m.LOAD(
                req_id=1,
                artifact_path=manifest.dir,
                artifact_digest=manifest.digest,
                format="coreml-owned",
                runtime_config={"shapes": [{"rows": "8"}]},
            ),
            "config_invalid",
        ),
    ]
    if sys.platform != "darwin":
        cases.append(
            (
                m.LOAD(
                    req_id=1,
                    artifact_path=manifest.dir,
                    artifact_digest=manifest.digest,
                    format="coreml-owned",
                    runtime_config={"backend": "coreml"},
                ),
                "config_invalid",
            )
        )
    for req, code in cases:
        with pytest.raises(EngineError) as e:
            engine.load(req, NullProgress())
        assert e.value.code == code, (req, e.value)
    loaded = engine.load(good, NullProgress())
    assert loaded.model_ref == "minilm" and loaded.dims == 384
    assert engine.load(good, NullProgress()).cold_load_ms == 0.0  # idempotent
    other = h.load_request(h.cross_encoder(), shapes=[])
    with pytest.raises(EngineError) as e:
        engine.load(other, NullProgress())
    assert e.value.code == "invalid_request"  # one model per worker
    engine.unload(m.UNLOAD(req_id=2, model_ref="minilm"), NullProgress())
    assert engine.models_loaded() == []
    engine.close()


def test_compute_units_are_validated_and_the_environment_overrides(monkeypatch) -> None:
    manifest = h.minilm()
    engine = AneEngine(backend="reference")
    try:
        with pytest.raises(EngineError) as e:
            engine.load(
                h.load_request(manifest, shapes=[], compute_units="ane_only"), NullProgress()
            )
        assert e.value.code == "config_invalid" and "compute_units" in e.value.msg
        monkeypatch.setenv(ENV_COMPUTE_UNITS, "gpu_please")
        with pytest.raises(EngineError) as e:
            engine.load(
                h.load_request(manifest, shapes=[], compute_units="cpu_only"), NullProgress()
            )
        assert e.value.code == "config_invalid"
        assert "SYNAPSE_COREML_COMPUTE_UNITS='gpu_please'" in e.value.msg
        assert "cpu_and_ne" in e.value.msg  # the message lists the valid values
        monkeypatch.setenv(ENV_COMPUTE_UNITS, "cpu_only")
        loaded = engine.load(
            h.load_request(manifest, shapes=[], compute_units="all"), NullProgress()
        )
        assert loaded.model_ref == "minilm"  # the reference backend accepts any valid value
    finally:
        engine.close()
    config = parse_runtime_config({"compute_units": "all"})
    assert resolve_compute_units(config, {}) == "all"
    assert resolve_compute_units(config, {ENV_COMPUTE_UNITS: "cpu_only"}) == "cpu_only"
    assert resolve_compute_units(config, {ENV_COMPUTE_UNITS: ""}) == "all"  # unset = empty
    assert resolve_compute_units(parse_runtime_config({}), {}) == "cpu_and_ne"


def test_loaded_declares_the_longest_item_its_shapes_take(rerank_engine: AneEngine) -> None:
    """LOADED.max_item_tokens is the longest admitted row (packed or not), which a host
    serving the model on two lanes reads to send a longer item to the other lane; a LOAD of
    the model already loaded declares it again."""
    manifest = h.cross_encoder()
    assert manifest.config.max_seq_length > 128  # the shapes hold less than the model does
    again = h.load_request(manifest, shapes=[h.RERANK_UNPACKED, h.RERANK_PACKED])
    loaded = rerank_engine.load(again, NullProgress())
    assert isinstance(loaded, m.LOADED) and loaded.max_item_tokens == 128


def test_worker_started_for_one_artifact_refuses_another() -> None:
    engine = AneEngine(h.minilm().dir, backend="reference")
    with pytest.raises(EngineError) as e:
        engine.load(h.load_request(h.cross_encoder(), shapes=[]), NullProgress())
    assert e.value.code == "artifact_invalid"
    engine.close()


def test_hello_and_argv() -> None:
    engine = AneEngine.from_argv(
        ["--artifact", h.minilm().dir, "--backend", "reference", "--cache-root", str(h.CACHE_ROOT)]
    )
    extras = engine.hello_extras()
    assert extras == {
        "manifest_digest": h.minilm().digest,
        "kernel_revision": KERNEL_REVISION,
        "packed": True,
    }
    hello = m.HELLO(v=3, nonce="n", engine=engine.info(), pid=1, **extras)
    assert m.decode_from_worker(m.encode(hello)) == hello
    assert AneEngine().hello_extras() == {"kernel_revision": KERNEL_REVISION, "packed": True}


def test_request_validation(embed_engine: AneEngine, rerank_engine: AneEngine) -> None:
    good = h.encode("fine")
    cases = [
        ([np.array([101, 30522, 102], np.int32)], "invalid_request"),  # id outside vocab
        ([np.array([101, -1, 102], np.int32)], "invalid_request"),
        ([np.arange(300, dtype=np.int32) + 1000], "shape_unsupported"),  # longer than 256
        ([np.arange(513, dtype=np.int32) + 1000], "invalid_request"),  # past 512 positions
    ]
    for seqs, code in cases:
        with pytest.raises(EngineError) as e:
            _embed(embed_engine, [good, *seqs])
        assert e.value.code == code
    req, ids = h.embed_request(h.minilm(), [good, good])
    with pytest.raises(EngineError) as e:  # frame shorter than declared
        embed_engine.embed(req, ids[:-1], NullProgress())
    assert e.value.code == "invalid_request"
    with pytest.raises(EngineError) as e:
        embed_engine.embed(m.EMBED_BATCH(req_id=1, model_ref="nope", items=[]), ids, NullProgress())
    assert e.value.code == "model_not_loaded"
    with pytest.raises(EngineError) as e:
        embed_engine.embed(
            m.EMBED_BATCH(
                req_id=1,
                model_ref="minilm",
                pooling="cls",
                items=[m.EmbedItem(id=0, n_tokens=len(good))],
            ),
            good,
            NullProgress(),
        )
    assert e.value.code == "unsupported"
    ce = h.model_ref(h.cross_encoder())
    with pytest.raises(EngineError) as e:  # a cross-encoder does not embed
        rerank_engine.embed(
            m.EMBED_BATCH(req_id=1, model_ref=ce, items=[m.EmbedItem(id=0, n_tokens=len(good))]),
            good,
            NullProgress(),
        )
    assert e.value.code == "unsupported"
    with pytest.raises(EngineError) as e:
        rerank_engine.rerank_sequences(
            m.RERANK_SEQUENCES(
                req_id=1, model_ref=ce, sequences=[m.RerankSequence(n_tokens=len(good), n_first=0)]
            ),
            good,
            NullProgress(),
        )
    assert e.value.code == "invalid_request"


def _encode(engine: AneEngine, manifest, seqs: list[np.ndarray], outputs: list) -> list:
    req = m.ENCODE(
        req_id=4,
        model_ref=h.model_ref(manifest),
        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)],
        outputs=outputs,
    )
    return engine.encode(req, np.concatenate(seqs).astype(np.int32), NullProgress())


def test_encode_gives_token_states_and_refuses_typed(
    embed_engine: AneEngine, rerank_engine: AneEngine
) -> None:
    """ENCODE's token states pooled by the model's mean are its own dense output. What it
    cannot give is a typed refusal, never a fallback."""
    seqs = [h.encode("a short one"), h.encode("and a somewhat longer sentence here")]
    tokens, dense = _encode(embed_engine, h.minilm(), seqs, ["tokens", "dense"])
    assert tokens.counts == [len(s) for s in seqs] and tokens.dims == 384
    rows = np.split(tokens.arrays[0], np.cumsum(tokens.counts)[:-1])
    pooled = np.stack([r.mean(axis=0) for r in rows])
    assert h.cosines(pooled, dense.arrays[0]).min() >= 0.9999
    cases = [
        (embed_engine, h.minilm(), seqs, ["tokens", "tokens"], "invalid_request", "once"),
        (embed_engine, h.minilm(), seqs, ["sparse"], "unsupported", "no sparse head"),
        (rerank_engine, h.cross_encoder(), seqs, ["tokens"], "unsupported", "no token outputs"),
        (
            embed_engine,
            h.minilm(),
            [np.arange(300, dtype=np.int32) + 1000],
            ["tokens"],
            "shape_unsupported",
            "longest admitted shape takes 256",
        ),
    ]
    for engine, manifest, items, outputs, code, says in cases:
        with pytest.raises(EngineError, match=says) as e:
            _encode(engine, manifest, items, outputs)
        assert e.value.code == code
    # A head whose files are not what ingest wrote is refused at LOAD, as llama.cpp's is.
    missing = {"sparse": {"path": "/nonexistent/heads/sparse.json", "digest": "ab" * 32}}
    with pytest.raises(EngineError, match="cannot read") as e:
        h.new_engine(h.minilm(), [], heads=missing)
    assert e.value.code == "artifact_invalid"


def _token_rows(section) -> list[np.ndarray]:
    return np.split(section.arrays[0], np.cumsum(section.counts)[:-1])


def test_packed_rows_give_each_item_its_own_token_states(embed_engine: AneEngine) -> None:
    """Short items go to the packed shape, and their token states come from it: each item's
    columns sliced out of its row, equal to the fp32 reference's last hidden states at the
    lane's fp16 bar, and the same whether the item is alone in its row or packed with others
    (the block-diagonal mask: its neighbours are never seen)."""
    seqs = [h.encode(t) for t in h.embed_corpus()[:12]]
    shapes = [c.shape for c in embed_engine._model.shapes.values()]  # type: ignore[union-attr]
    chunks = plan([len(s) for s in seqs], shapes)
    assert len(chunks) == 1 and chunks[0].shape.packed
    assert len(next(r for r in chunks[0].rows if 0 in r)) > 1  # item 0 shares its row
    together, dense = _encode(embed_engine, h.minilm(), seqs, ["tokens", "dense"])
    alone = _token_rows(_encode(embed_engine, h.minilm(), seqs[:1], ["tokens"])[0])[0]
    ref = h.minilm_reference()
    got = _token_rows(together)
    pairs = zip(got, seqs, strict=True)
    worst = min(float(h.cosines(g, ref.hidden_states(s)).min()) for g, s in pairs)
    # Alone and packed differ by the order in which the masked keys' zeros are summed: a
    # few fp16 ulps (|values| reach ~8, an ulp there is 2^-8); a neighbour seen would move
    # every state.
    moved = float(h.cosines(alone, got[0]).min())
    print(f"\npacked token states: worst cos {worst:.6f} vs fp32; alone vs packed cos {moved:.7f}")
    assert [len(g) for g in got] == [len(s) for s in seqs]
    assert worst >= 0.9995
    assert moved >= 0.99999
    pooled = np.stack([g.mean(axis=0) for g in got])  # the segment's own dense output
    assert h.cosines(pooled, dense.arrays[0]).min() >= 0.9999


def test_compiled_packages_use_only_executor_ops(
    embed_engine: AneEngine, rerank_engine: AneEngine
) -> None:
    seen: set[str] = set()
    for engine in (embed_engine, rerank_engine):
        for loaded in engine._model.shapes.values():  # inspection only
            seen |= loaded.runner.program.op_types
    print("\nconverted program op set:", sorted(seen))
    assert seen - {"const"} <= SUPPORTED_OPS
    assert {"conv", "einsum", "softmax", "layer_norm", "gelu"} <= seen


# ---- typed refusals and small models --------------------------------------------------------


def test_a_packed_shape_with_zero_segments_is_refused_typed(embed_engine: AneEngine) -> None:
    req = m.ADMIT_SHAPE(
        req_id=20, model_ref="minilm", rows=1, seq_len=16, packed=True, max_segments=0
    )
    with pytest.raises(EngineError) as e:  # an untyped ValueError made the worker exit
        embed_engine.admit_shape(req, NullProgress())
    assert e.value.code == "invalid_request"
    assert _embed(embed_engine, [h.encode("still serving")]).shape == (1, 384)


@pytest.mark.parametrize("packed", [False, True])
def test_warm_up_inputs_fit_a_one_token_shape(packed: bool) -> None:
    from workers.ane.engine import _warmup_feeds

    feeds = _warmup_feeds(Shape(1, 1, packed, 1), h.minilm())
    assert feeds["input_ids"].shape == (1, 1)


def test_a_model_with_fewer_positions_loads_with_the_default_shapes(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    from formats.owned.manifest import ingest_owned
    from ingest.model_packages import minilm_dir

    src, d = minilm_dir(), tmp_path / "minilm-64"
    shutil.copytree(src, d)
    weights = load_file(str(src / "model.safetensors"))
    name = "embeddings.position_embeddings.weight"
    weights[name] = np.ascontiguousarray(weights[name][:64])
    save_file(weights, str(d / "model.safetensors"))
    for file, key in (
        ("config.json", "max_position_embeddings"),
        ("sentence_bert_config.json", "max_seq_length"),
    ):
        doc = json.loads((d / file).read_text())
        doc[key] = 64
        (d / file).write_text(json.dumps(doc))
    manifest = ingest_owned(d, tmp_path / "owned")
    engine = AneEngine(manifest.dir, backend="reference")
    try:  # no `shapes`: the defaults (8x128, 4x max_seq_length) clamp to 64 positions
        engine.load(h.load_request(manifest), NullProgress())
        assert sorted(engine.loaded_shapes()) == ["4x64", "8x64"]
    finally:
        engine.close()


def test_a_compiled_form_the_runtime_cannot_open_is_a_typed_compile_failure(monkeypatch) -> None:
    # Core ML's native loader raises bare RuntimeErrors (this one is macOS 14's answer to a
    # function name): admission answers compile_failed and the engine keeps serving.
    engine = h.new_engine(h.minilm(), [h.EMBED_UNPACKED])

    def native_open_fails(self, compiled_dir):
        raise RuntimeError("The 'functionName' property can only be set on macOS >= 15.0")

    monkeypatch.setattr(ReferenceBackend, "open", native_open_fails)
    try:
        with pytest.raises(EngineError) as e:
            engine.admit_shape(
                m.ADMIT_SHAPE(req_id=14, model_ref="minilm", rows=1, seq_len=16), NullProgress()
            )
        assert e.value.code == "compile_failed"
        assert "opening the compiled form failed" in e.value.msg
        assert "RuntimeError: The 'functionName' property" in e.value.msg
        assert engine.loaded_shapes() == ["4x256"]
        assert _embed(engine, [h.encode("still serving")]).shape == (1, 384)
    finally:
        engine.close()


# A slow compute plan (MLComputePlan for a Qwen3-size model) made real on Linux: the reference
# backend's placement really takes this long (PLACEMENT_DELAY_ENV), over PING's real window.
SLOW_PLAN_S = 2.5
PING_WINDOW_S = 1.0


async def test_a_slow_compute_plan_is_paid_at_admission_and_never_costs_a_strike(
    embed_engine: AneEngine, short_runtime_dir
) -> None:
    """The placement is computed at shape admission (LOAD's control window, PROGRESS around
    it), never inside PING: PING answers within its 1 s window with the share, and the lane
    keeps its worker with no strike. Computed lazily in PING, the same plan would miss the
    window, and the host would kill the worker and strike the lane."""
    manifest = h.minilm()  # its 4x256 shape is in the shared cache (embed_engine built it)
    argv = ["python", "-m", "workers.ane", "--artifact", str(manifest.dir),
            "--backend", "reference"]  # fmt: skip
    host = HostConfig(runtime_dir=short_runtime_dir, ping_window_s=PING_WINDOW_S, ping_interval_s=0)
    env = {PLACEMENT_DELAY_ENV: str(SLOW_PLAN_S)}
    lane = Lane(LaneConfig(lane_id="slow-plan", argv=argv, env=env, device="ane"), host)
    try:
        await lane.start()
        pid = lane.state().pid
        started = time.monotonic()
        loaded, _ = await lane.request(h.load_request(manifest, shapes=[h.EMBED_UNPACKED]))
        assert isinstance(loaded, m.LOADED)
        # The slow plan ran inside LOAD: the seam really made it slow.
        assert time.monotonic() - started >= SLOW_PLAN_S
        pong = await lane.ping()
        assert pong.placement_source == "estimate" and 0.9 < pong.placement_share <= 1.0
        state = lane.state()
        assert state.strikes == 0 and state.restarts == 0 and state.pid == pid
    finally:
        await lane.stop()


def test_placement_delay_is_read_as_seconds() -> None:
    assert placement_delay_s({}) == 0.0
    assert placement_delay_s({PLACEMENT_DELAY_ENV: " 1.5 "}) == 1.5
    assert placement_delay_s({PLACEMENT_DELAY_ENV: "-3"}) == 0.0
    with pytest.raises(ValueError, match=PLACEMENT_DELAY_ENV):
        placement_delay_s({PLACEMENT_DELAY_ENV: "soon"})
