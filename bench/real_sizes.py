"""bench.embed at the real sizes of two models people serve: random (seeded) weights at the
exact configs of multilingual-e5-small (XLM-RoBERTa) and Qwen3-Embedding-0.6B (Qwen3).

    python -m bench.real_sizes [--which xlmr|qwen3|both] [--repeats N] [--out FILE]

No download: each directory is built here once, into `<synapse cache>/bench/real-sizes/`
(reused when present), as the hub's sentence-transformers directories are laid out
(config.json, model.safetensors in f32, tokenizer.json, modules.json, 1_Pooling,
2_Normalize, sentence_bert_config.json, config_sentence_transformers.json with the models'
prompts), then ingested into a store of its own there with `ArtifactStore.ingest_hf_dir` at
this platform's default embedding precision, and benchmarked with bench.embed (lane vs
in-process vs sentence-transformers vs ONNX Runtime, same texts, interleaved repeats).

- xlmr: XLMRobertaModel, 12 layers, hidden 384, 12 heads, intermediate 1536, vocab 250037,
  max_position_embeddings 514 (512 tokens), pad 1, one token type; mean pooling + Normalize;
  e5's "query: " / "passage: " prompts (the bench embeds passages). Tokenizer: a Unigram
  model trained here with SentencePiece on the certification corpus, fairseq ids <s>=0
  <pad>=1 </s>=2 <unk>=3, `<s> A </s>`, with SentencePiece's precompiled normalizer.
- qwen3: Qwen3Model, 28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
  intermediate 3072, vocab 151669, rope_theta 1e6, rms_norm_eps 1e-6, tied embeddings;
  last-token pooling + Normalize; Qwen3-Embedding's query instruction prompt (the bench
  embeds documents: no prompt). Tokenizer: byte-level BPE trained here with `tokenizers`
  (Qwen2's split regex, ByteLevel, NFC), `<|endoftext|>` appended to every input by a
  TemplateProcessing post-processor, as Qwen3-Embedding's tokenizer does (the last token is
  the one pooled).

The trained vocabularies are small (the corpus is ~300 items: ~900 Unigram pieces, ~2.4k BPE
tokens), so their ids use a subset of the full-size embedding tables; the compute per token is
the real model's, but a text takes more tokens than with the real vocabulary (read tokens/s,
or the ratios, rather than sentences/s). The Qwen3 run embeds fewer, shorter texts (one
repeat of 0.6B parameters in fp32 on 2 cores takes minutes): its JSON says how many.
Targets, reported not asserted: lane / ORT >= 1.0 for the XLM-R shape, lane /
sentence-transformers >= 1.2 for the Qwen3 shape.

A model is ingested again when the converter sources (ingest/*.py) changed since it was
ingested, so a fixed converter is measured, not its predecessor's GGUF.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from certification.corpus import corpus
from ingest.store import ArtifactStore, default_root

SEED = 0
E5_PROMPTS = {"query": "query: ", "passage": "passage: "}
QWEN3_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
    "query\nQuery:",
    "document": "",
}
# Qwen2's pre-tokenizer split, as its tokenizer.json (and llama.cpp's "qwen2") spells it.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_MAX_SEQ = 8192
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

XLMR_CONFIG = {
    "architectures": ["XLMRobertaModel"],
    "attention_probs_dropout_prob": 0.1,
    "bos_token_id": 0,
    "classifier_dropout": None,
    "eos_token_id": 2,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 384,
    "initializer_range": 0.02,
    "intermediate_size": 1536,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 514,
    "model_type": "xlm-roberta",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "position_embedding_type": "absolute",
    "torch_dtype": "float32",
    "type_vocab_size": 1,
    "use_cache": True,
    "vocab_size": 250037,
}
QWEN3_CONFIG = {
    "architectures": ["Qwen3Model"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151669,
    # bos/eos: the trained tokenizer's <|endoftext|> id (151643 in the real vocabulary)
}


@dataclass(frozen=True)
class Shape:
    """One real-size model: how to build its directory and how to bench it."""

    key: str  # --which
    name: str  # store name
    real: str  # the model whose shape this is
    build: Callable[[Path, dict, int], None]
    config: dict
    bench: dict = field(default_factory=dict)  # run_bench keyword arguments
    target: tuple[str, str, float] = ("", "", 0.0)  # (section, ratio key, at least)


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _st_files(
    out: Path, dims: int, pooling_key: str, max_seq_length: int, prompts: dict[str, str]
) -> None:
    """The hub's (sentence-transformers <= 5) layout: Transformer, Pooling, Normalize."""
    _write_json(
        out / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ],
    )
    modes = [
        "cls_token",
        "mean_tokens",
        "max_tokens",
        "mean_sqrt_len_tokens",
        "weightedmean_tokens",
        "lasttoken",
    ]
    _write_json(
        out / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": dims,
            **{f"pooling_mode_{m}": m == pooling_key for m in modes},
            "include_prompt": True,
        },
    )
    (out / "2_Normalize").mkdir(exist_ok=True)
    _write_json(
        out / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length, "do_lower_case": False},
    )
    _write_json(
        out / "config_sentence_transformers.json",
        {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"},
    )


def _save_weights(model, out: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def xlmr_tokenizer(out: Path, max_seq_length: int, vocab_size: int = 8000) -> int:
    """XLM-RoBERTa's tokenizer files (fairseq ids <s>=0 <pad>=1 </s>=2 <unk>=3) from a Unigram
    model trained here on the certification corpus, with SentencePiece's precompiled normalizer
    as the hub's files carry; its size (<mask> comes after the trained pieces). One training
    thread: the same pieces every run, so seeded models built on it are the same every run."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import XLMRobertaTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(corpus()) * 3),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    proto = pb.ModelProto()
    proto.ParseFromString(buf.getvalue())
    tok = XLMRobertaTokenizer(vocab=[(p.piece, p.score) for p in proto.pieces])
    tok.model_max_length = max_seq_length
    tok.save_pretrained(str(out))
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {
                "type": "Precompiled",
                "precompiled_charsmap": base64.b64encode(
                    proto.normalizer_spec.precompiled_charsmap
                ).decode(),
            },
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        ],
    }
    spec["truncation"] = spec["padding"] = None
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return len(tok)


def qwen3_tokenizer(out: Path) -> int:
    """Qwen3-Embedding's tokenizer files from a byte-level BPE trained here; the id of
    <|endoftext|> (after the trained tokens, as in the real vocabulary)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        list(corpus()),
        trainers.BpeTrainer(
            vocab_size=8000,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.add_special_tokens(QWEN3_SPECIALS)
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A:0 <|endoftext|>:0",
        pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eos)],
    )
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "add_prefix_space": False,
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "padding_side": "left",  # Qwen3-Embedding's; sentence-transformers' lasttoken copes
            "model_max_length": 131072,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": QWEN3_SPECIALS[1:],
        },
    )
    return eos


def build_xlmr(out: Path, config: dict, seed: int) -> None:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    max_seq = config["max_position_embeddings"] - config["pad_token_id"] - 1
    n_tok = xlmr_tokenizer(out, max_seq)
    if n_tok > config["vocab_size"]:
        raise ValueError(f"the tokenizer has {n_tok} tokens, the table {config['vocab_size']}")
    torch.manual_seed(seed)
    model = XLMRobertaModel(XLMRobertaConfig(**config)).eval()  # with the pooler, as e5 has
    _save_weights(model, out)
    _write_json(out / "config.json", config)
    _st_files(out, config["hidden_size"], "mean_tokens", max_seq, E5_PROMPTS)


def build_qwen3(out: Path, config: dict, seed: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3Model

    eos = qwen3_tokenizer(out)
    config = {**config, "bos_token_id": eos, "eos_token_id": eos}
    torch.manual_seed(seed)
    model = Qwen3Model(Qwen3Config(**config)).eval()
    _save_weights(model, out)
    _write_json(out / "config.json", config)
    # sentence_bert_config's limit (the store caps an input at the worker's encoder batch)
    _st_files(out, config["hidden_size"], "lasttoken", QWEN3_MAX_SEQ, QWEN3_PROMPTS)


SHAPES = {
    "xlmr": Shape(
        "xlmr",
        "e5-small-random",
        "intfloat/multilingual-e5-small",
        build_xlmr,
        XLMR_CONFIG,
        bench={"prompt_name": "passage"},
        target=("ort", "lane_vs_ort", 1.0),
    ),
    "qwen3": Shape(
        "qwen3",
        "qwen3-embedding-0.6b-random",
        "Qwen/Qwen3-Embedding-0.6B",
        build_qwen3,
        QWEN3_CONFIG,
        bench={"prompt_name": "document", "sentences": 96, "max_chars": 200},
        target=("sentence_transformers", "lane_ratio_vs_sentence_transformers", 1.2),
    ),
}


def cache_dir() -> Path:
    return default_root().parent / "bench" / "real-sizes"


def ensure_dir(shape: Shape, root: Path, config: dict | None = None, seed: int = SEED) -> Path:
    """The shape's directory under `root`, built once (atomically: a directory that exists
    is complete)."""
    config = config or shape.config
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    out = root / f"{shape.key}-{digest}-s{seed}"
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shape.build(tmp, config, seed)
    tmp.replace(out)
    return out


def _converter_digest() -> str:
    """The ingest sources: a changed converter means a GGUF to build again."""
    h = hashlib.sha256()
    for p in sorted((Path(__file__).resolve().parent.parent / "ingest").glob("*.py")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def ensure_model(store: ArtifactStore, hf_dir: Path, name: str, dtype: str | None = None):
    """`name` in `store`, ingested from `hf_dir` (again when the source or converter
    changed)."""
    from ingest.precision import embed_precision

    dtype = dtype or embed_precision().dtype
    stamps = store.root.parent / "ingested.json"
    seen = json.loads(stamps.read_text()) if stamps.is_file() else {}
    want = {"source": f"hf-dir:{hf_dir}", "dtype": dtype, "converter": _converter_digest()}
    if name in {r.name for r in store.ls()}:
        if seen.get(name) == want:
            return store.get(name)
        store.rm(name)
    record = store.ingest_hf_dir(hf_dir, name, dtype=dtype)
    seen[name] = want
    _write_json(stamps, seen)
    return record


def run_shape(
    shape: Shape,
    repeats: int,
    threads: int | None = None,
    root: Path | None = None,
    config: dict | None = None,
    **bench_kwargs,
) -> dict:
    from bench.embed import run_bench

    root = root or cache_dir()
    hf_dir = ensure_dir(shape, root, config)
    store = ArtifactStore(root / "models")
    record = ensure_model(store, hf_dir, shape.name)
    kwargs = {**shape.bench, **bench_kwargs}
    result = run_bench(
        record.name, repeats=repeats, threads=threads, store_root=str(store.root), **kwargs
    )
    result["shape_of"] = shape.real
    result["hf_dir"] = str(hf_dir)
    section, key, floor = shape.target
    got = result.get(section, {}).get(key)
    result["target"] = {
        "ratio": f"{section}.{key}",
        "at_least": floor,
        "value": got,
        "met": None if got is None else got >= floor,
    }
    return result


def _cpu() -> dict[str, str]:
    """This machine's CPU as /proc/cpuinfo names it (what OpenBLAS's kernel choice reads)."""
    out: dict[str, str] = {"cores": str(os.cpu_count())}
    if sys.platform != "linux":  # /proc is Linux's
        return out
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in out:
                    out[key] = value.strip()
                if not line.strip():
                    break
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.real_sizes")
    parser.add_argument("--which", choices=["xlmr", "qwen3", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--sentences",
        type=int,
        default=None,
        help="texts per repeat (default: 512 for xlmr, 96 for qwen3)",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    keys = ["xlmr", "qwen3"] if args.which == "both" else [args.which]
    extra = {"sentences": args.sentences} if args.sentences else {}
    runs = {}
    for key in keys:
        runs[key] = run_shape(SHAPES[key], args.repeats, args.threads, **extra)
        print(json.dumps({key: runs[key]}), file=sys.stderr, flush=True)  # progress
    out = {"bench": "real_sizes", "cpu": _cpu(), "runs": runs}
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
