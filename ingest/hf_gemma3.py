"""The project's own converter for Gemma 3 text encoders (EmbeddingGemma): a Hugging Face /
sentence-transformers `gemma3_text` directory -> GGUF of llama.cpp's `gemma-embedding`.

Written the way llama.cpp's converter (`EmbeddingGemma`, a `Gemma3Model`) writes it, so
llama.cpp's gemma-embedding graph computes what transformers' `Gemma3TextModel` computes:
- tensors under the pinned gguf package's names for the architecture; HF Linear weights are
  (out, in), which is ggml's [in, out], so nothing is transposed;
- every RMSNorm weight (`*norm.weight`: the layers' four, q/k norms, the final norm) gets +1:
  Gemma scales by (1 + w) and llama.cpp by w, which is what its converter adds;
- `sliding_window` is config.json's own value. transformers halves it on load for
  bidirectional attention (a token sees |i - j| < W // 2 + 1) and llama.cpp's symmetric window
  masks |i - j| > W // 2: the same window, from the original W;
- which layers slide is written per layer from `layer_types` (llama.cpp's default is every
  sixth layer global, which a config with other layer types would not be);
- RoPE bases: full attention's for global layers, sliding attention's for local ones;
- sentence-transformers Dense modules become `dense_2` / `dense_3`, which llama.cpp applies
  after pooling, in that order, without bias or activation.
Everything else llama.cpp would compute differently is refused, named: causal attention,
attention logit softcapping, a query scale other than 1/sqrt(head_dim), another activation,
attention biases, scaled RoPE, a Dense with a bias, an activation or a residual, a Dense
chain that does not start and end at the hidden width, pooling that skips the prompt.
A Gemma 3 LLM reranker (`convert_reranker`: a Gemma3ForCausalLM scored with LogitScore) is
written to llama.cpp's causal `gemma3` by the same rules.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH

from common.errors import ArtifactInvalid
from formats.hf_config import HfConfig
from formats.safetensors_io import read_model_weights, read_safetensors
from formats.st_layout import module_kind
from ingest.hf_common import (
    POOLING_TYPES,
    ConvertedModel,
    Dtype,
    PoolingName,
    embed_pooling,
    file_type,
    load_json,
    map_names,
    positive_ints,
    require,
    st_layout,
    tensor_dtype,
    write_gguf,
)
from ingest.hf_vocab import Vocab, spm_vocab
from ingest.llm_rerank import LlmRerankSpec

ARCH = MODEL_ARCH.GEMMA_EMBEDDING
# Keys config.json omits take transformers' Gemma3TextConfig defaults (formats.hf_config).
_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# ggml's GELU is the tanh approximation; these are the HF names of that function.
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")
_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")
_DENSE_NAMES = ("dense_2", "dense_3")  # llama.cpp's two projections, in the order it applies them
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")


def _check_config(config: HfConfig, reranker: bool = False) -> None:
    archs = config.architectures or ["Gemma3TextModel"]
    if reranker and archs != ["Gemma3ForCausalLM"]:
        raise ArtifactInvalid(f"a Gemma 3 LLM reranker is a Gemma3ForCausalLM, not {archs}")
    if not reranker and archs != ["Gemma3TextModel"]:
        raise ArtifactInvalid(
            f"architectures {archs}: only Gemma3TextModel (a text encoder) is converted"
        )
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "head_dim",
        "num_key_value_heads",
        "max_position_embeddings",
    ):
        config.positive_int(key)
    if config.positive_int("num_attention_heads") % config.positive_int("num_key_value_heads"):
        raise ArtifactInvalid("num_attention_heads is not a multiple of num_key_value_heads")
    if reranker:
        _check_causal(config)
    elif config.get("use_bidirectional_attention") is not True:
        raise ArtifactInvalid(
            "use_bidirectional_attention is not true: a causal Gemma 3 is a "
            "decoder, and llama.cpp's gemma-embedding attends both ways"
        )
    if config.get("attn_logit_softcapping") is not None:
        raise ArtifactInvalid(
            "attn_logit_softcapping is set: llama.cpp's gemma-embedding "
            "does not cap attention logits"
        )
    scalar = config.value("query_pre_attn_scalar")
    if reranker and config.positive_int("num_hidden_layers") == 62:
        # llama.cpp's gemma3 takes a 62-layer model for Gemma 3 27B and scales its queries by
        # 1/sqrt(hidden / heads), which is that checkpoint's query_pre_attn_scalar.
        heads = config.positive_int("num_attention_heads")
        width = config.positive_int("hidden_size") / heads
        if scalar != width:
            raise ArtifactInvalid(
                f"query_pre_attn_scalar {scalar} != hidden_size / num_attention_heads {width:g}: "
                "llama.cpp's gemma3 scales a 62-layer model's queries by 1/sqrt(hidden / heads)"
            )
    elif scalar != config.positive_int("head_dim"):
        graph = "gemma3" if reranker else "gemma-embedding"
        raise ArtifactInvalid(
            f"query_pre_attn_scalar {scalar} != head_dim "
            f"{config.positive_int('head_dim')}: llama.cpp's {graph} scales queries by "
            "1/sqrt(head_dim)"
        )
    act = config.value("hidden_activation")
    if act not in _TANH_GELU:
        raise ArtifactInvalid(
            f"hidden_activation {act!r}: llama.cpp's gemma-embedding "
            "computes tanh-approximated GELU only"
        )
    eps = config.number("rms_norm_eps")
    if not eps < 1:
        raise ArtifactInvalid(f"config.json: rms_norm_eps {eps!r} is not a small positive number")
    if config.get("attention_bias"):
        raise ArtifactInvalid(
            "attention_bias is true: llama.cpp's gemma-embedding has no attention biases"
        )


def _check_causal(config: HfConfig) -> None:
    """What llama.cpp's causal `gemma3` graph computes otherwise than transformers'
    Gemma3ForCausalLM does, refused: bidirectional attention, and a capped logit (the score
    would no longer be a difference of two LM-head rows: tanh is applied to each logit)."""
    if config.get("use_bidirectional_attention"):
        raise ArtifactInvalid(
            "use_bidirectional_attention is true: llama.cpp's gemma3 graph is causal"
        )
    cap = config.get("final_logit_softcapping")
    if cap is not None:
        raise ArtifactInvalid(
            f"final_logit_softcapping {cap!r}: the reranker's score would be "
            "cap * (tanh(logit[true] / cap) - tanh(logit[false] / cap)), not the difference "
            "of two LM-head rows that is served"
        )


def _layer_types(config: HfConfig) -> list[bool]:
    """Per layer: does it slide? transformers' own rule when layer_types is absent."""
    n = config.positive_int("num_hidden_layers")
    types = config.get("layer_types")
    if types is None:
        pattern = config.positive_int("sliding_window_pattern")
        slides = [bool((i + 1) % pattern) for i in range(n)]
    else:
        if not isinstance(types, list) or len(types) != n:
            raise ArtifactInvalid(
                f"config.json: layer_types must list one type for each of the {n} layers"
            )
        unknown = sorted(
            {t for t in types if t not in ("sliding_attention", "full_attention")}, key=str
        )
        if unknown:
            raise ArtifactInvalid(f"config.json: unknown layer type {unknown[0]!r}")
        slides = [t == "sliding_attention" for t in types]
    if all(slides) or not any(slides):
        # llama.cpp fills both attention masks of gemma-embedding on every batch; the one no
        # layer uses is never allocated, and the worker aborts on it.
        raise ArtifactInvalid(
            f"{'every' if all(slides) else 'no'} layer uses sliding "
            "attention: llama.cpp's gemma-embedding needs both local and "
            "global layers"
        )
    return slides


def _rope_bases(config: HfConfig) -> dict[str, float]:
    """RoPE base per layer type, read as transformers reads it (either format); scaled RoPE is
    refused."""
    params = config.get("rope_parameters")
    if params is None:  # the older format: top-level thetas, rope_scaling for global layers
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ArtifactInvalid(f"config.json: rope_scaling {scaling!r} is not an object")
        full = {"rope_theta": config.get("rope_theta")} if "rope_theta" in config else {}
        local = (
            {"rope_theta": config.get("rope_local_base_freq")}
            if "rope_local_base_freq" in config
            else {}
        )
        params = {"full_attention": full | scaling, "sliding_attention": local}
    if (
        not isinstance(params, dict)
        or not params.keys() <= set(_THETA)
        or not all(isinstance(v, dict) for v in params.values())
    ):
        raise ArtifactInvalid(
            f"config.json: rope_parameters {params!r} is not one entry per "
            f"layer type ({', '.join(_THETA)})"
        )
    bases: dict[str, float] = {}
    for kind, default in _THETA.items():
        entry = params.get(kind) or {}
        # rope_scaling may say "type" (older) or "rope_type"; either one scaling is refused.
        scaled = [
            t for t in (entry.get("rope_type"), entry.get("type")) if t not in (None, "default")
        ]
        if scaled:
            raise ArtifactInvalid(
                f"rope_type {scaled[0]!r} for {kind} layers: only unscaled RoPE is converted"
            )
        if entry.get("partial_rotary_factor", 1.0) != 1.0:
            raise ArtifactInvalid(
                f"partial_rotary_factor for {kind} layers: llama.cpp's "
                "gemma-embedding rotates the whole head"
            )
        theta = entry.get("rope_theta")
        theta = default if theta is None else theta
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ArtifactInvalid(f"config.json: rope_theta {theta!r} for {kind} layers")
        bases[kind] = float(theta)
    return bases


def _check_modules(model_dir: Path) -> None:
    """The sentence-transformers pipeline is one llama.cpp computes: Transformer, Pooling,
    Dense..., Normalize, in that order and nothing else."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return
    kinds = [module_kind(str(m.get("type", ""))) for m in load_json(path) if isinstance(m, dict)]
    if not kinds:
        return
    other = [k for k in kinds if k not in _ST_MODULES]
    if other:
        raise ArtifactInvalid(
            f"sentence-transformers module {other[0]!r}: llama.cpp's "
            "gemma-embedding computes Transformer, Pooling, Dense, Normalize "
            "only"
        )
    order = [_ST_MODULES.index(k) for k in kinds]
    if order != sorted(order) or kinds.count("Transformer") != 1 or kinds[0] != "Transformer":
        raise ArtifactInvalid(
            f"sentence-transformers modules {kinds}: llama.cpp pools first, "
            "then projects, then normalizes"
        )
    st_cfg = model_dir / "sentence_bert_config.json"
    if st_cfg.is_file() and load_json(st_cfg).get("do_lower_case"):
        raise ArtifactInvalid(
            "sentence_bert_config.json do_lower_case: sentence-transformers "
            "lowercases inputs the served tokenizer would not"
        )


def _dense_layers(dense_dirs: tuple[Path, ...], hidden: int) -> list[np.ndarray]:
    """Each Dense module's weight (out, in), checked to be a plain linear map that llama.cpp's
    dense_2 / dense_3 apply, the chain starting and ending at the hidden width."""
    if len(dense_dirs) > len(_DENSE_NAMES):
        raise ArtifactInvalid(
            f"{len(dense_dirs)} Dense modules: llama.cpp's gemma-embedding "
            f"applies at most {len(_DENSE_NAMES)}"
        )
    out: list[np.ndarray] = []
    width = hidden
    for d in dense_dirs:
        cfg = load_json(d / "config.json")
        positive_ints(cfg, ("in_features", "out_features"))
        # sentence-transformers' own defaults: a bias, tanh.
        if cfg.get("bias", True):
            raise ArtifactInvalid(
                f"{d.name}: a Dense with a bias; llama.cpp's gemma-embedding projects without one"
            )
        act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in _IDENTITY:
            raise ArtifactInvalid(
                f"{d.name}: Dense activation {act!r}; llama.cpp's gemma-embedding applies none"
            )
        if cfg.get("use_residual"):
            raise ArtifactInvalid(
                f"{d.name}: a Dense with a residual connection; llama.cpp's "
                "gemma-embedding has none"
            )
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, "sentence_embedding") != "sentence_embedding":
                raise ArtifactInvalid(
                    f"{d.name}: Dense {key} {cfg[key]!r}; llama.cpp projects "
                    "the pooled sentence embedding"
                )
        if cfg["in_features"] != width:
            raise ArtifactInvalid(
                f"{d.name}: Dense in_features {cfg['in_features']}, but its input is {width} wide"
            )
        path = d / "model.safetensors"
        if not path.is_file():
            raise ArtifactInvalid(
                f"{d.name} has no model.safetensors (pytorch .bin checkpoints "
                "are not read: no torch)"
            )
        weights = read_safetensors(path)
        if set(weights) != {"linear.weight"}:
            raise ArtifactInvalid(f"{d.name}: expected only linear.weight, found {sorted(weights)}")
        w = weights["linear.weight"]
        if tuple(w.shape) != (cfg["out_features"], cfg["in_features"]):
            raise ArtifactInvalid(
                f"{d.name}: linear.weight has shape {tuple(w.shape)}, its "
                f"config says {(cfg['out_features'], cfg['in_features'])}"
            )
        out.append(w)
        width = cfg["out_features"]
    if width != hidden:
        raise ArtifactInvalid(
            f"the Dense modules end {width} wide: llama.cpp's gemma-embedding "
            f"serves vectors of the hidden width {hidden}"
        )
    return out


def _tensors(
    model_dir: Path, config: HfConfig, dense: list[np.ndarray], arch: MODEL_ARCH = ARCH
) -> dict[str, np.ndarray]:
    n_layers = config.positive_int("num_hidden_layers")
    weights = read_model_weights(model_dir)
    projections = {f"{n}.weight": w for n, w in zip(_DENSE_NAMES, dense, strict=False)}
    clash = sorted(projections.keys() & weights.keys())
    if clash:
        raise ArtifactInvalid(f"unexpected tensor {clash[0]!r} in the transformer's weights")
    # A text encoder has no LM head; if one was saved, embeddings never read it.
    tensors = map_names(
        weights | projections, arch, n_layers, ignored=lambda key: key == "lm_head.weight"
    )
    h, ff = config.positive_int("hidden_size"), config.positive_int("intermediate_size")
    hd = config.positive_int("head_dim")
    q = config.positive_int("num_attention_heads") * hd
    kv = config.positive_int("num_key_value_heads") * hd
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (config.positive_int("vocab_size"), h),
        "output_norm.weight": (h,),
    }
    shapes |= {name: tuple(w.shape) for name, w in projections.items()}
    for b in range(n_layers):
        shapes |= {
            f"blk.{b}.attn_norm.weight": (h,),
            f"blk.{b}.attn_q.weight": (q, h),
            f"blk.{b}.attn_k.weight": (kv, h),
            f"blk.{b}.attn_v.weight": (kv, h),
            f"blk.{b}.attn_q_norm.weight": (hd,),
            f"blk.{b}.attn_k_norm.weight": (hd,),
            f"blk.{b}.attn_output.weight": (h, q),
            f"blk.{b}.post_attention_norm.weight": (h,),
            f"blk.{b}.ffn_norm.weight": (h,),
            f"blk.{b}.ffn_gate.weight": (ff, h),
            f"blk.{b}.ffn_up.weight": (ff, h),
            f"blk.{b}.ffn_down.weight": (h, ff),
            f"blk.{b}.post_ffw_norm.weight": (h,),
        }
    require(tensors, shapes)
    extra = sorted(set(tensors) - set(shapes))
    if extra:  # e.g. biases: llama.cpp's gemma-embedding would not load them
        raise ArtifactInvalid(f"unexpected tensor {extra[0]!r}")
    for name in tensors:
        if name.endswith("norm.weight"):
            # Gemma's RMSNorm scales by (1 + w); llama.cpp's by w, as its converter writes it.
            tensors[name] = tensors[name].astype(np.float32) + np.float32(1.0)
    return tensors


def _special_ids(model_dir: Path, tok: dict, vocab: Vocab) -> tuple[dict[str, int], bool, bool]:
    """BOS/EOS/UNK/PAD ids from tokenizer_config.json, and whether the tokenizer's template
    adds BOS / EOS (what llama.cpp's own tokenization should add)."""
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = load_json(cfg_path) if cfg_path.is_file() else {}
    ids: dict[str, int] = {}
    for kind in ("bos", "eos", "unk", "pad"):
        text = cfg.get(f"{kind}_token")
        if isinstance(text, dict):  # AddedToken serialised as an object
            text = text.get("content")
        if isinstance(text, str):
            ids[kind] = vocab.id_of(text, kind)
    post = tok.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    single: list[dict] = next(
        (s.get("single") for s in steps if s.get("type") == "TemplateProcessing"), []
    )
    pieces = [("A" if "Sequence" in p else p.get("SpecialToken", {}).get("id")) for p in single]
    at = pieces.index("A") if "A" in pieces else 0
    add_bos, add_eos = at > 0, at < len(pieces) - 1
    for kind, piece in (
        ("bos", pieces[0] if add_bos else None),
        ("eos", pieces[-1] if add_eos else None),
    ):
        if isinstance(piece, str):
            ids.setdefault(kind, vocab.id_of(piece, kind))
    return ids, add_bos, add_eos


def _space_prefix(tok: dict) -> bool:
    norm = tok.get("normalizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    return any(s and s.get("type") == "Prepend" for s in steps)


def convert(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str,
) -> ConvertedModel:
    _check_config(config)
    swa = _layer_types(config)
    window = config.positive_int("sliding_window")
    bases = _rope_bases(config)
    pooling = embed_pooling(model_dir, pooling)
    _check_modules(model_dir)
    layout = st_layout(model_dir)
    if not layout.include_prompt:
        raise ArtifactInvalid(
            "the Pooling module excludes the prompt's tokens: llama.cpp "
            "pools over every token it is given"
        )
    hidden = config.positive_int("hidden_size")
    dense = _dense_layers(layout.dense_dirs, hidden)
    tensors = _tensors(model_dir, config, dense)

    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ArtifactInvalid(f"missing tokenizer.json in {model_dir}")
    tok = load_json(tok_path)
    vocab = spm_vocab(tok, config.positive_int("vocab_size"))
    special, add_bos, add_eos = _special_ids(model_dir, tok, vocab)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_name(name)
        w.add_file_type(file_type(dtype))
        w.add_context_length(config.positive_int("max_position_embeddings"))
        w.add_embedding_length(hidden)
        w.add_block_count(config.positive_int("num_hidden_layers"))
        w.add_feed_forward_length(config.positive_int("intermediate_size"))
        w.add_head_count(config.positive_int("num_attention_heads"))
        w.add_head_count_kv(config.positive_int("num_key_value_heads"))
        w.add_key_length(config.positive_int("head_dim"))
        w.add_value_length(config.positive_int("head_dim"))
        w.add_layer_norm_rms_eps(config.number("rms_norm_eps"))
        w.add_rope_freq_base(bases["full_attention"])
        w.add_rope_freq_base_swa(bases["sliding_attention"])
        w.add_sliding_window(window)
        w.add_sliding_window_pattern(swa)
        # llama.cpp forces gemma-embedding non-causal; said here too for readers of the header.
        w.add_causal_attention(False)
        w.add_pooling_type(POOLING_TYPES[pooling])
        for dense_name, arr in zip(_DENSE_NAMES, dense, strict=False):
            w.add_dense_features_dims(dense_name, arr.shape[1], arr.shape[0])

        vocab.add_to(w)
        w.add_add_space_prefix(_space_prefix(tok))
        for kind, add in (
            ("bos", w.add_bos_token_id),
            ("eos", w.add_eos_token_id),
            ("unk", w.add_unk_token_id),
            ("pad", w.add_pad_token_id),
        ):
            if kind in special:
                add(special[kind])
        w.add_add_bos_token(add_bos)
        w.add_add_eos_token(add_eos)

        for tname, arr in tensors.items():
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=tensor_dtype(tname, arr, dtype)))

    write_gguf(out_path, gguf.MODEL_ARCH_NAMES[ARCH], fill)
    return ConvertedModel(
        kind="embed",
        dtype=dtype,
        dims=dense[-1].shape[0] if dense else hidden,
        pooling=pooling,
        n_ctx_train=config.positive_int("max_position_embeddings"),
        vocab_size=config.positive_int("vocab_size"),
        n_layers=config.positive_int("num_hidden_layers"),
        n_labels=0,
        cls_id=None,
        sep_id=None,
        max_seq_length=layout.max_seq_length,
        architecture=gguf.MODEL_ARCH_NAMES[ARCH],
    )


RERANK_ARCH = MODEL_ARCH.GEMMA3


def convert_reranker(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    name: str,
    spec: LlmRerankSpec,
) -> ConvertedModel:
    """A Gemma 3 LLM reranker (a Gemma3ForCausalLM that sentence-transformers scores with
    `LogitScore`) -> GGUF of llama.cpp's causal `gemma3`, with the same weights, norms, window
    and RoPE rules as the embedder, rank pooling and the two scored tokens as
    `classifier.output_labels` [true, false]. Unlike Qwen3's, llama.cpp's gemma3 graph loads
    no `cls.output` tensor (a file with one would not load), so the worker reads the two rows
    of the LM head llama.cpp uses: `output.weight`, written only when the checkpoint does not
    tie it to the token embedding, else `token_embd.weight`."""
    _check_config(config, reranker=True)
    swa = _layer_types(config)
    window = config.positive_int("sliding_window")
    bases = _rope_bases(config)
    tensors = _tensors(model_dir, config, [], RERANK_ARCH)
    # transformers' Gemma3TextConfig ties the LM head to the token embedding unless told not to.
    if config.get("tie_word_embeddings") is False:
        head = read_model_weights(model_dir).get("lm_head.weight")
        if head is None:
            raise ArtifactInvalid("tie_word_embeddings is false, but there is no lm_head.weight")
        tensors["output.weight"] = head
    hidden = config.positive_int("hidden_size")
    n_vocab = config.positive_int("vocab_size")
    if max(spec.true_id or 0, spec.false_id or 0) >= n_vocab:
        raise ArtifactInvalid(f"the scored tokens are outside the {n_vocab}-row LM head")
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ArtifactInvalid(f"missing tokenizer.json in {model_dir}")
    tok = load_json(tok_path)
    vocab = spm_vocab(tok, n_vocab)
    special, _, _ = _special_ids(model_dir, tok, vocab)
    assert spec.true_token is not None and spec.false_token is not None
    labels = [spec.true_token, spec.false_token]

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_name(name)
        w.add_file_type(file_type(dtype))
        w.add_context_length(config.positive_int("max_position_embeddings"))
        w.add_embedding_length(hidden)
        w.add_block_count(config.positive_int("num_hidden_layers"))
        w.add_feed_forward_length(config.positive_int("intermediate_size"))
        w.add_head_count(config.positive_int("num_attention_heads"))
        w.add_head_count_kv(config.positive_int("num_key_value_heads"))
        w.add_key_length(config.positive_int("head_dim"))
        w.add_value_length(config.positive_int("head_dim"))
        w.add_layer_norm_rms_eps(config.number("rms_norm_eps"))
        w.add_rope_freq_base(bases["full_attention"])
        w.add_rope_freq_base_swa(bases["sliding_attention"])
        w.add_sliding_window(window)  # causal: transformers keeps config.json's window as is
        w.add_sliding_window_pattern(swa)
        w.add_pooling_type(POOLING_TYPES["rank"])
        w.add_classifier_output_labels(labels)
        w.add_chat_template(spec.chat_template)
        vocab.add_to(w)
        w.add_add_space_prefix(_space_prefix(tok))
        for kind, add in (
            ("bos", w.add_bos_token_id),
            ("eos", w.add_eos_token_id),
            ("unk", w.add_unk_token_id),
            ("pad", w.add_pad_token_id),
        ):
            if kind in special:
                add(special[kind])
        # The chat template composes each sequence (its own <bos>); llama.cpp adds nothing.
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        for tname, arr in tensors.items():
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=tensor_dtype(tname, arr, dtype)))

    write_gguf(out_path, gguf.MODEL_ARCH_NAMES[RERANK_ARCH], fill)
    return ConvertedModel(
        kind="rerank",
        dtype=dtype,
        dims=hidden,
        pooling="rank",
        n_ctx_train=config.positive_int("max_position_embeddings"),
        vocab_size=n_vocab,
        n_layers=config.positive_int("num_hidden_layers"),
        n_labels=0,
        cls_id=None,
        sep_id=None,
        max_seq_length=st_layout(model_dir).max_seq_length,
        architecture=gguf.MODEL_ARCH_NAMES[RERANK_ARCH],
        llm_rerank=spec,
    )
