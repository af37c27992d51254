"""A jina-embeddings-v3 directory -> GGUF (arch `jina-bert-v3`), one task's LoRA adapter merged.

What llama.cpp's jina-bert-v3 graph computes (models/bert.cpp in the vendored llama.cpp), the
function transformers' `JinaEmbeddingsV3Model` computes: token + token-type embeddings ->
LayerNorm (no position table: rotary positions, NEOX halves as transformers' `rotate_half`);
per layer, post-norm: fused QKV with biases, bidirectional attention, output projection,
residual, LayerNorm; a GELU MLP `fc2(gelu(fc1(x)))`, residual, LayerNorm.

Two directory forms, both in the original checkpoint's tensor names (`emb_ln`,
`encoder.layers.N.mixer.Wqkv`, `mixer.out_proj`, `mlp.fc1`/`fc2`, `norm1`/`norm2`; what
transformers' `save_pretrained` writes too):

- transformers' `jina_embeddings_v3` (no adapters): converted as it is.
- the Hub's checkpoint (`model_type` `xlm-roberta` with `lora_adaptations`, weights under
  `roberta.`): every Linear and Embedding weight carries a torch parametrization, the weight
  as `X.parametrizations.weight.original` and one LoRA pair per task as
  `X.parametrizations.weight.0.lora_A` / `lora_B`, stacked on a first axis in the order of
  `lora_adaptations`. The checkpoint's own code applies task t as
  `W + (B[t] @ A[t]) * lora_alpha / lora_rank` for a Linear (A: rank x in, B: out x rank) and
  `W + (A[t] @ B[t]) * lora_alpha / lora_rank` for an Embedding (A: rows x rank, B: rank x
  width). Without a task the model is meant to be used with one, so one task must be named
  (the prompt of that name, chosen as the default prompt at ingest): its adapter is merged into
  the weights here, in float64, and the model serves that task alone. llama.cpp's own
  converter writes the adapters as separate LoRA GGUFs instead; merging gives the same
  function without a runtime adapter. A retrieval setup ingests the model twice
  (`retrieval.query` for queries, `retrieval.passage` for documents).

The task's instruction (`task_instructions`) is the prompt the store records for the task, so
every call applies it as jina's own `encode(task=...)` prepends it. Only a mean pooling is
declared by the checkpoint's sentence-transformers modules; the vocabulary is XLM-RoBERTa's
Unigram, written as the XLM-RoBERTa converter writes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH

from common.errors import ArtifactInvalid, InvalidRequest
from formats.hf_config import HfConfig
from formats.safetensors_io import read_model_weights
from ingest.bert_to_gguf import add_bert_specials, special_ids, unigram_dir_vocab
from ingest.hf_common import (
    POOLING_TYPES,
    ConvertedModel,
    Dtype,
    PoolingName,
    file_type,
    map_names,
    require,
    st_layout,
    st_pooling,
    tensor_dtype,
    write_gguf,
)

ARCH = MODEL_ARCH.JINA_BERT_V3
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]  # "jina-bert-v3"
MODEL_TYPE = "jina_embeddings_v3"
DEFAULT_ROPE_THETA = 20000.0  # transformers' JinaEmbeddingsV3Config.default_theta
_PARAM = re.compile(
    r"^(?P<stem>.+)\.parametrizations\.weight\.(?P<part>original|0\.lora_A|0\.lora_B)$"
)
_IGNORED = re.compile(r"^(pooler\..*|embeddings\.position_ids|lm_head\..*)$")


def is_jina_v3(config: HfConfig) -> bool:
    """transformers' jina_embeddings_v3, or the Hub's XLM-RoBERTa with rotary positions and
    task adapters (what the XLM-RoBERTa converter would refuse for its positions)."""
    if config.model_type == MODEL_TYPE:
        return True
    return config.model_type == "xlm-roberta" and config.get("lora_adaptations") is not None


def tasks(config: HfConfig) -> list[str]:
    value = config.get("lora_adaptations")
    if value is None:
        return []
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise ArtifactInvalid("config.json: lora_adaptations must be a list of task names")
    return list(value)


def task_instructions(config: HfConfig) -> dict[str, str]:
    """The instruction each task prepends (jina's `encode(task=...)`), as prompts by task."""
    value = config.mapping("task_instructions")
    if not all(isinstance(v, str) for v in value.values()):
        raise ArtifactInvalid("config.json: task_instructions must map tasks to text")
    return dict(value)


def merged_weights(
    weights: dict[str, np.ndarray], config: HfConfig, task: str | None
) -> dict[str, np.ndarray]:
    """The checkpoint's weights with `task`'s adapter merged (see the module docstring), the
    `roberta.` prefix dropped; a directory without adapters comes back as it is."""
    names = tasks(config)
    plain: dict[str, np.ndarray] = {}
    params: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in weights.items():
        k = key.removeprefix("roberta.")
        m = _PARAM.match(k)
        if m is None:
            plain[k] = arr
        else:
            params.setdefault(m["stem"], {})[m["part"]] = arr
    if not params:
        if names:
            raise ArtifactInvalid("config.json names lora_adaptations but the weights have none")
        return plain
    if not names:
        raise ArtifactInvalid("the weights carry LoRA adapters but config.json names no tasks")
    if task is None:
        raise InvalidRequest(
            f"jina-embeddings-v3 serves one task per ingest (its LoRA adapter is merged into the "
            f"weights): name it as the default prompt, one of {', '.join(names)} (ingest twice "
            "for retrieval: retrieval.query and retrieval.passage)"
        )
    if task not in names:
        raise InvalidRequest(f"task {task!r} is not one of the model's ({', '.join(names)})")
    t = names.index(task)
    scale = config.number("lora_alpha", 1.0) / config.positive_int("lora_rank")
    for stem, parts in params.items():
        if set(parts) != {"original", "0.lora_A", "0.lora_B"}:
            raise ArtifactInvalid(f"{stem}: a parametrization without {sorted(parts)} is unknown")
        w, a, b = parts["original"], parts["0.lora_A"], parts["0.lora_B"]
        if a.ndim != 3 or b.ndim != 3 or a.shape[0] != len(names) or b.shape[0] != len(names):
            raise ArtifactInvalid(f"{stem}: LoRA pairs must stack one per task ({len(names)})")
        # nn.Embedding: (rows x rank) @ (rank x width); nn.Linear: (out x rank) @ (rank x in)
        left, right = (a[t], b[t]) if stem.endswith("_embeddings") else (b[t], a[t])
        if (left.shape[0], right.shape[1]) != w.shape or left.shape[1] != right.shape[0]:
            raise ArtifactInvalid(
                f"{stem}: the adapter's {left.shape} @ {right.shape} does not fit {w.shape}"
            )
        plain[f"{stem}.weight"] = _merge(w, left, right, scale)
    return plain


def _merge(w: np.ndarray, left: np.ndarray, right: np.ndarray, scale: float) -> np.ndarray:
    """`w + scale * left @ right` in float64, stored f32, a block of rows at a time: the
    word-embedding delta of the real model (250002 x 1024) would take 2 GB in one piece."""
    out = np.empty(w.shape, dtype=np.float32)
    r = right.astype(np.float64)
    for start in range(0, w.shape[0], 8192):
        rows = slice(start, start + 8192)
        delta = left[rows].astype(np.float64) @ r
        out[rows] = w[rows].astype(np.float64) + scale * delta
    return out


def rope_theta(config: HfConfig) -> float:
    """`rotary_emb_base` (the Hub's config) or `rope_parameters.rope_theta` (transformers');
    both present must agree."""
    given = {}
    if config.get("rotary_emb_base") is not None:
        given["rotary_emb_base"] = config.number("rotary_emb_base")
    rope = config.mapping("rope_parameters")
    if rope.get("rope_theta") is not None:
        given["rope_parameters.rope_theta"] = float(rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            raise ArtifactInvalid(f"config.json: rope_type {rope['rope_type']!r} is not served")
    if len(set(given.values())) > 1:
        raise ArtifactInvalid(f"config.json: the rotary bases disagree ({given})")
    return next(iter(given.values()), DEFAULT_ROPE_THETA)


def convert(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str,
    *,
    task: str | None = None,
) -> ConvertedModel:
    act = config.string("hidden_act", "gelu")
    if act != "gelu":
        raise ArtifactInvalid(f"unsupported hidden_act {act!r} (jina-bert-v3 runs GELU)")
    h, heads = config.positive_int("hidden_size"), config.positive_int("num_attention_heads")
    ff, layers = config.positive_int("intermediate_size"), config.positive_int("num_hidden_layers")
    n_vocab, n_types = config.positive_int("vocab_size"), config.positive_int("type_vocab_size", 1)
    # The config keeps XLM-RoBERTa's position-table size, whose first pad_token_id + 1 rows were
    # never positions (8194 -> 8192 trained tokens); llama.cpp's converter records the same.
    n_ctx = config.positive_int("max_position_embeddings") - _pad_offset(config)
    if h % heads:
        raise ArtifactInvalid("hidden_size is not a multiple of num_attention_heads")
    if pooling is None:
        pooling = st_pooling(model_dir)
        if pooling is None:
            raise InvalidRequest(f"{model_dir} declares no pooling; pass pooling=")
    elif pooling == "rank":
        raise InvalidRequest("rank pooling needs a sequence-classification model")
    merged = merged_weights(read_model_weights(model_dir), config, task)
    tensors = map_names(merged, ARCH, layers, lambda k: _IGNORED.match(k) is not None)
    require(
        tensors,
        {
            "token_embd.weight": (n_vocab, h),
            "token_types.weight": (n_types, h),
            "token_embd_norm.weight": (h,),
            **{
                f"blk.{b}.{n}": s
                for b in range(layers)
                for n, s in {
                    "attn_qkv.weight": (3 * h, h),
                    "attn_qkv.bias": (3 * h,),
                    "attn_output.weight": (h, h),
                    "attn_output_norm.weight": (h,),
                    "ffn_up.weight": (ff, h),
                    "ffn_down.weight": (h, ff),
                    "layer_output_norm.weight": (h,),
                }.items()
            },
        },
    )
    vocab = unigram_dir_vocab(model_dir, n_vocab)
    special = special_ids(model_dir, vocab.ids, "xlm-roberta")
    max_seq = st_layout(model_dir).max_seq_length
    theta = rope_theta(config)
    eps = config.number("layer_norm_eps", 1e-5)
    ordered = dict(sorted(tensors.items(), key=lambda kv: _tensor_order(kv[0])))

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_name(name)
        w.add_file_type(file_type(dtype))
        w.add_context_length(n_ctx)
        w.add_embedding_length(h)
        w.add_feed_forward_length(ff)
        w.add_block_count(layers)
        w.add_head_count(heads)
        w.add_layer_norm_eps(eps)
        w.add_rope_freq_base(theta)
        w.add_causal_attention(False)
        w.add_pooling_type(POOLING_TYPES[pooling])
        vocab.add_to(w)
        w.add_token_type_count(n_types)
        w.add_add_space_prefix(True)  # SentencePiece's defaults, as XLM-RoBERTa is trained
        w.add_remove_extra_whitespaces(True)
        add_bert_specials(w, special, add_sep=True)
        for tname, arr in ordered.items():
            target = tensor_dtype(tname, arr, dtype, keep_f32=tname.startswith("token_types"))
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=target))

    write_gguf(out_path, ARCH_NAME, fill)
    return ConvertedModel(
        kind="embed",
        dtype=dtype,
        dims=h,
        pooling=pooling,
        n_ctx_train=n_ctx,
        vocab_size=n_vocab,
        n_layers=layers,
        n_labels=0,
        cls_id=special["cls"],
        sep_id=special["sep"],
        max_seq_length=max_seq if isinstance(max_seq, int) else None,
        architecture=ARCH_NAME,
        task=task if tasks(config) else None,
    )


def _pad_offset(config: HfConfig) -> int:
    pad = config.value("pad_token_id", 1)
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise ArtifactInvalid(f"config.json: pad_token_id {pad!r} is not a token id")
    if pad + 1 >= config.positive_int("max_position_embeddings"):
        raise ArtifactInvalid("config.json: max_position_embeddings leaves no positions")
    return pad + 1


def _tensor_order(name: str) -> tuple[int, str]:
    m = re.match(r"^blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)
