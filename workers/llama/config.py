"""LOAD's `runtime_config` for the llama.cpp engine, validated strictly.

Unknown keys and wrong types are refused (`config_invalid`) rather than ignored: a typo such as
`n_thread` must not silently run with defaults.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from workers.heads.files import HeadFile
from workers.llama.device import ALL_LAYERS

PosInt = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
Kind = Literal["embed", "rerank", "generate"]
PoolingName = Literal["none", "mean", "cls", "last", "rank"]


class RuntimeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Every key is optional; unset ones are derived from the GGUF (see `LlamaEngine.load`).

    model_ref     name the host addresses the model by (default: file stem, or the parent
                  directory's name when the file is the store's generic `model.gguf`)
    kind          embed | rerank | generate; default from the GGUF's pooling type
    n_ctx         context size (tokens); per-item limit for embed/rerank, prompt+output for
                  generate
    n_batch       max tokens per llama_decode call
    n_ubatch      max tokens per physical micro-batch (encoders: per decode)
    n_seq_max     max sequences packed into one decode (embed/rerank)
    n_threads     compute threads (the host passes cores / workers); n_threads_batch likewise
    embedding     force embedding mode on/off (a decoder can be served as an embedder)
    pooling       pooling override for embedders (must agree with the model for rerank)
    flash_attn    default: on, except for an encoder reranker (a cross-encoder) on the CPU.
                  Packing many sequences per decode is slower without it, but llama.cpp's CPU
                  flash attention casts an encoder's K and V to f16 (it keeps no KV cache),
                  which tripled a cross-encoder's raw logit error (tiny bge-reranker-v2-m3-style
                  model, logits -11..17: max 0.053 with it, 0.017 without, 0.017 for
                  llama-cpp-python in process without it); an embedder's normalized vector is
                  within its bar either way. A decoder reranker (LLM reranker, decoder
                  classifier) keeps it: its plain attention multiplies every cache cell in use,
                  padded to 256 (see context_plan.flash_attention). True/False force it.
    heads         embed: heads on the token states by output ("sparse", "multivector"), each
                  {path, digest}: loaded with the model (workers.heads), digest checked first
    encode_streams  embed/rerank: llama_contexts decoding one request's packed decodes in
                  parallel, n_threads / streams threads each (default: n_threads on the CPU,
                  1 when offloaded to a GPU; see workers.llama.context_plan.encode_streams)
    seed          accepted for interface stability; greedy decoding draws no randomness
    use_mmap      mmap the GGUF (default True)
    gpu_layers    "auto" (default: all layers on the GPU when the build offloads, else CPU) or
                  a layer count; > 0 on a build without offload is refused. The env
                  SYNAPSE_LLAMA_GPU_LAYERS overrides it (see workers.llama.device)
    """

    model_ref: str | None = None
    kind: Kind | None = None
    n_ctx: PosInt | None = None
    n_batch: PosInt | None = None
    n_ubatch: PosInt | None = None
    n_seq_max: PosInt | None = None
    n_threads: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    n_threads_batch: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    embedding: bool | None = None
    pooling: PoolingName | None = None
    flash_attn: bool | None = None
    encode_streams: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)] = 0
    use_mmap: bool = True
    gpu_layers: Literal["auto"] | Annotated[int, msgspec.Meta(ge=0, le=ALL_LAYERS)] = "auto"
    heads: dict[Literal["sparse", "multivector"], HeadFile] = {}


def parse_runtime_config(raw: object) -> RuntimeConfig:
    """Raise ValueError with a readable reason on any unknown key or bad value."""
    if not isinstance(raw, dict):
        raise ValueError("runtime_config must be an object")
    try:
        return msgspec.convert(raw, RuntimeConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from e
