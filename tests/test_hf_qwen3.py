"""Qwen3 embedders (Qwen3-Embedding: a causal decoder pooled at its appended end-of-text
token), converted by our own converter and served through real workers, judged against
sentence-transformers' `encode` on a tiny seeded model built here with transformers and a
byte-level BPE trained with `tokenizers` (Qwen2's split rule, `<|endoftext|>` appended)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from certification.corpus import corpus
from common.errors import ArtifactInvalid, InvalidRequest
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.hf_dir import convert_hf_dir
from ingest.store import ArtifactStore

pytestmark = pytest.mark.model

TEXTS = [sanitize(t) for t in list(corpus())[::9]]
PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that "
    "answer the query\nQuery:",
    "document": "",
}
MAX_SEQ = 40  # shorter than many corpus items: truncation is part of what is compared
HIDDEN = 64
EOT = "<|endoftext|>"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _tokenizer(dst: Path, append_eot: bool = True) -> int:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        list(corpus()) * 2,
        trainers.BpeTrainer(
            vocab_size=800,
            special_tokens=[EOT, "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    if append_eot:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOT}",
            pair=f"$A {EOT} $B {EOT}",
            special_tokens=[(EOT, tok.token_to_id(EOT))],
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOT, pad_token=EOT, model_max_length=MAX_SEQ
    )
    fast.save_pretrained(dst)
    return tok.get_vocab_size()


def _save_st(raw: Path, dst: Path, pooling: str = "lasttoken") -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    body = Transformer(str(raw), max_seq_length=MAX_SEQ)
    SentenceTransformer(
        modules=[body, Pooling(HIDDEN, pooling), Normalize()], device="cpu", prompts=PROMPTS
    ).save(str(dst))
    return dst


def tiny_qwen3(dst: Path) -> Path:
    """A seeded 2-layer Qwen3 with its trained tokenizer, written to `dst`. head_dim is not
    hidden / heads (as in Qwen3-Embedding-0.6B), heads are grouped, and the random weights are
    wide (0.3) so another pooling, a lost EOS or prompt, a shorter cut each fail the 0.9999
    bar."""
    import torch
    from transformers import Qwen3Model

    torch.manual_seed(0)
    Qwen3Model(tiny_qwen3_config(_tokenizer(dst))).eval().save_pretrained(dst)
    return dst


def tiny_qwen3_config(n_vocab: int, tied: bool = True):
    """The tiny Qwen3 every Qwen3 test builds (embedder or reranker): head_dim is not hidden /
    heads (as in Qwen3-Embedding-0.6B), heads are grouped, and the random weights are wide
    (0.3), so a wrong pooling, token, row or position falls far below each bar."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=n_vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        initializer_range=0.3,
    )


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    raw = tiny_qwen3(module_tmp / "qwen3-raw")
    return {"raw": raw, "st": _save_st(raw, module_tmp / "qwen3-st")}


@pytest.fixture(scope="module")
def store(module_tmp, dirs) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "models")
    s.ingest_hf_dir(dirs["st"], "qwen3", dtype="f32")
    return s


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def test_the_manifest_says_what_the_directory_says(store):
    man = store.get("qwen3").manifest
    assert (man.kind, man.pooling, man.dims, man.max_tokens) == ("embed", "last", HIDDEN, MAX_SEQ)
    assert man.prompts == PROMPTS


async def test_the_lane_embeds_like_sentence_transformers(
    store, dirs, short_runtime_dir, module_tmp
):
    from sentence_transformers import SentenceTransformer

    config = ModuleConfig(
        store_root=str(store.root),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    async with Module(config) as mod:
        plain = (await mod.embed(TEXTS, model="qwen3")).vectors
        query = (await mod.embed(TEXTS, model="qwen3", prompt_name="query")).vectors
        ids = (await mod.tokenizer("qwen3")).encode(TEXTS, truncate=True).ids
    eot = json.loads((dirs["raw"] / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    assert all(x[-1] == eot for x in ids)  # the pooled token, kept on cut inputs too
    assert max(len(x) for x in ids) == MAX_SEQ
    st = SentenceTransformer(str(dirs["st"]), device="cpu")
    ref_plain = st.encode(TEXTS, normalize_embeddings=True)
    ref_query = st.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    print(
        f"min cos: plain {_cos(plain, ref_plain).min():.7f}, "
        f"prompted {_cos(query, ref_query).min():.7f}"
    )
    assert _cos(plain, ref_plain).min() >= 0.9999, _cos(plain, ref_plain).min()
    assert _cos(query, ref_query).min() >= 0.9999, _cos(query, ref_query).min()
    # The bar discriminates: a missing prompt, mean pooling, a shorter cut, a lost EOS.
    assert _cos(query, ref_plain).min() < 0.9999
    st[1].pooling_mode = "mean"
    assert _cos(plain, st.encode(TEXTS, normalize_embeddings=True)).min() < 0.9999
    st[1].pooling_mode = "lasttoken"
    st.max_seq_length = MAX_SEQ // 2
    assert _cos(plain, st.encode(TEXTS, normalize_embeddings=True)).min() < 0.9999
    no_eot = module_tmp / "qwen3-no-eot"
    _tokenizer(no_eot, append_eot=False)
    for f in ("config.json", "model.safetensors"):
        (no_eot / f).write_bytes((dirs["raw"] / f).read_bytes())
    lost = SentenceTransformer(str(_save_st(no_eot, module_tmp / "qwen3-no-eot-st")), device="cpu")
    assert _cos(plain, lost.encode(TEXTS, normalize_embeddings=True)).min() < 0.9999


def test_what_the_converter_refuses(dirs, module_tmp):
    bad = module_tmp / "qwen3-bad"
    shutil.copytree(dirs["st"], bad)
    config = json.loads((dirs["st"] / "config.json").read_text())
    out = module_tmp / "bad.gguf"
    for change, reason in (
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding_window"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "without score.weight"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope scaling"),
    ):
        (bad / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ArtifactInvalid, match=reason):
            convert_hf_dir(bad, out)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="last token"):
        convert_hf_dir(bad, out, pooling="mean")
    assert not out.exists()


async def test_certify_judges_the_qwen3_embedder_with_sentence_transformers(store, module_tmp):
    from certification.runner import RunOptions, certify
    from certification.store import CertificateStore

    certs = CertificateStore(module_tmp / "certificates")
    config = ModuleConfig(
        store_root=str(store.root),
        host=HostConfig(runtime_dir=tempfile.mkdtemp(prefix="syn-", dir="/tmp"), ping_interval_s=0),
    )
    async with Module(config) as mod:
        options = RunOptions(model="qwen3", sample_stride=8, curve=False)
        cert = await certify(mod, options, certs)
    assert cert.reference.startswith("sentence-transformers"), cert.reference
    cos = next(c for c in cert.checks if c.name == "quality.min_cosine")
    assert cos.status == "pass" and cos.value >= 0.9999, cos
    assert cert.status == "certified", cert.failing
