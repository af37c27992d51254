"""The fp32 BERT reference: self-consistency, an independent loop-by-loop cross-check, erf."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from certification.reference.bert import BertConfig, BertReference, erf, gelu, one_plus_erf
from certification.reference.cross_encoder import build_test_cross_encoder
from host.tokenization import Tokenizer
from ingest.model_packages import minilm_dir

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Ein Mann isst Brot.",
    "東京は日本の首都です。",
    "ok",
    "A much longer sentence that goes on for a while, with commas, numbers like 12345 and "
    "a few rarer words such as photosynthesis and antidisestablishmentarianism.",
]


@pytest.fixture(scope="module")
def minilm() -> BertReference:
    return BertReference.from_dir(minilm_dir())


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(minilm_dir())


@pytest.fixture(scope="module")
def cross_dir(test_cross_encoder_dir: Path) -> Path:
    return test_cross_encoder_dir


# -- erf / GELU --------------------------------------------------------------------------------


def test_erf_matches_libm_everywhere() -> None:
    z = np.linspace(-12.0, 12.0, 120_001)
    want = np.array([math.erf(v) for v in z])
    assert np.abs(erf(z) - want).max() < 1e-14


def test_one_plus_erf_keeps_relative_accuracy_on_the_lower_tail() -> None:
    z = np.linspace(1.0, 9.0, 4001)
    want = np.array([math.erfc(v) for v in z])
    rel = np.abs(one_plus_erf(-z) - want) / want
    assert rel.max() < 1e-12


def test_gelu_is_the_erf_form_rounded_once_to_float32() -> None:
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32) * 4
    # erfc form: 1 + erf(x) would cancel on the negative tail.
    want = np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in x.astype(float)])
    got = gelu(x)
    assert got.dtype == np.float32
    # Correctly rounded float32 is within half an ulp of the float64 value.
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= 0.5 * ulp + 1e-30)
    # The tanh approximation ("gelu_new") differs measurably: we are not computing it.
    tanh_form = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    assert np.abs(tanh_form - got).max() > 1e-4


# -- self-consistency -------------------------------------------------------------------------


def test_batched_equals_one_at_a_time(minilm: BertReference, tok: Tokenizer) -> None:
    ids = tok.encode(SENTENCES, truncate=True).ids
    batched = minilm.embed(ids)
    single = np.stack([minilm.embed([i])[0] for i in ids])
    assert np.abs(batched - single).max() < 2e-6
    # Order of the batch does not matter either.
    rev = minilm.embed(ids[::-1])[::-1]
    assert np.abs(batched - rev).max() < 2e-6


def test_mean_pooling_uses_real_tokens_only(minilm: BertReference, tok: Tokenizer) -> None:
    short, long = tok.encode(["ok", SENTENCES[-1]], truncate=True).ids
    alone = minilm.embed([short], normalize=False)[0]
    beside_long = minilm.embed([short, long], normalize=False)[0]
    assert np.abs(alone - beside_long).max() < 2e-6
    # Mean of the sequence's own hidden states, nothing else.
    h = minilm.hidden_states(short)
    assert np.abs(alone - h.mean(axis=0)).max() < 1e-6
    # CLS pooling is the first row.
    assert np.array_equal(minilm.embed([short], pooling="cls", normalize=False)[0], h[0])


def test_normalized_output_is_unit_norm(minilm: BertReference, tok: Tokenizer) -> None:
    e = minilm.embed(tok.encode(SENTENCES, truncate=True).ids)
    assert e.dtype == np.float32 and e.shape == (len(SENTENCES), 384)
    assert np.allclose(np.linalg.norm(e.astype(np.float64), axis=1), 1.0, atol=1e-6)
    raw = minilm.embed(tok.encode(SENTENCES, truncate=True).ids, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-2)


def test_semantics_sanity(minilm: BertReference, tok: Tokenizer) -> None:
    # Paraphrases are closer than unrelated sentences (a broken forward fails this).
    e = minilm.embed(tok.encode(SENTENCES[:3], truncate=True).ids)
    sim = e @ e.T
    assert sim[0, 1] > 0.6 > 0.2 > sim[0, 2]


def test_deterministic(minilm: BertReference, tok: Tokenizer) -> None:
    ids = tok.encode(SENTENCES, truncate=True).ids
    a = minilm.embed(ids)
    b = minilm.embed(ids)
    c = BertReference.from_dir(minilm_dir()).embed(ids)
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_token_types_change_hidden_states(minilm: BertReference) -> None:
    ids = [101, 7592, 102, 2088, 102]
    a = minilm.hidden_states(ids)
    b = minilm.hidden_states(ids, [0, 0, 0, 1, 1])
    assert np.abs(a - b).max() > 1e-3


# -- independent cross-check ------------------------------------------------------------------


def _loop_forward(
    w: dict[str, np.ndarray], cfg: dict, ids: list[int], types: list[int], prefix: str = ""
) -> np.ndarray:
    """BERT written token by token and head by head, float64, HF (out, in) weight layout."""
    n_h = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    d_h = hidden // n_h
    eps = cfg["layer_norm_eps"]

    def W(name: str) -> np.ndarray:
        return w[prefix + name].astype(np.float64)

    def ln(v: np.ndarray, name: str) -> np.ndarray:
        mu = sum(v) / len(v)
        var = sum((x - mu) ** 2 for x in v) / len(v)
        return (v - mu) / math.sqrt(var + eps) * W(name + ".weight") + W(name + ".bias")

    def linear(v: np.ndarray, name: str) -> np.ndarray:
        m, b = W(name + ".weight"), W(name + ".bias")
        return np.array([np.dot(m[o], v) for o in range(m.shape[0])]) + b

    hs = [
        ln(
            W("embeddings.word_embeddings.weight")[t]
            + W("embeddings.position_embeddings.weight")[p]
            + W("embeddings.token_type_embeddings.weight")[tt],
            "embeddings.LayerNorm",
        )
        for p, (t, tt) in enumerate(zip(ids, types, strict=True))
    ]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{layer}."
        qs = [linear(h, p + "attention.self.query") for h in hs]
        ks = [linear(h, p + "attention.self.key") for h in hs]
        vs = [linear(h, p + "attention.self.value") for h in hs]
        new = []
        for i in range(len(hs)):
            ctx = np.zeros(hidden)
            for head in range(n_h):
                sl = slice(head * d_h, (head + 1) * d_h)
                logits = [np.dot(qs[i][sl], ks[j][sl]) / math.sqrt(d_h) for j in range(len(hs))]
                top = max(logits)
                ex = [math.exp(a - top) for a in logits]
                total = sum(ex)
                for j in range(len(hs)):
                    ctx[sl] += ex[j] / total * vs[j][sl]
            attn = linear(ctx, p + "attention.output.dense")
            a = ln(hs[i] + attn, p + "attention.output.LayerNorm")
            inter = linear(a, p + "intermediate.dense")
            inter = np.array([0.5 * x * (1 + math.erf(x / math.sqrt(2))) for x in inter])
            new.append(ln(a + linear(inter, p + "output.dense"), p + "output.LayerNorm"))
        hs = new
    return np.array(hs)


def test_matches_an_independent_loop_implementation(minilm: BertReference) -> None:
    w = load_file(str(minilm_dir() / "model.safetensors"))
    cfg = json.loads((minilm_dir() / "config.json").read_text())
    ids, types = [101, 1037, 3899, 102], [0, 0, 1, 1]  # [CLS] a dog [SEP], mixed token types
    want = _loop_forward(w, cfg, ids, types)
    got = minilm.hidden_states(ids, types)
    assert np.abs(got - want).max() < 2e-4
    # Same check through the pooled, normalized embedding path (token types 0).
    want0 = _loop_forward(w, cfg, ids, [0] * 4).mean(axis=0)
    want0 /= np.linalg.norm(want0)
    assert np.abs(minilm.embed([ids])[0] - want0).max() < 2e-5


def test_classifier_matches_loop_implementation(cross_dir: Path) -> None:
    ref = BertReference.from_dir(cross_dir)
    w = load_file(str(cross_dir / "model.safetensors"))
    cfg = json.loads((cross_dir / "config.json").read_text())
    ids, types = [101, 3899, 102, 4937, 2003, 102], [0, 0, 0, 1, 1, 1]
    h = _loop_forward(w, cfg, ids, types, prefix="bert.")
    pw, pb = w["bert.pooler.dense.weight"].astype(float), w["bert.pooler.dense.bias"].astype(float)
    pooled = np.tanh(pw @ h[0] + pb)
    want = float(w["classifier.weight"].astype(float)[0] @ pooled + w["classifier.bias"][0])
    got = ref.score(ids, types)
    assert isinstance(got, np.float32)
    assert abs(float(got) - want) < 1e-4


# -- checkpoints --------------------------------------------------------------------------------


def test_both_key_layouts_give_identical_backbones(minilm: BertReference, cross_dir: Path) -> None:
    ce = BertReference.from_dir(cross_dir)
    ids = [101, 7592, 2088, 102]
    assert np.array_equal(ce.hidden_states(ids), minilm.hidden_states(ids))


def test_cross_encoder_checkpoint_layout(cross_dir: Path) -> None:
    cfg = json.loads((cross_dir / "config.json").read_text())
    assert cfg["architectures"] == ["BertForSequenceClassification"]
    assert cfg["id2label"] == {"0": "LABEL_0"}
    assert "NOT a relevance model" in cfg["synapse_note"]
    w = load_file(str(cross_dir / "model.safetensors"))
    assert all(k.startswith(("bert.", "classifier.")) for k in w)
    assert w["bert.pooler.dense.weight"].shape == (384, 384)
    assert w["classifier.weight"].shape == (1, 384)
    assert w["classifier.bias"].shape == (1,)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        assert (cross_dir / name).is_file()


def test_cross_encoder_is_seeded(tmp_path: Path, cross_dir: Path) -> None:
    same = load_file(str(build_test_cross_encoder(tmp_path / "a", seed=0) / "model.safetensors"))
    other = load_file(str(build_test_cross_encoder(tmp_path / "b", seed=1) / "model.safetensors"))
    base = load_file(str(cross_dir / "model.safetensors"))
    assert np.array_equal(same["classifier.weight"], base["classifier.weight"])
    assert not np.array_equal(other["classifier.weight"], base["classifier.weight"])


def test_cross_encoder_scores_vary_and_depend_on_token_types(cross_dir: Path) -> None:
    ref = BertReference.from_dir(cross_dir)
    tok = Tokenizer.from_model_dir(cross_dir)
    docs = SENTENCES + ["Bread is baked in an oven.", "Stocks fell on Tuesday.", ""]
    pairs = tok.encode_pairs("How do I bake bread?", docs, truncate=True)
    scores = ref.score_many(pairs.ids, pairs.token_type_ids)
    assert scores.shape == (len(docs),) and scores.dtype == np.float32
    assert scores.std() > 0.1  # spread far above fp16 noise and the lanes' tolerances
    one = np.array([ref.score(i, t) for i, t in zip(pairs.ids, pairs.token_type_ids, strict=True)])
    assert np.abs(one - scores).max() < 1e-5
    assert np.abs(ref.score_many(pairs.ids) - scores).max() > 0.02  # token types matter


# -- refusals ---------------------------------------------------------------------------------


def test_rejects_invalid_inputs(minilm: BertReference) -> None:
    with pytest.raises(ValueError):
        minilm.embed([[]])
    with pytest.raises(ValueError):
        minilm.embed([[101] * 513])
    with pytest.raises(ValueError):
        minilm.embed([[101, 30522, 102]])
    with pytest.raises(ValueError):
        minilm.hidden_states([101, 102], [0, 2])
    with pytest.raises(ValueError):
        minilm.embed([[101, 102]], pooling="max")
    with pytest.raises(ValueError, match="no classification head"):
        minilm.score([101, 102])


def test_refuses_other_activations_and_finds_layouts(tmp_path: Path) -> None:
    cfg = json.loads((minilm_dir() / "config.json").read_text())
    with pytest.raises(ValueError, match="gelu"):
        BertConfig.from_dict({**cfg, "hidden_act": "gelu_new"})
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(minilm_dir() / "model.safetensors", d / "model.safetensors")
    assert BertReference.from_dir(d).config.num_labels == 0
    with pytest.raises(KeyError):
        BertReference(BertConfig.from_dict(cfg), {"foo": np.zeros(1, np.float32)})
