"""The sparse head's files, which ingest writes and the worker reads: `heads/sparse.json` (a
`SparseHeads` spec) beside `heads/sparse.safetensors` (its weights, f32).

A sparse model answers each side of a search with one head on the engine's token states (or,
for inference-free SPLADE's queries, on the token ids alone):

- `splade`: the checkpoint's masked-LM head (dense -> activation -> LayerNorm -> decoder to
  the vocabulary), then `log1p(relu(.))` (twice for `log1p_relu`), pooled over the tokens by
  `max` or `sum` -- sentence-transformers' `Transformer(fill-mask)` + `SpladePooling`.
  Tensors `dense.weight` (H, H), `dense.bias`, `norm.weight`, `norm.bias`,
  `decoder.weight` (V, H), `decoder.bias` (V).
- `static`: one weight per vocabulary entry, read at each distinct token id of the text
  tokenized without special tokens -- `SparseStaticEmbedding`. Tensor `weight` (V,).
- `token_weights`: bge-m3's lexical weights, `relu(w . h + b)` per token, the largest per
  token id, the tokenizer's cls/eos/pad/unk ids dropped. Tensors `weight` (1, H), `bias` (1,).

Each route's tensors are stored under its `prefix`; routes that share a head share a prefix.
`max_active_dims` (the model's top-k by absolute value, as `SparseEncoder.encode` applies it
to every route's output) is the model's, not a head's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from common.errors import ArtifactInvalid
from formats.safetensors_io import read_safetensors

HEADS_DIR = "heads"
SPARSE_CONFIG = "sparse.json"
SPARSE_WEIGHTS = "sparse.safetensors"
FORMAT_VERSION = 1

HeadKind = Literal["splade", "static", "token_weights"]
Source = Literal["splade", "inference_free_splade", "bge_m3"]
# The kinds whose vector holds one weight per distinct token id of the text, so never more
# entries than the text has tokens (splade's may fill the vocabulary).
PER_TOKEN_HEADS: tuple[HeadKind, ...] = ("static", "token_weights")
# The transformers activations the MLM head's transform may name (`hidden_act`): the erf
# GELU, its tanh approximations (three names of one function), and ReLU.
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")
# The tensors each kind stores under its prefix, with their shapes in (hidden H, vocab V).
TENSORS: dict[str, dict[str, tuple[str, ...]]] = {
    "splade": {
        "dense.weight": ("H", "H"),
        "dense.bias": ("H",),
        "norm.weight": ("H",),
        "norm.bias": ("H",),
        "decoder.weight": ("V", "H"),
        "decoder.bias": ("V",),
    },
    "static": {"weight": ("V",)},
    "token_weights": {"weight": ("1", "H"), "bias": ("1",)},
}


class SparseHeadInvalid(ArtifactInvalid):
    """A sparse head's files are missing, unreadable, or do not match their spec."""


class HeadSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: HeadKind
    prefix: str
    vocab_size: int
    hidden_size: int = 0  # 0: the head reads no token states (static)
    # splade only
    pooling: Literal["max", "sum"] = "max"
    activation: Literal["relu", "log1p_relu"] = "relu"
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    # token_weights only: the ids whose weights are dropped (cls, eos, pad, unk)
    dropped_ids: tuple[int, ...] = ()
    # How the route tokenizes: False for a static route (it sees the text's own tokens only).
    add_special_tokens: bool = True


class SparseHeads(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    source: Source
    # "query" and "document" always; a symmetric model's two routes are one head.
    routes: dict[str, HeadSpec]
    # The route a request that names no side takes (the Router's default; None: it must name
    # one, as sentence-transformers then refuses).
    default_route: str | None = "document"
    max_active_dims: int | None = None


def head_dir(out_dir: Path) -> Path:
    return Path(out_dir) / HEADS_DIR


def write_spec(directory: Path, spec: SparseHeads) -> Path:
    path = Path(directory) / SPARSE_CONFIG
    path.write_bytes(msgspec.json.format(msgspec.json.encode(spec), indent=2))
    return path


def read_spec(directory: Path) -> SparseHeads:
    path = Path(directory) / SPARSE_CONFIG
    try:
        spec = msgspec.json.decode(path.read_bytes(), type=SparseHeads)
    except OSError as e:
        raise SparseHeadInvalid(f"cannot read {path}: {e}") from e
    except msgspec.DecodeError as e:  # ValidationError is one
        raise SparseHeadInvalid(f"{path}: {e}") from e
    if spec.format != FORMAT_VERSION:
        raise SparseHeadInvalid(f"{path}: format {spec.format}, this reader reads {FORMAT_VERSION}")
    if set(spec.routes) != {"query", "document"}:
        raise SparseHeadInvalid(f"{path}: routes {sorted(spec.routes)}, not query and document")
    if spec.default_route is not None and spec.default_route not in spec.routes:
        raise SparseHeadInvalid(f"{path}: default route {spec.default_route!r} is not a route")
    if spec.max_active_dims is not None and spec.max_active_dims <= 0:
        raise SparseHeadInvalid(f"{path}: max_active_dims must be positive")
    by_prefix: dict[str, HeadSpec] = {}
    for name, head in spec.routes.items():
        if by_prefix.setdefault(head.prefix, head) != head:
            raise SparseHeadInvalid(f"{path}: two different heads share prefix {head.prefix!r}")
        if head.vocab_size <= 0 or head.hidden_size < 0:
            raise SparseHeadInvalid(f"{path}: route {name}: sizes must be positive")
        if head.kind != "static" and head.hidden_size <= 0:
            raise SparseHeadInvalid(f"{path}: route {name}: a {head.kind} head needs hidden_size")
        if head.hidden_act not in HIDDEN_ACTS:
            raise SparseHeadInvalid(f"{path}: route {name}: hidden_act {head.hidden_act!r}")
        if any(not 0 <= i < head.vocab_size for i in head.dropped_ids):
            raise SparseHeadInvalid(f"{path}: route {name}: a dropped id is outside the vocabulary")
    return spec


def read_tensors(directory: Path, spec: SparseHeads) -> dict[str, dict[str, np.ndarray]]:
    """Each distinct prefix's tensors (f32, views of the file's map), every one present with
    the shape its spec implies; nothing else may be in the file."""
    path = Path(directory) / SPARSE_WEIGHTS
    tensors = read_safetensors(path)
    out: dict[str, dict[str, np.ndarray]] = {}
    expected: set[str] = set()
    for head in spec.routes.values():
        dims = {"H": head.hidden_size, "V": head.vocab_size, "1": 1}
        group = out.setdefault(head.prefix, {})
        for name, shape in TENSORS[head.kind].items():
            key = head.prefix + name
            expected.add(key)
            arr = tensors.get(key)
            want = tuple(dims[d] for d in shape)
            if arr is None:
                raise SparseHeadInvalid(f"{path}: tensor {key!r} is missing")
            if arr.dtype != np.float32 or arr.shape != want:
                raise SparseHeadInvalid(
                    f"{path}: tensor {key!r} is {arr.dtype}{list(arr.shape)}, "
                    f"expected float32{list(want)}"
                )
            group[name] = arr
    extra = sorted(tensors.keys() - expected)
    if extra:
        raise SparseHeadInvalid(f"{path}: unexpected tensor {extra[0]!r}")
    return out
