"""The references that judge a certification run.

sentence-transformers / transformers on the CPU in fp32 judges every family where it is
installed; our numpy BERT forward judges BERT models where it is not. Shown here: the two agree
from the same token ids (so switching the judge moves no certificate), which one is chosen
and when neither can judge, that the pooling of the sentence-transformers reference is the
directory's own, and that a run records its judge, passes under it and fails under a wrong one.
Runs use a private certificate store: a deliberately failed certificate must not become the
session's current record for a lane other tests certify.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import msgspec
import numpy as np
import pytest

from certification import report
from certification.certificate import NUMPY_REFERENCE, decode, encode
from certification.corpus import corpus, queries
from certification.errors import ReferenceUnavailable
from certification.oracle import NUMPY, ST, Oracle, reference_dir_for, select_reference
from certification.runner import RunOptions, _pair_composer
from certification.store import CertificateStore
from host.tokenization import Tokenizer
from ingest.model_packages import minilm_dir
from ingest.store import Manifest, ModelRecord
from tests.session_certs import adopt
from tests.test_certification import STRIDE, check, run

pytestmark = pytest.mark.model

# Asked without importing torch at collection time.
HAS_ST = find_spec("sentence_transformers") is not None and find_spec("torch") is not None
needs_st = pytest.mark.skipif(not HAS_ST, reason="sentence-transformers is not installed")

MIN_COSINE = 0.99999  # ST vs numpy, per item, the same ids
MAX_LOGIT_DIFF = 1e-4


@pytest.fixture
def cache_env(synapse_cache_dir, monkeypatch):
    """The session's cache for what a run resolves from the environment (the CLI's store)."""
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(synapse_cache_dir))


@pytest.fixture(scope="module")
def cert_store(module_tmp) -> CertificateStore:
    return CertificateStore(module_tmp / "certificates")


@pytest.fixture(scope="module")
def corpus_ids() -> list[np.ndarray]:
    """Every 8th corpus item (every category, the over-long ones included), tokenized as the
    lane's host tokenizes them."""
    texts = list(corpus())[::STRIDE]
    return Tokenizer.from_model_dir(minilm_dir()).encode(texts, truncate=True).ids


def _linked_copy(src: Path, dst: Path) -> Path:
    """`src` as symlinks (no copy of the weights), its sentence-transformers files real."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).symlink_to(p)
    return dst


def _with_pooling(dst: Path, mode: str) -> Path:
    d = _linked_copy(minilm_dir(), dst)
    (d / "1_Pooling").mkdir()
    cfg = json.loads((minilm_dir() / "1_Pooling" / "config.json").read_text())
    for key in [k for k in cfg if k.startswith("pooling_mode")]:
        cfg[key] = False
    cfg[f"pooling_mode_{'cls_token' if mode == 'cls' else mode + '_tokens'}"] = True
    (d / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return d


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(1) / np.linalg.norm(a64, axis=1) / np.linalg.norm(b64, axis=1)


# ---- the two references agree ----------------------------------------------------------------


@needs_st
def test_sentence_transformers_and_numpy_embeddings_agree(corpus_ids):
    st = Oracle(minilm_dir(), reference=ST).embed(corpus_ids)
    ref = Oracle(minilm_dir(), reference=NUMPY).embed(corpus_ids)
    cos = _cosines(st, ref)
    print(
        f"ST vs numpy embeddings: {len(cos)} items, 1 - min cos {1 - cos.min():.3g}, "
        f"max |diff| {np.abs(st - ref).max():.3g}"
    )
    assert st.shape == ref.shape == (len(corpus_ids), 384)
    assert cos.min() >= MIN_COSINE


@needs_st
def test_sentence_transformers_and_numpy_logits_agree(test_cross_encoder_dir):
    """The pairs the runner judges a lane on, scored by CrossEncoder and by the numpy forward:
    one query against every 8th corpus item."""
    tok = Tokenizer.from_model_dir(test_cross_encoder_dir)
    st, ref = (Oracle(test_cross_encoder_dir, reference=r) for r in (ST, NUMPY))
    assert st.is_cross_encoder and st.n_token_types == 2
    docs = list(corpus())[::STRIDE]
    ids, types = _pair_composer("llama", tok, st.n_token_types)(queries()[0], docs)
    # The llama lane's segments composed with the model's pair template are the pairs the
    # Core ML lane is judged on (its template, its types): one typed forward judges both.
    ane_ids, ane_types = _pair_composer("ane", tok, st.n_token_types)(queries()[0], docs)
    assert all(np.array_equal(a, b) for a, b in zip(ids, ane_ids, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(types, ane_types, strict=True))
    got, want = st.scores(ids, types), ref.scores(ids, types)
    diff = np.abs(got.astype(np.float64) - want)
    print(
        f"ST vs numpy logits: {len(diff)} pairs, max |diff| {diff.max():.3g}, "
        f"spread {want.std():.3g}"
    )
    assert got.shape == want.shape == (len(docs),)
    assert diff.max() <= MAX_LOGIT_DIFF
    # The types reach the CrossEncoder: dropping them moves the logits far past the tolerance.
    untyped = st.scores(ids, [np.zeros_like(t) for t in types])
    assert np.abs(untyped - got).max() > 100 * MAX_LOGIT_DIFF


@needs_st
def test_the_sentence_transformers_pooling_is_the_directorys_own(tmp_path, corpus_ids):
    ids = corpus_ids[:12]
    numpy_ref = Oracle(minilm_dir(), reference=NUMPY, pooling="cls").embed(ids)
    cls_dir = _with_pooling(tmp_path / "cls", "cls")
    # The lane's pooling ("mean") does not override what the directory declares...
    declared = Oracle(cls_dir, reference=ST, pooling="mean").embed(ids)
    assert _cosines(declared, numpy_ref).min() >= MIN_COSINE
    # ...and a plain HF directory, which declares none, is pooled as the lane pools.
    plain = _linked_copy(minilm_dir(), tmp_path / "plain")
    (plain / "modules.json").unlink()
    as_lane = Oracle(plain, reference=ST, pooling="cls").embed(ids)
    assert _cosines(as_lane, numpy_ref).min() >= MIN_COSINE
    mean = Oracle(plain, reference=ST, pooling="mean").embed(ids)
    assert _cosines(mean, numpy_ref).min() < 0.99


@needs_st
def test_the_cache_keys_name_the_reference(tmp_path, corpus_ids):
    ids = corpus_ids[:4]
    cache = tmp_path / "cache"
    st = Oracle(minilm_dir(), cache, reference=ST)
    numpy_ref = Oracle(minilm_dir(), cache, reference=NUMPY)
    assert st.reference_name.startswith("sentence-transformers ")
    assert "fp32 CPU" in st.reference_name and "torch " in st.reference_name
    assert numpy_ref.reference_name.startswith(NUMPY_REFERENCE)
    st.embed(ids)
    numpy_ref.embed(ids)
    assert len(list(cache.glob("*.npy"))) == 2  # the same call and ids, one entry per judge
    st.embed(ids)
    assert len(list(cache.glob("*.npy"))) == 2  # and each judge finds its own again
    # The module pipeline is part of what the sentence-transformers reference computes.
    other = Oracle(_with_pooling(tmp_path / "cls", "cls"), cache, reference=ST)
    assert other.weights_digest != st.weights_digest


# ---- which reference judges ------------------------------------------------------------------


def _qwen3_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3Model"], "hidden_size": 8})
    )
    (path / "model.safetensors").write_bytes(b"")  # never read: no forward runs here
    return path


def test_the_reference_is_sentence_transformers_where_it_imports(tmp_path):
    qwen = _qwen3_dir(tmp_path / "qwen3")
    assert select_reference(minilm_dir(), st_available=True) == ST
    assert select_reference(qwen, st_available=True) == ST


def test_without_sentence_transformers_bert_falls_back_to_numpy_and_others_are_refused(
    tmp_path,
):
    assert select_reference(minilm_dir(), st_available=False) == NUMPY
    qwen = _qwen3_dir(tmp_path / "qwen3")
    with pytest.raises(ReferenceUnavailable, match="'qwen3'.*BERT models only") as info:
        select_reference(qwen, st_available=False)
    assert info.value.code == "reference_unavailable"
    assert "synapse[reference]" in str(info.value) and "sentence-transformers" in str(info.value)
    with pytest.raises(ReferenceUnavailable, match="BERT models only"):  # asked for directly
        Oracle(qwen, reference=NUMPY)
    with pytest.raises(ValueError, match="'mean' or 'cls'"):
        Oracle(minilm_dir(), reference=NUMPY, pooling="last")


def test_a_model_ingested_from_a_gguf_file_needs_a_reference_dir(tmp_path):
    manifest = Manifest(
        name="from-gguf",
        format="gguf",
        kind="embed",
        digest="0" * 64,
        size_bytes=1,
        dims=8,
        n_ctx=512,
        n_ctx_train=512,
        max_tokens=256,
        max_tokens_limit=512,
        source="gguf:/models/some-embedder.gguf",
        created_at="2026-01-01T00:00:00Z",
        pooling="last",
    )
    with pytest.raises(ValueError, match="ingested from a GGUF file.*--reference-dir"):
        reference_dir_for(ModelRecord(manifest, tmp_path))


# ---- a run records its judge -----------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_cert(minilm_llama_certificate, cert_store):
    """The default model's llama lane certified with the default judge: the session's one run
    of it (tests/conftest.py), adopted into this module's store."""
    assert minilm_llama_certificate.corpus.sample_stride == STRIDE
    return adopt(minilm_llama_certificate, cert_store)


def test_an_embedder_run_records_its_reference_and_passes(embed_cert, cert_store, tmp_path):
    cert = embed_cert
    chosen = select_reference(minilm_dir())  # sentence-transformers here, numpy without it
    assert cert.status == "certified" and cert.failing == [], cert.checks
    assert cert.reference.startswith(
        "sentence-transformers " if chosen == ST else NUMPY_REFERENCE
    ), cert.reference
    assert cert.reference_dir == str(minilm_dir())
    assert check(cert, "quality.min_cosine").value >= 0.9999
    back = cert_store.get(cert.id)
    assert back is not None and back.reference == cert.reference
    assert cert.reference in report.write(cert, tmp_path / "r.html").read_text()
    # A certificate written before the judge was recorded reads back as the numpy one's.
    raw = json.loads(encode(cert))
    del raw["reference"]
    assert decode(msgspec.json.encode(raw)).reference == NUMPY_REFERENCE


@needs_st
async def test_a_wrong_reference_fails_the_run(store_root, cert_store, tmp_path, cache_env):
    """The lane mean-pools, as MiniLM does; a reference directory that says CLS must fail it
    (the judge pools as its directory says, not as the lane does)."""
    wrong = _with_pooling(tmp_path / "minilm-cls", "cls")
    cert = await run(
        store_root,
        cert_store,
        RunOptions(
            model="minilm-l6-v2",
            sample_stride=40,
            reference_dir=str(wrong),
            save=False,
            token_outputs=False,
        ),
    )
    assert cert.status == "failed" and "quality.min_cosine" in cert.failing
    assert check(cert, "quality.min_cosine").value < 0.99
    assert check(cert, "quality.tokenizer_agreement").status == "pass"  # the same ids
    assert cert.reference.startswith("sentence-transformers ")


@needs_st
def test_a_cross_encoder_run_is_judged_by_the_cross_encoder(xenc_llama_certificate, cert_store):
    # The test cross-encoder (f16) on the llama lane: the session's one run of it
    # (tests/conftest.py), adopted into this module's store.
    cert = adopt(xenc_llama_certificate, cert_store)
    assert cert_store.get(cert.id) == cert
    rerank = check(cert, "quality.rerank_max_abs_error")
    assert rerank.status == "pass" and "own token types" in rerank.detail, rerank
    assert cert.status == "certified" and cert.reference.startswith("sentence-transformers ")


def test_the_cli_names_a_missing_reference(tmp_path, capsys, cache_env):
    """`synapse certify --reference numpy` on a family the numpy forward cannot compute: its
    own error code, exit 2, and refused before any worker starts."""
    from cli.main import main

    qwen = _qwen3_dir(tmp_path / "qwen3")
    assert (
        main(
            [
                "certify",
                "--model",
                "minilm-l6-v2",
                "--reference",
                "numpy",
                "--reference-dir",
                str(qwen),
                "--no-save",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "error[reference_unavailable]" in err and "synapse[reference]" in err
