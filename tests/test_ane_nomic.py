"""The Core ML lane's NomicBERT graph (rotary positions, SwiGLU, no biases), judged through the
reference executor (fp16 emulated) against sentence-transformers' `encode` with nomic's query
prompt, on the tiny seeded NomicBERT tests/test_hf_nomic_bert.py builds (wide random weights,
MiniLM's WordPiece vocabulary, transformers 5's saved names and the Hub's layout beside them)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from common.errors import ArtifactInvalid
from formats.owned.manifest import Manifest, build_body, ingest_owned
from formats.owned.model import UnsupportedModel
from host.tokenization import Tokenizer
from tests.ane_support import load_reference_engine, serve_on_ane
from tests.test_hf_nomic_bert import PROMPTS, TEXTS, dirs  # noqa: F401  (the module's model)
from workers.ane import placement, program_ir
from workers.ane.build_options import BuildOptions
from workers.ane.compiler import cache_key
from workers.ane.engine import AneEngine
from workers.ane.identity import kernel_revision
from workers.ane.packing import plan
from workers.ane.shapes import Shape
from workers.engine import NullProgress
from workers.protocol import messages as m

pytestmark = pytest.mark.model

UNPACKED = {"rows": 4, "seq_len": 64}
PACKED = {"rows": 2, "seq_len": 128, "packed": True, "max_segments": 8}


@pytest.fixture(scope="module")
def manifest(dirs, module_tmp) -> Manifest:  # noqa: F811
    return ingest_owned(dirs["st"], module_tmp / "owned")


@pytest.fixture(scope="module")
def tokens(dirs) -> list[np.ndarray]:  # noqa: F811
    # The host's own tokenization: the query prompt prepended, cut to the model's 64 tokens.
    tok = Tokenizer.from_model_dir(dirs["st"])
    return tok.encode(TEXTS, truncate=True, prompt=PROMPTS["query"]).ids


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str, np.ndarray]:  # noqa: F811
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(dirs["st"]), device="cpu")
    return {
        "query": st.encode(TEXTS, prompt_name="query", normalize_embeddings=True),
        "plain": st.encode(TEXTS, normalize_embeddings=True),
    }


@pytest.fixture(scope="module")
def engines(manifest, module_tmp):
    out = {}
    for name, shape in (("unpacked", UNPACKED), ("packed", PACKED)):
        out[name] = load_reference_engine(
            manifest,
            {"model_ref": "nomic", "shapes": [shape], "cache_root": str(module_tmp / "cache")},
        )
    yield out
    for engine in out.values():
        engine.close()


def _embed(engine: AneEngine, ids: list[np.ndarray]) -> np.ndarray:
    req = m.EMBED_BATCH(
        req_id=2,
        model_ref="nomic",
        pooling="mean",
        normalize=True,
        items=[m.EmbedItem(id=i, n_tokens=len(x)) for i, x in enumerate(ids)],
    )
    return engine.embed(req, np.concatenate(ids), NullProgress())


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


# ---- the manifest ---------------------------------------------------------------------------


def test_the_manifest_names_nomic_bert_and_its_own_graph(manifest, dirs, module_tmp):  # noqa: F811
    cfg = manifest.config
    assert (cfg.family, cfg.rope_theta, cfg.hidden_act) == ("nomic_bert", 1000.0, "silu")
    assert (cfg.max_positions, cfg.max_seq_length, cfg.type_vocab_size) == (2048, 64, 2)
    assert (manifest.head.type, manifest.head.normalize) == ("embed_mean", True)
    assert "encoder.layers.1.attn.Wqkv.weight" in manifest.body.tensors
    # Its own kernel revision: no other family's compiled shape or certificate matches.
    others = {kernel_revision(f) for f in ("bert", "xlm-roberta", "qwen3")}
    assert kernel_revision("nomic_bert") not in others
    key = cache_key(manifest, Shape(4, 64), BuildOptions())
    assert key["kernel_revision"] == kernel_revision("nomic_bert")
    assert AneEngine(manifest.dir).hello_extras()["kernel_revision"] == kernel_revision(
        "nomic_bert"
    )
    # The Hub's layout (nomic's config keys too) and transformers' in-memory names (split
    # q/k/v) are the same model: the same artifact digest.
    for layout in ("orig", "native"):
        assert build_body(dirs[layout])[0] == manifest.body, layout


@pytest.mark.parametrize(
    ("change", "error", "says"),
    [
        ({"rotary_emb_fraction": 0.5}, ArtifactInvalid, "rotary_emb_fraction"),
        ({"qkv_proj_bias": True}, ArtifactInvalid, "qkv_proj_bias"),
        ({"hidden_act": "gelu"}, ArtifactInvalid, "hidden_act"),
        ({"rotary_emb_base": 10_000}, ArtifactInvalid, "rotary base"),
        ({"type_vocab_size": 3}, UnsupportedModel, "type_vocab_size=3"),
    ],
)
def test_what_the_manifest_refuses(dirs, tmp_path, change, error, says):  # noqa: F811
    bad = tmp_path / "bad"
    shutil.copytree(dirs["orig"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(error, match=says):
        build_body(bad)


def test_a_tensor_the_graph_does_not_read_is_refused(dirs, tmp_path):  # noqa: F811
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bias"
    shutil.copytree(dirs["st"], bad)
    w = load_file(str(bad / "model.safetensors"))
    w["encoder.layers.0.mlp.fc2.bias"] = np.zeros(64, np.float32)
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="fc2.bias"):
        build_body(bad)


# ---- fidelity and placement -----------------------------------------------------------------


def test_unpacked_and_packed_rows_embed_like_sentence_transformers(engines, tokens, reference):
    lengths = [len(x) for x in tokens]
    assert max(lengths) == 64 and min(lengths) < 16
    rows = [r for c in plan(lengths, [Shape(**PACKED)]) for r in c.rows]
    assert max(len(r) for r in rows) >= 3  # the packed engine really packs
    for layout, engine in engines.items():
        got = _embed(engine, tokens)
        cos = _cos(got, reference["query"])
        print(f"\n{layout}: cosine vs sentence-transformers {cos.min():.6f} / {cos.mean():.6f}")
        assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, (layout, cos.min(), cos.mean())
        # The bar discriminates: the prompt is part of what is compared.
        assert _cos(got, reference["plain"]).min() < 0.9995


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_every_layer_op_is_ane_eligible_and_the_estimate_is_reported(engines, manifest, layout):
    engine = engines[layout]
    (compiled,) = engine._model.shapes.values()  # the program the engine serves, as converted
    ops = [
        op
        for op in program_ir.walk(compiled.runner.program.function.operations)
        if op.op_type != "const"
    ]
    convs = [i for i, op in enumerate(ops) if op.op_type == "conv"]
    assert len(convs) == 7 * manifest.config.num_layers  # q k v out gate up down
    layers = ops[convs[0] : convs[-1] + 1]  # the encoder layers, in program order
    assert [op.op_type for op in layers if not placement.ane_eligible(op)] == []
    # The CPU's share is the token and rotary gathers, int casts and output casts, before the
    # first layer or after the last: once per prediction, never per layer or head.
    cpu = [op.op_type for op in ops if not placement.ane_eligible(op)]
    assert set(cpu) <= {"cast", "gather", "greater_equal", "add", "select"}, cpu
    share, source = engine.placement()
    print(f"\n{layout}: placement {source} {share:.4f}, {len(cpu)} CPU ops")
    assert source == "estimate" and share >= 0.99, share


# ---- end to end -----------------------------------------------------------------------------


async def test_the_module_serves_nomic_bert_on_the_ane_lane(
    dirs,  # noqa: F811
    engines,
    reference,
    module_tmp,
    short_runtime_dir,
):
    query, identity, share, source = await serve_on_ane(
        dirs["st"], "nomic", module_tmp, short_runtime_dir, [UNPACKED, PACKED], TEXTS
    )
    cos = _cos(query, reference["query"])
    assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, (cos.min(), cos.mean())
    assert identity["kernel_revision"] == kernel_revision("nomic_bert")
    assert source == "estimate" and share >= 0.99, share
