"""The multi-vector head's files, as ingest writes them and the worker reads them.

`<model>/heads/multivector.json` (a `MultiVectorSpec`) and `<model>/heads/multivector.safetensors`
(the projection: `dense.<i>.weight` `(out, in)` and, when the layer has one, `dense.<i>.bias`,
f32, applied in order). Its JSON file carries the weights' sha256, so the one digest the
manifest keeps of that file covers both. Both sides import this module, so the two cannot
disagree on a name.

Two kinds, as their references compute them (what each field means is said where it is
declared; `workers.heads.multivector` applies them):

- `colbert`: a sentence-transformers 6 `MultiVectorEncoder` (or a PyLate / Stanford ColBERT
  checkpoint it loads): `Dense` layer(s) on every token state, the side's prompt, query
  expansion, the document skiplist, token-level `Normalize`.
- `bge-m3`: FlagEmbedding's `BGEM3FlagModel` `colbert_vecs`: `colbert_linear` on every token
  state but the first (CLS), normalized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from common.errors import ArtifactInvalid, InvalidRequest
from formats.digest import sha256_file
from formats.safetensors_io import read_safetensors

HEADS_DIR = "heads"
SPEC_FILE = "multivector.json"
WEIGHTS_FILE = "multivector.safetensors"

Kind = Literal["colbert", "bge-m3"]
Side = Literal["query", "document"]
SIDES: tuple[Side, ...] = ("query", "document")
# sentence-transformers `Dense` activations we apply (its `activation_function` names, by the
# last component of `torch.nn...`'s path).
Activation = Literal["identity", "tanh", "relu"]
Similarity = Literal["maxsim", "meanmaxsim"]


class MultiVectorHeadInvalid(ArtifactInvalid):
    """The head's files are missing, unreadable or disagree with each other."""


class Expansion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """sentence-transformers' `QueryExpansionConfig`, resolved against the tokenizer."""

    # "fixed": every query is exactly `length` tokens (cut, or padded with `token_id`);
    # "min": padded up to `length`, longer queries kept (up to `query_length`).
    strategy: Literal["fixed", "min"]
    length: int
    token_id: int  # the tokenizer's mask token unless the checkpoint names one
    # Whether the encoder attends to the expansion positions. False (classic ColBERT): their
    # attention-mask entry is 0, so no position (not even their own) sees them, yet their own
    # states are computed and scored; an engine that cannot hide a token from itself cannot
    # serve such queries exactly.
    attend: bool


class Layer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    in_features: int
    out_features: int
    bias: bool
    activation: Activation = "identity"


class MultiVectorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Kind
    weights_sha256: str  # of multivector.safetensors beside it
    hidden: int  # the encoder's hidden size: the width of the states the head reads
    dim: int  # the width of each output vector
    layers: list[Layer]
    normalize: bool  # L2 per vector (torch's F.normalize, eps 1e-12)
    # bge-m3: the first token's (CLS) vector is not returned.
    drop_first: bool = False
    # The text each side's input is prefixed with, as sentence-transformers prepends prompts
    # ("" for none), and its tokens alone (no special tokens).
    query_prompt: str = ""
    document_prompt: str = ""
    query_prefix_ids: list[int] = []
    document_prefix_ids: list[int] = []
    # Whether inserting the prefix ids after the leading special token(s) gives the same ids as
    # tokenizing prompt + text (proved at ingest on probe texts); if not, the prompt must be
    # prepended as text before tokenizing.
    prefix_insertable: bool = True
    # The tokenizer's special tokens around a single text: how many lead and close it.
    leading_specials: int = 1
    closing_specials: int = 1
    # Per-side token caps of the reference (sentence-transformers' query_length /
    # document_length); None: the model's own limit, applied by the host.
    query_length: int | None = None
    document_length: int | None = None
    expansion: Expansion | None = None
    # Token ids whose vectors are dropped, on the sides named (documents only by default).
    skiplist_ids: list[int] = []
    skiplist_sides: list[Side] = msgspec.field(default_factory=lambda: ["document"])
    # What the reference's own similarity computes (`MultiVectorEncoder.similarity_fn_name`;
    # bge-m3's `colbert_score` divides by the query's vector count).
    reference_similarity: Similarity = "maxsim"


def spec_path(head_dir: Path) -> Path:
    return Path(head_dir) / SPEC_FILE


def weights_path(head_dir: Path) -> Path:
    return Path(head_dir) / WEIGHTS_FILE


def encode_spec(spec: MultiVectorSpec) -> bytes:
    return json.dumps(msgspec.to_builtins(spec), indent=2, sort_keys=True).encode() + b"\n"


def read_head(head: Path) -> tuple[MultiVectorSpec, list[tuple[np.ndarray, np.ndarray | None]]]:
    """The head's spec and each layer's (weight (out, in), bias or None) as f32, from the heads
    directory or its spec file, checked against each other: weights whose sha256 is not the
    one its spec names, or a layer chain that does not lead from `hidden` to `dim`, are
    refused."""
    head_dir = Path(head).parent if Path(head).name == SPEC_FILE else Path(head)
    path = spec_path(head_dir)
    try:
        spec = msgspec.json.decode(path.read_bytes(), type=MultiVectorSpec)
    except FileNotFoundError as e:
        raise MultiVectorHeadInvalid(f"{path}: no such file") from e
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MultiVectorHeadInvalid(f"{path}: {e}") from e
    weights = weights_path(head_dir)
    try:
        digest = sha256_file(weights)
    except OSError as e:
        raise MultiVectorHeadInvalid(f"{weights}: {e}") from e
    if digest != spec.weights_sha256:
        raise MultiVectorHeadInvalid(f"{weights}: sha256 {digest} is not the one its spec names")
    tensors = read_safetensors(weights)
    layers: list[tuple[np.ndarray, np.ndarray | None]] = []
    width = spec.hidden
    for i, layer in enumerate(spec.layers):
        w = tensors.get(f"dense.{i}.weight")
        b = tensors.get(f"dense.{i}.bias")
        if w is None or w.shape != (layer.out_features, layer.in_features):
            raise MultiVectorHeadInvalid(
                f"{weights_path(head_dir)}: dense.{i}.weight is not "
                f"({layer.out_features}, {layer.in_features})"
            )
        if layer.in_features != width:
            raise MultiVectorHeadInvalid(
                f"{path}: layer {i} reads {layer.in_features}, not {width}"
            )
        if (b is not None) != layer.bias or (b is not None and b.shape != (layer.out_features,)):
            raise MultiVectorHeadInvalid(f"{weights_path(head_dir)}: dense.{i}.bias")
        layers.append((np.asarray(w, np.float32), None if b is None else np.asarray(b, np.float32)))
        width = layer.out_features
    if width != spec.dim:
        raise MultiVectorHeadInvalid(
            f"{path}: the layers give {width} dims, its spec says {spec.dim}"
        )
    return spec, layers


# ---- scores: one definition for the host's rerank and the tests ----------------------------

EMPTY_DOCUMENT_SCORE = -1e9  # sentence-transformers' MaxSim of a document with no vector


def _check_pair(query: np.ndarray, document: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, d = np.asarray(query, np.float32), np.asarray(document, np.float32)
    if q.ndim != 2 or d.ndim != 2 or q.shape[1] != d.shape[1]:
        raise InvalidRequest(f"MaxSim of {q.shape} and {d.shape} vectors")
    return q, d


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """sum over query vectors of max over document vectors of the dot product: the raw MaxSim
    that rerank returns (not divided, no sigmoid). A document with no vector scores
    `EMPTY_DOCUMENT_SCORE`, as sentence-transformers scores it; an empty query 0."""
    q, d = _check_pair(query, document)
    if d.shape[0] == 0:
        return EMPTY_DOCUMENT_SCORE
    if q.shape[0] == 0:
        return 0.0
    return float((q @ d.T).max(axis=1).astype(np.float64).sum())


def mean_maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """MaxSim divided by the number of query vectors: sentence-transformers' `meanmaxsim` and
    bge-m3's `colbert_score`. Not what rerank returns."""
    q, _ = _check_pair(query, document)
    return maxsim(query, document) / q.shape[0] if q.shape[0] else 0.0
