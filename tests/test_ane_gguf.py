"""The Core ML lane for models that exist only as a GGUF file: the owned artifact is built from
the GGUF's f16/f32 tensors and metadata (`formats.owned.manifest_gguf`), with the tokenizer the
host derived from the GGUF and proved equal to llama.cpp's at ingest.

Tiny seeded BERT, XLM-RoBERTa and Qwen3 models (embedders, and BERT and XLM-RoBERTa cross-
encoders) are written as HF directories, converted to GGUF by our own converter, and ONLY the
GGUF is ingested into a fresh store, so the record names no directory. The lane's reference
executor (fp16 emulated) on that build is judged against sentence-transformers on the original
directory, fed the ids sentence-transformers tokenizes, and the owned weights are compared with
the ones the directory gives: equal for an f32 GGUF, equal to their fp16 rounding for an f16
one. Quantized tensors and other architectures are refused, named."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from certification.corpus import corpus
from certification.reference.cross_encoder import minilm_dir
from certification.thresholds import thresholds_for
from certification.tokenizer_proof import prove_gguf_tokenizer
from common.errors import ArtifactInvalid
from formats.owned.gguf_weights import QuantizedTensor
from formats.owned.manifest import Manifest, ingest_owned, load_manifest
from formats.owned.manifest_gguf import UnsupportedArchitecture
from host.sanitize import sanitize
from ingest.hf_dir import convert_hf_dir
from ingest.owned import ensure_owned, hf_source
from ingest.store import ArtifactStore
from tests.ane_support import load_reference_engine
from tests.gguf_edit import rewrite_gguf
from tests.test_ane_qwen3 import _qwen3
from tests.test_ane_xlmr import _config as _xlmr_config
from tests.test_ane_xlmr import _unigram_tokenizer
from workers.ane.engine import AneEngine
from workers.engine import NullProgress
from workers.protocol import messages as m

pytestmark = pytest.mark.model

MAX_SEQ = 32
HIDDEN = 64
SHAPE = {"rows": 1, "seq_len": MAX_SEQ}
TEXTS = [sanitize(t) for t in list(corpus())[::7]]  # every script; long ones cut at 32
EMBEDDERS = {"bert": "mean", "xlmr": "cls", "qwen3": "last"}
CROSS_ENCODERS = ("bert-xenc", "xlmr-xenc")
# The GGUF precision per model: BERT's embedder as f16 (weights rounded), the rest f32.
DTYPES = {"bert": "f16", "xlmr": "f32", "qwen3": "f32", "bert-xenc": "f32", "xlmr-xenc": "f32"}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def _st_save(raw: Path, dst: Path, pooling: str) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    body = Transformer(str(raw), max_seq_length=MAX_SEQ)
    SentenceTransformer(modules=[body, Pooling(HIDDEN, pooling), Normalize()], device="cpu").save(
        str(dst)
    )
    return dst


def _bert_tokenizer(dst: Path) -> None:
    """MiniLM's WordPiece tokenizer files (30522 ids) under a tiny random BERT."""
    dst.mkdir(parents=True)
    for name in _TOKENIZER_FILES:
        if (minilm_dir() / name).is_file():
            shutil.copyfile(minilm_dir() / name, dst / name)


def _bert_config(**extra):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        type_vocab_size=2,
        **{"initializer_range": 0.3, **extra},
    )


def _condition_head(layers) -> None:
    # As tests/test_ane_xlmr.py conditions its cross-encoder: a fan-in scaled head keeps the
    # random encoder's fp16 noise at a trained reranker's share of its logit spread.
    import torch

    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_(0.0, HIDDEN**-0.5)
            layer.bias.normal_(0.0, 0.1)


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    import torch
    from transformers import (
        BertForSequenceClassification,
        BertModel,
        XLMRobertaForSequenceClassification,
        XLMRobertaModel,
    )

    out: dict[str, Path] = {}
    raw = module_tmp / "bert-raw"
    _bert_tokenizer(raw)
    torch.manual_seed(0)
    BertModel(_bert_config()).eval().save_pretrained(raw)
    out["bert"] = _st_save(raw, module_tmp / "bert", "mean")
    out["bert-xenc"] = module_tmp / "bert-xenc"
    _bert_tokenizer(out["bert-xenc"])
    torch.manual_seed(1)
    xenc = BertForSequenceClassification(_bert_config(num_labels=1, initializer_range=0.2))
    _condition_head([xenc.bert.pooler.dense, xenc.classifier])
    xenc.eval().save_pretrained(out["bert-xenc"])

    raw = module_tmp / "xlmr-raw"
    n_vocab = _unigram_tokenizer(raw)
    torch.manual_seed(0)
    XLMRobertaModel(_xlmr_config(n_vocab)).eval().save_pretrained(raw)
    out["xlmr"] = _st_save(raw, module_tmp / "xlmr", "cls")
    out["xlmr-xenc"] = module_tmp / "xlmr-xenc"
    shutil.copytree(
        raw, out["xlmr-xenc"], ignore=shutil.ignore_patterns("*.safetensors", "config*")
    )
    torch.manual_seed(1)
    xenc = XLMRobertaForSequenceClassification(
        _xlmr_config(n_vocab, num_labels=1, initializer_range=0.2)
    )
    _condition_head([xenc.classifier.dense, xenc.classifier.out_proj])
    xenc.eval().save_pretrained(out["xlmr-xenc"])

    out["qwen3"] = _st_save(_qwen3(module_tmp / "qwen3-raw"), module_tmp / "qwen3", "lasttoken")
    return out


@pytest.fixture(scope="module")
def ggufs(dirs, module_tmp) -> dict[str, Path]:
    out = {}
    for name, src in dirs.items():
        out[name] = module_tmp / "gguf" / f"{name}.gguf"
        out[name].parent.mkdir(exist_ok=True)
        convert_hf_dir(src, out[name], DTYPES[name])
    return out


@pytest.fixture(scope="module")
def store(ggufs, module_tmp) -> ArtifactStore:
    """A fresh store holding only the GGUF files: no record names a directory."""
    s = ArtifactStore(module_tmp / "models")
    for name, path in ggufs.items():
        # A GGUF does not carry sentence-transformers' default truncation: given here as the
        # embedders' directories state it (the cross-encoders' state none: the model's limit).
        limit = MAX_SEQ if name in EMBEDDERS else None
        rec = s.ingest_gguf(path, name, prove=prove_gguf_tokenizer, max_tokens=limit)
        assert rec.manifest.source.startswith("gguf:") and hf_source(rec) is None
    return s


@pytest.fixture(scope="module")
def owned(store) -> dict[str, tuple[Path, str]]:
    return {name: ensure_owned(store, store.get(name)) for name in DTYPES}


@pytest.fixture(scope="module")
def from_gguf(owned) -> dict[str, Manifest]:
    return {name: load_manifest(d) for name, (d, _) in owned.items()}


@pytest.fixture(scope="module")
def from_dir(dirs, module_tmp) -> dict[str, Manifest]:
    return {name: ingest_owned(d, module_tmp / "owned-hf" / name) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def engines(from_gguf, module_tmp):
    made: dict[str, AneEngine] = {}

    def get(name: str) -> AneEngine:
        if name not in made:
            man = from_gguf[name]
            engine = load_reference_engine(
                man, {"cache_root": str(module_tmp / "cache"), "model_ref": name, "shapes": [SHAPE]}
            )
            made[name] = engine
        return made[name]

    yield get
    for engine in made.values():
        engine.close()


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ---- the owned artifact ---------------------------------------------------------------------


def test_the_owned_weights_are_the_directorys(from_gguf, from_dir, owned, store):
    for name, man in from_gguf.items():
        hf = from_dir[name]
        assert (man.config.family, man.head) == (hf.config.family, hf.head), name
        got, want = man.load_weights(), hf.load_weights()
        assert set(got) == set(want), name
        offset = hf.config.position_offset
        for tensor, arr in got.items():
            ref = want[tensor]
            if tensor == "embeddings.position_embeddings.weight":
                # The GGUF's table starts at the model's first real position: XLM-RoBERTa's
                # padding rows were cut by the converter, and the build says so.
                ref = ref[offset:]
                assert man.config.position_offset == 0
            if DTYPES[name] == "f16" and not np.array_equal(arr, ref):
                ref = ref.astype(np.float16).astype(np.float32)  # the f16 file's rounding
            assert arr.dtype == np.float32 and np.array_equal(arr, ref), (name, tensor)
        # What the graph is built from beside the weights: the same numbers (the GGUF stores
        # epsilons as f32) and the positions the directory's graph serves; the default
        # truncation is the record's (a GGUF does not carry sentence-transformers' own).
        a, b = man.config, hf.config
        assert (
            a.max_positions,
            a.pad_token_id,
            a.num_kv_heads,
            a.head_dim,
            a.rope_theta,
            a.type_vocab_size,
            a.vocab_size,
            a.intermediate_size,
        ) == (
            b.max_positions,
            b.pad_token_id,
            b.num_kv_heads,
            b.head_dim,
            b.rope_theta,
            b.type_vocab_size,
            b.vocab_size,
            b.intermediate_size,
        ), name
        assert a.layer_norm_eps == pytest.approx(b.layer_norm_eps, rel=1e-6)
        assert a.max_seq_length == store.get(name).manifest.max_tokens
        # The tokenizer is the one the host serves the GGUF with.
        assert man.tokenizer_path.read_bytes() == store.get(name).tokenizer_path.read_bytes()
        # The digest covers what the build was made of, and is the one the host advertises.
        assert man.digest == owned[name][1] != hf.digest
    assert {k: from_gguf[k].config.first_position_row for k in ("bert", "xlmr")} == {
        "bert": None,
        "xlmr": 0,
    }


def test_a_second_load_reuses_the_build(store, owned):
    assert ensure_owned(store, store.get("xlmr")) == owned["xlmr"]


# ---- fidelity against sentence-transformers -------------------------------------------------


@pytest.mark.parametrize("name", sorted(EMBEDDERS))
def test_embeddings_match_sentence_transformers(engines, dirs, name):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(dirs[name]), device="cpu")
    feats = st.preprocess(TEXTS)
    seqs = [
        ids[mask.bool()].numpy().astype(np.int32)
        for ids, mask in zip(feats["input_ids"], feats["attention_mask"], strict=True)
    ]
    assert max(len(s) for s in seqs) == MAX_SEQ  # long items were cut, as st cuts them
    ref = st.encode(TEXTS, normalize_embeddings=True)
    req = m.EMBED_BATCH(
        req_id=2,
        model_ref=name,
        pooling=EMBEDDERS[name],
        normalize=True,
        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)],
    )
    cos = _cos(engines(name).embed(req, np.concatenate(seqs), NullProgress()), ref)
    print(
        f"\n{name} ({DTYPES[name]} GGUF), {len(TEXTS)} texts: min cos {cos.min():.6f}, "
        f"mean {cos.mean():.6f}"
    )
    assert cos.min() >= 0.9995 and cos.mean() >= 0.9999


@pytest.mark.parametrize("name", CROSS_ENCODERS)
def test_cross_encoder_scores_match_crossencoder_logits(engines, dirs, name):
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(dirs[name]), device="cpu", max_length=MAX_SEQ)
    query, docs = TEXTS[10], TEXTS[:10] + TEXTS[12:40]
    seqs, ids = [], []
    for d in docs:
        enc = ce.tokenizer(query, d, truncation=True, max_length=MAX_SEQ)
        ids.append(np.asarray(enc["input_ids"], np.int32))
        # The first segment's length: BERT's document half is token type 1; XLM-RoBERTa has
        # one type, so every token is "first" (as the host sends it).
        types = np.asarray(enc.get("token_type_ids") or [0] * len(ids[-1]))
        seqs.append(m.RerankSequence(n_tokens=len(ids[-1]), n_first=int((types == 0).sum())))
    if name.startswith("bert"):
        assert any(s.n_first < s.n_tokens for s in seqs)
    req = m.RERANK_SEQUENCES(req_id=3, model_ref=name, sequences=seqs)
    ref = ce.predict([(query, d) for d in docs], activation_fn=torch.nn.Identity())
    gate = thresholds_for("ane", "fp16").rerank_max_abs
    assert ref.std() > 20 * gate  # the bar discriminates
    got = engines(name).rerank_sequences(req, np.concatenate(ids), NullProgress())
    diff = float(np.abs(got - ref).max())
    print(
        f"\n{name}: {len(docs)} pairs, max |logit diff| {diff:.2e} (gate {gate}, logit std "
        f"{ref.std():.2f})"
    )
    assert diff <= gate


# ---- other tensor types, other architectures ------------------------------------------------


def _retype(src: Path, dst: Path, tensor: str, qtype: gguf.GGMLQuantizationType) -> Path:
    """`src` with `tensor` stored as `qtype` (gguf's own quantizer), everything else as it was."""
    from gguf.quants import quantize

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name == tensor:
            writer.add_tensor(
                t.name, quantize(np.asarray(t.data, np.float32), qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(t.name, t.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_bf16_tensor_is_read_as_its_float32_value(ggufs, store, from_gguf, module_tmp):
    name = "blk.1.attn_q.weight"
    bf16 = _retype(
        ggufs["qwen3"], module_tmp / "qwen3-bf16.gguf", name, gguf.GGMLQuantizationType.BF16
    )
    man = ingest_owned(
        bf16,
        module_tmp / "owned-bf16",
        tokenizer=store.get("qwen3").tokenizer_path,
        pooling="last",
        max_seq_length=MAX_SEQ,
    )
    got = man.load_weights()["layers.1.self_attn.q_proj.weight"]
    f32 = from_gguf["qwen3"].load_weights()["layers.1.self_attn.q_proj.weight"]
    # gguf rounds to nearest even bf16: the value is within half a bf16 step (2^-8 relative)
    # of the f32 one, and its low 16 bits are zero.
    assert not np.array_equal(got, f32)
    np.testing.assert_allclose(got, f32, rtol=2.0**-8, atol=0)
    assert not (got.view(np.uint32) & 0xFFFF).any()


def test_a_quantized_gguf_is_refused_naming_the_tensor(ggufs, store, module_tmp):
    q8 = _retype(
        ggufs["xlmr"],
        module_tmp / "xlmr-q8.gguf",
        "blk.0.ffn_up.weight",
        gguf.GGMLQuantizationType.Q8_0,
    )
    tok = store.get("xlmr").tokenizer_path
    out = module_tmp / "owned-q8"
    with pytest.raises(QuantizedTensor) as e:
        ingest_owned(q8, out, tokenizer=tok, pooling="cls")
    assert (e.value.tensor, e.value.type_name, e.value.code) == (
        "blk.0.ffn_up.weight",
        "Q8_0",
        "unsupported",
    )
    assert "f16/f32" in str(e.value) and not out.exists()
    # Through the host: the store serves the file on llama.cpp, the Core ML build says why not.
    rec = store.ingest_gguf(q8, "xlmr-q8", prove=prove_gguf_tokenizer, max_tokens=MAX_SEQ)
    with pytest.raises(ArtifactInvalid, match=r"'blk\.0\.ffn_up\.weight' is Q8_0"):
        ensure_owned(store, rec)


def test_another_architecture_is_refused_by_name(ggufs, store, module_tmp):
    other = rewrite_gguf(ggufs["bert"], module_tmp / "nomic.gguf", arch="nomic-bert")
    with pytest.raises(UnsupportedArchitecture, match="'nomic-bert'") as e:
        ingest_owned(
            other,
            module_tmp / "owned-nomic",
            tokenizer=store.get("bert").tokenizer_path,
            pooling="mean",
        )
    assert e.value.code == "unsupported"
