"""llama.cpp through llama-cpp-python's ctypes API: the backend, model and context params,
the llama_contexts and llama_batches a loaded model owns, and the one decode call.

The shapes these are created with are decided in context_plan.py; here they are only handed
to llama.cpp, and what llama.cpp resolved is read back.
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import _ggml

from workers.engine import EngineError
from workers.llama import cpu_quirks
from workers.llama.config import Kind
from workers.llama.context_plan import ContextPlan
from workers.llama.device import context_param_fields, model_param_fields
from workers.llama.last_states import LastStates
from workers.llama.llm_head import DecoderHead
from workers.llama.model_kind import POOLING_TYPES
from workers.llama.typed_pairs import TypedPairs

VERBOSE_ENV = "SYNAPSE_LLAMA_VERBOSE"
TOKEN_NULL = -1

_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        # llama-cpp-python routes llama.cpp's log through this logger; keep INFO chatter out
        # of the worker log ring unless asked (errors still print).
        verbose = os.environ.get(VERBOSE_ENV) == "1"
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        _backend_ready = True


def registered_backends() -> list[str]:
    """ggml's backend registry ("BLAS", "CPU", "MTL"...). llama_print_system_info names the
    CPU's features only, and whether a BLAS library runs the matmuls changes both the speed
    and the float rounding (so it belongs in HELLO's build flags, hence the certificate)."""
    lib = _ggml.libggml
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_reg_get.restype = ctypes.c_void_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    names = []
    for i in range(lib.ggml_backend_reg_count()):
        name = lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))
        names.append(name.decode("utf-8", "replace") if name else "?")
    return names


def system_info() -> str:
    """llama.cpp's feature string ("CPU : SSE3 = 1 | AVX = 1 | ...")."""
    flags = llama_cpp.llama_print_system_info()
    return flags.decode("utf-8", "replace").strip() if flags else ""


def model_params(gpu_layers: int, use_mmap: bool = True) -> llama_cpp.llama_model_params:
    """The model params a lane of `gpu_layers` layers loads with: the extra-buffer-type policy
    (AMX: see workers/llama/cpu_quirks.py), the device fields (a CPU lane lists no GPU
    device: see workers/llama/device.py) and the load mode."""
    params = cpu_quirks.model_params()
    for name, value in model_param_fields(gpu_layers).items():
        setattr(params, name, value)
    params.load_mode = (
        llama_cpp.LLAMA_LOAD_MODE_MMAP if use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
    )
    return params


def context_params(offloaded: bool) -> llama_cpp.llama_context_params:
    """llama.cpp's default context params with the device fields (a CPU lane offloads no op)."""
    params = llama_cpp.llama_context_default_params()
    for name, value in context_param_fields(offloaded).items():
        setattr(params, name, value)
    return params


def planned_context_params(
    plan: ContextPlan, *, offloaded: bool, encoder: bool, pooling: str, flash_attn: bool
) -> llama_cpp.llama_context_params:
    """`context_params` filled in with the plan's shape, for one of its `plan.streams`."""
    cparams = context_params(offloaded)
    cparams.n_ctx = plan.n_ctx
    cparams.n_batch = plan.n_batch
    cparams.n_ubatch = plan.n_ubatch
    cparams.n_seq_max = plan.n_seq_max
    cparams.n_threads, cparams.n_threads_batch = plan.stream_threads
    cparams.embeddings = encoder
    cparams.pooling_type = POOLING_TYPES[pooling if encoder else "none"]
    cparams.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if flash_attn
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    cparams.no_perf = True
    # Encoders keep no KV cache; a unified layout stops llama.cpp from rounding n_ctx up
    # to n_seq_max * 256 (it sizes per-sequence contexts otherwise).
    cparams.kv_unified = encoder
    return cparams


def _view(ptr: Any, ctype: type, n: int) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctype)), shape=(n,))


def batch_views(b: llama_cpp.llama_batch, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy views of a llama_batch's positions, sequence counts and output flags."""
    return (
        _view(b.pos, ctypes.c_int32, n),
        _view(b.n_seq_id, ctypes.c_int32, n),
        _view(b.logits, ctypes.c_int8, n),
    )


@dataclass
class EmbdBatch:
    """A llama_batch of input embeddings (`embd`, n_embd floats a token) and its views."""

    batch: llama_cpp.llama_batch
    embd: np.ndarray = field(repr=False)  # (capacity, n_embd) float32
    pos: np.ndarray = field(repr=False)
    nsid: np.ndarray = field(repr=False)
    out: np.ndarray = field(repr=False)

    @classmethod
    def create(cls, capacity: int, n_embd: int) -> EmbdBatch:
        b = llama_cpp.llama_batch_init(capacity, n_embd, 1)
        embd = np.ctypeslib.as_array(
            ctypes.cast(b.embd, ctypes.POINTER(ctypes.c_float)), shape=(capacity, n_embd)
        )
        pos, nsid, out = batch_views(b, capacity)
        return cls(b, embd, pos, nsid, out)


@dataclass
class Slot:
    """One llama_context and its llama_batch. A generator has one; an encoder on the CPU has
    one per encode stream, all sharing the model's weights (see context_plan.encode_streams)."""

    ctx: ctypes.c_void_p
    batch: llama_cpp.llama_batch
    capacity: int  # llama_batch slots: n_batch plus headroom (see make_slot)
    # Token views into the llama_batch (filled with numpy, not per-token ctypes calls).
    tok: np.ndarray = field(repr=False)
    pos: np.ndarray = field(repr=False)
    nsid: np.ndarray = field(repr=False)
    out: np.ndarray = field(repr=False)

    # Input-embedding batch for typed BERT pairs (see workers/llama/typed_pairs.py).
    typed: EmbdBatch | None = None
    # The final states of a decode's output tokens, for a head on each sequence's last
    # token (see workers/llama/last_states.py); None when llama.cpp pools.
    last: LastStates | None = None

    def free(self) -> None:
        if self.typed is not None:
            llama_cpp.llama_batch_free(self.typed.batch)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def make_slot(
    model: ctypes.c_void_p,
    cparams: llama_cpp.llama_context_params,
    last: LastStates | None = None,
) -> Slot:
    """A context and its batch; with `last`, a context that outputs each sequence's last
    token only, its final state read through `last` (see last_states.py)."""
    if last is not None:
        cparams = llama_cpp.llama_context_params.from_buffer_copy(cparams)
        # Embedding mode would make every token an output (and run the LM head on each).
        cparams.embeddings = False
        # At most one output per sequence: llama.cpp reserves its graph and output buffer
        # for this many outputs rather than n_batch of full-vocabulary rows.
        cparams.n_outputs_max = cparams.n_seq_max
        # K and V in f32, as the reference computes attention: with f16 cells, ggml rounds Q
        # to f16 for the KQ product on its own kernels (under 32 rows) but not through BLAS
        # (32 and up), so a pair's score would move with how many tokens share its decode
        # (last_token.py decodes a shared prefix apart from the pairs' own tokens).
        cparams.type_k = cparams.type_v = llama_cpp.GGML_TYPE_F32
        cparams.cb_eval = last.callback
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise EngineError("oom", "llama.cpp could not create a context (memory?) — see log")
    n = int(llama_cpp.llama_n_batch(ctx))
    # Headroom beyond n_batch: with validation off, an oversized decode must reach
    # llama.cpp intact (and trip its own assert) instead of being cut short here.
    capacity = max(2 * n, 4096)
    batch = llama_cpp.llama_batch_init(capacity, 0, 1)
    pos, nsid, out = batch_views(batch, capacity)
    tok = _view(batch.token, ctypes.c_int32, capacity)
    return Slot(ctx, batch, capacity, tok, pos, nsid, out, last=last)


@dataclass
class LoadedModel:
    """One loaded model: its llama_model, its contexts (`slots`) and what llama.cpp resolved
    them to (n_ctx... read back from the first context, not the values asked for)."""

    ref: str
    path: str
    kind: Kind
    model: ctypes.c_void_p
    slots: list[Slot]
    vocab: ctypes.c_void_p
    n_vocab: int
    n_embd: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_ctx_train: int
    pooling: str
    causal: bool
    n_cls_out: int
    arch: str
    device: str = "cpu"  # where its layers run: "cpu", or the offload device ("metal"...)
    # A BERT cross-encoder's token types, fed as input embeddings (None: ids are faithful).
    typed: TypedPairs | None = None
    # The head an LLM reranker or decoder sequence classifier applies to its last token's
    # state (llm_head.py); None for every other model.
    decoder_head: DecoderHead | None = None
    # An embedder's pooling-NONE context params, and those contexts (one per encode stream)
    # once a request needs token states (token_states.py); None / empty for other kinds.
    token_cparams: Any = None
    token_slots: list[Slot] = field(default_factory=list)
    # Heads on the token states, by the output they give ("sparse", "multivector").
    heads: dict[str, Any] = field(default_factory=dict)
    head_limits: dict[str, int | None] = field(default_factory=dict)
    pool: ThreadPoolExecutor | None = None  # runs the slots' decodes when there are several
    # (n_threads, n_threads_batch): each slot's own, and all of them (a lone wide decode).
    stream_threads: tuple[int, int] = (1, 1)
    all_threads: tuple[int, int] = (1, 1)

    @property
    def item_limit(self) -> int:
        """Longest single sequence an embed/rerank decode can take."""
        return min(self.n_ctx, self.n_ubatch, self.n_batch, self.n_ctx_train)

    def free(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for slot in self.slots:
            slot.free()
        for slot in self.token_slots:
            slot.free()
        llama_cpp.llama_model_free(self.model)


def decode(slot: Slot, batch: llama_cpp.llama_batch) -> None:
    """llama_decode, its failures typed: allocation (`oom`) or a refused batch."""
    ret = int(llama_cpp.llama_decode(slot.ctx, batch))
    if ret == 0:
        return
    if ret == 1 or ret == -2:
        raise EngineError("oom", f"llama_decode could not allocate ({ret})")
    raise EngineError("invalid_request", f"llama_decode rejected the batch ({ret})")


def clear_memory(slot: Slot) -> None:
    """Drop the context's cache (the previous decode's sequences), when it keeps one."""
    mem = llama_cpp.llama_get_memory(slot.ctx)
    if mem:
        llama_cpp.llama_memory_clear(mem, True)
