"""The project's own converter: a Hugging Face BERT or XLM-RoBERTa directory -> GGUF (arch
`bert`, which llama.cpp also uses for XLM-RoBERTa).

Mirrors what llama.cpp's convert_hf_to_gguf.py `BertModel` writes, so llama.cpp's BERT graph
loads it unchanged:
- tensors under llama.cpp's BERT names (taken from `gguf.constants`, never spelled by hand);
  HF Linear weights are (out, in), which GGUFWriter stores as ggml ne [in, out] — exactly
  what llama.cpp expects, so nothing is transposed;
- f16 files keep 1-D tensors (norms, biases), position and token-type embeddings in f32, as
  llama.cpp's converter does (its kernels want f32 there);
- WordPiece vocab in llama.cpp's "phantom space" form (`##x` -> `x`, word-initial `w` ->
  `▁w`, control tokens untouched) under `tokenizer.ggml.model = "bert"`;
- `BertForSequenceClassification`: the pooler (dense + tanh) becomes `cls` and the
  classifier becomes `cls.output`, which llama.cpp's RANK pooling applies in that order
  (tanh(W_p h_cls + b_p), then W_c x + b_c) — the same function HF computes.

XLM-RoBERTa differs from BERT in four places, handled as llama.cpp's `XLMRobertaModel`
converter does:
- weights under `roberta.` (or bare); the MLM head (`lm_head.*`) is unused;
- positions start at `pad_token_id + 1` (HF numbers them from the padding index), so the first
  `pad_token_id + 1` rows of the position table are cut and the trained context shrinks by
  as much (514 rows -> 512 positions);
- a Unigram vocabulary (`tokenizer.ggml.model = "t5"`) with its precompiled character map;
- the sequence classifier's head is `classifier.dense` (+ tanh) then `classifier.out_proj`,
  the same function as BERT's pooler + classifier, so they become `cls` and `cls.output`;
  a pair is `<s> q </s></s> d </s>`: BOS=<s>, EOS=SEP=</s>, with add_sep set.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH, MODEL_TENSOR

from common.errors import ArtifactInvalid, InvalidRequest
from formats.hf_config import SIZE_KEYS, HfConfig
from formats.safetensors_io import read_model_weights
from ingest.hf_common import (
    POOLING_TYPES,
    ConvertedModel,
    Dtype,
    PoolingName,
    check_request,
    file_type,
    load_json,
    st_layout,
    st_pooling,
    tensor_dtype,
    tensor_name,
    write_gguf,
)
from ingest.hf_vocab import Vocab, unigram_vocab

_EMBED_ARCHS = {"BertModel", "BertForMaskedLM", "XLMRobertaModel", "XLMRobertaForMaskedLM"}
_RERANK_ARCHS = {"BertForSequenceClassification", "XLMRobertaForSequenceClassification"}
_DEFAULT_ARCH = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel"}


BertGGUFInfo = ConvertedModel  # the name callers knew before other families


def _name(t: MODEL_TENSOR, bid: int | None = None) -> str:
    return tensor_name(MODEL_ARCH.BERT, t, bid)


_EMBEDDINGS = {
    "embeddings.word_embeddings": MODEL_TENSOR.TOKEN_EMBD,
    "embeddings.token_type_embeddings": MODEL_TENSOR.TOKEN_TYPES,
    "embeddings.position_embeddings": MODEL_TENSOR.POS_EMBD,
    "embeddings.LayerNorm": MODEL_TENSOR.TOKEN_EMBD_NORM,
}
_LAYER = {
    "attention.self.query": MODEL_TENSOR.ATTN_Q,
    "attention.self.key": MODEL_TENSOR.ATTN_K,
    "attention.self.value": MODEL_TENSOR.ATTN_V,
    "attention.output.dense": MODEL_TENSOR.ATTN_OUT,
    "attention.output.LayerNorm": MODEL_TENSOR.ATTN_OUT_NORM,
    "intermediate.dense": MODEL_TENSOR.FFN_UP,
    "output.dense": MODEL_TENSOR.FFN_DOWN,
    "output.LayerNorm": MODEL_TENSOR.LAYER_OUT_NORM,
}
_HEAD = {
    "pooler.dense": MODEL_TENSOR.CLS,
    "classifier": MODEL_TENSOR.CLS_OUT,
    "classifier.dense": MODEL_TENSOR.CLS,
    "classifier.out_proj": MODEL_TENSOR.CLS_OUT,
}
# Keys that carry no inference weights for our use (MLM/NSP heads, a buffer).
_IGNORED = re.compile(
    r"^(embeddings\.position_ids|embeddings\.token_type_ids|cls\.predictions\..*"
    r"|cls\.seq_relationship\..*|lm_head\..*)$"
)
_LAYER_KEY = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
# Tensors llama.cpp's converter keeps f32 even in an f16 file.
_KEEP_F32 = {MODEL_TENSOR.POS_EMBD, MODEL_TENSOR.TOKEN_TYPES}


def _model_kind(config: HfConfig) -> Literal["embed", "rerank"]:
    model_type = config.model_type
    if model_type not in _DEFAULT_ARCH:
        raise ArtifactInvalid(f"unsupported model_type {model_type!r} (bert or xlm-roberta)")
    arch = config.architecture(_DEFAULT_ARCH[model_type])
    if not arch.startswith(_DEFAULT_ARCH[model_type].removesuffix("Model")):
        raise ArtifactInvalid(f"unsupported architecture {arch!r} for model_type {model_type!r}")
    if arch in _EMBED_ARCHS:
        return "embed"
    if arch in _RERANK_ARCHS:
        return "rerank"
    raise ArtifactInvalid(f"unsupported architecture {arch!r}")


def _check_config(config: HfConfig) -> None:
    # llama.cpp's BERT graph is absolute-position, GELU; anything else would load and be wrong.
    if config.string("position_embedding_type") != "absolute":
        raise ArtifactInvalid("only absolute position embeddings are supported")
    act = config.string("hidden_act")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ArtifactInvalid(f"unsupported hidden_act {act!r}")
    for key in SIZE_KEYS:
        config.positive_int(key)
    if config.positive_int("hidden_size") % config.positive_int("num_attention_heads"):
        raise ArtifactInvalid("hidden_size is not a multiple of num_attention_heads")


def _phantom(token: str, control: bool) -> str:
    if control:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def wordpiece_vocab(model_dir: Path, n_vocab: int) -> Vocab:
    """Tokens in phantom form, token types, and the raw token -> id map."""
    tok_path = model_dir / "tokenizer.json"
    special: set[str] = set()
    if tok_path.is_file():
        tok = load_json(tok_path)
        model = tok.get("model") or {}
        if model.get("type") != "WordPiece":
            raise ArtifactInvalid(f"tokenizer.json model is {model.get('type')!r}, not WordPiece")
        vocab: dict[str, int] = dict(model["vocab"])
        for added in tok.get("added_tokens", []):
            vocab.setdefault(added["content"], added["id"])
            if added.get("special"):
                special.add(added["content"])
    elif (model_dir / "vocab.txt").is_file():
        lines = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
        vocab = {t: i for i, t in enumerate(lines)}
        special = {t for t in vocab if re.fullmatch(r"\[(CLS|SEP|PAD|UNK|MASK)\]", t)}
    else:
        raise ArtifactInvalid(f"{model_dir} has neither tokenizer.json nor vocab.txt")
    if not vocab or max(vocab.values()) >= n_vocab or min(vocab.values()) < 0:
        raise ArtifactInvalid(f"vocab ids do not fit the embedding table ({n_vocab} rows)")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(gguf.TokenType.UNUSED)] * n_vocab
    for text, i in vocab.items():
        control = text in special
        tokens[i] = _phantom(text, control)
        types[i] = int(gguf.TokenType.CONTROL if control else gguf.TokenType.NORMAL)
    # llama.cpp ignores the pre-tokenizer for WPM vocabularies.
    return Vocab("bert", "default", tokens, types, ids=vocab)


def unigram_dir_vocab(model_dir: Path, n_vocab: int) -> Vocab:
    """The Unigram vocabulary of an XLM-RoBERTa directory's tokenizer.json."""
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ArtifactInvalid(
            f"{model_dir} has no tokenizer.json (an XLM-RoBERTa model needs "
            "its Unigram tokenizer.json)"
        )
    return unigram_vocab(load_json(tok_path), n_vocab)


# The special tokens each family names by default (tokenizer_config.json may rename them).
_SPECIAL_DEFAULTS = {
    "bert": {"cls": "[CLS]", "sep": "[SEP]", "unk": "[UNK]", "pad": "[PAD]", "mask": "[MASK]"},
    "xlm-roberta": {"cls": "<s>", "sep": "</s>", "unk": "<unk>", "pad": "<pad>", "mask": "<mask>"},
}


def special_ids(model_dir: Path, vocab: dict[str, int], model_type: str) -> dict[str, int]:
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = load_json(cfg_path) if cfg_path.is_file() else {}
    ids: dict[str, int] = {}
    for kind, default in _SPECIAL_DEFAULTS[model_type].items():
        text = cfg.get(f"{kind}_token", default)
        if isinstance(text, dict):  # AddedToken serialised as an object
            text = text.get("content", default)
        if text in vocab:
            ids[kind] = vocab[text]
    for kind in ("cls", "sep"):
        if kind not in ids:
            raise ArtifactInvalid(f"vocab has no {kind} token")
    return ids


def add_bert_specials(w: gguf.GGUFWriter, special: dict[str, int], add_sep: bool) -> None:
    """The special-token keys of a BERT-style vocabulary. As gguf's SpecialVocab does: CLS
    doubles as BOS and SEP as EOS, so "BOS a EOS" is "[CLS] a [SEP]" and a rerank pair
    "[CLS] q [SEP] d [SEP]" (add_sep: XLM-RoBERTa's "<s> q </s></s> d </s>")."""
    w.add_bos_token_id(special["cls"])
    w.add_eos_token_id(special["sep"])
    w.add_sep_token_id(special["sep"])
    for kind, add in (
        ("unk", w.add_unk_token_id),
        ("pad", w.add_pad_token_id),
        ("mask", w.add_mask_token_id),
    ):
        if kind in special:
            add(special[kind])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(add_sep)


def _map_tensors(
    weights: dict[str, np.ndarray], kind: str, n_layers: int
) -> list[tuple[MODEL_TENSOR, str, np.ndarray]]:
    """(tensor kind, gguf name, array) for every weight; strict about unknown keys."""
    out: list[tuple[MODEL_TENSOR, str, np.ndarray]] = []
    for key, arr in weights.items():
        k = re.sub(r"^(bert|roberta)\.", "", key)
        k = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", k))
        if _IGNORED.match(k):
            continue
        stem, _, suffix = k.rpartition(".")
        if suffix not in ("weight", "bias"):
            raise ArtifactInvalid(f"unexpected tensor {key!r}")
        if stem in _EMBEDDINGS:
            t, bid = _EMBEDDINGS[stem], None
        elif stem in _HEAD:
            if kind != "rerank":
                continue  # embedders pool themselves; the NSP pooler is unused (as upstream)
            t, bid = _HEAD[stem], None
        elif m := _LAYER_KEY.match(k):
            bid, sub = int(m.group(1)), m.group(2)
            if sub not in _LAYER or bid >= n_layers:
                raise ArtifactInvalid(f"unexpected tensor {key!r}")
            t = _LAYER[sub]
        else:
            raise ArtifactInvalid(f"unexpected tensor {key!r}")
        out.append((t, f"{_name(t, bid)}.{suffix}", arr))
    names = {n for _, n, _ in out}
    if len(names) != len(out):
        raise ArtifactInvalid("duplicate tensors after name mapping (prefixed and bare keys?)")
    required = [
        f"{_name(t)}.{s}"
        for t in _EMBEDDINGS.values()
        for s in ("weight", "bias")
        if not (
            t in (MODEL_TENSOR.TOKEN_EMBD, MODEL_TENSOR.TOKEN_TYPES, MODEL_TENSOR.POS_EMBD)
            and s == "bias"
        )
    ]
    required += [
        f"{_name(t, b)}.{s}"
        for b in range(n_layers)
        for t in _LAYER.values()
        for s in ("weight", "bias")
    ]
    if kind == "rerank":
        required += [f"{_name(t)}.{s}" for t in _HEAD.values() for s in ("weight", "bias")]
    missing = [n for n in required if n not in names]
    if missing:
        raise ArtifactInvalid(f"missing tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return out


def _check_shapes(tensors: dict[str, np.ndarray], config: HfConfig, n_labels: int) -> None:
    h, ff = config.positive_int("hidden_size"), config.positive_int("intermediate_size")
    want = {
        "token_embd.weight": (config.positive_int("vocab_size"), h),
        "position_embd.weight": (config.positive_int("max_position_embeddings"), h),
        "token_types.weight": (config.positive_int("type_vocab_size"), h),
        "blk.0.attn_q.weight": (h, h),
        "blk.0.ffn_up.weight": (ff, h),
        "blk.0.ffn_down.weight": (h, ff),
    }
    if n_labels:
        want["cls.weight"] = (h, h)
        want["cls.output.weight"] = (n_labels, h)
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ArtifactInvalid(f"{name} has shape {tensors[name].shape}, config says {shape}")


def convert_bert_dir(
    model_dir: str | Path,
    out_path: str | Path,
    dtype: Dtype = "f16",
    *,
    pooling: PoolingName | None = None,
    name: str | None = None,
) -> ConvertedModel:
    """Convert the BERT / XLM-RoBERTa `model_dir` to a GGUF at `out_path` (atomically).

    `pooling` overrides what the directory declares; embedders without a sentence-transformers
    Pooling module must be given one. Raises ArtifactInvalid / InvalidRequest."""
    check_request(dtype, pooling)
    model_dir, out_path = Path(model_dir), Path(out_path)
    if not model_dir.is_dir():
        raise ArtifactInvalid(f"{model_dir} is not a directory")
    config = HfConfig.read(model_dir)
    return convert(model_dir, config, out_path, dtype, pooling, name or model_dir.name)


def convert(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str,
) -> ConvertedModel:
    model_type = config.model_type
    kind = _model_kind(config)
    _check_config(config)

    n_labels = 0
    labels: list[str] = []
    if kind == "rerank":
        labels = config.labels()
        n_labels = len(labels)
        if pooling not in (None, "rank"):
            raise InvalidRequest("a sequence classifier is served with rank pooling only")
        pooling = "rank"
    elif pooling is None:
        pooling = st_pooling(model_dir)
        if pooling is None:
            raise InvalidRequest(f"{model_dir} declares no pooling; pass pooling=")
    elif pooling == "rank":
        raise InvalidRequest("rank pooling needs a sequence-classification model")

    n_layers = config.positive_int("num_hidden_layers")
    mapped = _map_tensors(read_model_weights(model_dir), kind, n_layers)
    by_name = {n: a for _, n, a in mapped}
    _check_shapes(by_name, config, n_labels)
    n_ctx_train = config.positive_int("max_position_embeddings")
    if model_type == "xlm-roberta":
        offset = _position_offset(config)
        n_ctx_train -= offset
        mapped = [(t, n, a[offset:] if t == MODEL_TENSOR.POS_EMBD else a) for t, n, a in mapped]
        vocab = unigram_dir_vocab(model_dir, config.positive_int("vocab_size"))
    else:
        vocab = wordpiece_vocab(model_dir, config.positive_int("vocab_size"))
    special = special_ids(model_dir, vocab.ids, model_type)
    max_seq = st_layout(model_dir).max_seq_length

    def fill(w: gguf.GGUFWriter) -> None:
        _fill(
            w,
            mapped,
            config,
            n_ctx_train,
            dtype,
            pooling,
            vocab,
            special,
            labels,
            name,
            add_sep=model_type == "xlm-roberta",
        )

    write_gguf(out_path, gguf.MODEL_ARCH_NAMES[MODEL_ARCH.BERT], fill)
    return ConvertedModel(
        kind=kind,
        dtype=dtype,
        dims=config.positive_int("hidden_size"),
        pooling=pooling,
        n_ctx_train=n_ctx_train,
        vocab_size=config.positive_int("vocab_size"),
        n_layers=n_layers,
        n_labels=n_labels,
        cls_id=special["cls"],
        sep_id=special["sep"],
        max_seq_length=max_seq if isinstance(max_seq, int) else None,
    )


def _position_offset(config: HfConfig) -> int:
    """HF numbers XLM-RoBERTa positions from `pad_token_id + 1` on; llama.cpp from 0."""
    pad = config.value("pad_token_id")
    rows = config.positive_int("max_position_embeddings")
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < rows - 1:
        raise ArtifactInvalid(f"config.json: pad_token_id {pad!r} cannot offset the positions")
    return pad + 1


def _fill(
    w: gguf.GGUFWriter,
    mapped: list[tuple[MODEL_TENSOR, str, np.ndarray]],
    config: HfConfig,
    n_ctx_train: int,
    dtype: Dtype,
    pooling: PoolingName,
    vocab: Vocab,
    special: dict[str, int],
    labels: list[str],
    model_name: str,
    add_sep: bool,
) -> None:
    w.add_name(model_name)
    w.add_file_type(file_type(dtype))
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(config.positive_int("hidden_size"))
    w.add_feed_forward_length(config.positive_int("intermediate_size"))
    w.add_block_count(config.positive_int("num_hidden_layers"))
    w.add_head_count(config.positive_int("num_attention_heads"))
    w.add_layer_norm_eps(config.number("layer_norm_eps"))
    w.add_causal_attention(False)
    w.add_pooling_type(POOLING_TYPES[pooling])
    if labels:
        w.add_classifier_output_labels(labels)

    vocab.add_to(w)
    w.add_token_type_count(config.positive_int("type_vocab_size"))
    if vocab.model == "t5":  # SentencePiece's defaults, as XLM-RoBERTa is trained with
        w.add_add_space_prefix(True)
        w.add_remove_extra_whitespaces(True)
    add_bert_specials(w, special, add_sep)

    for t, name, arr in mapped:
        target = tensor_dtype(name, arr, dtype, keep_f32=t in _KEEP_F32)
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=target))
