"""ModernBERT directories converted by `ingest.hf_modernbert`, served by a real llama.cpp
worker and judged against sentence-transformers on the same directories.

The models are built here (nothing downloaded): a tiny random ModernBERT whose global and
local (sliding-window) layers both occur, with a window far shorter than the test texts so
the window changes every long text's vector; a byte-level BPE tokenizer trained on the
certification corpus with BERT's specials; and cross-encoders of both classifier poolings.
The weights are drawn wide (initializer_range 0.3) so that different texts get clearly
different vectors and a cosine bar of 0.9999 tells a faithful conversion from a near miss.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from certification.corpus import corpus
from common.errors import ArtifactInvalid
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.hf_dir import convert_hf_dir
from ingest.store import ArtifactStore

pytestmark = pytest.mark.model

HIDDEN = 64
MAX_SEQ = 128  # sentence-transformers' truncation and the served max_tokens
LOCAL_ATTENTION = 16  # 8 tokens either side on the local layers
TEXTS = [sanitize(t) for t in list(corpus())[::9]]  # every script; long items get truncated
QUERY = "Where do cats like to sleep?"
DOCS = list(corpus())[:30:3]
BAR = 0.9999
IRREGULAR = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        list(corpus()),
        trainers.BpeTrainer(
            vocab_size=800,
            special_tokens=["[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        model_max_length=MAX_SEQ,
    )


def _config(tok, **over):
    from transformers import ModernBertConfig

    ids = {
        k: tok.convert_tokens_to_ids(t)
        for k, t in (("cls", "[CLS]"), ("sep", "[SEP]"), ("pad", "[PAD]"))
    }
    # Layers 0 and 3 global, 1 and 2 local; the two RoPE bases differ, so a swap would show.
    return ModernBertConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        global_attn_every_n_layers=3,
        local_attention=LOCAL_ATTENTION,
        max_position_embeddings=512,
        initializer_range=0.3,
        pad_token_id=ids["pad"],
        cls_token_id=ids["cls"],
        sep_token_id=ids["sep"],
        bos_token_id=ids["cls"],
        eos_token_id=ids["sep"],
        **over,
    )


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )
    from transformers import ModernBertForSequenceClassification, ModernBertModel

    tok = _tokenizer()
    out = {"hf": module_tmp / "hf", "st": module_tmp / "st"}
    torch.manual_seed(0)
    ModernBertModel(_config(tok)).eval().save_pretrained(out["hf"])
    tok.save_pretrained(out["hf"])
    st = SentenceTransformer(
        modules=[Transformer(str(out["hf"])), Pooling(HIDDEN, "mean"), Normalize()]
    )
    st.save(str(out["st"]))
    # Layer types no every-n rule gives (a local layer first): written as one flag per layer.
    out["st-layers"] = _variant(out["st"], module_tmp / "st-layers", {"layer_types": IRREGULAR})
    for pooling in ("cls", "mean"):
        out[f"xenc-{pooling}"] = d = module_tmp / f"xenc-{pooling}"
        torch.manual_seed(1)
        ModernBertForSequenceClassification(
            _config(tok, num_labels=1, classifier_pooling=pooling)
        ).eval().save_pretrained(d)
        tok.save_pretrained(d)
    return out


@pytest.fixture(scope="module")
def store(module_tmp, dirs) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "models")
    s.ingest_hf_dir(dirs["st"], "mbert", dtype="f32")
    s.ingest_hf_dir(dirs["st-layers"], "mbert-layers", dtype="f32")
    for pooling in ("cls", "mean"):
        s.ingest_hf_dir(dirs[f"xenc-{pooling}"], f"mbert-xenc-{pooling}", dtype="f32")
    return s


@pytest.fixture(scope="module")
def lane(store) -> dict:
    """What one real worker serves: the embeddings of TEXTS and both rerankers' scores."""

    async def serve(runtime_dir: str) -> dict:
        cfg = ModuleConfig(
            store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
        )
        async with Module(cfg) as mod:
            got = {
                "embed": (await mod.embed(TEXTS, model="mbert")).vectors,
                "layers": (await mod.embed(TEXTS, model="mbert-layers")).vectors,
            }
            for pooling in ("cls", "mean"):
                result = await mod.rerank(QUERY, DOCS, model=f"mbert-xenc-{pooling}")
                scores = dict(result.results)
                got[pooling] = np.array([scores[i] for i in range(len(DOCS))])
            return got

    runtime_dir = tempfile.mkdtemp(prefix="syn-", dir="/tmp")  # short: socket paths
    try:
        return asyncio.run(serve(runtime_dir))
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _st(path: Path, max_seq: int = MAX_SEQ) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    model.max_seq_length = max_seq
    return model.encode(TEXTS, normalize_embeddings=True)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_gguf_says_what_llama_cpp_reads(store):
    from ingest.store import gguf_metadata

    meta = gguf_metadata(store.get("mbert").artifact_path)
    assert meta["architecture"] == "modern-bert"
    assert (meta["attention.sliding_window"], meta["attention.sliding_window_pattern"]) == (
        LOCAL_ATTENTION,
        3,
    )
    assert (meta["rope.freq_base"], meta["rope.freq_base_swa"]) == (160_000.0, 10_000.0)
    assert meta["attention.causal"] is False and meta["hidden_activation"] == "gelu"
    rec = store.get("mbert").manifest
    assert (rec.kind, rec.pooling, rec.dims, rec.max_tokens, rec.n_ctx_train) == (
        "embed",
        "mean",
        HIDDEN,
        MAX_SEQ,
        512,
    )
    xenc = store.get("mbert-xenc-mean").manifest
    assert (xenc.kind, xenc.pooling, xenc.n_labels) == ("rerank", "rank", 1)
    for pooling, want in (("cls", 2), ("mean", 1)):  # llama.cpp's pooling type ids
        meta = gguf_metadata(store.get(f"mbert-xenc-{pooling}").artifact_path)
        assert meta["classifier.pooling_type"] == want


def test_embeddings_match_sentence_transformers(lane, dirs):
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(dirs["hf"])(TEXTS)["input_ids"]]
    assert max(lengths) > MAX_SEQ  # truncation is exercised
    assert np.median(lengths) > 2 * LOCAL_ATTENTION  # most texts outreach the local window
    cos = _cosines(lane["embed"], _st(dirs["st"]))
    print(f"min cosine vs sentence-transformers: {cos.min():.7f}")
    assert cos.min() >= BAR, float(cos.min())


def test_any_layer_pattern_is_served_as_configured(lane, dirs, store):
    import gguf

    reader = gguf.GGUFReader(str(store.get("mbert-layers").artifact_path))
    flags = reader.fields["modern-bert.attention.sliding_window_pattern"].contents()
    assert flags == [t == "sliding_attention" for t in IRREGULAR]
    cos = _cosines(lane["layers"], _st(dirs["st-layers"]))
    print(f"min cosine, layers {IRREGULAR}: {cos.min():.7f}")
    assert cos.min() >= BAR, float(cos.min())


def test_hub_style_rope_and_layer_keys_convert_the_same(dirs, tmp_path):
    # Hub configs (transformers 4) carry global/local_rope_theta and no layer_types; the
    # transformers 5 spelling of the same model must give the same file, byte for byte.
    thetas = {"full_attention": 80_000.0, "sliding_attention": 20_000.0}
    config = json.loads((dirs["st"] / "config.json").read_text())
    legacy = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    legacy |= {
        "global_rope_theta": thetas["full_attention"],
        "local_rope_theta": thetas["sliding_attention"],
    }
    modern = {
        "rope_parameters": {k: {"rope_type": "default", "rope_theta": v} for k, v in thetas.items()}
    }
    old = _variant(dirs["st"], tmp_path / "legacy", legacy, replace=True)
    new = _variant(dirs["st"], tmp_path / "modern", modern)
    convert_hf_dir(old, tmp_path / "legacy.gguf", "f32", name="m")
    convert_hf_dir(new, tmp_path / "modern.gguf", "f32", name="m")
    assert (tmp_path / "legacy.gguf").read_bytes() == (tmp_path / "modern.gguf").read_bytes()


def test_the_bar_tells_near_misses_apart(lane, dirs, module_tmp):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    # Each is one thing a converter or lane could get wrong; each must fall below the bar.
    cls = SentenceTransformer(
        modules=[Transformer(str(dirs["hf"])), Pooling(HIDDEN, "cls"), Normalize()]
    )
    cls.max_seq_length = MAX_SEQ
    misses = {
        "cls pooling": cls.encode(TEXTS, normalize_embeddings=True),
        "truncated at 64": _st(dirs["st"], max_seq=64),
    }
    for name, edit in (
        ("no sliding window", {"local_attention": 4096}),
        (
            "one RoPE base",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 160_000.0},
                }
            },
        ),
    ):
        variant = module_tmp / f"st-{name.replace(' ', '-')}"
        shutil.copytree(dirs["st"], variant)
        config = json.loads((variant / "config.json").read_text())
        (variant / "config.json").write_text(json.dumps(config | edit))
        misses[name] = _st(variant)
    worst = {name: float(_cosines(lane["embed"], vecs).min()) for name, vecs in misses.items()}
    print(f"min cosine of each near miss: {worst}")
    assert all(c < BAR for c in worst.values()), worst


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_rerank_matches_the_cross_encoder(lane, dirs, pooling):
    import torch
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(dirs[f"xenc-{pooling}"]), device="cpu").predict(
        [(QUERY, d) for d in DOCS], activation_fn=torch.nn.Identity()
    )
    got = lane[pooling]
    print(f"{pooling}: max |logit diff| {np.abs(got - ref).max():.2e}, spread {np.ptp(ref):.3f}")
    assert list(np.argsort(-got)) == list(np.argsort(-ref))
    assert np.abs(got - ref).max() <= 2e-2


def test_a_masked_lm_converts_as_its_encoder(dirs, tmp_path):
    # The MLM head (dense, norm, decoder) is dropped: what remains is the encoder itself.
    from safetensors.numpy import load_file
    from transformers import ModernBertForMaskedLM, ModernBertModel

    encoder = ModernBertModel.from_pretrained(dirs["hf"])
    mlm = ModernBertForMaskedLM(encoder.config)
    mlm.model.load_state_dict(encoder.state_dict())
    mlm.save_pretrained(tmp_path / "mlm")
    saved = load_file(str(tmp_path / "mlm" / "model.safetensors"))
    assert {"head.dense.weight", "head.norm.weight", "decoder.bias"} <= set(saved)
    shutil.copy(dirs["hf"] / "tokenizer.json", tmp_path / "mlm")
    shutil.copy(dirs["hf"] / "tokenizer_config.json", tmp_path / "mlm")
    info = convert_hf_dir(tmp_path / "mlm", tmp_path / "mlm.gguf", "f32", pooling="mean", name="m")
    convert_hf_dir(dirs["hf"], tmp_path / "enc.gguf", "f32", pooling="mean", name="m")
    assert (info.kind, info.pooling) == ("embed", "mean")
    assert (tmp_path / "mlm.gguf").read_bytes() == (tmp_path / "enc.gguf").read_bytes()


def _variant(
    src: Path,
    dst: Path,
    config: dict | None = None,
    tensors: dict | None = None,
    tokenizer=None,
    replace: bool = False,
) -> Path:
    """A copy of `src` with config.json keys changed (or, `replace`, the whole config),
    tensors added or replaced, or tokenizer.json edited in place by `tokenizer`."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = {} if replace else json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(cfg | config))
    if tensors is not None:
        from safetensors.numpy import load_file, save_file

        weights = load_file(str(dst / "model.safetensors"))
        save_file(weights | tensors, str(dst / "model.safetensors"))
    if tokenizer is not None:
        tok = json.loads((dst / "tokenizer.json").read_text())
        tokenizer(tok)
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def _roberta_pairs(tok: dict) -> None:
    pair = tok["post_processor"]["pair"]
    tok["post_processor"]["pair"] = pair[:3] + pair[2:3] + pair[3:]  # [CLS] q [SEP] [SEP] d [SEP]


ONES = np.ones(HIDDEN, np.float32)
REFUSED = {
    "attention bias": ("st", {"attention_bias": True}, None, None, "attention_bias"),
    "norm bias": ("st", {"norm_bias": True}, None, None, "norm_bias"),
    "activation": ("st", {"hidden_activation": "quick_gelu"}, None, None, "hidden_activation"),
    "scaled rope": (
        "st",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 160_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            }
        },
        None,
        None,
        "only unscaled RoPE",
    ),
    "architecture": (
        "st",
        {"architectures": ["ModernBertForTokenClassification"]},
        None,
        None,
        "unsupported ModernBERT architecture",
    ),
    "layer-0 norm": ("st", None, {"layers.0.attn_norm.weight": ONES}, None, "does not compute"),
    "shape": ("st", {"intermediate_size": 48}, None, None, "config.json says"),
    "head activation": (
        "xenc-cls",
        {"classifier_activation": "tanh"},
        None,
        None,
        "classifier_activation",
    ),
    "head bias": ("xenc-cls", {"classifier_bias": True}, None, None, "classifier_bias"),
    "head pooling": ("xenc-mean", {"classifier_pooling": "max"}, None, None, "classifier_pooling"),
    "pair template": ("xenc-cls", None, None, _roberta_pairs, "composes a pair"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_llama_cpp_would_compute_differently_is_refused(case, dirs, tmp_path):
    src, config, tensors, tokenizer, reason = REFUSED[case]
    d = _variant(dirs[src], tmp_path / "model", config, tensors, tokenizer)
    out = tmp_path / "out.gguf"
    with pytest.raises(ArtifactInvalid, match=reason):
        convert_hf_dir(d, out, "f32")
    assert not out.exists()
