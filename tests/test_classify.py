"""Sequence classifiers of N labels (BERT and XLM-RoBERTa, single-label and multi-label), from
a Hugging Face directory through `models ingest` to the llama lane, `POST /predict`, `synapse
classify` and `synapse batch classify`, judged against transformers' text-classification
pipeline on tiny seeded models built here."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from common.errors import InvalidRequest
from formats.gguf_header import read_gguf_header
from host.config import HostConfig
from host.module import Module, ModuleConfig
from ingest.model_packages import minilm_dir
from ingest.store import ArtifactStore
from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model

HIDDEN = 32
SENTIMENT = {0: "negative", 1: "neutral", 2: "positive"}
TOXICITY = {0: "toxic", 1: "insult", 2: "threat"}
# name -> (family, labels, problem_type)
MODELS = {
    "bert-sentiment": ("bert", SENTIMENT, "single_label_classification"),
    "bert-toxicity": ("bert", TOXICITY, "multi_label_classification"),
    "xlmr-sentiment": ("xlmr", SENTIMENT, None),  # single-label by its label count
    "xlmr-toxicity": ("xlmr", TOXICITY, "multi_label_classification"),
}
TEXTS = [
    "The cat sits on the mat.",
    "Stock markets fell sharply on Monday.",
    "I loved every minute of this film!",
    "Le chat dort sur le tapis.",
    "What a terrible, boring waste of time.",
    "ok",
]
PAIRS = [
    ("Where does the cat sleep?", "The cat sleeps on the mat."),
    ("Is the market up?", "Stock markets fell sharply on Monday."),
    ("Any good films?", "I loved every minute of this film!"),
]
PROB_TOL = 2e-2  # the llama lane's bar on probabilities (f32 weights, its own kernels)


def _condition_head(layers) -> None:
    # A fan-in scaled head: logits of a trained classifier's spread, so the probabilities are
    # neither all ~1/3 (nothing to compare) nor saturated (nothing left to differ).
    import torch

    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_(0.0, 2.0 * layer.weight.shape[1] ** -0.5)
            layer.bias.normal_(0.0, 0.3)


def _build(dst: Path, family: str, labels: dict, problem_type: str | None, seed: int) -> None:
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    head = {
        "id2label": labels,
        "label2id": {v: k for k, v in labels.items()},
        "problem_type": problem_type,
    }
    sizes = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "initializer_range": 0.2,
    }
    torch.manual_seed(seed)
    if family == "bert":
        dst.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
            if (minilm_dir() / name).is_file():
                shutil.copyfile(minilm_dir() / name, dst / name)
        config = BertConfig(
            vocab_size=30522, max_position_embeddings=64, type_vocab_size=2, **sizes, **head
        )
        model = BertForSequenceClassification(config)
        _condition_head([model.bert.pooler.dense, model.classifier])
    else:
        from bench.real_sizes import xlmr_tokenizer

        n_vocab = xlmr_tokenizer(dst, 48, vocab_size=700)
        config = XLMRobertaConfig(
            vocab_size=n_vocab,
            max_position_embeddings=66,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **sizes,
            **head,
        )
        model = XLMRobertaForSequenceClassification(config)
        _condition_head([model.classifier.dense, model.classifier.out_proj])
    model.eval().save_pretrained(dst)


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    out = {}
    for seed, (name, (family, labels, problem_type)) in enumerate(MODELS.items()):
        out[name] = module_tmp / "hf" / name
        _build(out[name], family, labels, problem_type, seed)
    return out


@pytest.fixture(scope="module")
def cache_dir(module_tmp, dirs) -> Path:
    """A SYNAPSE_CACHE_DIR whose store holds the four classifiers, ingested from their dirs."""
    store = ArtifactStore(module_tmp / "cache" / "models")
    for name, path in dirs.items():
        store.ingest_hf_dir(path, name, dtype="f32")
    return module_tmp / "cache"


@pytest.fixture(scope="module")
def store(cache_dir) -> ArtifactStore:
    return ArtifactStore(cache_dir / "models")


@pytest.fixture(scope="module")
def runtime_dir():
    path = tempfile.mkdtemp(prefix="syn-cls-", dir="/tmp")  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _module(store: ArtifactStore, runtime_dir: str) -> Module:
    return Module(
        ModuleConfig(
            store_root=str(store.root),
            host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
        )
    )


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str, dict]:
    """transformers' text-classification pipeline per model: every label's score, for the
    texts and then the pairs, as the pipeline computes them (activated) and raw."""
    from transformers import pipeline

    out = {}
    for name, path in dirs.items():
        clf = pipeline("text-classification", model=str(path), device="cpu")
        inputs = [*TEXTS, *({"text": a, "text_pair": b} for a, b in PAIRS)]
        scored = {}
        for function in ("default", "none"):
            kw = {} if function == "default" else {"function_to_apply": "none"}
            rows = [clf(x, top_k=None, **kw) for x in inputs]
            scored[function] = [{d["label"]: d["score"] for d in row} for row in rows]
        out[name] = scored
    return out


def _matrix(rows: list[dict[str, float]], labels: list[str]) -> np.ndarray:
    return np.array([[row[label] for label in labels] for row in rows], dtype=np.float64)


# ---- ingest ------------------------------------------------------------------------------------


def test_ingest_records_the_labels_and_the_problem_type(store):
    for name, (_, labels, problem_type) in MODELS.items():
        record = store.get(name)
        man = record.manifest
        assert (man.kind, man.pooling, man.n_labels) == ("rerank", "rank", 3)
        assert man.labels == [labels[i] for i in range(3)]
        assert man.problem_type == problem_type
        # The GGUF names the head's outputs as llama.cpp's converter writes them, by id.
        key = "bert.classifier.output_labels"
        hdr = read_gguf_header(record.artifact_path, want_arrays=frozenset({key}))
        assert hdr.kv[key] == man.labels


# ---- the llama lane against transformers ---------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
async def test_llama_lane_scores_as_the_transformers_pipeline(store, runtime_dir, reference, name):
    # One call of texts and pairs mixed: each pair is composed as the tokenizer pairs it.
    async with _module(store, runtime_dir) as module:
        result = await module.classify([*TEXTS, *PAIRS], name)
    labels = [MODELS[name][1][i] for i in range(3)]
    assert result.labels == labels
    want = _matrix(reference[name]["default"], labels)
    got = result.scores()
    assert got.shape == want.shape == (len(TEXTS) + len(PAIRS), 3)
    diff = np.abs(got - want).max()
    assert diff <= PROB_TOL, (name, diff)
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
    # The activation is the model's: rows of a single-label model sum to 1, not so otherwise.
    multi = MODELS[name][2] == "multi_label_classification"
    assert result.activation == ("sigmoid" if multi else "softmax")
    assert multi != np.allclose(got.sum(axis=1), 1.0, atol=1e-5)
    # raw_scores: the head's own logits, as the pipeline gives them with no function.
    raw = _matrix(reference[name]["none"], labels)
    raw_diff = np.abs(result.scores(raw_scores=True) - raw).max()
    print(f"{name}: max |prob diff| {diff:.2e}, max |logit diff| {raw_diff:.2e}")
    assert raw_diff <= 1e-2
    spread = raw.max() - raw.min()
    assert spread > 1.0, spread  # the test sees label differences, not a flat head
    ranked = result.ranked()
    assert [label for label, _ in ranked[0]] == [labels[j] for j in np.argsort(-got[0])]


async def test_a_many_label_model_is_no_reranker(store, runtime_dir):
    async with _module(store, runtime_dir) as module:
        with pytest.raises(InvalidRequest, match="sequence classifier with 3 labels") as info:
            await module.rerank("query", ["a document"], "bert-sentiment")
        assert "negative, neutral, positive" in info.value.message
        assert info.value.http_status == 400
        assert module.served_lanes() == []  # refused before a worker started
        with pytest.raises(InvalidRequest, match="lane 'gpu'"):
            await module.classify(["text"], "bert-sentiment", lane="gpu")
        with pytest.raises(InvalidRequest, match="a text or a pair"):
            await module.classify([("a", "b", "c")], "bert-sentiment")  # type: ignore[list-item]
        with pytest.raises(InvalidRequest, match="over the limit"):
            await module.classify([" ".join(["word"] * 200)], "bert-sentiment", truncate=False)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("bert-sentiment", {"rows": 4, "seq_len": 64}),
        ("xlmr-toxicity", {"rows": 2, "seq_len": 64, "packed": True, "max_segments": 8}),
    ],
)
def test_the_core_ml_graph_has_the_n_label_head(dirs, module_tmp, reference, name, shape):
    # The owned graph's cross-encoder head, N outputs wide, through the reference executor
    # (fp16 end to end), unpacked and packed (one shape a model: each costs a conversion),
    # against the same pipeline.
    from certification.thresholds import thresholds_for
    from formats.owned.manifest import ingest_owned
    from host.classify import activate
    from host.tokenization import Tokenizer
    from tests.ane_support import load_reference_engine
    from workers.engine import NullProgress
    from workers.protocol import messages as m

    tok = Tokenizer.from_model_dir(dirs[name])
    single = tok.encode(TEXTS, truncate=True)
    pairs = [tok.encode_pairs(a, [b], truncate=True) for a, b in PAIRS]
    ids = [*single.ids, *(p.ids[0] for p in pairs)]
    n_first = [*single.n_tokens, *(p.n_first[0] for p in pairs)]
    seqs = [m.RerankSequence(n_tokens=len(x), n_first=f) for x, f in zip(ids, n_first, strict=True)]
    request = m.CLASSIFY(req_id=2, model_ref=name, sequences=seqs)
    man = ingest_owned(dirs[name], module_tmp / "owned" / name)
    labels = [MODELS[name][1][i] for i in range(3)]
    want = _matrix(reference[name]["default"], labels)
    bar = thresholds_for("ane", "fp16").rerank_max_abs
    config = {"cache_root": str(module_tmp / "compile-cache"), "model_ref": name, "shapes": [shape]}
    engine = load_reference_engine(man, config)
    try:
        logits = engine.classify(request, np.concatenate(ids), NullProgress())
    finally:
        engine.close()
    assert logits.shape == (len(ids), 3)
    multi = MODELS[name][2] == "multi_label_classification"
    activation = "sigmoid" if multi else "softmax"
    diff = np.abs(activate(logits, activation) - want).max()  # type: ignore[arg-type]
    print(f"{name} on the Core ML graph {shape}: max |prob diff| {diff:.2e}")
    assert diff <= bar, (shape, diff)
    assert (logits.argmax(axis=1) == want.argmax(axis=1)).all()


# ---- HTTP, CLI, bulk ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(store):
    srv = ServerProcess(server_config(str(store.root), preload=[]))
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            yield client
    finally:
        srv.stop()


def test_predict_over_http_in_teis_shape(http, reference):
    name = "xlmr-toxicity"
    labels = [TOXICITY[i] for i in range(3)]
    want = _matrix(reference[name]["default"], labels)
    one = http.post("/predict", json={"inputs": TEXTS[0], "model": name})
    assert one.status_code == 200, one.text
    body = one.json()  # TEI: one input -> its labels best first
    assert [d["label"] for d in body] == [labels[j] for j in np.argsort(-want[0], kind="stable")]
    assert abs(body[0]["score"] - want[0].max()) <= PROB_TOL
    assert one.headers["X-Synapse-Model"] == name
    pair = http.post("/predict", json={"inputs": list(PAIRS[0]), "model": name}).json()
    i = len(TEXTS)  # the first pair's reference row
    assert {d["label"]: d["score"] for d in pair} == pytest.approx(
        dict(zip(labels, want[i], strict=True)), abs=PROB_TOL
    )
    batch = [[t] for t in TEXTS[:3]] + [list(p) for p in PAIRS[:2]]
    got = http.post("/predict", json={"inputs": batch, "model": name, "raw_scores": True})
    assert got.status_code == 200, got.text
    rows = got.json()  # a batch -> one list per input
    raw = _matrix(reference[name]["none"], labels)
    for row, j in zip(rows, [0, 1, 2, i, i + 1], strict=True):
        scores = [d["score"] for d in row]
        assert scores == sorted(scores, reverse=True)
        assert {d["label"]: d["score"] for d in row} == pytest.approx(
            dict(zip(labels, raw[j], strict=True)), abs=5e-2
        )
    info = http.get("/info", params={"model": name}).json()
    head = info["model_type"]["classifier"]
    assert head["id2label"] == {"0": "toxic", "1": "insult", "2": "threat"}
    for bad in ({"inputs": ["a", "b", "c"]}, {"inputs": []}, {"inputs": [["a"], "b"]}):
        resp = http.post("/predict", json={**bad, "model": name})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "inputs", resp.text
    # Four classifiers installed: a request that names none must say which.
    resp = http.post("/predict", json={"inputs": "x"})
    assert resp.status_code == 400 and "bert-sentiment" in resp.json()["error"]["message"]
    resp = http.post("/rerank", json={"query": "q", "texts": ["d"], "model": name})
    assert resp.status_code == 400 and "/predict" in resp.json()["error"]["message"]
    assert "/predict" in http.get("/openapi.json").json()["paths"]


def test_the_cli_classifies_texts_and_pairs(cache_dir, runtime_dir, monkeypatch, capsys, reference):
    from cli.main import main

    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_dir)
    name = "bert-sentiment"
    labels = [SENTIMENT[i] for i in range(3)]
    want = _matrix(reference[name]["default"], labels)

    def run(*argv: str) -> list[dict[str, float]]:
        assert main(["classify", *argv, "--model", name, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["activation"] == "softmax"
        return [{d["label"]: d["score"] for d in row} for row in out["data"]]

    got = _matrix(run(*TEXTS[:2]), labels)
    assert np.abs(got - want[:2]).max() <= PROB_TOL
    got = _matrix(run("--pair", *PAIRS[0], *PAIRS[1]), labels)
    assert np.abs(got - want[len(TEXTS) : len(TEXTS) + 2]).max() <= PROB_TOL
    assert main(["classify", "--pair", "odd", "count", "of three", "--model", name]) == 2
    assert "error[invalid_request]" in capsys.readouterr().err


async def test_batch_classify_writes_label_score_and_every_score(
    module_tmp, store, runtime_dir, reference
):
    from batch.job import JobOptions, run_job

    name = "xlmr-sentiment"
    labels = [SENTIMENT[i] for i in range(3)]
    rows = module_tmp / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS))
        + '{"id": "bad"}\n'
    )
    out = module_tmp / "classified.parquet"
    config = ModuleConfig(
        store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )
    summary = await run_job(
        JobOptions(
            input=str(rows),
            output=str(out),
            model=name,
            task="classify",
            module=config,
            window_rows=4,  # two commits: the parts merge with their metadata
        )
    )
    assert (summary.rows, summary.errors) == (len(TEXTS), 1)
    table = pq.read_table(out)
    assert table.column_names == ["id", "label", "score", "scores", "n_tokens", "truncated"]
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert json.loads(meta["synapse.labels"]) == labels
    assert (meta["synapse.task"], meta["synapse.activation"]) == ("classify", "softmax")
    want = _matrix(reference[name]["default"], labels)[: len(TEXTS)]
    scores = np.array(table.column("scores").to_pylist())
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(len(TEXTS))]
    assert np.abs(scores - want).max() <= PROB_TOL
    assert table.column("label").to_pylist() == [labels[j] for j in scores.argmax(axis=1)]
    assert np.array(table.column("score").to_pylist()) == pytest.approx(scores.max(axis=1))


async def test_certify_judges_a_classifier_against_the_pipeline(store, module_tmp, runtime_dir):
    from certification.runner import RunOptions, certify
    from certification.store import CertificateStore

    certs = CertificateStore(module_tmp / "certificates")
    async with _module(store, runtime_dir) as mod:
        cert = await certify(mod, RunOptions(model="bert-toxicity", sample_stride=8), certs)
    checks = {c.name: c for c in cert.checks}
    error = checks["quality.label_score_max_abs_error"]
    assert error.status == "pass" and error.value <= PROB_TOL, error
    assert checks["quality.top_label_agreement"].status == "pass"
    assert len(cert.measurements.rerank_errors) == cert.corpus.n_items  # one per item
    assert cert.reference.startswith("sentence-transformers"), cert.reference
    assert cert.status == "certified", cert.failing
