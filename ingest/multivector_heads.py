"""Ingest of multi-vector (late interaction) heads: from a checkpoint directory, the head's
spec and the projection weights the worker's head applies (`formats.multivector_head`),
written under `<out_dir>/heads/`.

Which directories carry one, and where each fact comes from:

- **sentence-transformers 6 `MultiVectorEncoder`** (`config_sentence_transformers.json`
  `model_type: "MultiVectorEncoder"`): `modules.json` lists the backbone `Transformer` (its
  `sentence_bert_config.json` holds `query_length`, `document_length`, `query_expansion`), one
  or more token-level `Dense`, `MultiVectorMask` (`skiplist_words`, `skiplist_tasks`) and a
  token-level `Normalize`; the prefixes are its `prompts` ("query", "document").
- **PyLate <= 3** (`model_type: "ColBERT"`), as sentence-transformers 6 loads it
  (`MultiVectorEncoder._parse_model_config`): `query_prefix` / `document_prefix`,
  `query_length`, `document_length`, `do_query_expansion`, `attend_to_expansion_tokens` and
  `skiplist_words` (punctuation when absent) at the top of `config_sentence_transformers.json`;
  `[Transformer, Dense]` in `modules.json`, the mask and the normalization implied. A prefix
  the tokenizer knows but splits is registered as one special token, as
  `_register_prefix_tokens` does.
- **Stanford-NLP ColBERT** (`config.json` `architectures: ["HF_ColBERT"]`, no
  sentence-transformers model type): `artifact.metadata` and `linear.weight` in the root
  weights, as `MultiVectorEncoder` reads them.
- **bge-m3** (FlagEmbedding's layout): `colbert_linear.pt` (a `torch.save`d `nn.Linear`
  state dict) beside the XLM-RoBERTa checkpoint; read without torch (`formats.torch_pt`).

Tokenizer facts (the prefix's ids, how many special tokens lead and close a text, the skiplist
and expansion token ids) come from the directory's `tokenizer.json` through `tokenizers`, the
library the host tokenizes with. Inserting the prefix ids after the leading special token is
proved equal to tokenizing prompt + text on probe texts, and recorded (`prefix_insertable`).

Refused with a typed error: a directory whose modules we do not apply (token pooling, a
`Router`, an image allowlist, a residual `Dense`, an activation other than identity / tanh /
relu), a malformed config or weight file.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer

from common.errors import ArtifactInvalid
from formats.digest import sha256_file
from formats.hf_config import HfConfig
from formats.multivector_head import (
    HEADS_DIR,
    SIDES,
    SPEC_FILE,
    WEIGHTS_FILE,
    Activation,
    Expansion,
    Kind,
    Layer,
    MultiVectorSpec,
    Similarity,
    encode_spec,
)
from formats.safetensors_io import read_safetensors
from formats.st_layout import module_kind
from formats.torch_pt import read_torch_pt
from ingest.errors import UnsupportedModelType

BGE_M3_COLBERT = "colbert_linear.pt"
# sentence-transformers' Dense activation names (`fullname(module)`) we apply.
_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
}
_ST_KINDS = {"Transformer", "Dense", "MultiVectorMask", "Normalize"}
# Texts the prefix insertion is proved on: words, punctuation, digits, accents, CJK, spaces.
_PROBES = ("hello world", "What is ColBERT?", "  two  spaces", "x", "Ünïcödé 東京 42,5%")


class MultiVectorCheckpointInvalid(ArtifactInvalid):
    """A multi-vector checkpoint's head files are missing, malformed or disagree with the
    encoder (a projection that does not read the hidden size, a bias of the wrong length)."""


class UnsupportedMultiVectorHead(UnsupportedModelType):
    """The directory is a multi-vector model whose head computes something we do not apply
    (its message names what)."""


class MultiVectorHeadInfo(msgspec.Struct, frozen=True):
    """What the manifest records of a model's multi-vector head: its spec file (relative to
    the model's directory) and its sha256, which covers the weights (its spec names their
    digest), and the width of each vector."""

    kind: Kind
    dims: int
    digest: str
    file: str = f"{HEADS_DIR}/{SPEC_FILE}"
    # The query side needs an attention mask llama.cpp cannot express (expansion not attended).
    query_needs_owned_mask: bool = False
    reference_similarity: Similarity = "maxsim"
    # How many more vectors than ids an item can have: the worker inserts a side's prefix ids
    # and pads a query to its expansion length.
    prefix_rows: int = 0
    expansion_rows: int = 0


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise MultiVectorCheckpointInvalid(f"{path}: no such file") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MultiVectorCheckpointInvalid(f"{path}: {e}") from e


def _object(path: Path, missing_ok: bool = True) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    data = _json(path)
    if not isinstance(data, dict):
        raise MultiVectorCheckpointInvalid(f"{path}: expected a JSON object")
    return data


def detect(model_dir: Path) -> Kind | None:
    """Which multi-vector head the directory carries, None when it is no multi-vector model."""
    d = Path(model_dir)
    st_type = _object(d / "config_sentence_transformers.json").get("model_type")
    if st_type in ("MultiVectorEncoder", "ColBERT"):
        return "colbert"
    if (d / BGE_M3_COLBERT).is_file():
        return "bge-m3"
    if st_type is None and "HF_ColBERT" in (_object(d / "config.json").get("architectures") or []):
        return "colbert"  # Stanford-NLP ColBERT, as sentence-transformers loads it
    return None


def ingest_multivector_head(model_dir: Path, out_dir: Path) -> MultiVectorHeadInfo | None:
    """Write `<out_dir>/heads/multivector.{json,safetensors}` for a multi-vector checkpoint;
    None (nothing written) for any other directory."""
    d = Path(model_dir)
    kind = detect(d)
    if kind is None:
        return None
    spec, tensors = _bge_m3(d) if kind == "bge-m3" else _colbert(d)
    heads = Path(out_dir) / HEADS_DIR
    heads.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(heads / WEIGHTS_FILE))
    spec = msgspec.structs.replace(spec, weights_sha256=sha256_file(heads / WEIGHTS_FILE))
    (heads / SPEC_FILE).write_bytes(encode_spec(spec))
    exp = spec.expansion
    return MultiVectorHeadInfo(
        kind=kind,
        dims=spec.dim,
        digest=sha256_file(heads / SPEC_FILE),
        query_needs_owned_mask=exp is not None and not exp.attend,
        reference_similarity=spec.reference_similarity,
        prefix_rows=max(len(spec.query_prefix_ids), len(spec.document_prefix_ids)),
        expansion_rows=exp.length if exp is not None else 0,
    )


# ---- bge-m3 ------------------------------------------------------------------------------


def _bge_m3(d: Path) -> tuple[MultiVectorSpec, dict[str, np.ndarray]]:
    hidden = HfConfig.read(d).positive_int("hidden_size")
    path = d / BGE_M3_COLBERT
    state = read_torch_pt(path)
    if set(state) != {"weight", "bias"}:
        raise MultiVectorCheckpointInvalid(
            f"{path}: expected an nn.Linear state dict (weight, bias), found {sorted(state)}"
        )
    w, b = state["weight"], state["bias"]
    if w.ndim != 2 or w.shape[1] != hidden or b.shape != (w.shape[0],):
        raise MultiVectorCheckpointInvalid(
            f"{path}: weight {w.shape} and bias {b.shape} do not project the hidden size {hidden}"
        )
    dim = int(w.shape[0])
    spec = MultiVectorSpec(
        kind="bge-m3",
        weights_sha256="",  # set once the weights are written
        hidden=hidden,
        dim=dim,
        layers=[Layer(in_features=hidden, out_features=dim, bias=True)],
        normalize=True,  # BGEM3FlagModel's normalize_embeddings default
        drop_first=True,
        # M3Embedder.colbert_score divides by the query's vector count.
        reference_similarity="meanmaxsim",
    )
    return spec, {"dense.0.weight": _f32(w), "dense.0.bias": _f32(b)}


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


# ---- sentence-transformers / PyLate ColBERT ---------------------------------------------


def _modules(d: Path) -> list[tuple[str, Path]]:
    path = d / "modules.json"
    modules = _json(path)
    if not isinstance(modules, list) or not all(
        isinstance(m, dict) and isinstance(m.get("type"), str) for m in modules
    ):
        raise MultiVectorCheckpointInvalid(f"{path}: expected a list of modules with types")
    out = []
    for m in modules:
        kind = module_kind(m["type"])
        if kind not in _ST_KINDS:
            raise UnsupportedMultiVectorHead(f"{path}: module {m['type']} is not applied here")
        out.append((kind, d / str(m.get("path", ""))))
    kinds = [k for k, _ in out]
    if not kinds or kinds[0] != "Transformer" or kinds.count("Transformer") != 1:
        raise UnsupportedMultiVectorHead(f"{path}: expected one Transformer, first")
    if "Dense" not in kinds:
        raise UnsupportedMultiVectorHead(f"{path}: no Dense projection")
    if "Normalize" in kinds and kinds.index("Normalize") < len(kinds) - 1 - kinds[::-1].index(
        "Dense"
    ):
        raise UnsupportedMultiVectorHead(f"{path}: a Normalize before a Dense")
    return out


def _dense(path: Path, width: int) -> tuple[Layer, np.ndarray, np.ndarray | None]:
    cfg = _object(path / "config.json", missing_ok=False)
    if cfg.get("use_residual"):
        raise UnsupportedMultiVectorHead(f"{path}: a residual Dense")
    act_name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    activation = _ACTIVATIONS.get(str(act_name))
    if activation is None:
        raise UnsupportedMultiVectorHead(f"{path}: Dense activation {act_name!r}")
    if cfg.get("module_input_name", "token_embeddings") != "token_embeddings":
        raise UnsupportedMultiVectorHead(f"{path}: a Dense that does not read token embeddings")
    if (path / "model.safetensors").is_file():
        weights = read_safetensors(path / "model.safetensors")
    elif (path / "pytorch_model.bin").is_file():
        weights = read_torch_pt(path / "pytorch_model.bin")
    else:
        raise MultiVectorCheckpointInvalid(f"{path}: no model.safetensors or pytorch_model.bin")
    w = weights.get("linear.weight")
    b = weights.get("linear.bias")
    has_bias = bool(cfg.get("bias", True))
    if w is None or w.ndim != 2 or w.shape[1] != width:
        shape = None if w is None else w.shape
        raise MultiVectorCheckpointInvalid(
            f"{path}: linear.weight {shape} does not read {width} features"
        )
    if has_bias != (b is not None) or (b is not None and b.shape != (w.shape[0],)):
        raise MultiVectorCheckpointInvalid(f"{path}: linear.bias does not match bias={has_bias}")
    for key in ("in_features", "out_features"):
        want = w.shape[1] if key == "in_features" else w.shape[0]
        if cfg.get(key, want) != want:
            raise MultiVectorCheckpointInvalid(f"{path}: {key} {cfg.get(key)} but weight {w.shape}")
    layer = Layer(
        in_features=int(w.shape[1]),
        out_features=int(w.shape[0]),
        bias=has_bias,
        activation=activation,
    )
    return layer, _f32(w), None if b is None else _f32(b)


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer(d: Path) -> Tokenizer:
    path = d / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on any bad file
        raise MultiVectorCheckpointInvalid(f"{path}: {e}") from e
    # As the host tokenizes: one text's ids, no padding, cut by the caller.
    tok.no_padding()
    tok.no_truncation()
    return tok


def _specials(tok: Tokenizer) -> tuple[int, int]:
    """How many special tokens the tokenizer puts before and after a single text."""
    plain = tok.encode(_PROBES[0], add_special_tokens=False).ids
    full = tok.encode(_PROBES[0]).ids
    for lead in range(len(full) - len(plain) + 1):
        if full[lead : lead + len(plain)] == plain:
            return lead, len(full) - lead - len(plain)
    raise MultiVectorCheckpointInvalid("the tokenizer's special tokens wrap a text's ids oddly")


def _register_prefixes(tok: Tokenizer, prompts: dict[str, str]) -> None:
    """sentence-transformers' `_register_prefix_tokens` for legacy prefixes: a marker the
    tokenizer knows (whole, or its first word) but splits becomes one special token."""
    register = []
    for value in prompts.values():
        if not value or not value.split():
            continue
        for prefix in (value, value.split(None, 1)[0]):
            if tok.token_to_id(prefix) is None:
                continue
            if tok.encode(prefix, add_special_tokens=False).tokens != [prefix]:
                register.append(AddedToken(prefix, normalized=False, special=True))
            break
    if register:
        tok.add_special_tokens(register)


def _insertable(tok: Tokenizer, prompt: str, prefix: list[int], lead: int) -> bool:
    for text in _PROBES:
        bare = tok.encode(text).ids
        if tok.encode(prompt + text).ids != bare[:lead] + prefix + bare[lead:]:
            return False
    return True


def _expansion(raw: Any, tok: Tokenizer, tok_cfg: dict[str, Any], where: Path) -> Expansion | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise MultiVectorCheckpointInvalid(f"{where}: query_expansion {raw!r} is not an object")
    strategy, length = raw.get("strategy"), raw.get("length")
    attend = raw.get("attend", False)
    if strategy not in ("fixed", "min") or not isinstance(attend, bool):
        raise MultiVectorCheckpointInvalid(f"{where}: query_expansion {raw!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise MultiVectorCheckpointInvalid(f"{where}: query_expansion length {length!r}")
    # The token: named, else the mask token, else EOS (sentence-transformers' fallback chain).
    name = raw.get("token") or _token(tok_cfg.get("mask_token")) or _token(tok_cfg.get("eos_token"))
    token_id = tok.token_to_id(name) if isinstance(name, str) else None
    if token_id is None:
        raise MultiVectorCheckpointInvalid(
            f"{where}: query expansion token {name!r} is not in the tokenizer"
        )
    return Expansion(strategy=strategy, length=length, token_id=token_id, attend=attend)


def _length(value: Any, key: str, where: Path) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MultiVectorCheckpointInvalid(f"{where}: {key} {value!r} is not a positive integer")
    return value


@dataclass
class _Knobs:
    """What one layout says, before the tokenizer resolves it to ids."""

    prompts: dict[str, str]
    raw_expansion: Any
    where: Path  # the file the expansion came from, for errors
    query_length: int | None
    document_length: int | None
    skip_words: Any
    skip_tasks: Any
    dense: list[tuple[Layer, np.ndarray, np.ndarray | None]]
    normalize: bool
    # Legacy prefixes sentence-transformers registers as special tokens at load.
    legacy_prefixes: dict[str, str] = field(default_factory=dict)


def _prompts(st: dict[str, Any], where: Path) -> dict[str, str]:
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise MultiVectorCheckpointInvalid(f"{where}: prompts must map names to text")
    return dict(prompts)


def _dense_chain(
    modules: list[tuple[str, Path]], hidden: int
) -> list[tuple[Layer, np.ndarray, np.ndarray | None]]:
    out = []
    width = hidden
    for path in (p for k, p in modules if k == "Dense"):
        layer, w, b = _dense(path, width)
        out.append((layer, w, b))
        width = layer.out_features
    return out


def _native(d: Path, st: dict[str, Any], hidden: int) -> _Knobs:
    """sentence-transformers 6: the knobs live on the modules that apply them."""
    modules = _modules(d)
    where = modules[0][1] / "sentence_bert_config.json"
    body = _object(where)
    raw_exp = body.get("query_expansion")
    mask_dirs = [p for k, p in modules if k == "MultiVectorMask"]
    if raw_exp is not None and not mask_dirs:
        raise UnsupportedMultiVectorHead(
            f"{d}: query expansion without a MultiVectorMask (its tokens are never scored)"
        )
    mask = _object(mask_dirs[0] / "config.json") if mask_dirs else {}
    if mask.get("keep_only_token_ids"):
        raise UnsupportedMultiVectorHead(f"{d}: a MultiVectorMask image-token allowlist")
    return _Knobs(
        prompts=_prompts(st, d / "config_sentence_transformers.json"),
        raw_expansion=raw_exp,
        where=where,
        query_length=_length(body.get("query_length"), "query_length", where),
        document_length=_length(body.get("document_length"), "document_length", where),
        skip_words=mask.get("skiplist_words") or [],
        skip_tasks=mask.get("skiplist_tasks", ["document"]),
        dense=_dense_chain(modules, hidden),
        normalize=any(k == "Normalize" for k, _ in modules),
    )


def _pylate(d: Path, st: dict[str, Any], hidden: int) -> _Knobs:
    """PyLate <= 3, as `MultiVectorEncoder._parse_model_config` reads it: knobs at the top
    of config_sentence_transformers.json, the prefix ahead of any saved prompt, expansion on
    unless `do_query_expansion` is false, punctuation skipped unless `skiplist_words` says."""
    where = d / "config_sentence_transformers.json"
    prompts = _prompts(st, where)
    prefixes = {}
    for key, side in (("query_prefix", "query"), ("document_prefix", "document")):
        if key in st:
            prefix = st[key] or ""
            prefixes[side] = prefix
            prompts[side] = prefix + (prompts.get(side) or "").removeprefix(prefix)
    raw_exp = None
    if st.get("do_query_expansion") is not False:
        raw_exp = {
            "strategy": "fixed",
            "attend": bool(st.get("attend_to_expansion_tokens", False)),
            "length": st.get("query_length") or 32,
        }
    skip_words = st.get("skiplist_words")
    return _Knobs(
        prompts=prompts,
        raw_expansion=raw_exp,
        where=where,
        # With expansion, PyLate's query_length is the expansion length, not a cap.
        query_length=None
        if raw_exp is not None
        else _length(st.get("query_length"), "query_length", where),
        document_length=_length(st.get("document_length"), "document_length", where),
        skip_words=list(string.punctuation) if skip_words is None else skip_words,
        skip_tasks=["document"],
        dense=_dense_chain(_modules(d), hidden),
        normalize=True,  # appended by the loader: PyLate normalized inline
        legacy_prefixes=prefixes,
    )


def _stanford(d: Path, hidden: int) -> _Knobs:
    """Stanford-NLP ColBERT (`HF_ColBERT`), as `MultiVectorEncoder._maybe_load_stanford_metadata`
    and `_build_stanford_projection` read it: `artifact.metadata` (optional) for the markers
    ([unused0] / [unused1] by default), `query_maxlen` (the always-on expansion's length, 32 by
    default), `attend_to_mask_tokens`, `doc_maxlen` and `mask_punctuation` (default true); the
    projection is `linear.weight` (no bias) in the root weights."""
    where = d / "artifact.metadata"
    meta = _object(where)
    prefixes = {
        "query": (meta.get("query_token_id") or "[unused0]") + " ",
        "document": (meta.get("doc_token_id") or "[unused1]") + " ",
    }
    if (d / "model.safetensors").is_file():
        weights = read_safetensors(d / "model.safetensors")
    elif (d / "pytorch_model.bin").is_file():
        weights = read_torch_pt(d / "pytorch_model.bin")
    else:
        raise MultiVectorCheckpointInvalid(f"{d}: no model.safetensors or pytorch_model.bin")
    w = weights.get("linear.weight")
    if w is None or w.ndim != 2 or w.shape[1] != hidden:
        shape = None if w is None else w.shape
        raise MultiVectorCheckpointInvalid(
            f"{d}: linear.weight {shape} does not project the hidden size {hidden}"
        )
    layer = Layer(in_features=hidden, out_features=int(w.shape[0]), bias=False)
    return _Knobs(
        prompts=dict(prefixes),
        raw_expansion={
            "strategy": "fixed",
            "attend": bool(meta.get("attend_to_mask_tokens")),
            "length": meta.get("query_maxlen") or 32,
        },
        where=where,
        query_length=None,
        document_length=_length(meta.get("doc_maxlen"), "doc_maxlen", where),
        skip_words=list(string.punctuation) if meta.get("mask_punctuation", True) else [],
        skip_tasks=["document"],
        dense=[(layer, _f32(w), None)],
        normalize=True,
        legacy_prefixes=prefixes,
    )


def _colbert(d: Path) -> tuple[MultiVectorSpec, dict[str, np.ndarray]]:
    st = _object(d / "config_sentence_transformers.json")
    hidden = HfConfig.read(d).positive_int("hidden_size")
    if st.get("model_type") == "ColBERT":
        knobs = _pylate(d, st, hidden)
    elif st.get("model_type") == "MultiVectorEncoder":
        knobs = _native(d, st, hidden)
    else:
        knobs = _stanford(d, hidden)
    tok = _tokenizer(d)
    _register_prefixes(tok, knobs.legacy_prefixes)
    skip_words, skip_tasks = knobs.skip_words, knobs.skip_tasks
    if isinstance(skip_tasks, str):
        skip_tasks = [skip_tasks]
    if not isinstance(skip_words, list) or not all(isinstance(w, str) for w in skip_words):
        raise MultiVectorCheckpointInvalid(f"{d}: skiplist_words must be a list of strings")
    if not isinstance(skip_tasks, list) or not set(skip_tasks) <= set(SIDES):
        raise UnsupportedMultiVectorHead(f"{d}: skiplist_tasks {skip_tasks!r}")
    # The special tokens' names, where transformers reads them (the map fills what the
    # tokenizer config leaves out).
    tok_cfg = {**_object(d / "special_tokens_map.json"), **_object(d / "tokenizer_config.json")}
    expansion = _expansion(knobs.raw_expansion, tok, tok_cfg, knobs.where)

    tensors: dict[str, np.ndarray] = {}
    for i, (_, w, b) in enumerate(knobs.dense):
        tensors[f"dense.{i}.weight"] = w
        if b is not None:
            tensors[f"dense.{i}.bias"] = b
    layers = [layer for layer, _, _ in knobs.dense]

    lead, close = _specials(tok)
    prefix_ids: dict[str, list[int]] = {}
    insertable = True
    for side in SIDES:
        prompt = knobs.prompts.get(side) or ""
        ids = tok.encode(prompt, add_special_tokens=False).ids if prompt else []
        prefix_ids[side] = ids
        if ids and not _insertable(tok, prompt, ids, lead):
            insertable = False
    # Skiplist words that are not one token are dropped, as MultiVectorMask drops them.
    skip_ids = sorted({t for w in skip_words if (t := tok.token_to_id(w)) is not None})
    similarity = st.get("similarity_fn_name")
    spec = MultiVectorSpec(
        kind="colbert",
        weights_sha256="",  # set once the weights are written
        hidden=hidden,
        dim=layers[-1].out_features,
        layers=layers,
        normalize=knobs.normalize,
        query_prompt=knobs.prompts.get("query") or "",
        document_prompt=knobs.prompts.get("document") or "",
        query_prefix_ids=prefix_ids["query"],
        document_prefix_ids=prefix_ids["document"],
        prefix_insertable=insertable,
        leading_specials=lead,
        closing_specials=close,
        query_length=knobs.query_length,
        document_length=knobs.document_length,
        expansion=expansion,
        skiplist_ids=skip_ids,
        skiplist_sides=[s for s in SIDES if s in skip_tasks],
        reference_similarity="meanmaxsim" if similarity == "meanmaxsim" else "maxsim",
    )
    return spec, tensors
