"""The Core ML lane's XLM-RoBERTa graph (multilingual-e5, bge-m3, bge-reranker-v2-m3 are this
family) on the reference executor (the SAVED package, fp16 emulated after every op), judged
against sentence-transformers' own `encode` and `CrossEncoder` on tiny seeded models built
here with transformers and a sentencepiece-trained Unigram vocabulary.

The graph is fed the very ids sentence-transformers tokenizes (its own tokenizer, prompt and
truncation), so the forward alone is compared; the host's tokenization of the same models is
covered where a real lane serves them (certification, the CLI)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from bench.real_sizes import xlmr_tokenizer
from certification.corpus import corpus
from certification.thresholds import thresholds_for
from formats.owned.manifest import Manifest, ingest_owned
from formats.owned.model import UnsupportedModel
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.store import ArtifactStore
from tests.ane_support import load_reference_engine
from workers.ane.build_options import BuildOptions
from workers.ane.compiler import cache_key
from workers.ane.engine import AneEngine
from workers.ane.identity import KERNEL_REVISION, kernel_revision
from workers.ane.shapes import Shape
from workers.engine import NullProgress
from workers.protocol import messages as m

pytestmark = pytest.mark.model

TEXTS = [sanitize(t) for t in list(corpus())[::7]]
PROMPTS = {"query": "query: ", "passage": "passage: "}
MAX_SEQ = 48  # shorter than many corpus items: truncation is part of what is compared
HIDDEN = 64
POSITIONS = MAX_SEQ + 16  # usable positions; the table has 2 more (pad_token_id + 1 offset)
UNPACKED = {"rows": 4, "seq_len": MAX_SEQ}
PACKED = {"rows": 2, "seq_len": POSITIONS, "packed": True, "max_segments": 8}


def _unigram_tokenizer(dst: Path) -> int:
    return xlmr_tokenizer(dst, MAX_SEQ, vocab_size=700)


def _config(n_vocab: int, **extra):
    from transformers import XLMRobertaConfig

    # Wide random weights (initializer 0.3): vectors of different texts differ enough that a
    # wrong position offset, pooling or prompt each fail the bars below.
    return XLMRobertaConfig(
        vocab_size=n_vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=POSITIONS + 2,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        **{"initializer_range": 0.3, **extra},
    )


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    """HF directories: mean- and CLS-pooled sentence-transformers embedders (one encoder,
    e5 prompts) and a one-logit XLMRobertaForSequenceClassification."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )
    from transformers import XLMRobertaForSequenceClassification, XLMRobertaModel

    raw = module_tmp / "xlmr-raw"
    n_vocab = _unigram_tokenizer(raw)
    torch.manual_seed(0)
    XLMRobertaModel(_config(n_vocab)).eval().save_pretrained(raw)
    out = {}
    for pooling in ("mean", "cls"):
        out[pooling] = module_tmp / f"xlmr-{pooling}"
        body = Transformer(str(raw), max_seq_length=MAX_SEQ)
        SentenceTransformer(
            modules=[body, Pooling(HIDDEN, pooling), Normalize()], device="cpu", prompts=PROMPTS
        ).save(str(out[pooling]))
    out["xenc"] = module_tmp / "xlmr-xenc"
    shutil.copytree(raw, out["xenc"], ignore=shutil.ignore_patterns("*.safetensors", "config*"))
    torch.manual_seed(1)
    # Conditioned like a trained reranker: at the embedders' 0.3 init a random encoder's
    # fp16 noise is 2.5% of its logit spread (2e-2 at std 0.8), where MiniLM's test cross-
    # encoder (trained backbone, fan-in scaled head) shows 0.6% (1.2e-3 at std 0.19). A 0.2
    # init and a fan-in scaled head give about 1% here (1.8e-3 at std 0.17).
    xenc = XLMRobertaForSequenceClassification(
        _config(n_vocab, num_labels=1, initializer_range=0.2)
    ).eval()
    with torch.no_grad():
        for layer in (xenc.classifier.dense, xenc.classifier.out_proj):
            layer.weight.normal_(0.0, HIDDEN**-0.5)
            layer.bias.normal_(0.0, 0.1)
    xenc.save_pretrained(out["xenc"])
    return out


@pytest.fixture(scope="module")
def manifests(dirs, module_tmp) -> dict[str, Manifest]:
    return {k: ingest_owned(d, module_tmp / "owned" / k) for k, d in dirs.items()}


@pytest.fixture(scope="module")
def compile_root(module_tmp) -> Path:
    return module_tmp / "compile-cache"


@pytest.fixture(scope="module")
def engines(manifests, compile_root):
    """One engine per (model, unpacked | packed): each shape compiled once for the module."""
    made: dict[tuple[str, str], AneEngine] = {}

    def get(model: str, kind: str) -> AneEngine:
        if (model, kind) not in made:
            shape = UNPACKED if kind == "unpacked" else PACKED
            config = {"cache_root": str(compile_root), "model_ref": model, "shapes": [shape]}
            made[(model, kind)] = load_reference_engine(manifests[model], config)
        return made[(model, kind)]

    yield get
    for engine in made.values():
        engine.close()


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _st(path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


def _st_ids(st, texts: list[str], prompt: str = "") -> list[np.ndarray]:
    """The ids `st.encode(texts, prompt=prompt)` feeds its transformer (unpadded)."""
    feats = st.preprocess(texts, prompt=prompt or None)
    return [
        ids[mask.bool()].numpy().astype(np.int32)
        for ids, mask in zip(feats["input_ids"], feats["attention_mask"], strict=True)
    ]


def _embed(
    engine: AneEngine, model: str, pooling: str, seqs: list[np.ndarray], normalize: bool = True
) -> np.ndarray:
    req = m.EMBED_BATCH(
        req_id=2,
        model_ref=model,
        pooling=pooling,
        normalize=normalize,
        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)],
    )
    return engine.embed(req, np.concatenate(seqs), NullProgress())


# ---- the manifest and the graph's identity ------------------------------------------------


def test_the_manifest_reads_the_family_and_its_offsets(manifests, dirs):
    mean, cls, xenc = manifests["mean"], manifests["cls"], manifests["xenc"]
    for man in manifests.values():
        c = man.config
        assert (c.family, c.position_offset, c.max_positions) == ("xlm-roberta", 2, POSITIONS)
        assert c.type_vocab_size == 1 and c.max_seq_length == MAX_SEQ
        # The position table is the checkpoint's, offset rows included (digests are HF's).
        assert man.body.tensors["embeddings.position_embeddings.weight"].shape == [
            POSITIONS + 2,
            HIDDEN,
        ]
    assert (mean.head.type, mean.head.pooling, mean.head.normalize) == ("embed_mean", "mean", True)
    assert (cls.head.type, cls.head.pooling) == ("embed_cls", "cls")
    assert (xenc.head.type, xenc.head.num_labels) == ("cross_encoder", 1)
    # `roberta.` is stripped; the head keeps HF's names (no pooler in this architecture).
    assert {"classifier.dense.weight", "classifier.out_proj.weight"} <= set(xenc.body.tensors)
    assert not any(n.startswith(("roberta.", "pooler.")) for n in xenc.body.tensors)


def _variant(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | config))
    return dst


def test_what_the_graph_does_not_compute_is_refused(dirs, module_tmp):
    out = module_tmp / "refused"
    for i, change in enumerate(
        [
            {"architectures": ["XLMRobertaForTokenClassification"]},
            {"position_embedding_type": "relative_key"},
            {"hidden_act": "gelu_new"},
            {"model_type": "roberta"},
        ]
    ):
        with pytest.raises(UnsupportedModel) as e:
            ingest_owned(_variant(dirs["mean"], module_tmp / f"variant-{i}", **change), out)
        assert e.value.code == "unsupported", change
    # A Dense projection after pooling (as some e5 variants carry) is not served without it.
    dense = _variant(dirs["mean"], module_tmp / "variant-dense")
    modules = json.loads((dense / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModel, match="Dense"):
        ingest_owned(dense, out)
    assert not out.exists()


def test_the_graph_has_its_own_revision_and_cache_keys(manifests):
    xlmr = kernel_revision("xlm-roberta")
    assert xlmr != KERNEL_REVISION and xlmr.startswith(KERNEL_REVISION)
    assert kernel_revision("bert") == KERNEL_REVISION
    man = manifests["mean"]
    key = cache_key(man, Shape(4, MAX_SEQ), BuildOptions())
    assert key["kernel_revision"] == xlmr and key["manifest_digest"] == man.digest
    engine = AneEngine(man.dir, backend="reference")
    assert engine.hello_extras()["kernel_revision"] == xlmr
    assert engine.info().version.startswith(xlmr + " ")
    # A worker that advertised BERT's graph (no artifact at start) refuses to build this one.
    blind = AneEngine(backend="reference")
    with pytest.raises(Exception, match=f"advertised {KERNEL_REVISION}"):
        blind.load(
            m.LOAD(
                req_id=1,
                artifact_path=man.dir,
                artifact_digest=man.digest,
                format="coreml-owned",
                runtime_config={"shapes": []},
            ),
            NullProgress(),
        )


# ---- fidelity against sentence-transformers ------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embeddings_match_sentence_transformers(engines, dirs, pooling):
    st = _st(dirs[pooling])
    plain = _st_ids(st, TEXTS)
    query = _st_ids(st, TEXTS, PROMPTS["query"])
    assert max(len(s) for s in plain) == MAX_SEQ  # long items were cut, as st cuts them
    ref_plain = st.encode(TEXTS, normalize_embeddings=True)
    ref_query = st.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    figures = {}
    for kind in ("unpacked", "packed"):
        engine = engines(pooling, kind)
        for label, seqs, ref in (("plain", plain, ref_plain), ("query", query, ref_query)):
            cos = _cos(_embed(engine, pooling, pooling, seqs), ref)
            figures[kind, label] = (float(cos.min()), float(cos.mean()))
            assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, (kind, label, figures)
    print(
        f"\n{pooling} pooling, {len(TEXTS)} texts: "
        + "; ".join(f"{k}/{lab} min {a:.6f} mean {b:.6f}" for (k, lab), (a, b) in figures.items())
    )
    # The bar discriminates: the prompt changes the vectors beyond it.
    assert _cos(ref_plain, ref_query).min() < 0.9995


def test_packed_and_unpacked_agree_within_fp16_rounding(engines, dirs):
    st = _st(dirs["mean"])
    seqs = _st_ids(st, TEXTS) + _st_ids(st, TEXTS, PROMPTS["passage"])
    a = _embed(engines("mean", "unpacked"), "mean", "mean", seqs)
    b = _embed(engines("mean", "packed"), "mean", "mean", seqs)
    # The graphs round differently only where they differ (positions gathered per segment
    # against a folded constant; zero-weight keys of the other segments), and this random
    # encoder carries that through as it carries its own fp16 error against fp32 (~8e-4
    # each here). Served vectors have components up to ~0.4, where 2e-3 is 8 fp16 ulps;
    # positions shifted by one row already cost cosines down to 0.77 on this model.
    diff = float(np.abs(a - b).max())
    print(
        f"\npacked vs unpacked: max |diff| {diff:.2e}, min cos {_cos(a, b).min():.7f} over "
        f"{len(seqs)} items"
    )
    assert diff <= 2e-3 and _cos(a, b).min() >= 0.99999
    assert np.abs(a).max() > 0.05  # not trivially equal


def _pairs(ce, query: str, docs: list[str]) -> tuple[m.RERANK_SEQUENCES, np.ndarray]:
    """The ids CrossEncoder.predict scores (its tokenizer, truncation and pair template)."""
    seqs, ids = [], []
    for d in docs:
        enc = ce.tokenizer(query, d, truncation=True, max_length=MAX_SEQ)
        ids.append(np.asarray(enc["input_ids"], np.int32))
        # One token type: the host sends n_first = every token (the template's type ids).
        seqs.append(m.RerankSequence(n_tokens=len(ids[-1]), n_first=len(ids[-1])))
    return m.RERANK_SEQUENCES(req_id=3, model_ref="xenc", sequences=seqs), np.concatenate(ids)


def test_cross_encoder_scores_match_crossencoder_logits(engines, dirs):
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(dirs["xenc"]), device="cpu", max_length=MAX_SEQ)
    query, docs = TEXTS[10], TEXTS[:10] + TEXTS[12:40]
    req, ids = _pairs(ce, query, docs)
    first = ids[: req.sequences[0].n_tokens]
    assert first[0] == 0 and list(first).count(2) == 3  # <s> q </s></s> d </s>
    ref = ce.predict([(query, d) for d in docs], activation_fn=torch.nn.Identity())
    gate = thresholds_for("ane", "fp16").rerank_max_abs
    # The logits spread far beyond the gate: a graph that pooled another token, offset the
    # positions otherwise or dropped the head's tanh would be off by about this much.
    assert ref.std() > 20 * gate
    errors = {}
    for kind in ("unpacked", "packed"):
        got = engines("xenc", kind).rerank_sequences(req, ids, NullProgress())
        errors[kind] = float(np.abs(got - ref).max())
    print(
        f"\ncross-encoder over {len(docs)} pairs: max |logit diff| "
        + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
        + f" (gate {gate}, logit std "
        f"{ref.std():.2f})"
    )
    assert max(errors.values()) <= gate, errors


def test_shapes_go_through_the_cache_and_eviction_as_bert_ones_do(
    engines, manifests, dirs, compile_root
):
    for kind in ("unpacked", "packed"):
        engines("mean", kind)  # both shapes compiled into the module's cache
    config = {
        "cache_root": str(compile_root),
        "model_ref": "mean",
        "shapes": [UNPACKED, PACKED],
        "max_loaded_shapes": 1,
    }
    engine = load_reference_engine(manifests["mean"], config)
    try:
        assert engine.loaded_shapes() == ["2x64p8"]  # the budget evicted the first
        admitted = engine.admit_shape(
            m.ADMIT_SHAPE(req_id=2, model_ref="mean", **UNPACKED), NullProgress()
        )
        assert admitted.cache_hit and engine.loaded_shapes() == ["4x48"]
        assert (engine.cache_stats.hits, engine.cache_stats.misses) == (3, 0)
        st = _st(dirs["mean"])
        got = _embed(engine, "mean", "mean", _st_ids(st, TEXTS[:8]))
        assert _cos(got, st.encode(TEXTS[:8])).min() >= 0.9995
        evicted = engine.evict(m.EVICT(req_id=3, model_ref="mean", shape_id="4x48"), NullProgress())
        assert evicted.shape_ids == ["4x48"] and engine.loaded_shapes() == []
    finally:
        engine.close()


def test_placement_estimate_keeps_the_encoder_on_the_neural_engine(engines):
    gate = thresholds_for("ane", "fp16").placement_share
    shares = {}
    for model in ("mean", "xenc"):
        for kind in ("unpacked", "packed"):
            share, source = engines(model, kind).placement()
            assert source == "estimate"
            shares[model, kind] = share
    print("\nplacement estimate: " + ", ".join(f"{a}/{b} {s:.4f}" for (a, b), s in shares.items()))
    assert min(shares.values()) >= gate, shares


# ---- through the host: certification and the CLI -------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(module_tmp, dirs) -> Path:
    """A SYNAPSE_CACHE_DIR whose store holds the embedder and the cross-encoder."""
    cache = module_tmp / "synapse-cache"
    store = ArtifactStore(cache / "models")
    store.ingest_hf_dir(dirs["mean"], "xlmr", dtype="f32")
    store.ingest_hf_dir(dirs["xenc"], "xlmr-xenc", dtype="f32")
    return cache


def test_certify_on_the_ane_lane_is_provisional_off_a_mac(cache_dir):
    from certification.runner import RunOptions, certify
    from certification.store import CertificateStore

    certs = CertificateStore(cache_dir / "certificates")
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")

    async def run(model: str):
        config = ModuleConfig(
            store_root=str(cache_dir / "models"),
            host=HostConfig(runtime_dir=runtime, ping_interval_s=0),
        )
        async with Module(config) as mod:
            return await certify(
                mod,
                RunOptions(
                    model=model,
                    lane="ane",
                    shapes=[PACKED],
                    sample_stride=8,
                    runtime_config_extra={"backend": "reference"},
                    token_outputs=False,
                    # One certified lane: lane choice reads no curve (the routed lanes' is
                    # proven in tests/test_lane_route.py), and it is ~255 items on this executor.
                    curve=False,
                ),
                certs,
            )

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SYNAPSE_CACHE_DIR", str(cache_dir))  # the worker's compile cache
            embed = asyncio.run(run("xlmr"))
            rerank = asyncio.run(run("xlmr-xenc"))
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    for cert in (embed, rerank):
        assert cert.quality == "pass" and cert.failing == [], cert.checks
        assert cert.status == "provisional"  # the placement is the static estimate here
        assert cert.measurements.placement_source == "estimate"
        assert cert.key.kernel_revision == kernel_revision("xlm-roberta")
    cosines = embed.measurements.cosines
    assert {c.name: c for c in embed.checks}["quality.min_cosine"].value == pytest.approx(
        min(cosines), abs=1e-8
    )
    print(
        f"\ncertify: embed min cos {min(cosines):.6f}, rerank max |diff| "
        f"{max(rerank.measurements.rerank_errors):.2e}, placement "
        f"{embed.measurements.placement_share:.4f} / {rerank.measurements.placement_share:.4f}"
    )
    # What a Mac's compute-plan run of the same certificates would record: lane choice
    # (no `lane=`) then serves both models on the Core ML lane.
    asyncio.run(_served_on_ane_once_certified(cache_dir, [embed, rerank]))


async def _served_on_ane_once_certified(cache_dir: Path, certs) -> None:
    from certification.lane_policy import CertificateLanePolicy
    from certification.store import CertificateStore
    from tests.test_lane_choice import as_compute_plan_run

    store = CertificateStore(cache_dir / "certificates-mac")
    for cert in certs:
        store.save(as_compute_plan_run(cert))
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    config = ModuleConfig(
        store_root=str(cache_dir / "models"),
        host=HostConfig(runtime_dir=runtime, ping_interval_s=0),
    )
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SYNAPSE_CACHE_DIR", str(cache_dir))
            async with Module(config, CertificateLanePolicy(store)) as mod:
                await mod.embed(TEXTS[:3], model="xlmr")
                ranked = await mod.rerank("a cat on a mat", TEXTS[:3], model="xlmr-xenc")
                choices = mod.chosen_lanes()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert choices["xlmr"].lane == "ane" and choices["xlmr-xenc"].lane == "ane", choices
    assert ranked.method == "cross-encoder"


def test_the_cli_serves_one_model_on_either_lane(cache_dir, monkeypatch, capsys):
    import cli.commands
    from cli.main import main

    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(cli.commands, "ensure_defaults", lambda: None)  # not these tests'

    def run(*argv: str) -> dict:
        assert main(list(argv)) == 0
        return json.loads(capsys.readouterr().out)

    texts = TEXTS[:6]
    vectors = {}
    for lane in ("ane", "llama"):
        out = run("embed", *texts, "--model", "xlmr", "--lane", lane, "--json")
        assert out["lane"] == lane
        vectors[lane] = np.array(out["data"])
    assert _cos(vectors["ane"], vectors["llama"]).min() >= 0.9995
    scores = {}
    for lane in ("ane", "llama"):
        out = run("rerank", TEXTS[10], *texts, "--model", "xlmr-xenc", "--lane", lane, "--json")
        assert (out["lane"], out["method"]) == (lane, "cross-encoder")
        scores[lane] = np.array(
            [s for _, s in sorted((r["index"], r["score"]) for r in out["results"])]
        )
    assert np.abs(scores["ane"] - scores["llama"]).max() <= 1e-2
    # No flag: the certificate policy's choice (nothing is certified here: llama.cpp).
    assert run("embed", texts[0], "--model", "xlmr", "--json")["lane"] == "llama"
    with pytest.raises(SystemExit):  # argparse names the two lanes
        main(["embed", "x", "--lane", "gpu"])
