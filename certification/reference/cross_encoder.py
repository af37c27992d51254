"""Build a TEST cross-encoder checkpoint: MiniLM backbone + seeded random pooler and 1-label head.

THIS IS NOT A RELEVANCE MODEL. Its classification head is random: the scores it produces
carry no meaning about whether a document answers a query. It exists so that the rerank path
(tokenized pairs with token types -> encoder -> pooler -> classifier -> one logit per pair)
can be certified for NUMERICAL FIDELITY end to end — the llama.cpp RANK-pooling lane and the
Core ML graph must reproduce `certification.reference.bert.BertReference.score` on it —
without downloading a real reranker (no hub downloads in this project).

Layout written (a standard HF `BertForSequenceClassification` directory):
    config.json         MiniLM's config + architectures/id2label/label2id (num_labels = 1)
    model.safetensors   MiniLM's weights under "bert.", plus bert.pooler.dense.{weight,bias}
                        and classifier.{weight,bias} drawn from a seeded generator
    tokenizer.json, vocab.txt, tokenizer_config.json, special_tokens_map.json (copied)

Head scale: the pooler and the classifier both use the usual fan-in scale, 1/sqrt(hidden),
so `tanh` works in its curved region rather than the linear one; on ordinary sentence pairs
the logits spread with a standard deviation of about 0.17 (checked in
tests/test_reference_bert.py), and dropping the token types moves them by ~0.05 — a lane that
gets token types, the pooler or the head wrong shows up far above the 2e-3 / 5e-3 score
tolerances. (An earlier 6x-amplified classifier made llama.cpp's own approximations — tanh
GELU from an fp16 table — visible as ~0.5% of the spread, 9e-3 absolute; the relative error
is the same at either scale, the absolute tolerance is what the rerank gate fixes.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from formats.hf_config import HfConfig
from formats.safetensors_io import read_safetensors

# Tests and benches take the default package's directory from here.
from ingest.model_packages import minilm_dir

_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def build_test_cross_encoder(
    out_dir: str | Path, seed: int = 0, backbone_dir: str | Path | None = None
) -> Path:
    """Write the test cross-encoder into `out_dir` (created if needed) and return it."""
    src = Path(backbone_dir) if backbone_dir is not None else minilm_dir()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    base = read_safetensors(src / "model.safetensors")
    # `position_ids` is a buffer, not a weight: modern checkpoints omit it.
    weights = {
        f"bert.{k}": np.ascontiguousarray(v)
        for k, v in base.items()
        if not k.endswith("position_ids") and not k.startswith("pooler.")
    }
    hidden = base["embeddings.word_embeddings.weight"].shape[1]
    rng = np.random.default_rng(seed)
    fan_in = 1.0 / np.sqrt(hidden)
    weights["bert.pooler.dense.weight"] = _normal(rng, (hidden, hidden), fan_in)
    weights["bert.pooler.dense.bias"] = _normal(rng, (hidden,), 0.1)
    weights["classifier.weight"] = _normal(rng, (1, hidden), fan_in)
    weights["classifier.bias"] = _normal(rng, (1,), 0.1)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = HfConfig.read(src).as_dict()
    config.update(
        architectures=["BertForSequenceClassification"],
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        synapse_note=(
            "TEST cross-encoder: MiniLM backbone with a seeded random head "
            f"(seed={seed}). NOT a relevance model; for numerical-fidelity certification only."
        ),
    )
    config.pop("_name_or_path", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)
