"""jina-embeddings-v3 directories converted by `ingest.hf_jina_v3` to llama.cpp's jina-bert-v3,
served by a real llama.cpp worker and judged against transformers' own `JinaEmbeddingsV3Model`.

The model is built here: a tiny seeded JinaEmbeddingsV3Model (wide weights, initializer 0.3)
over a sentencepiece-trained Unigram vocabulary, written twice: as transformers saves it (no
adapters), and as the Hub's checkpoint is laid out (model_type xlm-roberta, weights under
`roberta.`, every Linear and Embedding weight a torch parametrization with one seeded LoRA pair
per task, `task_instructions`, `matryoshka_dimensions`). The reference for a task is
transformers' model with that task's pair merged into its weights in torch, as the checkpoint's
own parametrization applies it (Linear: W + B@A * alpha/rank; Embedding: W + A@B * alpha/rank),
fed the task's instruction before each text.
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
from common.errors import ArtifactInvalid, InvalidRequest
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.store import ArtifactStore
from tests.test_gguf_converted import hub_xlmr_tokenizer

pytestmark = pytest.mark.model

HIDDEN = 64
MAX_SEQ = 48
RANK, ALPHA = 4, 2.0
TASKS = ["retrieval.query", "retrieval.passage", "text-matching"]
INSTRUCTIONS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "text-matching": "",
}
TEXTS = [sanitize(t) for t in list(corpus())[::13]]
BAR = 0.9999
_LORA_LINEAR = ("mixer.Wqkv", "mixer.out_proj", "mlp.fc1", "mlp.fc2", "pooler.dense")
_LORA_EMBED = ("embeddings.word_embeddings", "embeddings.token_type_embeddings")


def _config(n_vocab: int):
    from transformers import JinaEmbeddingsV3Config

    return JinaEmbeddingsV3Config(
        vocab_size=n_vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.3,
    )


def _lora(weights: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One seeded LoRA pair per task for every Linear and Embedding weight, shaped as the
    checkpoint's parametrization stores them (wide: each task changes the vectors)."""
    rng = np.random.default_rng(7)
    out = {}
    for key, w in sorted(weights.items()):
        stem = key.removesuffix(".weight")
        if not key.endswith(".weight") or not stem.endswith(_LORA_LINEAR + _LORA_EMBED):
            continue
        if stem.endswith(_LORA_EMBED):  # A: rows x rank, B: rank x width
            a = rng.normal(0, 0.5, (len(TASKS), w.shape[0], RANK))
            b = rng.normal(0, 0.5, (len(TASKS), RANK, w.shape[1]))
        else:  # A: rank x in, B: out x rank
            a = rng.normal(0, 0.5, (len(TASKS), RANK, w.shape[1]))
            b = rng.normal(0, 0.5, (len(TASKS), w.shape[0], RANK))
        out[stem] = (a.astype(np.float32), b.astype(np.float32))
    return out


def _st_modules(d: Path) -> None:
    """The sentence-transformers modules the Hub's checkpoint lists: mean pooling, normalize."""
    (d / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "custom_st.Transformer"},
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": HIDDEN, "pooling_mode_mean_tokens": True})
    )
    (d / "2_Normalize").mkdir()


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict:
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import JinaEmbeddingsV3Model

    hf, hub = module_tmp / "hf", module_tmp / "hub"
    n_vocab = hub_xlmr_tokenizer(hf, MAX_SEQ)  # with the .model file llama.cpp's converter reads
    torch.manual_seed(0)
    JinaEmbeddingsV3Model(_config(n_vocab)).eval().save_pretrained(hf)
    _st_modules(hf)
    weights = load_file(str(hf / "model.safetensors"))
    lora = _lora(weights)
    shutil.copytree(hf, hub)
    hub_weights: dict[str, np.ndarray] = {}
    for key, arr in weights.items():
        stem = key.removesuffix(".weight")
        if stem in lora:
            p = f"roberta.{stem}.parametrizations.weight"
            hub_weights[f"{p}.original"] = arr
            hub_weights[f"{p}.0.lora_A"], hub_weights[f"{p}.0.lora_B"] = lora[stem]
        else:
            hub_weights[f"roberta.{key}"] = arr
    (hub / "model.safetensors").unlink()
    save_file(hub_weights, str(hub / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config |= {
        "model_type": "xlm-roberta",
        "architectures": ["XLMRobertaModel"],
        "position_embedding_type": "rotary",
        "rotary_emb_base": theta,
        "lora_adaptations": TASKS,
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "task_instructions": INSTRUCTIONS,
        "matryoshka_dimensions": [16, 32, 64],
    }
    (hub / "config.json").write_text(json.dumps(config))
    return {"hf": hf, "hub": hub, "lora": lora}


def _reference(dirs: dict, task: str | None) -> np.ndarray:
    """transformers' JinaEmbeddingsV3Model, `task`'s pair merged in torch, the instruction
    before each text, mean-pooled over the mask and normalized."""
    import torch
    from transformers import AutoTokenizer, JinaEmbeddingsV3Model

    model = JinaEmbeddingsV3Model.from_pretrained(dirs["hf"]).eval()
    prefix = ""
    if task is not None:
        t = TASKS.index(task)
        modules = dict(model.named_modules())
        renamed = {
            "emb_ln": "embeddings.LayerNorm",
            "encoder.layers.": "layers.",
            "mixer.Wqkv": "self_attn.qkv",
            "mixer.out_proj": "self_attn.o_proj",
        }
        with torch.no_grad():
            for stem, (a, b) in dirs["lora"].items():
                a_t, b_t = torch.from_numpy(a[t]).double(), torch.from_numpy(b[t]).double()
                delta = (a_t @ b_t) if stem.endswith(_LORA_EMBED) else (b_t @ a_t)
                delta = (delta * ALPHA / RANK).float()
                if stem.endswith("mixer.Wqkv"):  # transformers splits the fused projection
                    layer = modules[
                        stem.replace("encoder.layers.", "layers.").replace(
                            ".mixer.Wqkv", ".self_attn"
                        )
                    ]
                    for proj, part in zip(
                        ("q_proj", "k_proj", "v_proj"), delta.chunk(3, dim=0), strict=True
                    ):
                        getattr(layer, proj).weight += part
                    continue
                name = stem
                for theirs, ours in renamed.items():
                    name = name.replace(theirs, ours)
                modules[name].weight += delta
        prefix = INSTRUCTIONS[task]
    tok = AutoTokenizer.from_pretrained(dirs["hf"])
    enc = tok(
        [prefix + t for t in TEXTS],
        truncation=True,
        max_length=MAX_SEQ,
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    v = ((h * mask).sum(1) / mask.sum(1)).numpy()
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def served(module_tmp, dirs) -> dict:
    store = ArtifactStore(module_tmp / "models")
    store.ingest_hf_dir(
        dirs["hub"], "jina-query", dtype="f32", default_prompt_name="retrieval.query"
    )
    store.ingest_hf_dir(dirs["hf"], "jina-hf", dtype="f32")
    # llama.cpp's own converter of the Hub layout: the base model, each task's adapter apart.
    from certification.tokenizer_proof import prove_gguf_tokenizer
    from tests.llama_converter import Job, convert

    gguf = module_tmp / "llama" / "jina.gguf"
    gguf.parent.mkdir()
    convert([Job(str(dirs["hub"]), str(gguf), "f32")])
    store.ingest_gguf(gguf, name="jina-gguf", prove=prove_gguf_tokenizer, max_tokens=MAX_SEQ)

    async def serve(runtime_dir: str) -> dict:
        cfg = ModuleConfig(
            store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
        )
        async with Module(cfg) as mod:
            return {
                "query": (await mod.embed(TEXTS, model="jina-query")).vectors,
                "hf": (await mod.embed(TEXTS, model="jina-hf")).vectors,
                "gguf": (await mod.embed(TEXTS, model="jina-gguf")).vectors,
            }

    runtime_dir = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    try:
        return {"store": store, "gguf_path": gguf, **asyncio.run(serve(runtime_dir))}
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_manifest_serves_the_chosen_task_alone(served):
    from ingest.store import gguf_metadata

    rec = served["store"].get("jina-query")
    assert gguf_metadata(rec.artifact_path)["architecture"] == "jina-bert-v3"
    man = rec.manifest
    assert man.prompts == {"retrieval.query": INSTRUCTIONS["retrieval.query"]}
    assert man.default_prompt_name == "retrieval.query"
    assert man.matryoshka_dims == [64, 32, 16]  # config.json's matryoshka_dimensions
    assert (man.kind, man.pooling, man.dims) == ("embed", "mean", HIDDEN)


def test_a_task_merged_at_ingest_embeds_like_transformers_with_that_adapter(served, dirs):
    want = _reference(dirs, "retrieval.query")
    got = _cos(served["query"], want)
    print(f"min cos: query task {got.min():.7f}")
    assert got.min() >= BAR, got.min()
    # The bar discriminates: another task's adapter, or none, each fail it.
    assert _cos(served["query"], _reference(dirs, "retrieval.passage")).min() < BAR
    assert _cos(served["query"], _reference(dirs, None)).min() < BAR


def test_transformers_own_directory_and_llama_cpps_base_gguf_are_the_model_without_adapter(
    served, dirs
):
    base = _reference(dirs, None)
    for name in ("hf", "gguf"):
        assert _cos(served[name], base).min() >= BAR, (name, _cos(served[name], base).min())
    # The same positions both ways: the trained length without XLM-RoBERTa's offset rows.
    store = served["store"]
    assert store.get("jina-hf").manifest.n_ctx_train == store.get("jina-gguf").manifest.n_ctx_train
    # An adapter GGUF llama.cpp's converter writes beside it is no model: refused, named.
    from certification.tokenizer_proof import prove_gguf_tokenizer

    adapter = served["gguf_path"].with_name("lora-retrieval.query-jina.gguf")
    assert adapter.is_file()
    with pytest.raises(ArtifactInvalid, match=r"LoRA adapter \(task retrieval.query\)"):
        store.ingest_gguf(adapter, name="adapter", prove=prove_gguf_tokenizer)


def test_a_checkpoint_with_adapters_needs_a_task(dirs, module_tmp):
    store = ArtifactStore(module_tmp / "refused")
    with pytest.raises(InvalidRequest, match="serves one task per ingest"):
        store.ingest_hf_dir(dirs["hub"], "jina", dtype="f32")
    with pytest.raises(InvalidRequest, match="default prompt 'nope' is not one of"):
        store.ingest_hf_dir(dirs["hub"], "jina", dtype="f32", default_prompt_name="nope")
    assert store.ls() == []
