"""Sparse models: what makes a checkpoint one, and its heads written as the worker reads them
(`formats/sparse_head.py`: `heads/sparse.json` + `heads/sparse.safetensors`).

Three layouts are read, each as its reference computes it:

- SPLADE, a sentence-transformers `SparseEncoder`: `modules.json` lists a masked-LM
  transformer (`Transformer` with `transformer_task: fill-mask`, or the older
  `MLMTransformer`) then `SpladePooling`. The head is the checkpoint's own MLM head (BERT's
  `cls.predictions`, DistilBERT's `vocab_*`, the RoBERTa family's `lm_head`): its decoder is
  the word embedding when the config ties them and the file has no decoder of its own, as
  transformers ties them on load; its activation is the one transformers' head class
  applies (BERT's `hidden_act`, DistilBERT's `activation`, always the erf GELU for RoBERTa's).
  Both routes (query, document) are this head.
- inference-free SPLADE: `modules.json` is one `Router` whose routes are `SparseStaticEmbedding`
  (queries: one weight per vocabulary entry, no transformer) and the SPLADE pipeline above
  (documents), resolved for the tasks "query" and "document" by the Router's own rules.
- bge-m3 in FlagEmbedding's layout: `sparse_linear.pt` (a `torch.save`d `Linear(H, 1)`)
  beside the XLM-RoBERTa checkpoint, read without torch (`ingest/torch_state.py`); the ids
  FlagEmbedding drops are the tokenizer's cls, eos, pad and unk tokens.

`max_active_dims` is the model's (`config_sentence_transformers.json`), as `SparseEncoder`
reads it. Anything else a sparse directory declares that these heads do not compute (another
module after the pooling, a SPLADE over another family, an IDF file instead of weights) is
refused by name (`SparseCheckpointInvalid`, code `artifact_invalid`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from safetensors.numpy import save_file

from common.errors import ArtifactInvalid, StorageFull
from formats.hf_config import HfConfig
from formats.safetensors_io import read_model_weights, read_safetensors
from formats.sparse_head import (
    FORMAT_VERSION,
    HIDDEN_ACTS,
    SPARSE_CONFIG,
    SPARSE_WEIGHTS,
    TENSORS,
    HeadKind,
    HeadSpec,
    Source,
    SparseHeads,
    head_dir,
    write_spec,
)
from ingest.durable import full_disk_as
from ingest.torch_state import read_torch_state

SPARSE_LINEAR = "sparse_linear.pt"


@dataclass(frozen=True)
class _MlmHead:
    """Where a `...ForMaskedLM` keeps its head, and what its transform computes with."""

    dense: str
    norm: str
    decoder: str
    bias: str | None  # the separate bias parameter the decoder's is tied to, if any
    embeddings: str  # the word embedding the decoder's weight is tied to
    act_key: str | None  # the config key naming the activation; None: fixed `gelu`
    eps_key: str | None  # the config key of the LayerNorm epsilon; None: fixed 1e-12
    hidden_key: str = "hidden_size"


_ROBERTA_HEAD = _MlmHead(  # RobertaLMHead / XLMRobertaLMHead: erf GELU whatever hidden_act says
    "lm_head.dense",
    "lm_head.layer_norm",
    "lm_head.decoder",
    "lm_head.bias",
    "roberta.embeddings.word_embeddings.weight",
    None,
    "layer_norm_eps",
)
# The masked-LM heads read, by model_type (transformers' BertForMaskedLM,
# DistilBertForMaskedLM, RobertaForMaskedLM and the XLM-RoBERTa/CamemBERT copies of it).
_MLM_HEADS = {
    "bert": _MlmHead(
        "cls.predictions.transform.dense",
        "cls.predictions.transform.LayerNorm",
        "cls.predictions.decoder",
        "cls.predictions.bias",
        "bert.embeddings.word_embeddings.weight",
        "hidden_act",
        "layer_norm_eps",
    ),
    "distilbert": _MlmHead(
        "vocab_transform",
        "vocab_layer_norm",
        "vocab_projector",
        None,
        "distilbert.embeddings.word_embeddings.weight",
        "activation",
        None,
        hidden_key="dim",
    ),
    "roberta": _ROBERTA_HEAD,
    "xlm-roberta": _ROBERTA_HEAD,
    "camembert": _ROBERTA_HEAD,
}
# FlagEmbedding's unused tokens (m3.py `_process_token_weights`).
_DROPPED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")
_SPARSE_MODULES = ("SpladePooling", "SparseStaticEmbedding")


class SparseCheckpointInvalid(ArtifactInvalid):
    """A sparse checkpoint is malformed, or declares something its heads do not compute."""


class SparseHeadInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the manifest keeps of a sparse model's heads."""

    source: Source
    routes: dict[str, HeadKind]  # "query", "document" -> the head's kind
    vocab_size: int
    # sha256 over sparse.json then sparse.safetensors (as written to heads/).
    digest: str
    default_route: str | None = "document"
    max_active_dims: int | None = None
    # False when the query route is static: queries need no forward pass, and are tokenized
    # without special tokens, as SparseStaticEmbedding tokenizes them.
    query_needs_forward: bool = True


def _kind(entry: object) -> str:
    return str(entry.get("type", "")).rsplit(".", 1)[-1] if isinstance(entry, dict) else ""


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SparseCheckpointInvalid(f"unreadable {path}: {e}") from e


def _modules(model_dir: Path) -> list[dict] | None:
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = _json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise SparseCheckpointInvalid(f"{path}: expected a list of module objects")
    return modules


def _router_config(model_dir: Path, entry: dict) -> dict:
    path = model_dir / str(entry.get("path", "")) / "router_config.json"
    cfg = _json(path)
    ok = isinstance(cfg, dict) and all(
        isinstance(cfg.get(k), dict) for k in ("types", "structure", "parameters")
    )
    if not ok:
        raise SparseCheckpointInvalid(f"{path}: expected types, structure and parameters")
    return cfg  # type: ignore[return-value]


def sparse_source(model_dir: Path) -> Source | None:
    """Which sparse layout `model_dir` is, or None when it is not a sparse model."""
    model_dir = Path(model_dir)
    modules = _modules(model_dir)
    if modules:
        kinds = [_kind(m) for m in modules]
        if kinds == ["Router"]:
            types = _router_config(model_dir, modules[0])["types"].values()
            routed = {str(t).rsplit(".", 1)[-1] for t in types}
            if routed & set(_SPARSE_MODULES):
                return "inference_free_splade" if "SparseStaticEmbedding" in routed else "splade"
        elif set(kinds) & set(_SPARSE_MODULES):
            return "splade"
    if (model_dir / SPARSE_LINEAR).is_file():
        return "bge_m3"
    return None


# ---- SPLADE -----------------------------------------------------------------------------------


def _splade_head(
    transformer_dir: Path, transformer_kind: str, pooling_dir: Path, prefix: str
) -> tuple[HeadSpec, dict[str, np.ndarray]]:
    if transformer_kind == "Transformer":
        cfg_path = transformer_dir / "sentence_bert_config.json"
        st_cfg = _json(cfg_path) if cfg_path.is_file() else {}
        task = st_cfg.get("transformer_task") if isinstance(st_cfg, dict) else None
        if task != "fill-mask":
            raise SparseCheckpointInvalid(
                f"{transformer_dir}: SpladePooling reads MLM logits, but its Transformer's task "
                f"is {task!r}, not 'fill-mask'"
            )
    elif transformer_kind != "MLMTransformer":
        raise SparseCheckpointInvalid(f"SpladePooling after {transformer_kind}: not computed")
    pool = _json(pooling_dir / "config.json")
    if not isinstance(pool, dict):
        raise SparseCheckpointInvalid(f"{pooling_dir}/config.json: expected an object")
    pooling = pool.get("pooling_strategy", "max")
    activation = pool.get("activation_function", "relu")
    if pooling not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
        raise SparseCheckpointInvalid(
            f"{pooling_dir}: SpladePooling {pooling!r}/{activation!r} is not one sentence-"
            "transformers computes (max or sum; relu or log1p_relu)"
        )
    config = HfConfig.read(transformer_dir)
    model_type = config.string("model_type")
    names = _MLM_HEADS.get(model_type)
    if names is None:
        raise SparseCheckpointInvalid(
            f"{transformer_dir}: a SPLADE head over model_type {model_type!r} is not read "
            f"({', '.join(_MLM_HEADS)})"
        )
    hidden_act = config.string(names.act_key, "gelu") if names.act_key else "gelu"
    if hidden_act not in HIDDEN_ACTS:
        raise SparseCheckpointInvalid(
            f"{transformer_dir}: the MLM head's activation {hidden_act!r} is not computed "
            f"({', '.join(HIDDEN_ACTS)})"
        )
    eps = config.number(names.eps_key) if names.eps_key else 1e-12
    hidden, vocab = config.positive_int(names.hidden_key), config.positive_int("vocab_size")
    weights = read_model_weights(transformer_dir)
    tied = config.get("tie_word_embeddings", True) is not False

    def pick(own: str, tied_to: str | None) -> np.ndarray:
        # transformers' tying on load: the decoder keeps its own tensor when the file has
        # one, else (tied) takes its source's.
        if own in weights:
            return weights[own]
        if tied and tied_to in weights:
            return weights[tied_to]
        raise SparseCheckpointInvalid(f"{transformer_dir}: no {own} (nor a tied {tied_to})")

    def need(name: str) -> np.ndarray:
        if name not in weights:
            raise SparseCheckpointInvalid(f"{transformer_dir}: the MLM head has no {name}")
        return weights[name]

    tensors = {
        "dense.weight": need(names.dense + ".weight"),
        "dense.bias": need(names.dense + ".bias"),
        "norm.weight": need(names.norm + ".weight"),
        "norm.bias": need(names.norm + ".bias"),
        "decoder.weight": pick(names.decoder + ".weight", names.embeddings),
        "decoder.bias": pick(names.decoder + ".bias", names.bias),
    }
    spec = HeadSpec(
        kind="splade",
        prefix=prefix,
        vocab_size=vocab,
        hidden_size=hidden,
        pooling=pooling,
        activation=activation,
        hidden_act=hidden_act,
        layer_norm_eps=eps,
    )
    _check_shapes(spec, tensors, transformer_dir)
    return spec, tensors


def _check_shapes(spec: HeadSpec, tensors: dict[str, np.ndarray], where: Path) -> None:
    dims = {"H": spec.hidden_size, "V": spec.vocab_size, "1": 1}
    for name, shape in TENSORS[spec.kind].items():
        want = tuple(dims[d] for d in shape)
        if tensors[name].shape != want:
            raise SparseCheckpointInvalid(
                f"{where}: {name} is {list(tensors[name].shape)}, expected {list(want)}"
            )


def _static_head(module_dir: Path, prefix: str) -> tuple[HeadSpec, dict[str, np.ndarray]]:
    cfg = _json(module_dir / "config.json")
    if isinstance(cfg, dict) and cfg.get("path"):
        raise SparseCheckpointInvalid(
            f"{module_dir}: a SparseStaticEmbedding read from an IDF file ({cfg['path']}) is "
            "not read; save the model with sentence-transformers so its weights are a tensor"
        )
    path = module_dir / "model.safetensors"
    if not path.is_file():
        raise SparseCheckpointInvalid(
            f"{module_dir}: SparseStaticEmbedding has no model.safetensors (pickled weights "
            "are not read)"
        )
    weight = read_safetensors(path).get("weight")
    if weight is None or weight.ndim != 1 or weight.size == 0:
        raise SparseCheckpointInvalid(f"{path}: expected one vector 'weight' (vocabulary,)")
    spec = HeadSpec(
        kind="static", prefix=prefix, vocab_size=int(weight.size), add_special_tokens=False
    )
    return spec, {"weight": weight}


def _route_head(
    model_dir: Path, names: list[str], types: dict[str, str], prefix: str
) -> tuple[HeadSpec, dict[str, np.ndarray]]:
    kinds = [str(types.get(n, "")).rsplit(".", 1)[-1] for n in names]
    if kinds == ["SparseStaticEmbedding"]:
        return _static_head(model_dir / names[0], prefix)
    if len(kinds) == 2 and kinds[1] == "SpladePooling":
        return _splade_head(model_dir / names[0], kinds[0], model_dir / names[1], prefix)
    raise SparseCheckpointInvalid(f"{model_dir}: a route of modules {kinds} is not computed")


def resolve_route(task: str | None, structure: dict, parameters: dict) -> str | None:
    """sentence-transformers' `Router._resolve_route` for a text input of `task`: the
    mappings (task, text), (task, any), (any, text), (any, any), then a route named as the
    task, then one named "text"; past those a named task has no route (sentence-transformers
    raises), and no task takes the default route."""
    mappings: dict[tuple, str] = {}
    for key, value in (parameters.get("route_mappings") or {}).items():
        try:
            parsed = ast.literal_eval(key)
        except (ValueError, SyntaxError):
            continue  # sentence-transformers skips an unparsable key with a warning
        if isinstance(parsed, tuple) and len(parsed) == 2:
            mappings[parsed] = value
    for key in ((task, "text"), (task, None), (None, "text"), (None, None)):
        if key in mappings:
            return mappings[key]
    if task is not None and task in structure:
        return task
    if "text" in structure:
        return "text"
    return None if task is not None else _default_route(structure, parameters)


def _default_route(structure: dict, parameters: dict) -> str | None:
    default = parameters.get("default_route")
    if default is None and parameters.get("allow_empty_key", True) and structure:
        default = next(iter(structure))
    return default


def _tokenizer_model(module_dir: Path) -> object:
    path = module_dir / "tokenizer.json"
    spec = _json(path) if path.is_file() else None
    return spec.get("model") if isinstance(spec, dict) else None


def _sentence_transformers_heads(
    model_dir: Path, modules: list[dict], source: Source
) -> tuple[dict[str, HeadSpec], dict[str, np.ndarray], str | None]:
    routes: dict[str, HeadSpec] = {}
    tensors: dict[str, np.ndarray] = {}
    if source == "splade" and [_kind(m) for m in modules] != ["Router"]:
        kinds = [_kind(m) for m in modules]
        if len(kinds) != 2 or kinds[1] != "SpladePooling":
            raise SparseCheckpointInvalid(
                f"{model_dir}: modules {kinds}: only a masked-LM transformer then SpladePooling "
                "is computed"
            )
        spec, own = _splade_head(
            model_dir / str(modules[0].get("path", "")),
            kinds[0],
            model_dir / str(modules[1].get("path", "")),
            "",
        )
        tensors.update(own)
        return {"query": spec, "document": spec}, tensors, "document"
    router_dir = model_dir / str(modules[0].get("path", ""))
    cfg = _router_config(model_dir, modules[0])
    structure, parameters, types = cfg["structure"], cfg["parameters"], cfg["types"]
    built: dict[str, HeadSpec] = {}
    route_dirs: dict[str, Path] = {}
    for task in ("query", "document"):
        name = resolve_route(task, structure, parameters)
        if name is None or not isinstance(structure.get(name), list):
            raise SparseCheckpointInvalid(f"{router_dir}: no route for {task}s")
        if name not in built:
            names = [str(n) for n in structure[name]]
            built[name], own = _route_head(router_dir, names, types, f"{name}.")
            tensors.update({f"{name}.{k}": v for k, v in own.items()})
            route_dirs[name] = router_dir / names[0]
        routes[task] = built[name]
    # One engine and one tokenizer serve the model: routes that run different transformers
    # or tokenize with different vocabularies are not one model to us.
    transformers = {d for n, d in route_dirs.items() if built[n].kind == "splade"}
    if len(transformers) > 1:
        raise SparseCheckpointInvalid(f"{router_dir}: the routes run different transformers")
    if len({head.vocab_size for head in built.values()}) > 1:
        raise SparseCheckpointInvalid(f"{router_dir}: the routes' vocabulary sizes differ")
    vocabularies = {json.dumps(_tokenizer_model(d), sort_keys=True) for d in route_dirs.values()}
    if len(vocabularies) > 1:
        raise SparseCheckpointInvalid(f"{router_dir}: the routes' tokenizers differ")
    # The route of a request that names no side; one that is neither side's is no route our
    # heads serve.
    default = resolve_route(None, structure, parameters)
    by_name = {task: resolve_route(task, structure, parameters) for task in routes}
    default_task = next((t for t, n in by_name.items() if n == default), None)
    return routes, tensors, default_task


def _max_active_dims(model_dir: Path) -> int | None:
    path = model_dir / "config_sentence_transformers.json"
    cfg = _json(path) if path.is_file() else {}
    value = cfg.get("max_active_dims") if isinstance(cfg, dict) else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise SparseCheckpointInvalid(f"{path}: max_active_dims {value!r} is not a positive int")
    return value


# ---- bge-m3 -----------------------------------------------------------------------------------


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialised as an object
        value = value.get("content")
    return value if isinstance(value, str) else None


def _dropped_ids(model_dir: Path) -> tuple[int, ...]:
    """The ids of the tokenizer's cls, eos, pad and unk tokens (those it names), as
    transformers' `convert_tokens_to_ids` of its `special_tokens_map` gives them."""
    from tokenizers import Tokenizer

    tok_path = model_dir / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the Rust reader raises its own exception type
        raise SparseCheckpointInvalid(f"{tok_path}: not a readable tokenizer: {e}") from e
    maps = [model_dir / "tokenizer_config.json", model_dir / "special_tokens_map.json"]
    tables = [t for t in (_json(p) for p in maps if p.is_file()) if isinstance(t, dict)]
    ids: list[int] = []
    for name in _DROPPED_TOKENS:
        text = next((_token_text(t.get(name)) for t in tables if _token_text(t.get(name))), None)
        if text is None:
            continue
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            raise SparseCheckpointInvalid(f"{model_dir}: {name} {text!r} is not in the vocabulary")
        ids.append(token_id)
    return tuple(sorted(set(ids)))


def _bge_m3_heads(model_dir: Path) -> tuple[dict[str, HeadSpec], dict[str, np.ndarray]]:
    config = HfConfig.read(model_dir)
    hidden, vocab = config.positive_int("hidden_size"), config.positive_int("vocab_size")
    state = read_torch_state(model_dir / SPARSE_LINEAR)
    weight, bias = state.get("weight"), state.get("bias")
    if set(state) != {"weight", "bias"} or weight is None or bias is None:
        raise SparseCheckpointInvalid(
            f"{model_dir / SPARSE_LINEAR}: expected a Linear's weight and bias, got {sorted(state)}"
        )
    spec = HeadSpec(
        kind="token_weights",
        prefix="",
        vocab_size=vocab,
        hidden_size=hidden,
        dropped_ids=_dropped_ids(model_dir),
    )
    tensors = {"weight": weight, "bias": bias}
    _check_shapes(spec, tensors, model_dir / SPARSE_LINEAR)
    return {"query": spec, "document": spec}, tensors


# ---- writing ----------------------------------------------------------------------------------


def write_sparse_heads(model_dir: Path, out_dir: Path) -> SparseHeadInfo:
    """Read `model_dir`'s sparse heads and write them to `out_dir/heads/`; what the manifest
    keeps of them. `SparseCheckpointInvalid` when `model_dir` is not a sparse model we read."""
    model_dir = Path(model_dir)
    source = sparse_source(model_dir)
    if source is None:
        raise SparseCheckpointInvalid(
            f"{model_dir} is not a sparse model: no SpladePooling or SparseStaticEmbedding "
            f"module and no {SPARSE_LINEAR}"
        )
    default: str | None = "document"
    if source == "bge_m3":
        routes, tensors = _bge_m3_heads(model_dir)
    else:
        routes, tensors, default = _sentence_transformers_heads(
            model_dir, _modules(model_dir) or [], source
        )
    spec = SparseHeads(
        format=FORMAT_VERSION,
        source=source,
        routes=routes,
        default_route=default,
        max_active_dims=None if source == "bge_m3" else _max_active_dims(model_dir),
    )
    target = head_dir(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    flat = {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
    try:
        with full_disk_as(lambda e: StorageFull(f"writing {target}: {e}"), target):
            save_file(flat, str(target / SPARSE_WEIGHTS))
            write_spec(target, spec)
    except StorageFull:
        shutil.rmtree(target, ignore_errors=True)
        raise
    digest = hashlib.sha256()
    for name in (SPARSE_CONFIG, SPARSE_WEIGHTS):
        with open(target / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return SparseHeadInfo(
        source=source,
        routes={task: head.kind for task, head in routes.items()},
        vocab_size=routes["document"].vocab_size,
        digest=digest.hexdigest(),
        default_route=default,
        max_active_dims=spec.max_active_dims,
        query_needs_forward=routes["query"].kind != "static",
    )
