"""The token-level kinds' tiny seeded models, and a store with them ingested, built once per
test run (tests/session_share.py) for every module that certifies them (one per lane). No
tests here.

    dirs = kinds_dirs(tmp_path_factory)              # name -> HF / sentence-transformers dir
    store = kinds_store(tmp_path_factory, dst_root)  # a private store holding KIND_MODELS

The models are the head tests' own builders (tests.test_sparse_heads,
tests.test_multivector_heads, tests.test_hf_xlmr): an inference-free SPLADE, a bge-m3 in
FlagEmbedding's layout, a ColBERT with prefixes and attended query expansion and its variant
whose expansion is not attended, a mean-pooled XLM-RoBERTa for late chunking. Beside them, a
fault: the bge-m3 with both head files perturbed (what a careless head conversion does), the
checkpoint a served lane is judged against in place of the one it serves.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ingest.store import MANIFEST_FILE
from tests.session_share import build_once

KIND_MODELS = ("ifree", "m3", "colbert", "colbert-unattended", "xlmr")
BAD_HEADS = "m3-bad-heads"
_SUBDIRS = {
    "ifree": "ifree",
    "m3": "m3",
    "colbert": "colbert",
    "colbert-unattended": "unattended",
    "xlmr": "xlmr",
    BAD_HEADS: BAD_HEADS,
}


def perturbed_heads(src: Path, dst: Path) -> Path:
    """bge-m3 with both head files perturbed (seeded noise of a tenth of each weight's
    spread). Every other file is the original."""
    import torch

    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    gen = torch.Generator().manual_seed(7)
    for name in ("sparse_linear.pt", "colbert_linear.pt"):
        state = torch.load(src / name, map_location="cpu", weights_only=True)
        w = state["weight"]
        state["weight"] = w + 0.1 * w.std() * torch.randn(w.shape, generator=gen)
        (dst / name).unlink()
        torch.save(state, dst / name)
    return dst


def xlmr_embedder(root: Path) -> Path:
    """A mean-pooled, normalized XLM-RoBERTa sentence-transformers model (48 tokens)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import XLMRobertaModel

    from tests.test_hf_xlmr import _config as xlmr_config
    from tests.test_hf_xlmr import _unigram_tokenizer

    raw = root / "xlmr-raw"
    n_vocab = _unigram_tokenizer(raw)
    torch.manual_seed(0)
    XLMRobertaModel(xlmr_config(n_vocab)).eval().save_pretrained(raw)
    out = root / "xlmr"
    body = Transformer(str(raw), max_seq_length=48)
    dims = body.get_embedding_dimension()
    SentenceTransformer(modules=[body, Pooling(dims, "mean"), Normalize()], device="cpu").save(
        str(out)
    )
    return out


def _build_models(out: Path) -> None:
    from tests.test_multivector_heads import _body_variant, tiny_bge_m3, tiny_colbert
    from tests.test_sparse_heads import _bert, inference_free_splade

    colbert = tiny_colbert(out)  # out/colbert, its raw BERT in out/bert
    inference_free_splade(out / "ifree", _bert(out / "mlm", 0))
    tiny_bge_m3(out / "m3")
    _body_variant(colbert, out / "unattended", attend=False)
    xlmr_embedder(out)
    perturbed_heads(out / "m3", out / BAD_HEADS)


def kinds_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """KIND_MODELS and BAD_HEADS by name: their directories, built once per test run."""
    root = build_once(tmp_path_factory, "kinds-models", _build_models)
    return {name: root / sub for name, sub in _SUBDIRS.items()}


def kinds_store(tmp_path_factory: pytest.TempPathFactory, dst_root: Path):
    """An `ArtifactStore` at `dst_root` holding KIND_MODELS as ingested once per test run (f32;
    bge-m3 pools its CLS vector: FlagEmbedding's dense output). The files are linked, the
    manifests the module's own."""
    from ingest.store import ArtifactStore

    dirs = kinds_dirs(tmp_path_factory)

    def ingest(out: Path) -> None:
        store = ArtifactStore(out)
        for name in KIND_MODELS:
            pooling = "cls" if name == "m3" else None
            store.ingest_hf_dir(dirs[name], name, dtype="f32", pooling=pooling)

    built = build_once(tmp_path_factory, "kinds-store", ingest)
    for name in KIND_MODELS:
        _link_tree(built / name, dst_root / name)
    return ArtifactStore(dst_root)


def _link_tree(src: Path, dst: Path) -> None:
    """`src` at `dst`: its files hard-linked (subdirectories too: a model's heads), its
    manifest copied (what a module may rewrite)."""

    def link(a: str, b: str) -> None:
        if Path(a).name == MANIFEST_FILE:
            shutil.copy2(a, b)
            return
        try:
            os.link(a, b)
        except OSError:  # another filesystem
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)
