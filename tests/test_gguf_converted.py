"""GGUFs as llama.cpp's own converter writes them (`convert_hf_to_gguf.py` of the pinned
llama-cpp-python source: tests/llama_converter.py), of tiny seeded models of the families
served here, ingested with `synapse models ingest FILE` (tokenizer derived from the GGUF and
proven equal to llama.cpp's on the corpus) and judged against sentence-transformers:

- XLM-RoBERTa, an embedder and a bge-reranker-v2-m3-style cross-encoder, whose config
  `vocab_size` exceeds the tokenizer's pieces (multilingual-e5 checkpoints do): the converter
  pads the vocabulary with `[PADn]` pieces typed UNUSED at score -10000;
- ModernBERT (pre-tokenizer "modern-bert");
- a Qwen3 embedder (pre-tokenizer "qwen2", `<|endoftext|>` appended as EOS but not BOS).

The llama.cpp lane serves each; the Core ML lane (reference executor) serves the families its
owned-from-GGUF build supports (XLM-RoBERTa, Qwen3), from the GGUF alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from certification.corpus import corpus
from formats.gguf_header import read_gguf_header
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.gguf_vocab import TYPE_UNUSED, GGUFVocab
from ingest.store import ArtifactStore
from tests import test_hf_modernbert as modernbert
from tests import test_hf_qwen3 as qwen3
from tests import test_hf_xlmr as xlmr
from tests.gguf_edit import rewrite_gguf
from tests.llama_converter import Job, convert

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [sanitize(t) for t in list(corpus())[::9]]
PAD_ROWS = 5  # config rows past the tokenizer's pieces
EMBEDDERS = {
    "xlmr": xlmr.MAX_SEQ,
    "modernbert": modernbert.MAX_SEQ,
    "qwen3": qwen3.MAX_SEQ,
}
RERANKER = "xlmr-xenc"
HF_RERANKER = "xlmr-xenc-hf"
PRE = {"modernbert": "modern-bert", "qwen3": "qwen2"}  # as the converter's table names them


def hub_xlmr_tokenizer(dst: Path, max_seq: int = xlmr.MAX_SEQ) -> int:
    """XLM-RoBERTa's tokenizer files as the hub's checkpoints carry them: a SentencePiece
    Unigram model in SentencePiece's own id order (`sentencepiece.bpe.model`: <unk>, <s>, </s>,
    pieces), which llama.cpp's converter reads, beside fairseq's ids in `tokenizer.json` (<s>,
    <pad>, </s>, <unk>, the pieces one place up, <mask> last), which transformers reads.
    Trained here on the corpus with one thread: the same pieces every run."""
    import base64
    import io
    import json

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import XLMRobertaTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(corpus()) * 3),
        model_writer=buf,
        vocab_size=700,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    proto = pb.ModelProto()
    proto.ParseFromString(buf.getvalue())
    specials = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab = specials + [(p.piece, p.score) for p in proto.pieces[3:]] + [("<mask>", 0.0)]
    tok = XLMRobertaTokenizer(vocab=vocab)
    tok.model_max_length = max_seq
    tok.save_pretrained(str(dst))
    (dst / "sentencepiece.bpe.model").write_bytes(buf.getvalue())
    spec = json.loads((dst / "tokenizer.json").read_text())
    charsmap = base64.b64encode(proto.normalizer_spec.precompiled_charsmap).decode()
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": charsmap},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        ],
    }
    spec["truncation"] = spec["padding"] = None
    (dst / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return len(tok)


def bge_reranker_style(dst: Path, n_vocab: int, seed: int = 1) -> Path:
    """A bge-reranker-v2-m3-style cross-encoder (XLMRobertaForSequenceClassification, GELU,
    one logit), seeded, with its head scaled so the logits span about -10..3 as a trained
    reranker's do, and `PAD_ROWS` embedding rows past the tokenizer."""
    import torch
    from transformers import XLMRobertaForSequenceClassification

    torch.manual_seed(seed)
    model = XLMRobertaForSequenceClassification(
        xlmr._config(n_vocab + PAD_ROWS, num_labels=1, layer_norm_eps=1e-5)
    ).eval()
    with torch.no_grad():
        model.classifier.out_proj.weight.mul_(1.8)
        model.classifier.out_proj.bias.fill_(-6.5)
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    import torch
    from transformers import XLMRobertaModel

    out: dict[str, Path] = {}
    raw = module_tmp / "xlmr-raw"
    n_vocab = hub_xlmr_tokenizer(raw)
    torch.manual_seed(0)
    XLMRobertaModel(xlmr._config(n_vocab + PAD_ROWS)).eval().save_pretrained(raw)
    out["xlmr"] = _st(raw, module_tmp / "xlmr", xlmr.HIDDEN, xlmr.MAX_SEQ, "mean")
    # The hub's sentence-transformers repos (multilingual-e5) keep SentencePiece's file too.
    shutil.copy(raw / "sentencepiece.bpe.model", out["xlmr"])
    out[RERANKER] = module_tmp / RERANKER
    shutil.copytree(raw, out[RERANKER], ignore=shutil.ignore_patterns("*.safetensors", "config*"))
    bge_reranker_style(out[RERANKER], n_vocab)

    tok = modernbert._tokenizer()
    raw = module_tmp / "modernbert-raw"
    torch.manual_seed(0)
    from transformers import ModernBertModel

    ModernBertModel(modernbert._config(tok)).eval().save_pretrained(raw)
    tok.save_pretrained(raw)
    # The pinned converter writes ModernBERT's `norm_eps` as an RMS epsilon only, and llama.cpp
    # cannot load the file without `layer_norm_epsilon` (ingest refuses such a file: see
    # below); the same value under the key the converter reads for it makes a loadable one.
    config = json.loads((raw / "config.json").read_text())
    (raw / "config.json").write_text(json.dumps(config | {"layer_norm_eps": config["norm_eps"]}))
    out["modernbert"] = _st(
        raw, module_tmp / "modernbert", modernbert.HIDDEN, modernbert.MAX_SEQ, "mean"
    )
    raw = qwen3.tiny_qwen3(module_tmp / "qwen3-raw")
    # As Qwen3-Embedding's config.json: BOS and EOS are both <|endoftext|> (the tokenizer
    # appends it, never prepends it), which the converter writes as both token ids.
    config = json.loads((raw / "config.json").read_text())
    eot = tokenizers.Tokenizer.from_file(str(raw / "tokenizer.json")).token_to_id(qwen3.EOT)
    (raw / "config.json").write_text(
        json.dumps(config | {"bos_token_id": eot, "eos_token_id": eot})
    )
    out["qwen3"] = qwen3._save_st(raw, module_tmp / "qwen3")
    return out


def _st(raw: Path, dst: Path, hidden: int, max_seq: int, pooling: str) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    body = Transformer(str(raw), max_seq_length=max_seq)
    SentenceTransformer(modules=[body, Pooling(hidden, pooling), Normalize()], device="cpu").save(
        str(dst)
    )
    return dst


@pytest.fixture(scope="module")
def ggufs(dirs, module_tmp) -> dict[str, Path]:
    out = {name: module_tmp / "gguf" / f"{name}.gguf" for name in dirs}
    (module_tmp / "gguf").mkdir()
    convert([Job(str(dirs[n]), str(out[n]), "f32", PRE.get(n)) for n in dirs])
    return out


@pytest.fixture(scope="module")
def cache(ggufs, dirs, module_tmp) -> Path:
    """`synapse models ingest FILE` of each GGUF into one store (a real CLI process each)."""
    cache = module_tmp / "cache"
    for name, path in ggufs.items():
        # A GGUF holds no sentence-transformers truncation: given here as the directory says.
        limit = EMBEDDERS.get(name, xlmr.MAX_SEQ)
        args = ["ingest", str(path), "--name", name, "--max-tokens", str(limit)]
        done = _synapse(cache, *args)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "tokenizer proven equal to llama.cpp's" in " ".join(done.stdout.split())
    # The same cross-encoder through our own converter, for the same bar.
    ArtifactStore(cache / "models").ingest_hf_dir(dirs[RERANKER], HF_RERANKER, dtype="f32")
    return cache


def _synapse(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "models", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "SYNAPSE_CACHE_DIR": str(cache)},
    )


def _module(cache: Path, runtime_dir: str) -> Module:
    return Module(
        ModuleConfig(
            store_root=str(cache / "models"),
            host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
        )
    )


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_files_are_as_the_converter_writes_them(ggufs, dirs):
    for name in ("xlmr", RERANKER):
        vocab = GGUFVocab.read(ggufs[name])
        pads = [i for i, t in enumerate(vocab.tokens) if t.startswith("[PAD")]
        # The config's extra rows, and <mask>'s: SentencePiece's file has no <mask>, and the
        # converter's realignment to fairseq's ids leaves a pad piece in its place.
        assert len(pads) == PAD_ROWS + 1
        assert all(vocab.types[i] == TYPE_UNUSED and vocab.scores[i] == -10000 for i in pads)
    for name, pre in PRE.items():
        assert read_gguf_header(ggufs[name]).kv["tokenizer.ggml.pre"] == pre
    qwen = GGUFVocab.read(ggufs["qwen3"])
    assert qwen.add_eos and not qwen.add_bos and qwen.eos_id == qwen.bos_id


async def test_the_llama_lane_embeds_like_sentence_transformers(cache, dirs, short_runtime_dir):
    from sentence_transformers import SentenceTransformer

    async with _module(cache, short_runtime_dir) as mod:
        for name in EMBEDDERS:
            got = (await mod.embed(TEXTS, model=name)).vectors
            ref = SentenceTransformer(str(dirs[name]), device="cpu").encode(TEXTS)
            cos = _cos(got, ref)
            print(f"{name}: min cos {cos.min():.7f}")
            assert cos.min() >= 0.9999, (name, cos.min())


async def test_the_llama_lane_reranks_like_the_cross_encoder(cache, dirs, short_runtime_dir):
    # Raw logits within 1e-2, as llama.cpp itself computes them in process (0.0075 here); with
    # flash attention, which casts K and V to f16 on the CPU, the lane was 0.0117 off.
    import torch
    from sentence_transformers import CrossEncoder

    query, docs = TEXTS[10], TEXTS[:10] + TEXTS[12:40]
    ce = CrossEncoder(str(dirs[RERANKER]), device="cpu", max_length=xlmr.MAX_SEQ)
    ref = ce.predict([(query, d) for d in docs], activation_fn=torch.nn.Identity())
    assert ref.min() < -8 and ref.max() > 2  # a trained reranker's range (about -10..3)
    async with _module(cache, short_runtime_dir) as mod:
        for name in (RERANKER, HF_RERANKER):  # llama.cpp's converter, and ours
            result = await mod.rerank(query, docs, model=name)
            lane = np.zeros(len(docs))
            for i, score in result.results:
                lane[i] = score
            diff = np.abs(lane - ref).max()
            print(f"{name}: max |logit diff| {diff:.4f}, logits {ref.min():.2f}..{ref.max():.2f}")
            assert diff <= 1e-2, (name, diff)


def test_a_gguf_llama_cpp_cannot_load_is_refused_at_ingest(ggufs, module_tmp):
    # What the pinned converter makes of a ModernBERT directory as the hub has it (no
    # `layer_norm_eps`): llama.cpp's loader stops on the missing key, so ingest refuses it,
    # saying which key and what to do, instead of publishing a model no worker can load.
    from common.errors import ArtifactInvalid
    from ingest.gguf_model import inspect_gguf

    bare = rewrite_gguf(
        ggufs["modernbert"],
        module_tmp / "modernbert-hub.gguf",
        drop_kv=("modern-bert.attention.layer_norm_epsilon",),
    )
    with pytest.raises(ArtifactInvalid, match="lacks modern-bert.attention.layer_norm_epsilon"):
        inspect_gguf(bare)


# ---- the Core ML lane, from the GGUF alone ----------------------------------------------------

ANE_EMBEDDERS = {"xlmr": "mean", "qwen3": "last"}  # the families its GGUF build supports
ANE_TEXTS = TEXTS[::3]


@pytest.fixture(scope="module")
def ane(cache, module_tmp):
    """The reference executor (fp16 emulated) over each owned artifact built from the GGUF
    the store holds (the records name no directory)."""
    from formats.owned.manifest import load_manifest
    from ingest.owned import ensure_owned, hf_source
    from tests.ane_support import load_reference_engine
    from workers.ane.engine import AneEngine

    store = ArtifactStore(cache / "models")
    made: dict[str, AneEngine] = {}

    def get(name: str, seq_len: int) -> AneEngine:
        if name not in made:
            rec = store.get(name)
            assert hf_source(rec) is None  # built from the GGUF, not from a directory
            man = load_manifest(ensure_owned(store, rec)[0])
            config = {
                "cache_root": str(module_tmp / "coreml-cache"),
                "model_ref": name,
                "shapes": [{"rows": 1, "seq_len": seq_len}],
            }
            made[name] = load_reference_engine(man, config)
        return made[name]

    yield get
    for engine in made.values():
        engine.close()


@pytest.mark.parametrize("name", sorted(ANE_EMBEDDERS))
def test_the_core_ml_lane_embeds_like_sentence_transformers(ane, dirs, name):
    from sentence_transformers import SentenceTransformer

    from workers.engine import NullProgress
    from workers.protocol import messages as m

    st = SentenceTransformer(str(dirs[name]), device="cpu")
    feats = st.preprocess(ANE_TEXTS)
    seqs = [
        ids[mask.bool()].numpy().astype(np.int32)
        for ids, mask in zip(feats["input_ids"], feats["attention_mask"], strict=True)
    ]
    req = m.EMBED_BATCH(
        req_id=2,
        model_ref=name,
        pooling=ANE_EMBEDDERS[name],
        normalize=True,
        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)],
    )
    got = ane(name, EMBEDDERS[name]).embed(req, np.concatenate(seqs), NullProgress())
    cos = _cos(got, st.encode(ANE_TEXTS))
    print(f"{name}: min cos {cos.min():.6f}")
    assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, cos.min()


def test_the_core_ml_lane_reads_the_padded_reranker_as_its_directory(ane, dirs, cache, module_tmp):
    # The cross-encoder built from llama.cpp's padded GGUF is the one built from its directory:
    # same family, head and f32 weights (the padding rows included: the checkpoint has them),
    # the position table from the model's first real position. How the Core ML graph scores
    # an XLM-RoBERTa cross-encoder against CrossEncoder is tests/test_ane_xlmr.py's to judge;
    # its fp16 logits here still order the documents as CrossEncoder does.
    import torch
    from sentence_transformers import CrossEncoder

    from formats.owned.manifest import ingest_owned, load_manifest
    from ingest.owned import ensure_owned
    from workers.engine import NullProgress
    from workers.protocol import messages as m

    store = ArtifactStore(cache / "models")
    man = load_manifest(ensure_owned(store, store.get(RERANKER))[0])
    hf = ingest_owned(dirs[RERANKER], module_tmp / "owned-hf-xenc")
    assert (man.config.family, man.head) == (hf.config.family, hf.head)
    got, want = man.load_weights(), hf.load_weights()
    assert set(got) == set(want)
    for tensor, arr in got.items():
        ref = want[tensor]
        if tensor == "embeddings.position_embeddings.weight":
            ref = ref[hf.config.position_offset :]
        assert np.array_equal(arr, ref), tensor
    assert got["embeddings.word_embeddings.weight"].shape[0] == man.config.vocab_size

    ce = CrossEncoder(str(dirs[RERANKER]), device="cpu", max_length=xlmr.MAX_SEQ)
    query, docs = ANE_TEXTS[3], ANE_TEXTS[:3] + ANE_TEXTS[4:]
    ids = [
        np.asarray(ce.tokenizer(query, d, truncation=True, max_length=xlmr.MAX_SEQ)["input_ids"])
        for d in docs
    ]
    seqs = [m.RerankSequence(n_tokens=len(i), n_first=len(i)) for i in ids]  # one token type
    req = m.RERANK_SEQUENCES(req_id=3, model_ref=RERANKER, sequences=seqs)
    scores = ane(RERANKER, xlmr.MAX_SEQ).rerank_sequences(
        req, np.concatenate(ids).astype(np.int32), NullProgress()
    )
    ref = ce.predict([(query, d) for d in docs], activation_fn=torch.nn.Identity())
    apart = (ref[:, None] - ref[None, :]) > 0.1
    assert np.all((scores[:, None] > scores[None, :])[apart])
