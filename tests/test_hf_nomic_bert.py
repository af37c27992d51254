"""NomicBERT directories (nomic-embed-text v1 / v1.5) converted by `ingest.hf_nomic_bert`,
served by a real llama.cpp worker and judged against sentence-transformers on the same
directory (transformers' own `NomicBertModel` underneath).

The model is built here: a tiny random NomicBERT with MiniLM's WordPiece vocabulary, nomic's
query/document prompts, and weights drawn wide (initializer_range 0.3) so that a cosine bar of
0.9999 tells a faithful conversion from a near miss. The same weights are also written as the
Hub's checkpoints have them (nomic's original tensor names and config keys beside
transformers'), which must convert to the very same GGUF.
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
from ingest.model_packages import minilm_dir
from ingest.store import ArtifactStore

pytestmark = pytest.mark.model

HIDDEN = 64
LAYERS = 2
MAX_SEQ = 64
TEXTS = [sanitize(t) for t in list(corpus())[::11]]
PROMPTS = {"query": "search_query: ", "document": "search_document: "}
BAR = 0.9999
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
# nomic's own keys for the same model, as the Hub's config.json carries them.
_NOMIC_KEYS = {
    "n_embd": HIDDEN,
    "n_layer": LAYERS,
    "n_head": 4,
    "n_inner": 96,
    "n_positions": 8192,
    "max_trained_positions": 2048,
    "layer_norm_epsilon": 1e-12,
    "rotary_emb_base": 1000,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "activation_function": "swiglu",
    "prenorm": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "causal": False,
}
# transformers' in-memory names <- nomic's original ones (transformers' conversion mapping).
_ORIGINAL = (
    ("layers.", "encoder.layers."),
    ("embeddings.LayerNorm", "emb_ln"),
    ("self_attn.o_proj", "attn.out_proj"),
    ("mlp.up_proj", "mlp.fc11"),
    ("mlp.gate_proj", "mlp.fc12"),
    ("mlp.down_proj", "mlp.fc2"),
    ("post_attention_layernorm", "norm1"),
    ("post_mlp_layernorm", "norm2"),
)


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    import torch
    from safetensors.numpy import load_file, save_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import NomicBertConfig, NomicBertModel

    out = {"hf": module_tmp / "hf", "st": module_tmp / "st", "orig": module_tmp / "orig"}
    out["hf"].mkdir()
    for name in _TOKENIZER_FILES:
        shutil.copy(minilm_dir() / name, out["hf"] / name)
    torch.manual_seed(0)
    config = NomicBertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=2048,
        initializer_range=0.3,
    )
    NomicBertModel(config).eval().save_pretrained(out["hf"])
    st = SentenceTransformer(
        modules=[
            Transformer(str(out["hf"]), max_seq_length=MAX_SEQ),
            Pooling(HIDDEN, "mean"),
            Normalize(),
        ],
        prompts=PROMPTS,
    )
    st.save(str(out["st"]))

    # transformers saves nomic's original tensor names (fused Wqkv, fc11/fc12/fc2, norm1/2,
    # emb_ln); the Hub's config adds nomic's own keys beside transformers'.
    shutil.copytree(out["st"], out["orig"])
    cfg = json.loads((out["st"] / "config.json").read_text())
    (out["orig"] / "config.json").write_text(json.dumps(cfg | _NOMIC_KEYS))
    # The same weights under transformers' in-memory names (separate q/k/v projections).
    out["native"] = module_tmp / "native"
    shutil.copytree(out["st"], out["native"])
    weights = load_file(str(out["st"] / "model.safetensors"))
    assert "encoder.layers.0.attn.Wqkv.weight" in weights
    renamed: dict[str, np.ndarray] = {}
    for key, arr in weights.items():
        if key.endswith("attn.Wqkv.weight"):
            stem = key.removesuffix("attn.Wqkv.weight").replace("encoder.layers.", "layers.")
            for p, part in zip("qkv", np.split(arr, 3, axis=0), strict=True):
                renamed[f"{stem}self_attn.{p}_proj.weight"] = part
            continue
        for theirs, original in _ORIGINAL:
            key = key.replace(original, theirs)
        renamed[key] = arr
    (out["native"] / "model.safetensors").unlink()
    save_file(renamed, str(out["native"] / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def store(module_tmp, dirs) -> ArtifactStore:
    from certification.tokenizer_proof import prove_gguf_tokenizer
    from tests.llama_converter import Job, convert

    s = ArtifactStore(module_tmp / "models")
    s.ingest_hf_dir(dirs["st"], "nomic", dtype="f32")
    # What a user's GGUF of the Hub checkpoint is: llama.cpp's own converter of the Hub layout.
    gguf = module_tmp / "llama-converted.gguf"
    convert([Job(str(dirs["orig"]), str(gguf), "f32")])
    # A GGUF does not say where sentence-transformers truncates: the ingest states it.
    s.ingest_gguf(
        gguf, name="nomic-gguf", prove=prove_gguf_tokenizer, prompts=PROMPTS, max_tokens=MAX_SEQ
    )
    return s


@pytest.fixture(scope="module")
def lane(store) -> dict:
    async def serve(runtime_dir: str) -> dict:
        cfg = ModuleConfig(
            store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
        )
        async with Module(cfg) as mod:
            got = {
                name: (await mod.embed(TEXTS, model="nomic", prompt_name=name)).vectors
                for name in PROMPTS
            }
            got["gguf"] = (await mod.embed(TEXTS, model="nomic-gguf", prompt_name="query")).vectors
            return got

    runtime_dir = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    try:
        return asyncio.run(serve(runtime_dir))
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _same_tokens(st_dir: Path, tokenizer_json: Path | None) -> list[bool]:
    """Per text: whether the GGUF's derived tokenizer gives the ids transformers' does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    assert tokenizer_json is not None
    theirs = AutoTokenizer.from_pretrained(st_dir)
    ours = Tokenizer.from_file(str(tokenizer_json))
    queried = [PROMPTS["query"] + t for t in TEXTS]
    want = theirs(queried, truncation=True, max_length=MAX_SEQ)["input_ids"]
    got = [e.ids[:MAX_SEQ] for e in ours.encode_batch(queried)]
    return [w[:-1] == g[: len(w) - 1] for w, g in zip(want, got, strict=True)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_gguf_is_llama_cpps_nomic_bert(store):
    from ingest.store import gguf_metadata

    meta = gguf_metadata(store.get("nomic").artifact_path)
    assert meta["architecture"] == "nomic-bert"
    assert meta["rope.freq_base"] == 1000.0 and meta["attention.causal"] is False
    rec = store.get("nomic").manifest
    assert (rec.kind, rec.pooling, rec.dims, rec.n_ctx_train) == ("embed", "mean", HIDDEN, 2048)
    assert rec.prompts == PROMPTS


def test_embeddings_match_sentence_transformers_with_each_prompt(lane, dirs, store):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(dirs["st"]), device="cpu")
    for name in PROMPTS:
        want = model.encode(TEXTS, prompt_name=name, normalize_embeddings=True)
        cos = _cosines(lane[name], want)
        print(f"{name}: min cosine vs sentence-transformers {cos.min():.7f}")
        assert cos.min() >= BAR, (name, float(cos.min()))
    # llama.cpp's converter's GGUF: its tokenizer is llama.cpp's WordPiece (proven at ingest),
    # which keeps combining marks BERT's uncased tokenizer strips (Bengali vowel signs, ...).
    # Where the two tokenize alike the vectors must be the model's; the rest is tokenization.
    same = _same_tokens(dirs["st"], store.get("nomic-gguf").tokenizer_path)
    assert sum(same) >= 0.8 * len(TEXTS), same
    cos = _cosines(lane["gguf"], model.encode(TEXTS, prompt_name="query"))[same]
    print(f"llama.cpp's converter's GGUF: min cosine {cos.min():.7f} on {sum(same)} texts")
    assert cos.min() >= BAR, float(cos.min())
    # The prompt is part of what is compared: without it the vectors differ.
    bare = model.encode(TEXTS, normalize_embeddings=True)
    assert _cosines(lane["query"], bare).min() < BAR


def test_the_hubs_layout_converts_to_the_same_file(dirs, tmp_path):
    # Either tensor naming and either key set: the same model, byte for byte.
    convert_hf_dir(dirs["st"], tmp_path / "theirs.gguf", "f32", name="m")
    convert_hf_dir(dirs["orig"], tmp_path / "orig.gguf", "f32", name="m")
    convert_hf_dir(dirs["native"], tmp_path / "native.gguf", "f32", name="m")
    assert (tmp_path / "theirs.gguf").read_bytes() == (tmp_path / "orig.gguf").read_bytes()
    assert (tmp_path / "native.gguf").read_bytes() == (tmp_path / "orig.gguf").read_bytes()
    # nomic's keys alone (no transformers sizes) read the same.
    cfg = json.loads((dirs["orig"] / "config.json").read_text())
    only = {k: v for k, v in cfg.items() if k not in ("hidden_size", "num_hidden_layers")}
    alone = tmp_path / "alone"
    shutil.copytree(dirs["orig"], alone)
    (alone / "config.json").write_text(json.dumps(only))
    convert_hf_dir(alone, tmp_path / "alone.gguf", "f32", name="m")
    assert (tmp_path / "alone.gguf").read_bytes() == (tmp_path / "orig.gguf").read_bytes()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"n_embd": HIDDEN * 2}, "hidden size is 64 by transformers' keys and 128 by nomic's"),
        ({"rotary_emb_base": 10_000}, "rotary base"),
        ({"n_positions": 2048, "max_trained_positions": 512}, "context"),
        ({"prenorm": True}, "prenorm"),
        ({"rotary_emb_fraction": 0.5}, "rotary_emb_fraction"),
        ({"qkv_proj_bias": True}, "qkv_proj_bias"),
        ({"moe_every_n_layers": 2}, "mixture-of-experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_configs_the_graph_would_compute_differently_are_refused(dirs, tmp_path, change, says):
    d = tmp_path / "d"
    shutil.copytree(dirs["orig"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(ArtifactInvalid, match=says):
        convert_hf_dir(d, tmp_path / "x.gguf", "f32", name="m")
