"""Gemma 3 text encoders (EmbeddingGemma is one) converted by our own converter to llama.cpp's
gemma-embedding and served through a real worker, judged against sentence-transformers' own
`encode` on a tiny seeded model built here: bidirectional attention with a sliding window
shorter than the inputs on some layers (not llama.cpp's default every-sixth-layer pattern),
random RMSNorm weights (so Gemma's 1 + w matters), mean pooling, two bias-free Dense
projections, Normalize, EmbeddingGemma's prompts, and a SentencePiece BPE vocabulary with byte
fallback converted as transformers converts Gemma's."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from certification.corpus import corpus
from certification.tokenizer_proof import prove_gguf_tokenizer
from common.errors import ArtifactInvalid
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.hf_dir import convert_hf_dir
from ingest.store import ArtifactStore

pytestmark = pytest.mark.model

TEXTS = [sanitize(t) for t in list(corpus())[::9]]
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
MAX_SEQ = 48  # shorter than many corpus items: truncation is part of what is compared
HIDDEN, WIDE = 64, 128
WINDOW = 8  # config.json's sliding window: a local layer sees 4 tokens either side
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _gemma_tokenizer(
    dst: Path, extra: Sequence[str] = (), max_len: int = MAX_SEQ, chat_template: str | None = None
) -> int:
    """Gemma's tokenizer shape (<pad>=0 <eos>=1 <bos>=2 <unk>=3, byte fallback, no dummy
    prefix, `<bos> ... <eos>` as EmbeddingGemma adds) from a SentencePiece BPE trained here
    (on the corpus and `extra`)."""
    import sentencepiece as spm
    from tokenizers.models import BPE
    from transformers import GemmaTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(corpus()) * 3 + list(extra)),
        model_writer=buf,
        vocab_size=1200,
        model_type="bpe",
        character_coverage=0.9995,
        byte_fallback=True,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=["<mask>"],
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    dst.mkdir(parents=True)
    (dst / "tokenizer.model").write_bytes(buf.getvalue())
    spec = SentencePieceExtractor(str(dst / "tokenizer.model")).extract(BPE)
    (dst / "tokenizer.model").unlink()  # the converter reads tokenizer.json only
    tok = GemmaTokenizer(
        vocab=spec["vocab"],
        merges=spec["merges"],
        add_bos_token=True,
        add_eos_token=True,
        model_max_length=max_len,
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(dst)
    return len(tok)


def _config(n_vocab: int, causal: bool = False):
    from transformers import Gemma3TextConfig

    # Wide random weights (initializer 0.3): vectors of different texts differ enough that a
    # missing prompt or missing projections each fail the 0.9999 bar.
    return Gemma3TextConfig(
        vocab_size=n_vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        # A reranker's pair (its template alone is some 80 tokens) needs more room.
        max_position_embeddings=512 if causal else 128,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        use_bidirectional_attention=not causal,
        initializer_range=0.3,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        architectures=["Gemma3ForCausalLM" if causal else "Gemma3TextModel"],
    )


def tiny_gemma3(dst: Path, causal: bool = False, **tokenizer: Any) -> Path:
    """The tiny Gemma 3 of these tests: the encoder (Gemma3TextModel), or with `causal` the
    decoder with its tied LM head (Gemma3ForCausalLM); RMSNorm weights random, since Gemma
    initialises them to 0 (a scale of 1), which would hide a missing 1 + w."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextModel

    n_vocab = _gemma_tokenizer(dst, **tokenizer)
    torch.manual_seed(0)
    model = (Gemma3ForCausalLM if causal else Gemma3TextModel)(_config(n_vocab, causal)).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if key.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    raw = tiny_gemma3(module_tmp / "gemma-raw")
    st = module_tmp / "gemma-st"
    modules = [
        Transformer(str(raw), max_seq_length=MAX_SEQ),
        Pooling(HIDDEN, "mean"),
        Dense(HIDDEN, WIDE, bias=False, activation_function=torch.nn.Identity()),
        Dense(WIDE, HIDDEN, bias=False, activation_function=torch.nn.Identity()),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS).save(str(st))
    bare = module_tmp / "gemma-bare"  # the same encoder without the two projections
    SentenceTransformer(
        modules=[modules[0], modules[1], modules[4]], device="cpu", prompts=PROMPTS
    ).save(str(bare))
    return {"raw": raw, "st": st, "bare": bare}


@pytest.fixture(scope="module")
def store(module_tmp, dirs) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "models")
    s.ingest_hf_dir(dirs["st"], "egemma", dtype="f32")
    s.ingest_hf_dir(dirs["st"], "egemma-f16", dtype="f16")
    s.ingest_hf_dir(dirs["bare"], "egemma-bare", dtype="f32")
    return s


def _module(store: ArtifactStore, runtime_dir: str) -> Module:
    return Module(
        ModuleConfig(
            store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
        )
    )


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_the_manifest_says_what_the_directory_says(store, dirs):
    man = store.get("egemma").manifest
    assert (man.kind, man.pooling, man.dims, man.max_tokens, man.n_ctx_train) == (
        "embed",
        "mean",
        HIDDEN,
        MAX_SEQ,
        128,
    )
    assert man.prompts == PROMPTS and man.default_prompt_name is None


def test_the_gguf_carries_what_llama_cpp_reads(store, dirs):
    import gguf
    from safetensors.numpy import load_file

    reader = gguf.GGUFReader(str(store.get("egemma").artifact_path))

    def value(key):
        field = reader.fields[key]
        return field.contents()

    arch = "gemma-embedding"
    assert value("general.architecture") == arch
    assert value(f"{arch}.attention.sliding_window") == WINDOW  # config.json's, not halved
    assert value(f"{arch}.attention.sliding_window_pattern") == [
        t == "sliding_attention" for t in LAYER_TYPES
    ]
    assert value(f"{arch}.rope.freq_base") == 1_000_000.0
    assert value(f"{arch}.rope.freq_base_swa") == 10_000.0
    assert (
        value(f"{arch}.dense_2_feat_in"),
        value(f"{arch}.dense_2_feat_out"),
        value(f"{arch}.dense_3_feat_in"),
        value(f"{arch}.dense_3_feat_out"),
    ) == (HIDDEN, WIDE, WIDE, HIDDEN)
    assert value(f"{arch}.attention.causal") is False
    assert value("tokenizer.ggml.model") == "llama"
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    src = load_file(str(dirs["st"] / "model.safetensors"))
    np.testing.assert_array_equal(
        tensors["blk.0.attn_norm.weight"], src["layers.0.input_layernorm.weight"] + 1
    )
    np.testing.assert_array_equal(
        tensors["dense_2.weight"],
        load_file(str(dirs["st"] / "2_Dense" / "model.safetensors"))["linear.weight"],
    )


def test_llama_cpp_tokenizes_the_gguf_vocabulary_like_the_directory(store, dirs):
    # The host tokenizes with the directory's tokenizer.json; the GGUF's own SentencePiece
    # vocabulary still gives llama.cpp the same ids (the corpus and edge cases, with and
    # without <bos>/<eos>), so the file stands on its own.
    assert prove_gguf_tokenizer(
        store.get("egemma").artifact_path, dirs["st"] / "tokenizer.json"
    ) > len(TEXTS)


async def test_the_lane_embeds_like_sentence_transformers(store, dirs, short_runtime_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(dirs["st"]), device="cpu")
    async with _module(store, short_runtime_dir) as mod:
        query = (await mod.embed(TEXTS, model="egemma", prompt_name="query")).vectors
        doc = (await mod.embed(TEXTS, model="egemma", prompt_name="document")).vectors
        half = (await mod.embed(TEXTS, model="egemma-f16", prompt_name="query")).vectors
        bare = (await mod.embed(TEXTS, model="egemma-bare", prompt_name="query")).vectors
        ids = (
            (await mod.tokenizer("egemma"))
            .encode(TEXTS, truncate=True, prompt=PROMPTS["query"])
            .ids
        )
    assert max(len(x) for x in ids) == MAX_SEQ  # long items were cut, on both sides alike
    assert min(len(x) for x in ids) > 2 * WINDOW  # every input is wider than a local window
    ref_query = st.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    ref_doc = st.encode(TEXTS, prompt_name="document", normalize_embeddings=True)
    ref_bare = SentenceTransformer(str(dirs["bare"]), device="cpu").encode(
        TEXTS, prompt_name="query", normalize_embeddings=True
    )
    cos = {
        "query": _cos(query, ref_query),
        "document": _cos(doc, ref_doc),
        "f16 query": _cos(half, ref_query),
        "no-Dense query": _cos(bare, ref_bare),
    }
    print("min cos:", ", ".join(f"{k} {v.min():.7f}" for k, v in cos.items()))
    for kind, c in cos.items():
        assert c.min() >= 0.9999, (kind, c.min())
    # The bar discriminates: without the prompt, or without the two projections, it fails;
    # and the local layers' window is narrower than the inputs: widened, it fails too.
    off = {
        "no prompt": _cos(query, st.encode(TEXTS, normalize_embeddings=True)),
        "no Dense": _cos(query, ref_bare),
    }
    st[0].auto_model.config.sliding_window = 4 * MAX_SEQ
    off["no window"] = _cos(query, st.encode(TEXTS, prompt_name="query", normalize_embeddings=True))
    print("references off:", ", ".join(f"{k} {v.min():.4f}" for k, v in off.items()))
    for kind, c in off.items():
        assert c.min() < 0.9999, kind


def test_the_published_config_format_reads_the_same(dirs, module_tmp):
    import gguf

    # EmbeddingGemma's own config.json predates rope_parameters: top-level thetas, a null
    # rope_scaling, and no layer_types (transformers' every-sixth-layer rule then applies).
    old = _copy(dirs["st"], module_tmp / "gemma-old-config")
    config = json.loads((old / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        del config[key]
    config |= {
        "rope_theta": 500_000.0,
        "rope_local_base_freq": 20_000.0,
        "rope_scaling": None,
        "num_hidden_layers": 4,
        "sliding_window_pattern": 2,
    }
    (old / "config.json").write_text(json.dumps(config))
    out = module_tmp / "old.gguf"
    convert_hf_dir(old, out, "f16")
    fields = gguf.GGUFReader(str(out)).fields
    arch = "gemma-embedding"
    assert fields[f"{arch}.rope.freq_base"].contents() == 500_000.0
    assert fields[f"{arch}.rope.freq_base_swa"].contents() == 20_000.0
    assert fields[f"{arch}.attention.sliding_window_pattern"].contents() == [
        True,
        False,
        True,
        False,
    ]
    (old / "config.json").write_text(
        json.dumps(config | {"rope_scaling": {"type": "linear", "factor": 8.0}})
    )
    with pytest.raises(ArtifactInvalid, match="'linear' for full_attention layers"):
        convert_hf_dir(old, out, "f16")


def test_what_the_converter_refuses(dirs, module_tmp):
    out = module_tmp / "bad.gguf"
    cases = [
        ("config.json", {"use_bidirectional_attention": False}, "causal Gemma 3 is a decoder"),
        ("config.json", {"attn_logit_softcapping": 50.0}, "does not cap attention logits"),
        ("config.json", {"query_pre_attn_scalar": 64}, "scales queries by 1/sqrt"),
        ("config.json", {"hidden_activation": "gelu"}, "tanh-approximated GELU"),
        ("config.json", {"attention_bias": True}, "no attention biases"),
        ("config.json", {"layer_types": ["sliding_attention"] * 4}, "needs both local and"),
        ("config.json", {"architectures": ["Gemma3ForCausalLM"]}, "only Gemma3TextModel"),
        (
            "config.json",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "only unscaled RoPE",
        ),
        ("2_Dense/config.json", {"bias": True}, "a Dense with a bias"),
        (
            "3_Dense/config.json",
            {"activation_function": "torch.nn.modules.activation.Tanh"},
            "Dense activation",
        ),
        ("1_Pooling/config.json", {"include_prompt": False}, "excludes the prompt"),
    ]
    for i, (file, change, reason) in enumerate(cases):
        bad = _copy(dirs["st"], module_tmp / f"gemma-bad-{i}")
        _edit(bad / file, **change)
        with pytest.raises(ArtifactInvalid, match=reason):
            convert_hf_dir(bad, out, "f32")
        assert not out.exists()
    # A projection chain that does not come back to the hidden width.
    bad = _copy(dirs["st"], module_tmp / "gemma-bad-chain")
    modules = json.loads((bad / "modules.json").read_text())
    (bad / "modules.json").write_text(json.dumps([m for m in modules if m["path"] != "3_Dense"]))
    with pytest.raises(ArtifactInvalid, match="Dense modules end 128 wide"):
        convert_hf_dir(bad, out, "f32")


async def test_an_upstream_style_gguf_without_the_causal_key_is_an_encoder(
    store, module_tmp, short_runtime_dir
):
    # llama.cpp's own converter writes no `attention.causal` (its gemma-embedding graph forces
    # bidirectional attention) and no pooling type: the worker must still take it for the
    # encoder it is (mean pooling), not for a decoder to generate with.
    from formats.gguf_header import read_gguf_header
    from tests.gguf_edit import rewrite_gguf
    from workers.llama.config import RuntimeConfig
    from workers.llama.model_kind import decide_kind

    src = store.get("egemma").artifact_path
    bare = rewrite_gguf(
        src,
        module_tmp / "egemma-upstream.gguf",
        drop_kv=("gemma-embedding.attention.causal", "gemma-embedding.pooling_type"),
    )
    assert decide_kind(read_gguf_header(bare), RuntimeConfig()) == ("embed", "mean")
    gguf_store = ArtifactStore(module_tmp / "gguf-models")
    gguf_store.ingest_gguf(
        bare,
        "egemma-gguf",
        prove=prove_gguf_tokenizer,
        pooling="mean",
        max_tokens=MAX_SEQ,
        prompts=PROMPTS,
    )
    async with _module(store, short_runtime_dir) as mod:
        want = (await mod.embed(TEXTS, model="egemma", prompt_name="query")).vectors
    async with _module(gguf_store, short_runtime_dir) as mod:
        got = (await mod.embed(TEXTS, model="egemma-gguf", prompt_name="query")).vectors
    assert _cos(got, want).min() >= 0.99999
