"""The Core ML lane's Qwen3 graph (Qwen3-Embedding: a causal decoder pooled at the end-of-text
its tokenizer appends), judged through the reference executor (fp16 emulated) against
sentence-transformers' `encode` on a tiny seeded Qwen3 built with transformers (the builder of
tests/test_hf_qwen3.py: grouped K/V heads, head_dim != hidden / heads, wide random weights)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from certification.corpus import corpus
from formats.owned.manifest import Manifest, build_body, ingest_owned
from formats.owned.model import UnsupportedModel
from host.sanitize import sanitize
from host.tokenization import Tokenizer
from tests.ane_support import serve_on_ane
from tests.test_hf_qwen3 import HIDDEN, PROMPTS, _save_st, tiny_qwen3
from workers.ane import builder_qwen3, placement, program_ir
from workers.ane.build_options import BuildOptions
from workers.ane.builder import convert_and_save
from workers.ane.compiler import cache_key
from workers.ane.engine import AneEngine
from workers.ane.executor import load_executor
from workers.ane.fp16 import FP16_MAX
from workers.ane.identity import KERNEL_REVISION, kernel_revision
from workers.ane.packing import feeds_for, gather_rows, plan
from workers.ane.shapes import Shape
from workers.engine import NullProgress
from workers.protocol import messages as m

pytestmark = pytest.mark.model

TEXTS = [sanitize(t) for t in list(corpus())[::9]]  # every kind; long ones cut at 40 tokens
UNPACKED = {"rows": 4, "seq_len": 40}
PACKED = {"rows": 2, "seq_len": 128, "packed": True, "max_segments": 8}
# The loud model's layer-0 down_proj gain: its MLP then writes ~1.4e5 into the residual
# stream, twice fp16's largest value.
LOUD_GAIN = 2048.0


def _qwen3(dst: Path) -> Path:
    return tiny_qwen3(dst)


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    raw = _qwen3(module_tmp / "qwen3-raw")
    st = _save_st(raw, module_tmp / "qwen3-st")
    loud = module_tmp / "qwen3-loud-st"
    shutil.copytree(st, loud)
    w = load_file(str(st / "model.safetensors"))
    w["layers.0.mlp.down_proj.weight"] *= LOUD_GAIN
    save_file(w, str(loud / "model.safetensors"), metadata={"format": "pt"})
    return {"st": st, "loud": loud}


@pytest.fixture(scope="module")
def manifests(dirs, module_tmp) -> dict[str, Manifest]:
    return {k: ingest_owned(d, module_tmp / f"owned-{k}") for k, d in dirs.items()}


@pytest.fixture(scope="module")
def tokens(dirs) -> dict[str, list[np.ndarray]]:
    # The host's own tokenization: the prompt prepended, cut to 40 with the EOS kept.
    tok = Tokenizer.from_model_dir(dirs["st"])
    return {
        "plain": tok.encode(TEXTS, truncate=True).ids,
        "query": tok.encode(TEXTS, truncate=True, prompt=PROMPTS["query"]).ids,
    }


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(dirs["st"]), device="cpu")
    loud = SentenceTransformer(str(dirs["loud"]), device="cpu")
    return {
        "plain": st.encode(TEXTS, normalize_embeddings=True),
        "query": st.encode(TEXTS, prompt_name="query", normalize_embeddings=True),
        "loud": loud.encode(TEXTS, normalize_embeddings=True),
    }


@pytest.fixture(scope="module")
def engines(manifests, module_tmp):
    out = {}
    for name, shape in (("unpacked", UNPACKED), ("packed", PACKED)):
        engine = AneEngine(manifests["st"].dir, backend="reference")
        engine.load(
            m.LOAD(
                req_id=1,
                artifact_path=manifests["st"].dir,
                artifact_digest=manifests["st"].digest,
                format="coreml-owned",
                runtime_config={
                    "model_ref": "qwen3",
                    "shapes": [shape],
                    "cache_root": str(module_tmp / "cache"),
                },
            ),
            NullProgress(),
        )
        out[name] = engine
    yield out
    for engine in out.values():
        engine.close()


def _embed(engine: AneEngine, ids: list[np.ndarray], normalize: bool = True) -> np.ndarray:
    req = m.EMBED_BATCH(
        req_id=2,
        model_ref="qwen3",
        pooling="last",
        normalize=normalize,
        items=[m.EmbedItem(id=i, n_tokens=len(x)) for i, x in enumerate(ids)],
    )
    return engine.embed(req, np.concatenate(ids), NullProgress())


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def _package(manifest: Manifest, shape: Shape, out: Path, **kwargs: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return convert_and_save(builder_qwen3.build_program(manifest, shape, **kwargs), out)


# ---- the graph's building blocks, exactly (fp32 programs, no fp16 rounding) ----------------


def _fp32_run(shape: tuple[int, ...], body, x: np.ndarray) -> np.ndarray:
    from workers.ane.ct_quiet import Function, Program, ct, mb, types
    from workers.ane.executor import CompiledProgram

    with Function({"x": mb.placeholder(shape=shape, dtype=types.fp32)}, ct.target.macOS14) as func:
        func.set_outputs([body(func.inputs["x"])])
    prog = Program()
    prog.add_function("main", func)
    compiled = CompiledProgram(prog)
    return compiled.run({"x": x})[compiled.outputs[0].name]


def test_the_layer_norm_formulation_is_rmsnorm_with_its_epsilon_at_any_scale():
    rng = np.random.default_rng(3)
    c, eps, s = 48, 1e-6, builder_qwen3.RESIDUAL_SCALE
    # Tokens of ordinary size, tokens so small that epsilon dominates, and a zero token.
    true = rng.standard_normal((2, c, 1, 5)) * np.array([1.0, 30.0, 1e-4, 3e-3, 0.0])
    gamma = rng.uniform(0.5, 2.0, c)
    want = (
        true / np.sqrt(np.mean(true**2, axis=1, keepdims=True) + eps) * gamma.reshape(1, -1, 1, 1)
    )
    for in_scale, out_scale in ((1.0, 1.0), (s, 1.0), (1.0, 0.25)):
        got = _fp32_run(
            true.shape,
            lambda x, a=in_scale, o=out_scale: builder_qwen3.rms_norm(
                x, gamma, eps, in_scale=a, out_scale=o
            ),
            (true * in_scale).astype(np.float32),
        )
        np.testing.assert_allclose(got, want * out_scale, rtol=2e-5, atol=1e-6)


def test_the_executor_runs_silu_as_mil_defines_it():
    from workers.ane.ct_quiet import mb

    x = np.concatenate([np.linspace(-20, 20, 401), [-1e4, -100.0, 100.0, 1e4]]).astype(np.float32)
    got = _fp32_run(x.shape, lambda v: mb.silu(x=v), x)
    xd = x.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(1e4) in the float64 reference: silu is then -0
        want = xd / (1.0 + np.exp(-xd))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


# ---- the manifest ---------------------------------------------------------------------------


def test_the_manifest_names_the_decoder_and_its_own_graph(manifests):
    man = manifests["st"]
    cfg = man.config
    assert (cfg.family, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == ("qwen3", 2, 32, 1e4)
    assert cfg.type_vocab_size == 0 and cfg.max_seq_length == 40
    assert (man.head.type, man.head.pooling, man.head.normalize) == ("embed_last", "last", True)
    # Its own kernel revision, so no other family's compiled shape or certificate can match.
    assert kernel_revision("qwen3") != KERNEL_REVISION
    assert kernel_revision("qwen3") not in {kernel_revision(f) for f in ("bert", "xlm-roberta")}
    key = cache_key(man, Shape(4, 40), BuildOptions())
    assert key["kernel_revision"] == kernel_revision("qwen3")
    assert key["manifest_digest"] == man.digest
    engine = AneEngine(man.dir)
    assert engine.hello_extras()["kernel_revision"] == kernel_revision("qwen3")


def test_what_the_manifest_refuses(dirs, module_tmp):
    import json

    bad = module_tmp / "qwen3-bad"
    shutil.copytree(dirs["st"], bad)
    config = json.loads((dirs["st"] / "config.json").read_text())
    for change, reason in (
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding_window"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "classifiers"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope scaling"),
    ):
        (bad / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(UnsupportedModel, match=reason):
            build_body(bad)
    (bad / "config.json").write_text(json.dumps(config))
    pooling = bad / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps(json.loads(pooling.read_text()) | {"pooling_mode": "mean"}))
    with pytest.raises(UnsupportedModel, match="last token"):
        build_body(bad)


# ---- fidelity -------------------------------------------------------------------------------


def test_unpacked_and_packed_rows_embed_like_sentence_transformers(engines, tokens, reference):
    lengths = [len(x) for x in tokens["plain"]]
    assert max(lengths) == 40 and min(lengths) < 10
    # The packed engine really packs: several segments per row.
    rows = [r for c in plan(lengths, [Shape(**PACKED)]) for r in c.rows]
    assert max(len(r) for r in rows) >= 4
    for layout, engine in engines.items():
        for kind in ("plain", "query"):
            cos = _cos(_embed(engine, tokens[kind]), reference[kind])
            assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, (
                layout,
                kind,
                cos.min(),
                cos.mean(),
            )
    # The bar discriminates: the vectors are not those of the other input.
    assert _cos(_embed(engines["unpacked"], tokens["query"]), reference["plain"]).min() < 0.9999


def test_packed_rows_equal_unpacked_ones_within_fp16_rounding(engines, tokens):
    for kind in ("plain", "query"):
        unpacked = _embed(engines["unpacked"], tokens[kind], normalize=False)
        packed = _embed(engines["packed"], tokens[kind], normalize=False)
        # The same fp16 values up to a few roundings of the last op (BLAS sums a longer row
        # in another order): |diff| within 4 fp16 ulps of the vector's scale.
        ulp = 2.0**-10 * np.abs(unpacked).max(axis=1, keepdims=True)
        assert np.all(np.abs(packed - unpacked) <= 4 * ulp), np.abs(packed - unpacked).max()


# ---- fp16 range -----------------------------------------------------------------------------


def test_the_scaled_residual_stream_stays_in_fp16_where_the_unscaled_one_overflows(
    dirs, manifests, tokens, reference, module_tmp
):
    import torch
    from transformers import AutoModel

    ids = tokens["plain"]
    # The loud model's fp32 residual stream really leaves fp16's range.
    hf = AutoModel.from_pretrained(str(dirs["loud"])).eval()
    with torch.no_grad():
        peak = max(
            float(h.abs().max())
            for x in ids
            for h in hf(
                torch.tensor(x[None].astype(np.int64)), output_hidden_states=True
            ).hidden_states[:-1]
        )
    assert peak > 2 * FP16_MAX, peak
    shape = Shape(**UNPACKED)
    results = {}
    for name, scale in (("scaled", builder_qwen3.RESIDUAL_SCALE), ("unscaled", 1.0)):
        pkg = _package(manifests["loud"], shape, module_tmp / f"loud-{name}", residual_scale=scale)
        program = load_executor(pkg)
        out = np.zeros((len(ids), HIDDEN), np.float32)
        for chunk in plan([len(x) for x in ids], [shape]):
            feeds = feeds_for(chunk, ids, [np.zeros(len(x), np.int32) for x in ids])
            del feeds["token_type_ids"]
            with np.errstate(invalid="ignore", over="ignore"):  # the unscaled one's inf/NaN
                result = program.run(feeds)["embedding_l2"]
            for i, vec in gather_rows(chunk, result):
                out[i] = vec
        results[name] = out
    assert not np.isfinite(results["unscaled"]).any(axis=1).any()  # inf, then NaN: every row
    cos = _cos(results["scaled"], reference["loud"])
    assert np.isfinite(results["scaled"]).all()
    assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, (cos.min(), cos.mean())


# ---- placement ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_every_layer_op_is_ane_eligible_and_the_cpu_runs_once_per_prediction(
    engines, manifests, layout
):
    engine = engines[layout]
    (compiled,) = engine._model.shapes.values()  # the program the engine serves, as converted
    ops = [
        op
        for op in program_ir.walk(compiled.runner.program.function.operations)
        if op.op_type != "const"
    ]
    convs = [i for i, op in enumerate(ops) if op.op_type == "conv"]
    layers = ops[convs[0] : convs[-1] + 1]  # the decoder layers, in program order
    assert len(convs) == 7 * manifests["st"].config.num_layers  # q k v o gate up down
    assert [op.op_type for op in layers if not placement.ane_eligible(op)] == []
    # What is left to the CPU sits before the first layer (the token and rotary lookups, the
    # int casts around them, the mask's bool -> fp16 casts) or after the last (the fp32
    # output casts): once per prediction, never per layer or head.
    cpu = [op.op_type for op in ops if not placement.ane_eligible(op)]
    assert set(cpu) <= {"cast", "gather", "greater_equal", "add", "select"}, cpu
    assert len(cpu) <= 16
    share, source = engine.placement()
    assert source == "estimate" and share >= 0.99, share


# ---- end to end -----------------------------------------------------------------------------


async def test_the_module_serves_qwen3_on_the_ane_lane(
    dirs, engines, reference, module_tmp, short_runtime_dir
):
    query, identity, share, source = await serve_on_ane(
        dirs["st"], "qwen3", module_tmp, short_runtime_dir, [UNPACKED, PACKED], TEXTS
    )
    cos = _cos(query, reference["query"])
    assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, (cos.min(), cos.mean())
    assert identity["kernel_revision"] == kernel_revision("qwen3")
    assert source == "estimate" and share >= 0.99


def test_certify_is_provisional_off_a_mac_and_a_mac_run_would_flip_lane_choice(
    dirs, module_tmp, monkeypatch
):
    import asyncio
    import tempfile

    from certification.lane_policy import CertificateLanePolicy
    from certification.runner import RunOptions, certify
    from certification.store import CertificateStore
    from host.config import HostConfig
    from host.module import Module, ModuleConfig
    from ingest.store import ArtifactStore
    from tests.test_lane_choice import as_compute_plan_run

    cache = module_tmp / "certify-cache"
    ArtifactStore(cache / "models").ingest_hf_dir(dirs["st"], "qwen3", dtype="f32")
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(cache))  # the worker's compile cache
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    config = ModuleConfig(
        store_root=str(cache / "models"), host=HostConfig(runtime_dir=runtime, ping_interval_s=0)
    )

    async def run():
        async with Module(config) as mod:
            cert = await certify(
                mod,
                RunOptions(
                    model="qwen3",
                    lane="ane",
                    shapes=[PACKED],
                    sample_stride=8,
                    runtime_config_extra={"backend": "reference"},
                    # One certified lane: lane choice reads no curve (the routed lanes' is
                    # proven in tests/test_lane_route.py), and it is ~255 items on this executor.
                    curve=False,
                ),
                CertificateStore(cache / "certificates"),
            )
        mac = CertificateStore(cache / "certificates-mac")
        mac.save(as_compute_plan_run(cert))
        async with Module(config, CertificateLanePolicy(mac)) as mod:
            await mod.embed(TEXTS[:3], model="qwen3")
            return cert, mod.chosen_lanes()["qwen3"]

    try:
        cert, choice = asyncio.run(run())
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert cert.quality == "pass" and cert.failing == [], cert.checks
    assert cert.status == "provisional" and cert.measurements.placement_source == "estimate"
    assert cert.key.kernel_revision == kernel_revision("qwen3")
    assert choice.lane == "ane", choice
    print(
        f"\ncertify qwen3: min cos {min(cert.measurements.cosines):.6f}, placement "
        f"{cert.measurements.placement_share:.4f}"
    )
