"""A Hugging Face ModernBERT directory -> GGUF (arch `modern-bert`), for llama.cpp's graph.

What llama.cpp's ModernBERT graph computes, and so what a directory must be to be served by it:
- token embeddings -> LayerNorm (no position table: RoPE in every layer); per layer a pre-norm
  block (layer 0 has no attention norm, as HF's Identity), fused QKV, RoPE NEOX-style, full
  attention on "global" layers and a symmetric window of `local_attention // 2` tokens either
  side on "local" ones (HF's bidirectional sliding mask, `|q - k| <= local_attention // 2`),
  each kind with its own RoPE base; a GLU MLP whose first half is activated and multiplies the
  second (HF's `input, gate = Wi(x).chunk(2)`); a final LayerNorm;
- no biases anywhere and LayerNorms without a shift: `attention_bias`, `mlp_bias`,
  `norm_bias` must be false (llama.cpp would load the file without them, or not at all);
- the GLU's activation is read from `hidden_activation` (GELU -> GeGLU, SiLU -> SwiGLU,
  ReLU -> ReGLU); a name llama.cpp does not know silently falls back to GeGLU there, so any
  other activation is refused here. llama.cpp's GELU is the tanh form (through an f16 table),
  HF's "gelu" the erf form: the same function to ~1e-3, the difference every ModernBERT GGUF
  carries;
- `ModernBertForSequenceClassification` (rank pooling): CLS or mean pooling, per
  `classifier_pooling` (written as the classifier pooling type), then HF's head
  `norm(gelu(dense(x)))` as `cls` / `cls.norm`, then `classifier` as `cls.output`. llama.cpp
  hard-codes GELU and loads no bias for that head, so `classifier_activation` must be a GELU
  and `classifier_bias` false.

Specials: ModernBERT's tokenizer is byte-level BPE with BERT's [CLS]/[SEP]; BOS=[CLS],
EOS=SEP=[SEP], add_bos/add_eos on and add_sep off, so a rerank pair composes as
`[CLS] q [SEP] d [SEP]`, the pair template ModernBERT's tokenizer has. (llama.cpp's own
converter turns add_sep on, which gives `[CLS] q [SEP] [SEP] d [SEP]`: not what the model saw.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from common.errors import ArtifactInvalid, InvalidRequest
from formats.hf_config import HfConfig
from formats.safetensors_io import read_model_weights
from ingest.hf_common import (
    POOLING_TYPES,
    ConvertedModel,
    Dtype,
    PoolingName,
    embed_pooling,
    file_type,
    load_json,
    require,
    st_layout,
    tensor_dtype,
    write_gguf,
)
from ingest.hf_vocab import Vocab, byte_bpe_vocab

ARCH = gguf.MODEL_ARCH.MODERN_BERT
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]  # "modern-bert"
PRE_TOKENIZER = "modern-bert"  # llama.cpp maps it to GPT-2's pre-tokenizer regex

_EMBED_ARCHS = {"ModernBertModel", "ModernBertForMaskedLM"}
_RERANK_ARCHS = {"ModernBertForSequenceClassification"}

# HF activation -> the name llama.cpp's loader maps to the same GLU (its
# LLM_FFN_OP_TYPES_FROM_STRING). HF's tanh GELUs are llama.cpp's formula; "gelu" (erf)
# differs from it by the approximation described above.
_FFN_ACTS = {
    "gelu": "gelu",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}
_HEAD_ACTS = {"gelu", "gelu_new", "gelu_pytorch_tanh"}  # llama.cpp's head applies GELU only
_LAYER_TYPES = ("full_attention", "sliding_attention")
# The MLM head (dense/norm/decoder) is not part of the embedding.
_MLM_HEAD = re.compile(r"^(head|decoder)\.")
# Keys the pinned gguf package has no constant for yet; the strings are llama.cpp's
# (llama-arch.cpp LLM_KV_HIDDEN_ACT, LLM_KV_CLASSIFIER_POOLING_TYPE).
_KEY_HIDDEN_ACT = getattr(gguf.Keys.LLM, "HIDDEN_ACT", "{arch}.hidden_activation")
_KEY_CLS_POOLING = getattr(gguf.Keys.Classifier, "POOLING_TYPE", "{arch}.classifier.pooling_type")


def _kind(config: HfConfig) -> Literal["embed", "rerank"]:
    arch = config.architecture("ModernBertModel")
    if arch in _EMBED_ARCHS:
        return "embed"
    if arch in _RERANK_ARCHS:
        return "rerank"
    raise ArtifactInvalid(
        f"unsupported ModernBERT architecture {arch!r} (supported: "
        f"{', '.join(sorted(_EMBED_ARCHS | _RERANK_ARCHS))})"
    )


def _check_config(config: HfConfig, kind: str) -> None:
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "vocab_size",
    ):
        config.positive_int(key)
    if config.positive_int("hidden_size") % config.positive_int("num_attention_heads"):
        raise ArtifactInvalid("hidden_size is not a multiple of num_attention_heads")
    for key in ("attention_bias", "mlp_bias", "norm_bias"):
        if config.flag(key):
            raise ArtifactInvalid(
                f"{key}={config.get(key)!r}: llama.cpp's modern-bert graph has "
                "no biases (its layers would compute without them)"
            )
    act = config.value("hidden_activation")
    if act not in _FFN_ACTS:
        raise ArtifactInvalid(
            f"hidden_activation {act!r}: llama.cpp's modern-bert GLU computes "
            f"only {', '.join(sorted(_FFN_ACTS))}"
        )
    config.number("norm_eps")
    if kind == "rerank":
        if config.value("classifier_pooling") not in ("cls", "mean"):
            raise ArtifactInvalid(
                f"classifier_pooling {config.value('classifier_pooling')!r}: "
                "llama.cpp pools a ModernBERT classifier by cls or mean only"
            )
        if config.flag("classifier_bias"):
            raise ArtifactInvalid(
                "classifier_bias=true: llama.cpp's modern-bert head loads no "
                "bias for its dense layer"
            )
        head_act = config.value("classifier_activation")
        if head_act not in _HEAD_ACTS:
            raise ArtifactInvalid(
                f"classifier_activation {head_act!r}: llama.cpp applies GELU "
                "in a ModernBERT classifier head"
            )


def _layer_types(config: HfConfig) -> list[str]:
    """Each layer's attention, as HF decides it: `layer_types` when given (transformers 5
    writes it), else every `global_attn_every_n_layers`-th layer from 0 global."""
    n = config.positive_int("num_hidden_layers")
    types = config.get("layer_types")
    if types is None:
        every = config.positive_int("global_attn_every_n_layers")
        return [_LAYER_TYPES[bool(i % every)] for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise ArtifactInvalid(f"config.json: layer_types must list {n} of {_LAYER_TYPES}")
    return types


def _rope_theta(config: HfConfig, layer_type: str, legacy: str) -> float:
    """The RoPE base of one attention kind. transformers 5 writes `rope_parameters` per layer
    type; hub configs carry `global_rope_theta` / `local_rope_theta`."""
    params = config.mapping("rope_parameters").get(layer_type) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ArtifactInvalid(
            f"{layer_type} RoPE type {rope_type!r}: only unscaled RoPE is "
            "supported (the GGUF says rope scaling none)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ArtifactInvalid(
            "partial_rotary_factor: llama.cpp's modern-bert rotates every head dimension"
        )
    theta = params.get("rope_theta", config.value(legacy))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ArtifactInvalid(f"config.json: {layer_type} rope_theta {theta!r} is not positive")
    return float(theta)


def _swa_pattern(types: list[str], config: HfConfig) -> int | list[bool]:
    """What llama.cpp's `sliding_window_pattern` reads (dense first): an int n when layer i is
    global exactly when i % n == 0 (what llama.cpp's converter writes), else one flag per
    layer (True = sliding)."""
    every = config.get("global_attn_every_n_layers")
    if (
        isinstance(every, int)
        and every > 0
        and types == [_LAYER_TYPES[bool(i % every)] for i in range(len(types))]
    ):
        return every
    return [t == "sliding_attention" for t in types]


def _map_tensors(weights: dict[str, np.ndarray], kind: str, n_layers: int) -> dict[str, np.ndarray]:
    """HF names -> llama.cpp's through the pinned gguf package's map, strict about the rest."""
    table = gguf.get_tensor_name_map(ARCH, n_layers)
    out: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    for key, arr in weights.items():
        k = key[len("model.") :] if key.startswith("model.") else key
        if kind == "embed" and _MLM_HEAD.match(k):
            continue  # the MLM head is not part of the embedding (as upstream)
        stem, _, suffix = k.rpartition(".")
        if suffix not in ("weight", "bias"):
            raise ArtifactInvalid(f"unexpected tensor {key!r}")
        if kind == "rerank" and stem == "classifier":
            stem = "classifier.out_proj"  # the gguf map's name for a direct projection
        name = table.get_name(stem)
        if name is None:
            raise ArtifactInvalid(f"unexpected tensor {key!r}")
        full = f"{name}.{suffix}"
        if full in out:
            raise ArtifactInvalid(f"two tensors map to {full!r} ({source[full]!r}, {key!r})")
        out[full], source[full] = arr, key
    return out


def _expected_shapes(config: HfConfig, kind: str, n_labels: int) -> dict[str, tuple[int, ...]]:
    h, ff = config.positive_int("hidden_size"), config.positive_int("intermediate_size")
    n, v = config.positive_int("num_hidden_layers"), config.positive_int("vocab_size")
    want: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (v, h),
        "token_embd_norm.weight": (h,),
        "output_norm.weight": (h,),
    }
    for i in range(n):
        if i:  # layer 0 attends to the embedding norm's output directly
            want[f"blk.{i}.attn_norm.weight"] = (h,)
        want |= {
            f"blk.{i}.attn_qkv.weight": (3 * h, h),
            f"blk.{i}.attn_output.weight": (h, h),
            f"blk.{i}.ffn_up.weight": (2 * ff, h),
            f"blk.{i}.ffn_down.weight": (h, ff),
            f"blk.{i}.ffn_norm.weight": (h,),
        }
    if kind == "rerank":
        want |= {
            "cls.weight": (h, h),
            "cls.norm.weight": (h,),
            "cls.output.weight": (n_labels, h),
            "cls.output.bias": (n_labels,),
        }
    return want


def _check_tensors(tensors: dict[str, np.ndarray], want: dict[str, tuple[int, ...]]) -> None:
    # A tensor llama.cpp's graph has no place for (a bias, a layer-0 attention norm) would
    # either fail its load or change what it computes; neither is served.
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise ArtifactInvalid(
            f"tensors llama.cpp's modern-bert graph does not compute: "
            f"{extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    require(tensors, want)


def _token_text(cfg: dict, kind: str, default: str) -> str:
    text = cfg.get(f"{kind}_token", default)
    if isinstance(text, dict):  # AddedToken serialised as an object
        text = text.get("content", default)
    return text if isinstance(text, str) else default


def _specials(model_dir: Path, vocab: Vocab) -> dict[str, int]:
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = load_json(cfg_path) if cfg_path.is_file() else {}
    ids = {
        kind: vocab.id_of(_token_text(cfg, kind, default), kind)
        for kind, default in (("cls", "[CLS]"), ("sep", "[SEP]"))
    }
    for kind, default in (("unk", "[UNK]"), ("pad", "[PAD]"), ("mask", "[MASK]")):
        text = _token_text(cfg, kind, default)
        if text in vocab.ids:
            ids[kind] = vocab.ids[text]
    return ids


def _check_byte_level(tok: dict) -> None:
    # The GGUF says byte-level BPE ("gpt2"): its token strings are bytes spelled in GPT-2's
    # alphabet, which only a ByteLevel pre-tokenizer produces. (The module tokenizes with the
    # directory's own tokenizer.json, so its normalizer and regex are the model's either way.)
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(s and s.get("type") == "ByteLevel" for s in steps):
        raise ArtifactInvalid(f"tokenizer.json pre-tokenizer {pre.get('type')!r} is not byte-level")


def _check_pair_template(tok: dict, specials: dict[str, int]) -> None:
    """The worker composes a rerank pair from the GGUF's specials as `[CLS] q [SEP] d [SEP]`;
    the tokenizer the model was trained with must compose it the same way."""
    post = tok.get("post_processor") or {}
    cls, sep = specials["cls"], specials["sep"]
    if post.get("type") == "BertProcessing":
        got = [
            post.get("cls", [None, None])[1],
            "A",
            post.get("sep", [None, None])[1],
            "B",
            post.get("sep", [None, None])[1],
        ]
    elif post.get("type") == "TemplateProcessing":
        table = post.get("special_tokens") or {}
        got = []
        for piece in post.get("pair") or []:
            if "Sequence" in piece:
                got.append(piece["Sequence"].get("id"))
            else:
                ids = (table.get(piece.get("SpecialToken", {}).get("id")) or {}).get("ids")
                got.extend(ids or [None])
    else:
        raise ArtifactInvalid(
            f"tokenizer.json post-processor {post.get('type')!r}: a rerank "
            "pair must be composed as [CLS] q [SEP] d [SEP]"
        )
    if got != [cls, "A", sep, "B", sep]:
        raise ArtifactInvalid(
            f"tokenizer.json composes a pair as {got}, not "
            f"[{cls}, A, {sep}, B, {sep}] ([CLS] q [SEP] d [SEP]), which is "
            "how the worker composes it"
        )


def convert(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str,
) -> ConvertedModel:
    kind = _kind(config)
    _check_config(config, kind)
    layout = st_layout(model_dir)
    if layout.dense_dirs:
        raise ArtifactInvalid(
            "sentence-transformers Dense modules: llama.cpp's modern-bert graph does not apply them"
        )
    labels: list[str] = []
    if kind == "rerank":
        if pooling not in (None, "rank"):
            raise InvalidRequest("a sequence classifier is served with rank pooling only")
        pooling = "rank"
        labels = config.labels()
    else:
        pooling = embed_pooling(model_dir, pooling)

    types = _layer_types(config)
    global_theta = _rope_theta(config, "full_attention", "global_rope_theta")
    local_theta = _rope_theta(config, "sliding_attention", "local_rope_theta")
    if config.get("rope_scaling"):
        raise ArtifactInvalid("rope_scaling: only unscaled RoPE is supported")
    sliding = "sliding_attention" in types
    if sliding:
        config.positive_int("local_attention")

    n_layers = config.positive_int("num_hidden_layers")
    tensors = _map_tensors(read_model_weights(model_dir), kind, n_layers)
    _check_tensors(tensors, _expected_shapes(config, kind, len(labels)))

    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ArtifactInvalid(f"missing tokenizer.json in {model_dir}")
    tok = load_json(tok_path)
    _check_byte_level(tok)
    vocab = byte_bpe_vocab(tok, config.positive_int("vocab_size"), PRE_TOKENIZER)
    specials = _specials(model_dir, vocab)
    if kind == "rerank":
        _check_pair_template(tok, specials)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_name(name)
        w.add_file_type(file_type(dtype))
        w.add_context_length(config.positive_int("max_position_embeddings"))
        w.add_embedding_length(config.positive_int("hidden_size"))
        w.add_feed_forward_length(config.positive_int("intermediate_size"))
        w.add_block_count(n_layers)
        w.add_head_count(config.positive_int("num_attention_heads"))
        w.add_layer_norm_eps(config.number("norm_eps"))
        w.add_causal_attention(False)
        w.add_pooling_type(POOLING_TYPES[pooling])
        w.add_vocab_size(config.positive_int("vocab_size"))
        w.add_rope_freq_base(global_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        if sliding:
            w.add_sliding_window(config.positive_int("local_attention"))
            w.add_sliding_window_pattern(_swa_pattern(types, config))
            w.add_rope_freq_base_swa(local_theta)
        w.add_string(
            _KEY_HIDDEN_ACT.format(arch=ARCH_NAME),
            _FFN_ACTS[config.value("hidden_activation")],
        )
        if kind == "rerank":
            w.add_classifier_output_labels(labels)
            w.add_uint32(
                _KEY_CLS_POOLING.format(arch=ARCH_NAME),
                POOLING_TYPES[config.value("classifier_pooling")].value,
            )

        vocab.add_to(w)
        w.add_bos_token_id(specials["cls"])
        w.add_eos_token_id(specials["sep"])
        w.add_sep_token_id(specials["sep"])
        for kind_, add in (
            ("unk", w.add_unk_token_id),
            ("pad", w.add_pad_token_id),
            ("mask", w.add_mask_token_id),
        ):
            if kind_ in specials:
                add(specials[kind_])
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(False)

        for tname, arr in tensors.items():
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=tensor_dtype(tname, arr, dtype)))

    write_gguf(out_path, ARCH_NAME, fill)
    max_seq = layout.max_seq_length
    return ConvertedModel(
        kind=kind,
        dtype=dtype,
        dims=config.positive_int("hidden_size"),
        pooling=pooling,
        n_ctx_train=config.positive_int("max_position_embeddings"),
        vocab_size=config.positive_int("vocab_size"),
        n_layers=n_layers,
        n_labels=len(labels),
        cls_id=specials["cls"],
        sep_id=specials["sep"],
        max_seq_length=max_seq if isinstance(max_seq, int) else None,
        architecture=ARCH_NAME,
    )
