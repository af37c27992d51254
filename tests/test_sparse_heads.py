"""The sparse heads (workers/heads/sparse.py) on transformers' own final hidden states, from
the files ingest wrote (ingest/sparse_heads.py), judged against their references on tiny
seeded models built here: sentence-transformers' `SparseEncoder.encode` for SPLADE (max and
sum pooling, relu and log1p_relu, erf and tanh GELU, tied and untied decoders,
`max_active_dims`) and inference-free SPLADE (a Router whose query route is
`SparseStaticEmbedding`), and FlagEmbedding's bge-m3 lexical-weight formula, restated here in
torch, on a tiny XLM-RoBERTa with a `torch.save`d `sparse_linear.pt`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np
import pytest

from bench.real_sizes import xlmr_tokenizer
from certification.corpus import corpus
from formats.sparse_head import SPARSE_CONFIG, SPARSE_WEIGHTS, SparseHeadInvalid, head_dir
from formats.torch_pt import TorchPtInvalid
from ingest.model_packages import minilm_dir
from ingest.sparse_heads import (
    SparseCheckpointInvalid,
    SparseHeadInfo,
    resolve_route,
    sparse_source,
    write_sparse_heads,
)
from workers.engine import EngineError
from workers.heads.sparse import SpladeHead, StaticSparseHead, TokenWeightHead, load

pytestmark = pytest.mark.model

HIDDEN = 32
MAX_SEQ = 64
TEXTS = [
    *list(corpus())[::37][:5],
    "the cat sat on the mat, the cat sat on the hat",  # repeated tokens: max per id
]
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def _mlm(dst: Path, model, tokenizer_dir: Path, bias_mean: float = -5.0) -> Path:
    """A tiny `...ForMaskedLM` saved with the tokenizer files of `tokenizer_dir`, its
    vocabulary bias pushed down so that, as in a trained SPLADE, most of the vocabulary stays
    at zero."""
    import torch

    dst.mkdir(parents=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, dst / name)
    vocab = model.config.vocab_size
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if name.endswith("bias") and tuple(p.shape) == (vocab,):
                p.normal_(bias_mean, 1.0)
    model.eval().save_pretrained(dst)
    return dst


def _bert(dst: Path, seed: int, **extra) -> Path:
    """BertForMaskedLM under MiniLM's WordPiece vocabulary (30522 ids)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_SEQ + 16,
        initializer_range=0.3,
        **extra,
    )
    return _mlm(dst, BertForMaskedLM(config), minilm_dir())


def _distilbert(dst: Path) -> Path:
    import torch
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(5)
    config = DistilBertConfig(
        vocab_size=30522,
        dim=HIDDEN,
        hidden_dim=64,
        n_layers=2,
        n_heads=4,
        max_position_embeddings=MAX_SEQ + 16,
        initializer_range=0.3,
    )
    return _mlm(dst, DistilBertForMaskedLM(config), minilm_dir())


def _xlmr_config(n_vocab: int, **extra):
    from transformers import XLMRobertaConfig

    return XLMRobertaConfig(
        vocab_size=n_vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_SEQ + 2 + 16,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        initializer_range=0.3,
        **extra,
    )


def inference_free_splade(dst: Path, mlm_dir: Path) -> Path:
    """An inference-free SPLADE saved in `dst`: a Router whose query route is seeded static
    weights (some zero, some negative) and whose document route is SPLADE (max pooling) on
    the masked LM in `mlm_dir`, with a model-level top-k of 12."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    body = Transformer(str(mlm_dir), transformer_task="fill-mask", max_seq_length=MAX_SEQ)
    torch.manual_seed(2)
    weight = torch.rand(30522) * 3 - 0.5
    weight[torch.rand(30522) < 0.2] = 0.0
    router = Router.for_query_document(
        query_modules=[SparseStaticEmbedding(tokenizer=body.tokenizer, weight=weight, frozen=True)],
        document_modules=[body, SpladePooling("max")],
    )
    SparseEncoder(modules=[router], device="cpu", max_active_dims=12).save(str(dst))
    return dst


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import XLMRobertaForMaskedLM, XLMRobertaModel

    out: dict[str, Path] = {}
    tied = _bert(module_tmp / "bert-tied", 0)
    untied = _bert(module_tmp / "bert-untied", 1, tie_word_embeddings=False, hidden_act="gelu_new")

    def mlm(raw: Path):
        return Transformer(str(raw), transformer_task="fill-mask", max_seq_length=MAX_SEQ)

    # SPLADE v2/v3: max pooling; a model-level top-k that cuts these random vectors.
    out["splade"] = module_tmp / "splade"
    SparseEncoder(modules=[mlm(tied), SpladePooling("max")], device="cpu", max_active_dims=48).save(
        str(out["splade"])
    )
    # The original SPLADE's sum pooling, OpenSearch's log1p_relu, an untied tanh-GELU head.
    out["splade-sum"] = module_tmp / "splade-sum"
    pool = SpladePooling("sum", activation_function="log1p_relu")
    SparseEncoder(modules=[mlm(untied), pool], device="cpu").save(str(out["splade-sum"]))
    # Inference-free SPLADE: static query weights (some zero, some negative), SPLADE documents.
    out["ifree"] = inference_free_splade(module_tmp / "ifree", tied)
    # DistilBERT's head (OpenSearch's document encoders).
    out["splade-distil"] = module_tmp / "splade-distil"
    distil = mlm(_distilbert(module_tmp / "distil"))
    SparseEncoder(modules=[distil, SpladePooling("max")], device="cpu").save(
        str(out["splade-distil"])
    )

    # bge-m3 in FlagEmbedding's layout: the XLM-R checkpoint with sparse_linear.pt beside it,
    # saved as FlagEmbedding's `EncoderOnlyEmbedderM3Model.save` saves it (a cloned state dict).
    out["m3"] = module_tmp / "m3"
    n_vocab = xlmr_tokenizer(out["m3"], MAX_SEQ, vocab_size=700)
    torch.manual_seed(3)
    XLMRobertaModel(_xlmr_config(n_vocab)).eval().save_pretrained(out["m3"])
    linear = torch.nn.Linear(HIDDEN, 1)
    with torch.no_grad():  # about half the tokens weigh > 0, as in the trained head
        linear.weight.normal_(0.0, 0.5)
        linear.bias.fill_(0.1)
    state = linear.state_dict()
    torch.save(
        type(state)({k: v.clone().cpu() for k, v in state.items()}), out["m3"] / "sparse_linear.pt"
    )
    # XLM-RoBERTa's head applies the erf GELU whatever hidden_act says (relu here).
    out["splade-xlmr"] = module_tmp / "splade-xlmr"
    torch.manual_seed(6)
    xlmr = XLMRobertaForMaskedLM(_xlmr_config(n_vocab, hidden_act="relu"))
    body = mlm(_mlm(module_tmp / "xlmr", xlmr, out["m3"], bias_mean=-2.0))
    SparseEncoder(modules=[body, SpladePooling("max")], device="cpu").save(str(out["splade-xlmr"]))
    return out


@pytest.fixture(scope="module")
def written(dirs, module_tmp) -> dict[str, tuple[Path, SparseHeadInfo]]:
    out = {}
    for name, src in dirs.items():
        assert sparse_source(src) is not None
        out[name] = (module_tmp / "out" / name, write_sparse_heads(src, module_tmp / "out" / name))
    return out


@pytest.fixture(scope="module")
def ingested(written) -> dict[str, Path]:
    return {name: path for name, (path, _info) in written.items()}


def test_what_the_manifest_keeps_of_each_head(written):
    want = {
        "splade": ("splade", "splade", "splade", 48, True),
        "splade-sum": ("splade", "splade", "splade", None, True),
        "splade-distil": ("splade", "splade", "splade", None, True),
        "splade-xlmr": ("splade", "splade", "splade", None, True),
        "ifree": ("inference_free_splade", "static", "splade", 12, False),
        "m3": ("bge_m3", "token_weights", "token_weights", None, True),
    }
    for name, (path, info) in written.items():
        got = (
            info.source,
            info.routes["query"],
            info.routes["document"],
            info.max_active_dims,
            info.query_needs_forward,
        )
        assert got == want[name], name
        assert info.default_route == "document"
        files = [head_dir(path) / SPARSE_CONFIG, head_dir(path) / SPARSE_WEIGHTS]
        assert info.digest == hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
        # The info round-trips as the manifest would store it.
        assert msgspec.json.decode(msgspec.json.encode(info), type=SparseHeadInfo) == info


def _st_states(model_dir: Path, texts: list[str], sub: str = ""):
    """transformers' last hidden states of each text (its own padded batch, cut to the text's
    length) and the tokenizer's ids, special tokens included."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir / sub)
    model = AutoModel.from_pretrained(model_dir / sub).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=MAX_SEQ, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.numpy()
    lengths = batch["attention_mask"].sum(1).tolist()
    ids = batch["input_ids"].numpy()
    return [(hidden[i, :n], ids[i, :n]) for i, n in enumerate(lengths)]


# Both sides compute a logit as a float32 dot product over the hidden width, rounded in
# different orders: a few 1e-7 of the logit's scale (~1) apart. A value near zero
# (log1p(relu(x)) ~ x) keeps that absolute error, so it is held to 4e-6 absolute; every other
# value to 1e-5 relative.
ATOL = 4e-6


def _assert_same(ours, ref_row: np.ndarray) -> None:
    active = np.flatnonzero(ref_row)
    np.testing.assert_array_equal(ours.indices, active)
    assert ours.indices.dtype == np.int32 and ours.values.dtype == np.float32
    np.testing.assert_allclose(ours.values, ref_row[active], rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("name", ["splade", "splade-sum", "splade-distil", "splade-xlmr"])
def test_splade_equals_sparse_encoder_on_its_own_states(dirs, ingested, name):
    from sentence_transformers import SparseEncoder

    ref = SparseEncoder(str(dirs[name]), device="cpu").encode(TEXTS, convert_to_sparse_tensor=False)
    heads = load(head_dir(ingested[name]))
    head = heads.for_route("document")
    assert isinstance(head, SpladeHead) and heads.for_route("query") is head
    counts = []
    for row, (states, ids) in zip(ref.numpy(), _st_states(dirs[name], TEXTS), strict=True):
        _assert_same(head.apply(states, ids), row)
        counts.append(int((row != 0).sum()))
    if name == "splade":  # the model's top-k cut every vector: the cut itself is compared
        assert counts == [48] * len(TEXTS)
    else:
        vocab = head.spec.vocab_size
        assert 0 < min(counts) and max(counts) < vocab // 2, counts


def test_inference_free_splade_routes(dirs, ingested):
    from sentence_transformers import SparseEncoder
    from transformers import AutoTokenizer

    enc = SparseEncoder(str(dirs["ifree"]), device="cpu")
    heads = load(head_dir(ingested["ifree"]))
    assert not heads.query_needs_forward and heads.spec.default_route == "document"
    query, document = heads.for_route("query"), heads.for_route(None)
    assert isinstance(query, StaticSparseHead) and isinstance(document, SpladeHead)

    # Queries: the text's own ids, no special tokens, as the static module tokenizes them.
    tok = AutoTokenizer.from_pretrained(dirs["ifree"] / "query_0_SparseStaticEmbedding")
    ref_q = enc.encode_query(TEXTS, convert_to_sparse_tensor=False).numpy()
    for text, row in zip(TEXTS, ref_q, strict=True):
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"])
        _assert_same(query.apply(ids), row)
    assert (ref_q != 0).sum(1).max() == 12 and (ref_q < 0).any()

    ref_d = enc.encode_document(TEXTS, convert_to_sparse_tensor=False).numpy()
    states = _st_states(dirs["ifree"], TEXTS, sub="document_0_Transformer")
    for (h, ids), row in zip(states, ref_d, strict=True):
        _assert_same(document.apply(h, ids), row)


def _flag_embedding_lexical_weights(
    model_dir: Path, texts: list[str], max_length: int = MAX_SEQ
) -> list[dict[str, float]]:
    """FlagEmbedding's bge-m3 sparse output, restated in torch from its source:
    `EncoderOnlyEmbedderM3ModelForInference.forward` -> `_sparse_embedding(last_hidden_state,
    input_ids, return_embedding=False)` = `torch.relu(self.sparse_linear(hidden_state))`
    (FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py), then
    `M3Embedder.encode_single_device._process_token_weights`
    (FlagEmbedding/inference/embedder/encoder_only/m3.py): skip the ids of the tokenizer's
    cls/eos/pad/unk tokens, keep `w > result[idx]` from a `defaultdict(int)`."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    sparse_linear = torch.nn.Linear(model.config.hidden_size, 1)
    sparse_linear.load_state_dict(torch.load(model_dir / "sparse_linear.pt", map_location="cpu"))
    batch = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        last = model(**batch, return_dict=True).last_hidden_state
        token_weights = torch.relu(sparse_linear(last)).squeeze(-1).numpy()
    unused = {
        tok.convert_tokens_to_ids(tok.special_tokens_map[t])
        for t in ("cls_token", "eos_token", "pad_token", "unk_token")
        if t in tok.special_tokens_map
    }
    out = []
    for weights, ids in zip(token_weights, batch["input_ids"].numpy().tolist(), strict=True):
        result: dict[str, float] = defaultdict(int)
        for w, idx in zip(weights, ids, strict=True):
            if idx not in unused and w > 0 and w > result[str(idx)]:
                result[str(idx)] = w
        out.append({k: v for k, v in result.items() if v > 0})
    return out


def test_bge_m3_lexical_weights_equal_flag_embeddings_formula(dirs, ingested):
    heads = load(head_dir(ingested["m3"]))
    head = heads.for_route("query")
    assert isinstance(head, TokenWeightHead) and heads.for_route("document") is head
    assert head.spec.dropped_ids == (0, 1, 2, 3)  # <s> <pad> </s> <unk>
    ref = _flag_embedding_lexical_weights(dirs["m3"], TEXTS)
    for (states, ids), expected in zip(_st_states(dirs["m3"], TEXTS), ref, strict=True):
        ours = head.apply(states, ids)
        assert [str(i) for i in ours.indices] == sorted(expected, key=int)
        want = np.array([expected[str(i)] for i in ours.indices], np.float32)
        np.testing.assert_allclose(ours.values, want, rtol=1e-5, atol=0)
        assert 0 < ours.indices.size < len(set(ids.tolist()))  # some weights are dropped


def test_the_chunked_head_equals_the_whole_matrix(dirs, ingested):
    """Chunks of 7 tokens run across sequence boundaries: sequences that end with a chunk,
    inside one, several in one chunk, of one token, spanning three chunks."""
    long_text = " ".join(TEXTS)
    lengths = [7, 1, 2, 2, 9, 7, 20]  # ends 7 8 10 12 21 28 48: chunks end at 7 14 21 28 ...
    for name in ("splade", "splade-sum"):
        head = load(head_dir(ingested[name])).for_route("document")
        assert isinstance(head, SpladeHead)
        ((states, ids),) = _st_states(dirs[name], [long_text])
        bounds = np.cumsum([0, *lengths])
        assert states.shape[0] >= bounds[-1]
        seqs = [states[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        seq_ids = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        got = list(head.pooled_many(seqs, chunk_tokens=7))
        # Chunks on three threads fold in the same order: the same floats.
        threaded = list(head.pooled_many(seqs, chunk_tokens=7, threads=3))
        assert all(np.array_equal(a, b) for a, b in zip(got, threaded, strict=True))
        assert len(got) == len(seqs)
        for pooled, seq in zip(got, seqs, strict=True):
            whole = head.token_scores(seq)  # T x V at once, as SpladePooling without chunks
            want = whole.max(axis=0) if head.spec.pooling == "max" else whole.sum(axis=0)
            # One matmul of T rows and several of 7 round alike only to float32's noise.
            np.testing.assert_allclose(pooled, want, rtol=1e-5, atol=ATOL)
            assert (pooled != 0).sum() == (want != 0).sum() > 0
        # apply_many is apply on each: one sequence, chunked at the default size.
        for vec, seq, i in zip(head.apply_many(seqs, seq_ids), seqs, seq_ids, strict=True):
            one = head.apply(seq, i)
            np.testing.assert_array_equal(vec.indices, one.indices)
            np.testing.assert_allclose(vec.values, one.values, rtol=1e-5, atol=ATOL)


def _variant(src: Path, dst: Path) -> Path:
    """A copy of `src` whose files are hard links (cheap); `_rewrite` replaces one file."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def _rewrite(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.unlink()
    path.write_text(json.dumps(data))


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def test_ingest_refusals(dirs, tmp_path):
    import torch

    cases: list[tuple[str, Path, str]] = []

    def case(name: str, src: str, says: str) -> Path:
        dst = _variant(dirs[src], tmp_path / name)
        cases.append((name, dst, says))
        return dst

    plain = tmp_path / "plain"
    shutil.copytree(dirs["splade"], plain, ignore=shutil.ignore_patterns("modules.json"))
    cases.append(("plain", plain, "not a sparse model"))
    d = case("task", "splade", "not 'fill-mask'")
    _rewrite(d / "sentence_bert_config.json", _set("transformer_task", "feature-extraction"))
    d = case("pooling", "splade", "is not one sentence-transformers computes")
    _rewrite(d / "1_SpladePooling" / "config.json", _set("pooling_strategy", "mean"))
    d = case("act", "splade", "activation 'silu'")
    _rewrite(d / "config.json", _set("hidden_act", "silu"))
    d = case("family", "splade", "model_type 'modernbert'")
    _rewrite(d / "config.json", _set("model_type", "modernbert"))
    d = case("untied", "splade", "no cls.predictions.decoder.weight")
    _rewrite(d / "config.json", _set("tie_word_embeddings", False))
    d = case("extra", "splade", "only a masked-LM transformer then SpladePooling")
    _rewrite(d / "modules.json", lambda m: m.append(dict(m[1], idx=2, name="2")))
    d = case("topk", "splade", "max_active_dims -1")
    _rewrite(d / "config_sentence_transformers.json", _set("max_active_dims", -1))
    d = case("idf", "ifree", "IDF file")
    _rewrite(d / "query_0_SparseStaticEmbedding" / "config.json", _set("path", "idf.json"))
    d = case("route", "ifree", "of modules")
    _rewrite(d / "router_config.json", lambda c: c["structure"]["query"].append("x"))
    d = case("m3-shape", "m3", "expected")
    (d / "sparse_linear.pt").unlink()
    torch.save(torch.nn.Linear(HIDDEN, 2).state_dict(), d / "sparse_linear.pt")
    d = case("m3-garbage", "m3", "torch.save")
    (d / "sparse_linear.pt").unlink()
    (d / "sparse_linear.pt").write_bytes(b"\0" * 64)

    for name, src, says in cases:
        with pytest.raises(
            SparseCheckpointInvalid if name != "m3-garbage" else TorchPtInvalid, match=says
        ) as e:
            write_sparse_heads(src, tmp_path / "out" / name)
        assert e.value.code == "artifact_invalid", name
    assert sparse_source(plain) is None


def test_head_file_and_input_refusals(ingested, tmp_path):
    src = head_dir(ingested["splade"])

    def broken(name: str) -> Path:
        return _variant(src, tmp_path / name)

    d1 = broken("json")
    (d1 / SPARSE_CONFIG).unlink()
    (d1 / SPARSE_CONFIG).write_text("{")
    d2 = broken("version")
    _rewrite(d2 / SPARSE_CONFIG, _set("format", 99))
    d3 = broken("route")
    _rewrite(d3 / SPARSE_CONFIG, lambda c: c["routes"].pop("query"))
    d4 = broken("tensor")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / SPARSE_WEIGHTS))
    tensors.pop("decoder.bias")
    (d4 / SPARSE_WEIGHTS).unlink()
    save_file(tensors, str(d4 / SPARSE_WEIGHTS))
    d5 = broken("shape")
    tensors["decoder.bias"] = np.zeros(7, np.float32)
    (d5 / SPARSE_WEIGHTS).unlink()
    save_file(tensors, str(d5 / SPARSE_WEIGHTS))
    missing = tmp_path / "none"
    for d, says in [
        (d1, "truncated"),
        (d2, "format 99"),
        (d3, "not query and document"),
        (d4, "'decoder.bias' is missing"),
        (d5, "expected float32"),
        (missing, "cannot read"),
    ]:
        with pytest.raises(SparseHeadInvalid, match=says) as e:
            load(d)
        assert e.value.code == "artifact_invalid"

    head = load(src).for_route("document")
    states, ids = np.zeros((3, HIDDEN), np.float32), np.array([101, 7, 102])
    for bad_states, bad_ids, says in [
        (states[:, :5], ids, "token states"),
        (states, ids[:2], "token ids"),
        (states, np.array([101, 30522, 102]), "outside the vocabulary"),
        (states[:0], ids[:0], "no tokens"),
    ]:
        with pytest.raises(EngineError, match=says) as e:
            head.apply(bad_states, bad_ids)
        assert e.value.code == "invalid_request"
    with pytest.raises(EngineError, match="routes") as e:
        load(src).for_route("passage")


def test_routes_resolve_as_the_router_resolves_them(tmp_path):
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    def pools(*names):
        return {n: [SpladePooling("max")] for n in names}

    routers = [
        Router.for_query_document([SpladePooling("max")], [SpladePooling("max")]),
        Router(
            pools("q", "d"),
            route_mappings={("query", None): "q", (None, "text"): "d"},
            allow_empty_key=False,
        ),
        Router(pools("query", "text")),  # no default: the first route, allow_empty_key
        Router(pools("a", "b"), allow_empty_key=False),  # no route for any task
        Router(pools("a", "b")),  # a default, which a named task never falls back to
    ]
    for i, router in enumerate(routers):
        router.save(str(tmp_path / str(i)))
        cfg = json.loads((tmp_path / str(i) / "router_config.json").read_text())
        for task in (None, "query", "document"):
            try:
                want = router._resolve_route(task=task, modality="text")
            except ValueError:
                want = None
            assert resolve_route(task, cfg["structure"], cfg["parameters"]) == want, (i, task)


# ---- served: the llama.cpp lane ---------------------------------------------------------------


def _sparse_cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def served_store(dirs, module_tmp):
    from ingest.store import ArtifactStore

    store = ArtifactStore(module_tmp / "models")
    for name in ("splade", "ifree"):
        store.ingest_hf_dir(dirs[name], name, dtype="f32")
    return store


def _compare_sparse(checks, tolerance: float) -> tuple[float, float]:
    """(worst sparse cosine, worst relative value error) of served vectors against
    `SparseEncoder`'s. The same active set; under a top-k cut (max_active_dims) two entries
    within `tolerance` of the cut may trade places, and nothing else may differ."""
    worst_cos, worst_rel = 1.0, 0.0
    for got, ref in checks:
        ref = ref.to_dense().numpy() if hasattr(ref, "to_dense") else np.asarray(ref)
        for (idx, val), want in zip(got, ref, strict=True):
            dense = np.zeros_like(want)
            dense[idx] = val
            kept = np.nonzero(want)[0]
            cut = float(np.abs(want[kept]).min())
            traded = sorted(set(idx.tolist()) ^ set(kept.tolist()))
            for i in traded:
                near = max(abs(dense[i]), abs(want[i]))
                assert abs(near - cut) <= tolerance * cut, ("active set", i, dense[i], want[i])
            both = np.intersect1d(idx, kept)
            ours, theirs = dense.copy(), want.copy()
            ours[traded] = theirs[traded] = 0.0  # compared as absent in both
            worst_cos = min(worst_cos, _sparse_cos(ours, theirs))
            rel = np.abs(dense[both] - want[both]) / np.abs(want[both])
            worst_rel = max(worst_rel, float(rel.max()))
    return worst_cos, worst_rel


async def test_the_llama_lane_serves_splade_like_sparse_encoder(
    served_store, dirs, short_runtime_dir
):
    """Ingested from their directories and served: SPLADE documents and inference-free
    queries as `SparseEncoder` encodes them. On llama.cpp the same active set, each value
    within 10 % (its tanh GELU moves SPLADE values by a few %) and a sparse cosine >= 0.9999;
    the inference-free query side runs no forward pass and gives the exact static weights."""
    from sentence_transformers import SparseEncoder

    from common.errors import InvalidRequest
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    cfg = ModuleConfig(
        store_root=str(served_store.root),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    assert served_store.get("splade").manifest.outputs == ["sparse", "tokens"]
    # A SPLADE vector (either route of the inference-free one) may fill the vocabulary: the
    # host sizes its requests by the vocabulary, not by the texts' tokens.
    for name in ("splade", "ifree"):
        assert not served_store.get(name).manifest.heads["sparse"].entries_per_token
    async with Module(cfg) as mod:
        docs = await mod.encode_outputs(TEXTS, ["sparse"], "splade")
        ifree_docs = await mod.encode_outputs(TEXTS, ["sparse"], "ifree")
        ifree_queries = await mod.encode_outputs(TEXTS, ["sparse"], "ifree", side="query")
        with pytest.raises(InvalidRequest, match="no dense output"):
            await mod.embed(["a"], "splade")
        with pytest.raises(InvalidRequest, match="sparse output only"):
            await mod.encode_outputs(["a"], ["tokens"], "ifree", side="query")
    checks = [
        (docs.sparse, SparseEncoder(str(dirs["splade"]), device="cpu").encode_document(TEXTS)),
        (ifree_docs.sparse, SparseEncoder(str(dirs["ifree"]), device="cpu").encode_document(TEXTS)),
    ]
    worst_cos, worst_rel = _compare_sparse(checks, 0.10)
    ref_q = SparseEncoder(str(dirs["ifree"]), device="cpu").encode_query(TEXTS)
    ref_q = ref_q.to_dense().numpy() if hasattr(ref_q, "to_dense") else np.asarray(ref_q)
    for (idx, val), want in zip(ifree_queries.sparse, ref_q, strict=True):
        assert np.array_equal(idx, np.nonzero(want)[0]) and np.allclose(val, want[idx], rtol=1e-6)
    print(f"llama lane SPLADE: worst sparse cos {worst_cos:.7f}, worst value error {worst_rel:.4f}")
    assert worst_cos >= 0.9999 and worst_rel <= 0.10


async def test_a_bulk_job_writes_the_sparse_vectors_the_lane_serves(
    served_store, short_runtime_dir, tmp_path
):
    """`synapse batch embed --sparse --no-dense` on a SPLADE model: each row's
    `sparse_indices` / `sparse_values` are what `encode_outputs` returns, read back by DuckDB."""
    import json

    import duckdb

    from batch.job import JobOptions, run_job
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    src = tmp_path / "c.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    out = tmp_path / "s.parquet"
    config = ModuleConfig(
        store_root=str(served_store.root),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    opts = JobOptions(
        input=str(src),
        output=str(out),
        module=config,
        model="splade",
        outputs=("sparse",),
        dense=False,
    )
    await run_job(opts)
    async with Module(config) as mod:
        ref = await mod.encode_outputs(TEXTS, ["sparse"], "splade")
    rows = duckdb.execute(
        "SELECT sparse_indices, sparse_values FROM read_parquet(?)", [str(out)]
    ).fetchall()
    assert ref.sparse is not None and len(rows) == len(TEXTS)
    for (idx, val), (want_idx, want_val) in zip(rows, ref.sparse, strict=True):
        assert idx == want_idx.tolist()
        # A job packs its decodes otherwise than one request does, and llama.cpp's token
        # states move with the packing (up to ~2.5e-4 relative here, far inside the lane's
        # 10 % value bar against the reference).
        np.testing.assert_allclose(np.array(val, np.float32), want_val, rtol=1e-3)


# ---- served: the Core ML lane -----------------------------------------------------------------


async def test_the_core_ml_lane_serves_splade_like_sparse_encoder(
    served_store, dirs, module_tmp, short_runtime_dir
):
    """The Core ML graph runs SPLADE's vocabulary head a chunk of the vocabulary at a time
    (four chunks at this shape: `vocab_chunk`), pooled and activated per chunk; the worker cuts
    the top-k with the llama lane's code. Inference-free SPLADE's documents share the compiled
    graph (the same encoder and head) and its queries run no prediction. Against
    `SparseEncoder`: the same active set (two entries within 2 % of a top-k cut may trade
    places), a sparse cosine at the lane's fp16 bar (0.9995) and each value within 2 %."""
    from sentence_transformers import SparseEncoder

    from host.config import HostConfig
    from host.errors import WorkerError
    from host.module import Module, ModuleConfig
    from workers.ane.shapes import Shape
    from workers.ane.token_heads import vocab_chunk

    shape = {"rows": 4, "seq_len": MAX_SEQ}
    assert vocab_chunk(Shape(4, MAX_SEQ), 30522) == 8192  # the head is chunked
    extra = {"backend": "reference", "cache_root": str(module_tmp / "ane-cache"), "shapes": [shape]}
    cfg = ModuleConfig(
        store_root=str(served_store.root),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    async with Module(cfg) as mod:
        for name in ("splade", "ifree"):
            await mod.load(name, "ane", extra)
        docs = await mod.encode_outputs(TEXTS, ["sparse"], "splade", lane="ane")
        ifree_docs = await mod.encode_outputs(TEXTS, ["sparse"], "ifree", lane="ane")
        ifree_queries = await mod.encode_outputs(
            TEXTS, ["sparse"], "ifree", lane="ane", side="query"
        )
    worst_cos, worst_rel = _compare_sparse(
        [
            (docs.sparse, SparseEncoder(str(dirs["splade"]), device="cpu").encode_document(TEXTS)),
            (
                ifree_docs.sparse,
                SparseEncoder(str(dirs["ifree"]), device="cpu").encode_document(TEXTS),
            ),
        ],
        0.02,
    )
    ref_q = SparseEncoder(str(dirs["ifree"]), device="cpu").encode_query(TEXTS)
    for (idx, val), want in zip(ifree_queries.sparse or [], ref_q.to_dense().numpy(), strict=True):
        assert np.array_equal(idx, np.nonzero(want)[0]) and np.allclose(val, want[idx], rtol=1e-6)
    print(
        f"Core ML lane SPLADE: worst sparse cos {worst_cos:.7f}, worst value error {worst_rel:.4f}"
    )
    assert worst_cos >= 0.9995 and worst_rel <= 0.02

    # Packed rows only: the max is taken per SEGMENT (each segment's own bias row over the
    # chunk's logits, `max_segments` times narrower chunks for the same memory bound), and a
    # text alone in its row gets what it gets packed with the others.
    packed = {"rows": 2, "seq_len": MAX_SEQ, "packed": True, "max_segments": 4}
    assert vocab_chunk(Shape(2, MAX_SEQ, True, 4), 30522, max_pooling=True) == 4096
    # A shape where even one vocabulary entry per chunk would break the bound is refused.
    huge = {"rows": 1024, "seq_len": MAX_SEQ, "packed": True, "max_segments": 64}
    limits = {"max_rows": 1024, "max_shape_tokens": 1 << 16}
    async with Module(cfg) as mod:
        with pytest.raises(WorkerError, match="per-segment max") as refused:
            await mod.load("splade", "ane", {**extra, **limits, "shapes": [huge]})
        assert refused.value.code == "shape_unsupported"
        await mod.load("splade", "ane", {**extra, "shapes": [packed]})
        p_docs = await mod.encode_outputs(TEXTS, ["sparse"], "splade", lane="ane")
        alone = await mod.encode_outputs(TEXTS[-1:], ["sparse"], "splade", lane="ane")
    ref_docs = SparseEncoder(str(dirs["splade"]), device="cpu").encode_document(TEXTS)
    p_cos, p_rel = _compare_sparse([(p_docs.sparse, ref_docs)], 0.02)
    (a_idx, a_val), (t_idx, t_val) = (alone.sparse or [])[0], (p_docs.sparse or [])[-1]
    own = np.zeros(30522, np.float32), np.zeros(30522, np.float32)
    own[0][a_idx], own[1][t_idx] = a_val, t_val
    print(f"packed rows: worst sparse cos {p_cos:.7f}, worst value error {p_rel:.4f}")
    assert p_cos >= 0.9995 and p_rel <= 0.02
    assert _sparse_cos(*own) >= 0.99999


# Sum pooling adds every token's activated logit, each carrying fp16's logit noise (a few
# 1e-3, which also moves a logit near 0 across relu's kink): the sum is held to 0.1 absolute
# (measured 0.078 on texts of up to 64 tokens, values up to ~10), its direction to the
# lane's 0.9995 cosine.
ATOL_ANE_SUM = 0.1


def test_the_core_ml_graph_sums_log1p_relu_splade(dirs, module_tmp):
    """The graph's other SPLADE path, in process on the reference executor: sum pooling of
    log1p(log1p(relu(.))) (OpenSearch's), zeroing padding before the sum (per segment on a
    packed row), on the tied BERT,
    against `SparseEncoder`. (The BERT graph computes the erf GELU only, so a tanh-GELU head
    sits on an encoder its ingest refuses.)"""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import AutoTokenizer

    from formats.owned.manifest import ingest_owned
    from tests.ane_support import load_reference_engine
    from workers.ane.packing import plan
    from workers.ane.shapes import Shape
    from workers.engine import NullProgress
    from workers.protocol import messages as m

    src = module_tmp / "splade-sum-erf"
    body = Transformer(str(module_tmp / "bert-tied"), transformer_task="fill-mask")
    pool = SpladePooling("sum", activation_function="log1p_relu")
    SparseEncoder(modules=[body, pool], device="cpu").save(str(src))
    info = write_sparse_heads(src, module_tmp / "out" / "splade-sum-erf")
    man = ingest_owned(src, module_tmp / "owned-sum")
    heads = {
        "sparse": {
            "path": str(head_dir(module_tmp / "out" / "splade-sum-erf") / SPARSE_CONFIG),
            "digest": info.digest,
        }
    }
    tok = AutoTokenizer.from_pretrained(str(src))
    seqs = [np.asarray(tok(t, truncation=True, max_length=MAX_SEQ)["input_ids"]) for t in TEXTS]
    # Both paths: the short texts go to the packed shape (summed per segment by one matmul
    # with the segments' membership), the others to the unpacked one.
    shapes = [
        {"rows": 4, "seq_len": MAX_SEQ},
        {"rows": 2, "seq_len": MAX_SEQ, "packed": True, "max_segments": 4},
    ]
    chunks = plan([len(s) for s in seqs], [Shape(4, MAX_SEQ), Shape(2, MAX_SEQ, True, 4)])
    assert {c.shape.packed for c in chunks} == {False, True}
    engine = load_reference_engine(
        man, {"cache_root": str(module_tmp / "ane-cache"), "shapes": shapes, "heads": heads}
    )
    try:
        req = m.ENCODE(
            req_id=2,
            model_ref=Path(man.dir).name,
            items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)],
            outputs=["sparse"],
        )
        (section,) = engine.encode(req, np.concatenate(seqs).astype(np.int32), NullProgress())
    finally:
        engine.close()
    cut = np.cumsum(section.counts)[:-1]
    got = zip(np.split(section.arrays[0], cut), np.split(section.arrays[1], cut), strict=True)
    ref = SparseEncoder(str(src), device="cpu").encode_document(TEXTS).to_dense().numpy()
    worst_cos, worst_abs = 1.0, 0.0
    for (idx, val), want in zip(got, ref, strict=True):
        dense = np.zeros_like(want)
        dense[idx] = val
        # An entry active on one side only is one whose tokens' logits all sit within fp16's
        # noise of relu's 0: held to the same absolute bar as every value.
        worst_abs = max(worst_abs, float(np.abs(dense - want).max()))
        worst_cos = min(worst_cos, _sparse_cos(dense, want))
    print(f"Core ML graph, sum/log1p_relu SPLADE: sparse cos {worst_cos:.7f}, |diff| {worst_abs}")
    assert worst_cos >= 0.9995 and worst_abs <= ATOL_ANE_SUM
