"""A GGUF file ingested as it is: kind and pooling from its metadata, a module-side tokenizer
derived from its own vocabulary and proven equal to llama.cpp's (a real llama.cpp child), and
served through real workers, judged against the numpy BERT reference. The GGUFs are ours
(MiniLM, the seeded cross-encoder), rewritten the way other converters write them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers

from certification.corpus import corpus
from certification.reference.bert import BertReference
from certification.tokenizer_proof import prove_gguf_tokenizer
from common.errors import ArtifactInvalid, InvalidRequest
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.bert_to_gguf import convert_bert_dir
from ingest.errors import TokenizerMismatch
from ingest.gguf_model import inspect_gguf
from ingest.model_packages import minilm_dir
from ingest.store import ArtifactStore
from tests.gguf_edit import rewrite_gguf

pytestmark = pytest.mark.model

MINILM = minilm_dir()
ROOT = Path(__file__).resolve().parent.parent
TEXTS = [sanitize(t) for t in list(corpus())[::7]]  # every script, long items included


@pytest.fixture(scope="module")
def ggufs(module_tmp, test_cross_encoder_dir) -> dict[str, Path]:
    d = module_tmp
    out = {"minilm": d / "minilm.gguf", "xenc": d / "xenc.gguf"}
    convert_bert_dir(MINILM, out["minilm"], "f16")
    convert_bert_dir(test_cross_encoder_dir, out["xenc"], "f32")
    # llama.cpp's own converter writes no pooling type for a reranker.
    out["xenc-nopool"] = rewrite_gguf(
        out["xenc"], d / "xenc-nopool.gguf", drop_kv=("bert.pooling_type",)
    )
    out["xenc-nopooler"] = rewrite_gguf(
        out["xenc"],
        d / "xenc-nopooler.gguf",
        drop_kv=("bert.pooling_type",),
        drop_tensors=("cls.weight", "cls.bias"),
    )
    out["minilm-nopool"] = rewrite_gguf(
        out["minilm"], d / "minilm-nopool.gguf", drop_kv=("bert.pooling_type",)
    )
    return out


@pytest.fixture(scope="module")
def store(module_tmp, ggufs) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "models")
    s.ingest_gguf(ggufs["minilm"], "g-minilm", prove=prove_gguf_tokenizer)
    s.ingest_gguf(ggufs["xenc-nopool"], "g-xenc", prove=prove_gguf_tokenizer)
    return s


def module(store: ArtifactStore, runtime_dir: str) -> Module:
    return Module(
        ModuleConfig(
            store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
        )
    )


def test_the_facts_come_from_the_metadata(ggufs):
    m = inspect_gguf(ggufs["minilm"])
    assert (m.architecture, m.kind, m.pooling, m.dims, m.vocabulary, m.dtype) == (
        "bert",
        "embed",
        "mean",
        384,
        "bert",
        "f16",
    )
    assert m.n_ctx_train == 512 and m.item_limit == 512
    x = inspect_gguf(ggufs["xenc-nopool"])  # no pooling type: the classifier head says rank
    assert (x.kind, x.pooling, x.n_labels) == ("rerank", "rank", 1)
    with pytest.raises(InvalidRequest, match="does not say how it pools; pass pooling"):
        inspect_gguf(ggufs["minilm-nopool"])
    assert inspect_gguf(ggufs["minilm-nopool"], pooling="cls").pooling == "cls"


def test_refusals_name_the_reason(ggufs, store, store_root):
    with pytest.raises(ArtifactInvalid, match="without its pooler"):
        inspect_gguf(ggufs["xenc-nopooler"])
    gemma = Path(store_root) / "gemma3-270m" / "model.gguf"
    with pytest.raises(ArtifactInvalid, match="architecture 'gemma3' is not one llama.cpp"):
        inspect_gguf(gemma)
    with pytest.raises(InvalidRequest, match="no classifier head"):
        inspect_gguf(ggufs["minilm"], kind="rerank")
    with pytest.raises(InvalidRequest, match="ingest it as a reranker"):
        inspect_gguf(ggufs["xenc"], kind="embed")
    assert "g-xenc" in {r.name for r in store.ls()}


def unigram_gguf(src: Path, out: Path) -> Path:
    """`src` with an XLM-RoBERTa-style vocabulary: a SentencePiece Unigram model (nmt_nfkc
    normalizer: a real precompiled character map, extra whitespace removed, dummy prefix)
    trained here on the corpus, written as llama.cpp stores it (tokenizer.ggml.model "t5")."""
    import io

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(corpus()) * 3),
        model_writer=buf,
        vocab_size=800,
        model_type="unigram",
        character_coverage=0.9995,
        num_threads=1,
        minloglevel=2,
    )
    proto = pb.ModelProto()
    proto.ParseFromString(buf.getvalue())
    ns, ts, V = proto.normalizer_spec, proto.trainer_spec, gguf.GGUFValueType
    assert ns.name == "nmt_nfkc" and len(ns.precompiled_charsmap) > 1000
    kv = {
        "tokenizer.ggml.model": ("t5", V.STRING),
        "tokenizer.ggml.pre": ("default", V.STRING),
        "tokenizer.ggml.tokens": ([p.piece for p in proto.pieces], V.ARRAY),
        "tokenizer.ggml.scores": ([p.score for p in proto.pieces], V.ARRAY),
        "tokenizer.ggml.token_type": ([int(p.type) for p in proto.pieces], V.ARRAY),
        "tokenizer.ggml.precompiled_charsmap": (list(ns.precompiled_charsmap), V.ARRAY, V.UINT8),
        "tokenizer.ggml.unknown_token_id": (ts.unk_id, V.UINT32),
        "tokenizer.ggml.bos_token_id": (ts.bos_id, V.UINT32),
        "tokenizer.ggml.eos_token_id": (ts.eos_id, V.UINT32),
        "tokenizer.ggml.add_bos_token": (True, V.BOOL),
        "tokenizer.ggml.add_eos_token": (True, V.BOOL),
        "tokenizer.ggml.add_space_prefix": (ns.add_dummy_prefix, V.BOOL),
        "tokenizer.ggml.remove_extra_whitespaces": (ns.remove_extra_whitespaces, V.BOOL),
    }
    return rewrite_gguf(src, out, drop_kv=_vocabulary_keys(src), set_kv=kv)


def _vocabulary_keys(src: Path) -> tuple[str, ...]:
    """The tokenizer keys a new vocabulary replaces (BERT's token-type count is the model's)."""
    return tuple(
        k
        for k in gguf.GGUFReader(str(src)).fields
        if k.startswith("tokenizer.") and k != "tokenizer.ggml.token_type_count"
    )


@pytest.fixture(scope="module")
def ugm(ggufs, module_tmp) -> Path:
    return unigram_gguf(ggufs["minilm"], module_tmp / "ugm.gguf")


def test_a_unigram_vocabulary_is_derived_and_proven(ugm, module_tmp):
    from ingest.gguf_vocab import write_tokenizer_json

    tok = write_tokenizer_json(ugm, module_tmp / "ugm-tokenizer.json")
    assert prove_gguf_tokenizer(ugm, tok) > 300  # every text, with and without <s> ... </s>
    enc = tokenizers.Tokenizer.from_file(str(tok)).encode("ﬁne  ＡＢＣ")
    assert enc.tokens[-1] == "</s>" and enc.ids[0] == 1  # <s> ... </s>, NFKC-folded inside


async def test_an_xlm_roberta_style_gguf_serves_like_the_reference(
    ugm, module_tmp, short_runtime_dir
):
    # XLM-RoBERTa is stored as `bert` with a Unigram vocabulary: here MiniLM's encoder with the
    # Unigram vocabulary above, its embedding table cut to that vocabulary's 800 rows.
    from safetensors.numpy import load_file

    from certification.reference.bert import BertConfig

    tensors = {t.name: t for t in gguf.GGUFReader(str(ugm)).tensors}
    rows, types = tensors["token_embd.weight"], tensors["token_types.weight"]
    xlmr = rewrite_gguf(  # and one token type, as XLM-RoBERTa has
        ugm,
        module_tmp / "xlmr.gguf",
        set_kv={"tokenizer.ggml.token_type_count": (1, gguf.GGUFValueType.UINT32)},
        replace_tensors={
            "token_embd.weight": np.array(rows.data[:800]),
            "token_types.weight": np.array(types.data[:1]),
        },
    )
    s = ArtifactStore(module_tmp / "xlmr-store")
    rec = s.ingest_gguf(xlmr, "xlmr", prove=prove_gguf_tokenizer, max_tokens=128)
    assert (rec.manifest.pooling, rec.manifest.dims, rec.manifest.max_tokens) == ("mean", 384, 128)
    texts = TEXTS[::2]  # every script still; cut at 128 tokens, long inputs are tested above
    async with module(s, short_runtime_dir) as mod:
        result = await mod.embed(texts, model="xlmr")
        ids = (await mod.tokenizer("xlmr")).encode(texts, truncate=True).ids
    assert all(x[0] == 1 and x[-1] == 2 for x in ids)  # <s> ... </s>
    weights = load_file(str(MINILM / "model.safetensors"))
    weights["embeddings.word_embeddings.weight"] = np.asarray(rows.data[:800], np.float32)
    weights["embeddings.token_type_embeddings.weight"] = np.asarray(types.data[:1], np.float32)
    config = json.loads((MINILM / "config.json").read_text()) | {
        "vocab_size": 800,
        "type_vocab_size": 1,
    }
    ref = BertReference(BertConfig.from_dict(config), weights).embed(ids, pooling="mean")
    cos = np.sum(result.vectors * ref, axis=1)
    assert cos.min() >= 0.9999, float(cos.min())


def bpe_gguf(src: Path, out: Path) -> Path:
    """`src` with a Qwen-style vocabulary: byte-level BPE trained here on the corpus with the
    qwen2 pre-tokenizer, EOS appended to every input as Qwen3-Embedding's tokenizer does."""
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from ingest.gguf_vocab import BPE_PRE_TOKENIZERS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(BPE_PRE_TOKENIZERS["qwen2"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.train_from_iterator(
        list(corpus()),
        trainers.BpeTrainer(
            vocab_size=1200,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>"],
            show_progress=False,
        ),
    )
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    V = gguf.GGUFValueType
    kv = {
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("qwen2", V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY),
        "tokenizer.ggml.token_type": ([3 if t == "<|endoftext|>" else 1 for t in tokens], V.ARRAY),
        "tokenizer.ggml.merges": ([" ".join(m) for m in model["merges"]], V.ARRAY),
        "tokenizer.ggml.eos_token_id": (model["vocab"]["<|endoftext|>"], V.UINT32),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL),
        "tokenizer.ggml.add_eos_token": (True, V.BOOL),
    }
    return rewrite_gguf(src, out, drop_kv=_vocabulary_keys(src), set_kv=kv)


@pytest.fixture(scope="module")
def bpe(ggufs, module_tmp) -> Path:
    return bpe_gguf(ggufs["minilm"], module_tmp / "bpe-qwen2.gguf")


def test_a_byte_level_bpe_vocabulary_is_derived_and_proven(bpe, module_tmp):
    from ingest.gguf_vocab import write_tokenizer_json

    tok = write_tokenizer_json(bpe, module_tmp / "bpe-tokenizer.json")
    assert prove_gguf_tokenizer(bpe, tok) > 300
    enc = tokenizers.Tokenizer.from_file(str(tok)).encode("The cat sat.")
    assert enc.tokens[-1] == "<|endoftext|>"  # the last token, which last-token pooling reads


def test_every_pre_tokenizer_the_converter_writes_for_our_families_is_proven(bpe, module_tmp):
    # Each name llama.cpp's converter gives a served family's tokenizer, split as llama.cpp
    # splits for that name (its regex, or its own splitter for GPT-2's), on the corpus.
    from ingest.gguf_vocab import BPE_PRE_TOKENIZERS, write_tokenizer_json

    for pre in sorted(set(BPE_PRE_TOKENIZERS) - {"qwen2"}):
        named = rewrite_gguf(
            bpe,
            module_tmp / f"bpe-{pre}.gguf",
            set_kv={"tokenizer.ggml.pre": (pre, gguf.GGUFValueType.STRING)},
        )
        tok = write_tokenizer_json(named, module_tmp / f"bpe-{pre}.json")
        assert prove_gguf_tokenizer(named, tok) > 300, pre


def test_a_vocabulary_we_cannot_derive_is_refused(ggufs, module_tmp):
    bpe = rewrite_gguf(
        ggufs["minilm"],
        module_tmp / "bpe.gguf",
        arch="qwen3",
        set_kv={
            "tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
            "qwen3.pooling_type": (3, gguf.GGUFValueType.UINT32),
        },
    )
    s = ArtifactStore(module_tmp / "refusals")
    with pytest.raises(ArtifactInvalid, match="pre-tokenizer 'default'.*not yet"):
        s.ingest_gguf(bpe, "bpe", prove=prove_gguf_tokenizer)
    assert s.ls() == []  # nothing published, no staging left
    assert not [p for p in s.root.iterdir() if p.name.startswith(".tmp-")]


def test_a_tokenizer_that_differs_from_llama_cpp_is_refused(ggufs, module_tmp):
    # Keeping accents while lowercasing: llama.cpp lowercases U+0130 to "i", Unicode's full
    # lowercase gives "i" + U+0307; the proof finds the text and refuses the model.
    odd = rewrite_gguf(
        ggufs["minilm"],
        module_tmp / "keep-accents.gguf",
        set_kv={"tokenizer.ggml.normalizer.strip_accents": (False, gguf.GGUFValueType.BOOL)},
    )
    s = ArtifactStore(module_tmp / "mismatch")
    with pytest.raises(TokenizerMismatch, match="differs from llama.cpp's on text .*İstanbul"):
        s.ingest_gguf(odd, "odd", prove=prove_gguf_tokenizer)
    assert s.ls() == []


def test_the_derived_wordpiece_equals_llama_cpp_on_the_corpus(store, ggufs):
    from formats.digest import sha256_file

    rec = store.verify("g-minilm")  # re-hashes the published copy against its record
    assert rec.digest == sha256_file(ggufs["minilm"])  # the copy is the file, byte for byte
    assert prove_gguf_tokenizer(rec.artifact_path, rec.tokenizer_path) > 300
    man = rec.manifest
    assert (man.kind, man.pooling, man.max_tokens_limit, man.source.startswith("gguf:")) == (
        "embed",
        "mean",
        512,
        True,
    )


async def test_an_ingested_gguf_embedder_serves_like_the_reference(store, short_runtime_dir):
    async with module(store, short_runtime_dir) as mod:
        result = await mod.embed(TEXTS, model="g-minilm")
        ids = (await mod.tokenizer("g-minilm")).encode(TEXTS, truncate=True).ids
    # The reference reads the original weights; the ids are the derived tokenizer's (llama.cpp's).
    ref = BertReference.from_dir(MINILM).embed(ids, pooling="mean", normalize=True)
    cos = np.sum(result.vectors * ref, axis=1)
    assert cos.min() >= 0.9999, float(cos.min())


async def test_an_ingested_gguf_reranker_scores_typed_pairs(
    store, short_runtime_dir, test_cross_encoder_dir
):
    query, docs = "Where do cats like to sleep?", list(corpus())[:30:3]
    async with module(store, short_runtime_dir) as mod:
        result = await mod.rerank(query, docs, model="g-xenc")
        seg = (await mod.tokenizer("g-xenc")).rerank_segments(query, docs, truncate=True)
    assert result.method == "cross-encoder"
    cls_id, sep_id = 101, 102
    pairs = [np.concatenate([[cls_id], seg.query, [sep_id], d, [sep_id]]) for d in seg.docs]
    first = len(seg.query) + 2
    ref = BertReference.from_dir(test_cross_encoder_dir).score_many(
        pairs, [(np.arange(len(p)) >= first).astype(np.int64) for p in pairs]
    )
    got = np.array([dict(result.results)[i] for i in range(len(docs))])
    assert np.abs(got - ref).max() <= 2e-3


def test_the_cli_ingests_a_gguf_and_refuses_flags_that_do_not_apply(ggufs, tmp_path):
    env = {"SYNAPSE_CACHE_DIR": str(tmp_path / "cache")}

    def synapse(*args):
        return subprocess.run(
            [sys.executable, "-m", "cli.main", "models", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **env},
        )

    ok = synapse("ingest", str(ggufs["minilm-nopool"]), "--name", "cli-g", "--pooling", "cls")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "tokenizer proven equal to llama.cpp's" in " ".join(ok.stdout.split())
    bad = synapse("ingest", str(ggufs["minilm"]), "--dtype", "f32")
    assert bad.returncode == 2 and "keeps its own precision" in " ".join(bad.stderr.split())
    bad = synapse("ingest", str(MINILM), "--pooling", "cls")
    assert bad.returncode == 2 and "apply to GGUF files" in " ".join(bad.stderr.split())


def test_a_gguf_gets_its_prompts_and_matryoshka_widths_at_ingest(ggufs, module_tmp):
    s = ArtifactStore(module_tmp / "with-prompts")
    rec = s.ingest_gguf(
        ggufs["minilm"],
        "p",
        prove=prove_gguf_tokenizer,
        prompts={"query": "query: ", "passage": "passage: "},
        default_prompt_name="query",
        matryoshka_dims=[256, 384],
    )
    man = rec.manifest
    assert man.prompts == {"query": "query: ", "passage": "passage: "}
    assert man.default_prompt_name == "query" and man.matryoshka_dims == [384, 256]
    with pytest.raises(InvalidRequest, match="not one of the model's prompts"):
        s.ingest_gguf(
            ggufs["minilm"], "p2", prove=prove_gguf_tokenizer, default_prompt_name="query"
        )
    with pytest.raises(InvalidRequest, match="for embedding models"):
        s.ingest_gguf(ggufs["xenc"], "x", prove=prove_gguf_tokenizer, prompts={"q": "q: "})
    assert [r.name for r in s.ls()] == ["p"]
