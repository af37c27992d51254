"""`LlamaEngine`: the llama.cpp engine over llama-cpp-python's low-level API.

One engine holds several models at once (e.g. an embedder and a generator), each with its own
llama_model, llama_context and llama_batch, keyed by `model_ref`.

Every input that could reach a GGML_ASSERT/abort in llama.cpp is validated here first and
refused with `EngineError("invalid_request")`, the engine staying usable:
- token ids in [0, n_vocab) (llama.cpp also checks, but only by failing the whole decode);
- per-item length 1..min(n_ctx, n_ubatch, n_ctx_train) for embed/rerank, since an encoder
  decode must fit one micro-batch (`GGML_ASSERT(n_ubatch >= n_tokens)`) and positions index
  the position-embedding table (n_ctx_train rows for BERT);
- decodes are packed to at most min(n_batch, n_ubatch) tokens and n_seq_max sequences
  (`GGML_ASSERT(n_tokens_all <= n_batch)`);
- grammars are parsed by our GBNF validator, and a NULL grammar sampler is a refusal (handing
  NULL on, as `LlamaSampler.add_grammar` does, crashes); sampling never lets the grammar
  `accept` a token it rejected (llama.cpp aborts/throws through the C API there).
`SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE=1` turns the request validation off so that tests can
trip a real GGML_ASSERT in a worker process. Never set it in production.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import queue
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import llama_cpp
import numpy as np
from llama_cpp import _ggml

from formats.gguf_header import ArrayInfo, GGUFFormatError, GGUFHeader, read_gguf_header
from workers.cpus import usable_cpu_count
from workers.engine import Engine, EngineError, Generation, Progress
from workers.llama import cpu_quirks
from workers.llama.config import Kind, RuntimeConfig, parse_runtime_config
from workers.llama.device import (
    context_param_fields,
    describe_build,
    env_gpu_layers,
    model_param_fields,
    offload_device,
    resolve_gpu_layers,
)
from workers.llama.gbnf import GrammarError, validate_gbnf
from workers.llama.typed_pairs import TypedPairs, pair_types
from workers.protocol import messages as m

UNSAFE_ENV = "SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE"
VERBOSE_ENV = "SYNAPSE_LLAMA_VERBOSE"

_POOLING_IDS = {
    "none": llama_cpp.LLAMA_POOLING_TYPE_NONE,
    "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
    "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
    "rank": llama_cpp.LLAMA_POOLING_TYPE_RANK,
}
_POOLING_NAMES = {v: k for k, v in _POOLING_IDS.items()}
_TOKEN_NULL = -1

# Encoder defaults: one decode packs up to n_ctx_train tokens (clamped to 512..2048) from up
# to 64 sequences. Measured on MiniLM (2 cores): 512 and 2048 run equally fast, but the
# 2048-token compute buffer costs ~330 MB RSS against ~120 MB.
_ENC_BATCH_MIN, _ENC_BATCH_MAX = 512, 2048
_ENC_SEQ_MAX = 64
# Tokens per encoder decode: packed sequences see each other only through the attention mask,
# and ggml's CPU flash attention still walks every masked key, so attention costs n_tokens²
# per decode while the matmuls cost n_tokens. Measured on MiniLM f32, 2 threads, interleaved
# in-process runs of bench.embed's sentences: 128-token decodes of similar lengths (see
# `plan_decodes`) 2.2x faster than filling 512 on this shared, overloaded machine; 64 0.96x
# and 256 0.85x of 128. A perf profile (load-independent view) puts flash attention at 0.35
# of the matmul time with 512-token decodes and 0.24 with 128.
ENC_DECODE_TOKENS = 128
# With a BLAS backend (scripts/llama_wheel.py builds with OpenBLAS on Linux, Accelerate on
# macOS) the matmuls go to its sgemm, which gains more from taller matrices than attention
# loses: MiniLM f32, 2 single-threaded streams, OpenBLAS, same sentences: 128 -> 64-69,
# 256 -> 79.5, 384 -> 80.6, 512 -> 67-77 sentences/s (not measured on a Mac).
ENC_DECODE_TOKENS_BLAS = 256
# A request that is one decode (a lone input, at concurrency 1) would leave every stream but one
# idle, so it runs with all the threads when it is long enough to gain from them. Measured on
# MiniLM f32, 2 cores, one decode in-process, 2 threads against 1: 8 tokens 1.77x the time,
# 16 1.38-1.49x (a barrier per op costs more than it splits), 32 0.75-0.84x, 64 0.70x,
# 128 0.66x, 256 0.64x, 510 0.62-0.71x.
WIDE_DECODE_MIN_TOKENS = 32
# Small decodes come fast: report PROGRESS (the watchdog's heartbeat, one host wakeup each) at
# most this often rather than per decode, so the host does not steal the cores per decode.
_PROGRESS_EVERY_S = 0.25
# Generation defaults: prompts are short here (DESIGN 5), so a 2k context and 512-token
# prompt chunks (llama-cpp-python's own defaults for n_batch/n_ubatch).
_GEN_CTX = 2048
_GEN_BATCH = 512

_backend_ready = False


def _init_backend() -> None:
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


def _unsafe() -> bool:
    return os.environ.get(UNSAFE_ENV) == "1"


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass
class _Slot:
    """One llama_context and its llama_batch. A generator has one; an encoder on the CPU has
    one per encode stream, all sharing the model's weights (see `_encode_streams`)."""

    ctx: ctypes.c_void_p
    batch: llama_cpp.llama_batch
    capacity: int  # llama_batch slots: n_batch plus headroom (see _make_slot)
    # Token views into the llama_batch (filled with numpy, not per-token ctypes calls).
    tok: np.ndarray = field(repr=False)
    pos: np.ndarray = field(repr=False)
    nsid: np.ndarray = field(repr=False)
    out: np.ndarray = field(repr=False)

    # Input-embedding batch for typed BERT pairs (see workers/llama/typed_pairs.py).
    typed: _EmbdBatch | None = None

    def free(self) -> None:
        if self.typed is not None:
            llama_cpp.llama_batch_free(self.typed.batch)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


@dataclass
class _EmbdBatch:
    """A llama_batch of input embeddings (`embd`, n_embd floats a token) and its views."""

    batch: llama_cpp.llama_batch
    embd: np.ndarray = field(repr=False)  # (capacity, n_embd) float32
    pos: np.ndarray = field(repr=False)
    nsid: np.ndarray = field(repr=False)
    out: np.ndarray = field(repr=False)

    @classmethod
    def create(cls, capacity: int, n_embd: int) -> _EmbdBatch:
        b = llama_cpp.llama_batch_init(capacity, n_embd, 1)
        embd = np.ctypeslib.as_array(ctypes.cast(b.embd, ctypes.POINTER(ctypes.c_float)),
                                     shape=(capacity, n_embd))
        _, pos, nsid, out = _batch_views(b, capacity, with_tokens=False)
        return cls(b, embd, pos, nsid, out)


@dataclass
class _Model:
    ref: str
    path: str
    kind: Kind
    model: ctypes.c_void_p
    slots: list[_Slot]
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
        llama_cpp.llama_model_free(self.model)


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


def _batch_views(
    b: llama_cpp.llama_batch, n: int, with_tokens: bool = True
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:  # tokens None: embd
    def view(ptr: Any, ctype: type) -> np.ndarray:  # ptr: a llama_batch pointer field
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctype)), shape=(n,))

    return (
        view(b.token, ctypes.c_int32) if with_tokens else None,
        view(b.pos, ctypes.c_int32),
        view(b.n_seq_id, ctypes.c_int32),
        view(b.logits, ctypes.c_int8),
    )


def _split(ids: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    bounds = np.cumsum([0, *lengths])
    return [ids[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]


def plan_decodes(
    lengths: list[int],
    max_tokens: int,
    max_seqs: int,
    decode_tokens: int = ENC_DECODE_TOKENS,
    streams: int = 1,
) -> list[list[int]]:
    """Encoder decodes: shortest sequences first, so similar lengths share a decode, packed
    to `decode_tokens` (an item longer than that, up to `max_tokens`, goes alone). With
    several streams, the decodes come in whole rounds of one per stream, evenly filled, so
    no stream idles while another finishes a last decode: a 256-token batch runs as 2 x 128
    at once, a 768-token one as 4 x 192 rather than 3 x 256 (whose third decode ran alone:
    16-token inputs, 2 streams: 48 at once measured 0.7x the rate of 32 at once)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    budget = min(max_tokens, decode_tokens)
    if streams > 1 and lengths:
        total = sum(lengths)
        decodes = streams * -(-total // (streams * budget))
        # Greedy packing closes a decode only when the next item would overflow it, so each
        # closed one holds >= budget - longest + 1 tokens: this budget makes <= `decodes`.
        budget = min(budget, -(-total // decodes) + max(lengths) - 1)
    groups = pack([lengths[i] for i in order], budget, max_seqs)
    return [[order[j] for j in group] for group in groups]


def wide_decode(mdl: _Model, lengths: list[int]) -> bool:
    """Whether a request that is this one decode runs with all the model's threads on its first
    slot: only when the other slots would idle and it has enough tokens to gain (see
    WIDE_DECODE_MIN_TOKENS)."""
    return len(mdl.slots) > 1 and sum(lengths) >= WIDE_DECODE_MIN_TOKENS


def pack(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Group item indices, in order, into decodes of <= max_tokens tokens and <= max_seqs items.

    An item longer than `max_tokens` still gets a group of its own (only reachable with
    validation off, where it is meant to reach llama.cpp).
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and (used + n > max_tokens or len(cur) >= max_seqs):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def _encode_streams(cfg: RuntimeConfig, encoder: bool, offloaded: bool, threads: int) -> int:
    """How many llama_contexts an encoder decodes with in parallel, each on threads/streams
    threads. Default on the CPU: one per thread. ggml splits every op of a small BERT decode
    across its threads and meets them at a barrier after each op; separate single-threaded
    contexts never wait for each other. Measured on MiniLM f32 (bench.embed's 512 sentences,
    2 cores, in-process): two single-threaded contexts 1.26x one two-threaded context with
    ggml's own kernels (51.5 vs 40.9 sentences/s), 1.6x with OpenBLAS (75.0 vs 46.1).
    One stream on a GPU (one device queue) and for generation (one sequence at a time)."""
    if cfg.encode_streams is not None:
        if not encoder and cfg.encode_streams > 1:
            raise EngineError("config_invalid", "encode_streams > 1 applies to embed/rerank only")
        return min(cfg.encode_streams, threads) if encoder else 1
    return threads if encoder and not offloaded else 1


class _ProgressThrottle:
    """PROGRESS at most every _PROGRESS_EVERY_S (the watchdog's heartbeat, one host wakeup
    each) rather than per decode, so the host does not steal the cores per decode."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.reported, self.total = progress, 0, 0
        self.last = time.monotonic()

    def done(self, n: int) -> None:
        self.done_total(self.total + n)

    def done_total(self, total: int) -> None:
        self.total = total
        if time.monotonic() - self.last >= _PROGRESS_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.total > self.reported:
            self.progress.advance("inference", self.total - self.reported)
            self.reported, self.last = self.total, time.monotonic()


class LlamaEngine(Engine):
    """See the module docstring. Rerank pair composition is documented on `rerank`."""

    def __init__(self) -> None:
        _init_backend()
        self._models: dict[str, _Model] = {}
        self._backends = registered_backends()
        self._decode_tokens = (
            ENC_DECODE_TOKENS_BLAS if "BLAS" in self._backends else ENC_DECODE_TOKENS
        )

    # ---- identity --------------------------------------------------------------------------

    def info(self) -> m.EngineInfo:
        # The flags name the device: a certificate earned on the CPU must not cover a Metal
        # lane (their numerics differ), and HELLO is what the identity is built from.
        info = self._system_info().rstrip(" |")
        return m.EngineInfo(
            engine="llama.cpp",
            version=llama_cpp.__version__,
            build_flags=f"{info} | backends={','.join(self._backends)}"
            f" | device={self._auto_device()}",
        )

    @staticmethod
    def _system_info() -> str:
        flags = llama_cpp.llama_print_system_info()
        return flags.decode("utf-8", "replace").strip() if flags else ""

    def _offload_device(self) -> str:
        return offload_device(self._system_info(), bool(llama_cpp.llama_supports_gpu_offload()))

    def _auto_device(self) -> str:
        """The device a LOAD with gpu_layers "auto" uses here (env override included)."""
        try:
            env = env_gpu_layers()
        except ValueError:
            env = None  # refused at LOAD, with the reason
        return "cpu" if env == 0 else self._offload_device()

    def models_loaded(self) -> list[str]:
        return sorted(self._models)

    # ---- LOAD / UNLOAD -----------------------------------------------------------------------

    def load(self, req: m.LOAD, progress: Progress) -> m.LOADED:
        t0 = time.perf_counter()
        try:
            cfg = parse_runtime_config(req.runtime_config)
        except ValueError as e:
            raise EngineError("config_invalid", f"runtime_config: {e}") from e
        if req.format.lower() != "gguf":
            raise EngineError("unsupported", f"format {req.format!r}: this engine loads gguf")
        path = req.artifact_path
        if "\x00" in path:  # open() raises ValueError, and C would cut the path there
            raise EngineError("artifact_invalid", "artifact_path contains a NUL character")
        ref = cfg.model_ref or _default_ref(path)
        if ref in self._models:
            raise EngineError("config_invalid", f"model_ref {ref!r} is already loaded")

        self._verify_digest(path, req.artifact_digest)
        progress.advance("control")
        try:
            hdr = read_gguf_header(path, want_arrays=frozenset())
        except (OSError, GGUFFormatError) as e:
            raise EngineError("artifact_invalid", f"{path}: not a valid GGUF: {e}") from e
        kind, pooling = _decide_kind(hdr, cfg)
        n_cls_out = _n_cls_out(hdr)
        if kind == "rerank" and n_cls_out != 1:
            raise EngineError(
                "unsupported", f"rerank needs a single-logit classifier, this one has {n_cls_out}"
            )

        try:
            gpu_layers = resolve_gpu_layers(
                cfg.gpu_layers,
                bool(llama_cpp.llama_supports_gpu_offload()),
                describe_build(llama_cpp.__version__, self._system_info()),
            )
        except ValueError as e:
            raise EngineError("config_invalid", str(e)) from e
        model = self._load_model(path, cfg, gpu_layers)
        try:
            loaded = self._make_context(
                ref, path, model, hdr, cfg, kind, pooling, n_cls_out, gpu_layers > 0
            )
        except BaseException:
            llama_cpp.llama_model_free(model)
            raise
        loaded.device = self._offload_device() if gpu_layers > 0 else "cpu"
        self._models[ref] = loaded
        progress.advance("control")
        return m.LOADED(
            req_id=req.req_id,
            model_ref=ref,
            dims=loaded.n_embd,
            cold_load_ms=(time.perf_counter() - t0) * 1000.0,
            device=loaded.device,
        )

    def unload(self, req: m.UNLOAD, progress: Progress) -> None:
        mdl = self._models.pop(req.model_ref, None)
        if mdl is None:
            raise EngineError("model_not_loaded", f"{req.model_ref!r} is not loaded")
        mdl.free()
        progress.advance("control")

    def close(self) -> None:
        for ref in list(self._models):
            self._models.pop(ref).free()

    # ---- inference ---------------------------------------------------------------------------

    def embed(self, req: m.EMBED_BATCH, ids: np.ndarray, progress: Progress) -> np.ndarray:
        mdl = self._get(req.model_ref, "embed")
        if req.pooling != mdl.pooling and not _unsafe():
            raise EngineError(
                "invalid_request",
                f"{mdl.ref} was loaded with {mdl.pooling} pooling, request asks {req.pooling}",
            )
        lengths = [it.n_tokens for it in req.items]
        ids = self._check_ids(mdl, ids, lengths)
        seqs = _split(ids, lengths)
        out = self._encode(mdl, seqs, progress)
        if req.normalize:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out = out / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(out, dtype=np.float32)

    def rerank(self, req: m.RERANK, ids: np.ndarray, progress: Progress) -> np.ndarray:
        """Score each candidate against the query with the model's RANK head.

        Wire contract: the host sends the query's ids, then each candidate's ids, all WITHOUT
        special tokens. The worker composes every pair itself from the GGUF's vocabulary,
        exactly as llama-server's `format_prompt_rerank` does:

            [BOS if add_bos] q [EOS if add_eos] [SEP if add_sep] d [EOS if add_eos]

        with EOS falling back to SEP when the vocab has no EOS. For BERT cross-encoders our
        converter writes BOS=[CLS], EOS=SEP=[SEP], add_bos=add_eos=1, add_sep=0, giving
        `[CLS] q [SEP] d [SEP]`. The pair length (query + candidate + specials) must fit
        min(n_ctx, n_ubatch, n_ctx_train). Returns the raw classifier logit per candidate
        (float32). A BERT cross-encoder gets its token types (1 on `d [SEP]`), fed as input
        embeddings, since llama.cpp's BERT graph would give every position type 0 (see
        workers/llama/typed_pairs.py).
        """
        mdl = self._get(req.model_ref, "rerank")
        lengths = [req.query_n_tokens] + [c.n_tokens for c in req.candidates]
        if not req.candidates:
            return np.zeros(0, dtype=np.float32)
        ids = self._check_ids(mdl, ids, lengths, allow_empty=True)
        parts = _split(ids, lengths)
        pre, mid, post = _pair_template(mdl)
        pairs = [np.concatenate([pre, parts[0], mid, d, post]).astype(np.int32) for d in parts[1:]]
        if not _unsafe():
            # A text that tokenizes to nothing (" ", "\xa0") is still a pair to score, as a
            # cross-encoder scores "[CLS] q [SEP] [SEP]"; only a pair of no tokens at all (a
            # vocabulary without special tokens) is nothing llama.cpp can decode.
            if any(len(p) == 0 for p in pairs):
                raise EngineError("invalid_request", "a pair without any token cannot be scored")
            too_long = [i for i, p in enumerate(pairs) if len(p) > mdl.item_limit]
            if too_long:
                raise EngineError(
                    "invalid_request",
                    f"candidate {too_long[0]}: pair of {len(pairs[too_long[0]])} tokens exceeds "
                    f"the limit of {mdl.item_limit}",
                )
        types = None
        if mdl.typed is not None:  # BERT cross-encoder: segment B has token type 1
            n_first = len(pre) + len(parts[0]) + len(mid)
            types = [pair_types(n_first, len(p)) for p in pairs]
        scores = self._encode(mdl, pairs, progress, types)
        return np.ascontiguousarray(scores[:, 0], dtype=np.float32)

    def generate(self, req: m.GENERATE, ids: np.ndarray, progress: Progress) -> Generation:
        """Greedy decoding (argmax, first index on ties — llama.cpp's greedy sampler).

        Stops at an end-of-generation token (`stop`, token not included) or after
        `max_tokens` tokens (`length`). With a GBNF grammar, tokens the grammar rejects are
        masked before the argmax; if it leaves no token at all, generation ends with `stop`.
        Text is the UTF-8 decoding of the generated pieces (special tokens not rendered;
        a multi-byte character cut off by `length` is dropped, as llama-cpp-python does).
        """
        mdl = self._get(req.model_ref, "generate")
        ids = self._check_ids(mdl, ids, [len(ids)])
        n_prompt = len(ids)
        if not _unsafe() and n_prompt + req.max_tokens > mdl.n_ctx:
            raise EngineError(
                "invalid_request",
                f"prompt ({n_prompt}) + max_tokens ({req.max_tokens}) exceeds n_ctx {mdl.n_ctx}",
            )
        grammar = self._grammar_sampler(mdl, req.grammar) if req.grammar is not None else None
        try:
            return self._generate(mdl, ids, req.max_tokens, grammar, progress)
        finally:
            if grammar is not None:
                llama_cpp.llama_sampler_free(grammar)

    # ---- internals: loading ------------------------------------------------------------------

    def _verify_digest(self, path: str, digest: str) -> None:
        want = digest.lower().removeprefix("sha256:")
        if len(want) != 64 or any(c not in "0123456789abcdef" for c in want):
            raise EngineError("artifact_invalid", f"artifact_digest {digest!r} is not a sha256")
        try:
            got = sha256_file(path)
        except OSError as e:
            raise EngineError("artifact_invalid", f"cannot read {path}: {e}") from e
        if got != want:
            raise EngineError("artifact_invalid", f"{path}: sha256 {got} != expected {want}")

    def _load_model(self, path: str, cfg: RuntimeConfig, gpu_layers: int) -> ctypes.c_void_p:
        try:
            mparams = model_params(gpu_layers, cfg.use_mmap)
        except ValueError as e:
            raise EngineError("config_invalid", str(e)) from e
        model = llama_cpp.llama_model_load_from_file(path.encode("utf-8"), mparams)
        if not model:
            raise EngineError("artifact_invalid", f"llama.cpp could not load {path} (see log)")
        return model

    def _make_context(
        self,
        ref: str,
        path: str,
        model: ctypes.c_void_p,
        hdr: GGUFHeader,
        cfg: RuntimeConfig,
        kind: Kind,
        pooling: str,
        n_cls_out: int,
        offloaded: bool,
    ) -> _Model:
        n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(model))
        encoder = kind in ("embed", "rerank")
        # What llama.cpp's reservation sees: a decoder served as an embedder stays causal.
        causal = _causal(hdr)
        max_seq = llama_cpp.llama_max_parallel_sequences()
        if encoder:
            default_batch = min(max(n_ctx_train, _ENC_BATCH_MIN), _ENC_BATCH_MAX)
            n_batch = cfg.n_batch or max(default_batch, cfg.n_ubatch or 0)
            n_ubatch = cfg.n_ubatch or n_batch
            n_ctx = cfg.n_ctx or n_batch
            # Default: the most sequences per decode that llama.cpp's reservation accepts.
            reserve = _reserve_tokens(n_ctx, n_batch, n_ubatch, 1, unified=True, causal=causal)
            n_seq_max = cfg.n_seq_max or max(
                d for d in range(1, min(_ENC_SEQ_MAX, max_seq) + 1) if reserve % d == 0
            )
        else:
            n_ctx = cfg.n_ctx or min(_GEN_CTX, n_ctx_train)
            n_batch = cfg.n_batch or min(_GEN_BATCH, n_ctx)
            n_ubatch = cfg.n_ubatch or n_batch
            n_seq_max = cfg.n_seq_max or 1
        problems = []
        if n_ubatch > n_batch:
            problems.append(f"n_ubatch {n_ubatch} > n_batch {n_batch}")
        if n_seq_max > max_seq:
            problems.append(f"n_seq_max above {max_seq}")
        if not encoder and n_batch > n_ctx:
            problems.append(f"n_batch {n_batch} > n_ctx {n_ctx}")
        if not encoder and n_ctx > n_ctx_train:
            problems.append(f"n_ctx {n_ctx} > the model's trained context {n_ctx_train}")
        if not encoder and n_seq_max != 1:
            # Generation decodes one sequence; llama.cpp would give it n_ctx / n_seq_max
            # cells while the prompt is checked against n_ctx (a 507 instead of a 400).
            problems.append("generation serves one sequence: n_seq_max must be 1")
        reserve = _reserve_tokens(n_ctx, n_batch, n_ubatch, n_seq_max, unified=encoder,
                                  causal=causal)
        if reserve % n_seq_max:
            # llama.cpp reserves its worst-case graph with `reserve` tokens split evenly over
            # n_seq_max sequences; otherwise GGML_ASSERT(ggml_can_mul_mat) aborts at LOAD.
            problems.append(
                f"n_seq_max {n_seq_max} must divide min(n_ctx padded to 256, n_ubatch) = {reserve}"
            )
        if problems:
            raise EngineError("config_invalid", "; ".join(problems))

        threads = cfg.n_threads or usable_cpu_count()
        streams = _encode_streams(cfg, encoder, offloaded, threads)
        cparams = context_params(offloaded)
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = max(1, threads // streams)
        cparams.n_threads_batch = max(1, (cfg.n_threads_batch or threads) // streams)
        cparams.embeddings = encoder
        cparams.pooling_type = _POOLING_IDS[pooling if encoder else "none"]
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if cfg.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.no_perf = True
        # Encoders keep no KV cache; a unified layout stops llama.cpp from rounding n_ctx up
        # to n_seq_max * 256 (it sizes per-sequence contexts otherwise).
        cparams.kv_unified = encoder
        typed = None
        if kind == "rerank" and hdr.architecture == "bert":
            try:
                typed = TypedPairs.from_gguf(path, hdr)
            except (OSError, ValueError, GGUFFormatError, NotImplementedError) as e:
                raise EngineError("artifact_invalid", f"{path}: token-type tensors: {e}") from e
        slots: list[_Slot] = []
        try:
            for _ in range(streams):
                slots.append(self._make_slot(model, cparams))
                if typed is not None:
                    slots[-1].typed = _EmbdBatch.create(slots[-1].capacity, typed.n_embd)
            ctx = slots[0].ctx
            got_pooling = _POOLING_NAMES.get(int(llama_cpp.llama_pooling_type(ctx)), "none")
            if encoder and got_pooling != pooling:
                raise EngineError(
                    "config_invalid", f"llama.cpp resolved pooling {got_pooling}, not {pooling}"
                )
        except BaseException:
            for slot in slots:
                slot.free()
            raise
        vocab = llama_cpp.llama_model_get_vocab(model)
        return _Model(
            ref=ref,
            path=path,
            kind=kind,
            model=model,
            slots=slots,
            vocab=vocab,
            n_vocab=int(llama_cpp.llama_vocab_n_tokens(vocab)),
            n_embd=int(llama_cpp.llama_model_n_embd(model)),
            n_ctx=int(llama_cpp.llama_n_ctx(ctx)),
            n_batch=int(llama_cpp.llama_n_batch(ctx)),
            n_ubatch=int(llama_cpp.llama_n_ubatch(ctx)),
            n_seq_max=int(llama_cpp.llama_n_seq_max(ctx)),
            n_ctx_train=n_ctx_train,
            pooling=pooling if encoder else "none",
            causal=causal,
            n_cls_out=n_cls_out,
            arch=hdr.architecture,
            pool=ThreadPoolExecutor(streams, thread_name_prefix=f"encode-{ref}")
            if streams > 1
            else None,
            stream_threads=(cparams.n_threads, cparams.n_threads_batch),
            all_threads=(threads, cfg.n_threads_batch or threads),
            typed=typed,
        )

    @staticmethod
    def _make_slot(model: ctypes.c_void_p, cparams: llama_cpp.llama_context_params) -> _Slot:
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            raise EngineError("oom", "llama.cpp could not create a context (memory?) — see log")
        n = int(llama_cpp.llama_n_batch(ctx))
        # Headroom beyond n_batch: with validation off, an oversized decode must reach
        # llama.cpp intact (and trip its own assert) instead of being cut short here.
        capacity = max(2 * n, 4096)
        batch = llama_cpp.llama_batch_init(capacity, 0, 1)
        tok, pos, nsid, out = _batch_views(batch, capacity)
        return _Slot(ctx, batch, capacity, cast(np.ndarray, tok), pos, nsid, out)  # with tokens

    # ---- internals: requests -----------------------------------------------------------------

    def _get(self, ref: str, kind: Kind) -> _Model:
        mdl = self._models.get(ref)
        if mdl is None:
            raise EngineError("model_not_loaded", f"{ref!r} is not loaded")
        if mdl.kind != kind:
            raise EngineError("invalid_request", f"{ref!r} is a {mdl.kind} model, not {kind}")
        return mdl

    def _check_ids(
        self, mdl: _Model, ids: np.ndarray, lengths: list[int], allow_empty: bool = False
    ) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise EngineError("invalid_request", "token ids must be a 1-D integer array")
        if sum(lengths) != ids.size:
            raise EngineError(
                "invalid_request", f"items declare {sum(lengths)} tokens, payload has {ids.size}"
            )
        if _unsafe():
            return ids.astype(np.int32, copy=False)
        if not lengths:
            raise EngineError("invalid_request", "no items")
        # In the caller's dtype: cast first, and int64 2**32 + 5 would pass as token 5.
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= mdl.n_vocab):
            bad = int(ids[(ids < 0) | (ids >= mdl.n_vocab)][0])
            raise EngineError("invalid_request", f"token id {bad} outside [0, {mdl.n_vocab})")
        ids = ids.astype(np.int32, copy=False)
        if mdl.kind == "embed":
            for i, n in enumerate(lengths):
                if not 1 <= n <= mdl.item_limit:
                    raise EngineError(
                        "invalid_request",
                        f"item {i} has {n} tokens; allowed 1..{mdl.item_limit}",
                    )
        elif mdl.kind == "generate" and (not lengths[0] and not allow_empty):
            raise EngineError("invalid_request", "empty prompt")
        return ids

    def _encode(
        self,
        mdl: _Model,
        seqs: list[np.ndarray],
        progress: Progress,
        types: list[np.ndarray] | None = None,
    ) -> np.ndarray:
        """Pooled output (n_embd per seq, or n_cls_out for rank) for each sequence.

        With several slots, each slot's thread takes the next decode off a shared queue
        (llama_decode releases the GIL), so one request's decodes run on every core; the
        calling thread only reports PROGRESS and collects failures. Which slot runs a decode
        does not change its numbers; how sequences are packed can, by float rounding, and so
        can a request of one decode, which runs with every thread (`wide_decode`).
        `types`: per-sequence token types, fed as input embeddings (`mdl.typed` models).
        """
        width = mdl.n_cls_out if mdl.pooling == "rank" else mdl.n_embd
        out = np.empty((len(seqs), width), dtype=np.float32)
        budget = min(mdl.n_batch, mdl.n_ubatch)
        groups = plan_decodes(
            [len(s) for s in seqs], budget, mdl.n_seq_max, self._decode_tokens, len(mdl.slots)
        )
        if mdl.pool is None or len(groups) == 1:
            slot = mdl.slots[0]
            wide = bool(groups) and wide_decode(mdl, [len(seqs[i]) for i in groups[0]])
            if wide:
                llama_cpp.llama_set_n_threads(slot.ctx, *mdl.all_threads)
            try:
                reporter = _ProgressThrottle(progress)
                for group in groups:
                    self._encode_group(mdl, slot, seqs, group, out, types)
                    reporter.done(1)
                reporter.flush()
            finally:
                if wide:
                    llama_cpp.llama_set_n_threads(slot.ctx, *mdl.stream_threads)
            return out
        todo: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        for group in groups:
            todo.put(group)
        finished = [0] * len(mdl.slots)
        failed = threading.Event()

        def drain(i: int, slot: _Slot) -> None:
            while not failed.is_set():
                try:
                    group = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self._encode_group(mdl, slot, seqs, group, out, types)
                except BaseException:
                    failed.set()  # the other slots stop after their current decode
                    raise
                finished[i] += 1

        futures = [mdl.pool.submit(drain, i, slot) for i, slot in enumerate(mdl.slots)]
        reporter = _ProgressThrottle(progress)
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=_PROGRESS_EVERY_S, return_when=FIRST_EXCEPTION)
            reporter.done_total(sum(finished))
            if failed.is_set():
                wait(pending)
                break
        for fut in futures:
            fut.result()  # re-raise the first failure, typed as the slot raised it
        reporter.flush()
        return out

    def _encode_group(
        self,
        mdl: _Model,
        slot: _Slot,
        seqs: list[np.ndarray],
        group: list[int],
        out: np.ndarray,
        types: list[np.ndarray] | None = None,
    ) -> None:
        """One decode of `group`'s sequences on `slot`, pooled rows written to `out`; with
        `types`, as input embeddings that carry each token's type (see typed_pairs)."""
        mem = llama_cpp.llama_get_memory(slot.ctx)
        if mem:  # decoder-as-embedder: drop the previous decode's cache
            llama_cpp.llama_memory_clear(mem, True)
        typed = slot.typed if types is not None else None  # a slot has it iff the model does
        if types is not None and typed is None:
            raise RuntimeError("token types given for a model without typed input")
        batch, pos, nsid, outs = (typed.batch, typed.pos, typed.nsid, typed.out) if typed else (
            slot.batch, slot.pos, slot.nsid, slot.out)
        n = 0
        sid = batch.seq_id
        for seq_id, idx in enumerate(group):
            s = seqs[idx]
            k = len(s)
            if n + k > slot.capacity:  # unsafe mode only: never write past the batch
                k = slot.capacity - n
            if typed is not None:  # so `types` was given, and the model has typed input
                typed.embd[n : n + k] = cast(TypedPairs, mdl.typed).embeddings(
                    s[:k], cast("list[np.ndarray]", types)[idx][:k])
            else:
                slot.tok[n : n + k] = s[:k]
            pos[n : n + k] = np.arange(k, dtype=np.int32)
            nsid[n : n + k] = 1
            outs[n : n + k] = 1  # pooled embeddings need every token as an output
            for j in range(n, n + k):
                sid[j][0] = seq_id
            n += k
        batch.n_tokens = n
        self._decode(slot, batch)
        width = out.shape[1]
        for seq_id, idx in enumerate(group):
            ptr = llama_cpp.llama_get_embeddings_seq(slot.ctx, seq_id)
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no pooled output for seq {seq_id}")
            out[idx] = np.ctypeslib.as_array(ptr, shape=(width,))

    def _decode(self, slot: _Slot, batch: llama_cpp.llama_batch) -> None:
        ret = int(llama_cpp.llama_decode(slot.ctx, batch))
        if ret == 0:
            return
        if ret == 1 or ret == -2:
            raise EngineError("oom", f"llama_decode could not allocate ({ret})")
        raise EngineError("invalid_request", f"llama_decode rejected the batch ({ret})")

    def _grammar_sampler(self, mdl: _Model, grammar: str) -> ctypes.c_void_p:
        if not grammar.strip():
            # llama.cpp treats "" as "no grammar": refusing beats silently ignoring it.
            raise EngineError("invalid_request", "empty grammar")
        try:
            validate_gbnf(grammar)
        except GrammarError as e:
            raise EngineError("invalid_request", f"grammar: {e}") from e
        g = llama_cpp.LlamaGrammar.from_string(grammar, verbose=False)
        smpl = llama_cpp.llama_sampler_init_grammar(
            mdl.vocab, g._grammar.encode("utf-8"), g._root.encode("utf-8")
        )
        if not smpl:
            raise EngineError("invalid_request", "grammar rejected by llama.cpp (see log)")
        return smpl

    def _generate(
        self,
        mdl: _Model,
        ids: np.ndarray,
        max_tokens: int,
        grammar: ctypes.c_void_p | None,
        progress: Progress,
    ) -> Generation:
        n_prompt = len(ids)
        slot = mdl.slots[0]
        mem = llama_cpp.llama_get_memory(slot.ctx)
        if mem:
            llama_cpp.llama_memory_clear(mem, True)
        if max_tokens == 0:
            return Generation(text="", n_prompt=n_prompt, n_gen=0, finish_reason="length")
        for start in range(0, n_prompt, mdl.n_batch):
            chunk = ids[start : start + mdl.n_batch]
            self._fill_single(slot, chunk, start, last_logits=start + len(chunk) == n_prompt)
            self._decode(slot, slot.batch)
            progress.advance("inference")

        cand = _Candidates(mdl.n_vocab) if grammar is not None else None
        pieces: list[bytes] = []
        n_gen = 0
        finish = "length"
        buf = ctypes.create_string_buffer(256)
        while n_gen < max_tokens:
            logits_ptr = llama_cpp.llama_get_logits_ith(slot.ctx, -1)
            logits = np.ctypeslib.as_array(logits_ptr, shape=(mdl.n_vocab,))
            if cand is not None:
                cand.load(logits)
                llama_cpp.llama_sampler_apply(grammar, ctypes.byref(cand.array))
                masked = cand.data["logit"]
                tok = int(np.argmax(masked))
                if not math.isfinite(float(masked[tok])):
                    finish = "stop"  # the grammar allows nothing further
                    break
            else:
                tok = int(np.argmax(logits))
            if llama_cpp.llama_vocab_is_eog(mdl.vocab, tok):
                finish = "stop"
                break
            if grammar is not None:
                llama_cpp.llama_sampler_accept(grammar, tok)
            pieces.append(_piece(mdl.vocab, tok, buf))
            n_gen += 1
            if n_gen == max_tokens:
                break
            self._fill_single(slot, np.array([tok], dtype=np.int32), n_prompt + n_gen - 1, True)
            self._decode(slot, slot.batch)
            progress.advance("inference")
        text = b"".join(pieces).decode("utf-8", "ignore")
        return Generation(text=text, n_prompt=n_prompt, n_gen=n_gen, finish_reason=finish)

    def _fill_single(self, slot: _Slot, toks: np.ndarray, start: int, last_logits: bool) -> None:
        k = len(toks)
        slot.tok[:k] = toks
        slot.pos[:k] = np.arange(start, start + k, dtype=np.int32)
        slot.nsid[:k] = 1
        slot.out[:k] = 0
        if last_logits:
            slot.out[k - 1] = 1
        sid = slot.batch.seq_id
        for j in range(k):
            sid[j][0] = 0
        slot.batch.n_tokens = k


class _Candidates:
    """A llama_token_data_array over numpy memory, for applying the grammar sampler."""

    _dtype = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)

    def __init__(self, n_vocab: int) -> None:
        self.data = np.zeros(n_vocab, dtype=self._dtype)
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.array = llama_cpp.llama_token_data_array(
            data=self.data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=n_vocab,
            selected=-1,
            sorted=False,
        )
        self.n_vocab = n_vocab

    def load(self, logits: np.ndarray) -> None:
        self.data["id"] = self.ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        self.array.size = self.n_vocab
        self.array.selected = -1
        self.array.sorted = False


def _piece(vocab: ctypes.c_void_p, tok: int, buf: ctypes.Array) -> bytes:
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, False)
    if n < 0:
        big = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, tok, big, len(big), 0, False)
        return big.raw[:n]
    return buf.raw[:n]


def _pair_template(mdl: _Model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix, middle, suffix) token arrays of a rerank pair; see `LlamaEngine.rerank`."""
    v = mdl.vocab
    bos = int(llama_cpp.llama_vocab_bos(v))
    eos = int(llama_cpp.llama_vocab_eos(v))
    sep = int(llama_cpp.llama_vocab_sep(v))
    if eos == _TOKEN_NULL:
        eos = sep
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(v)) and bos != _TOKEN_NULL
    add_eos = bool(llama_cpp.llama_vocab_get_add_eos(v)) and eos != _TOKEN_NULL
    add_sep = bool(llama_cpp.llama_vocab_get_add_sep(v)) and sep != _TOKEN_NULL
    pre = [bos] if add_bos else []
    mid = ([eos] if add_eos else []) + ([sep] if add_sep else [])
    post = [eos] if add_eos else []
    return (np.array(pre, np.int32), np.array(mid, np.int32), np.array(post, np.int32))


# Architectures whose load_hparams force bidirectional attention whatever the file says
# (models/gemma-embedding.cpp, dream.cpp, llada.cpp, llada-moe.cpp, rnd1.cpp in the llama.cpp
# llama-cpp-python 0.3.36 vendors); upstream's EmbeddingGemma GGUFs carry no causal key.
_ALWAYS_BIDIRECTIONAL = frozenset({"gemma-embedding", "dream", "llada", "llada-moe", "rnd1"})


def _causal(hdr: GGUFHeader) -> bool:
    """Whether llama.cpp runs the model causally: its `attention.causal` key (true when
    absent, as llama.cpp defaults), unless the architecture forces bidirectional attention."""
    if hdr.architecture in _ALWAYS_BIDIRECTIONAL:
        return False
    return bool(hdr.arch_get("attention.causal", True))


def _reserve_tokens(
    n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int, *, unified: bool, causal: bool
) -> int:
    """Token count of llama.cpp's worst-case graph reservation (llama_context::sched_reserve).

    Mirrors llama-context.cpp: causal contexts clamp n_batch to the n_ctx asked for (before
    padding), n_ubatch is clamped to n_batch, and n_ctx is padded to 256 (per sequence when not
    unified).
    """
    batch = min(n_ctx, n_batch) if causal else n_batch
    ctx = -(-n_ctx // 256) * 256
    if not unified:
        ctx = -(-(ctx // n_seq_max) // 256) * 256 * n_seq_max
    return min(ctx, min(batch, n_ubatch))


def _default_ref(path: str) -> str:
    p = Path(path)
    return p.parent.name if p.stem == "model" and p.parent.name else p.stem


def _n_cls_out(hdr: GGUFHeader) -> int:
    labels = hdr.arch_get("classifier.output_labels")
    if isinstance(labels, ArrayInfo):
        return labels.length
    return 1


def _decide_kind(hdr: GGUFHeader, cfg: RuntimeConfig) -> tuple[Kind, str]:
    """(kind, pooling name) from the GGUF and the config; refuses what we cannot serve."""
    arch = hdr.architecture
    gguf_pool = hdr.arch_get("pooling_type")
    gguf_pooling = _POOLING_NAMES.get(gguf_pool) if isinstance(gguf_pool, int) else None
    # llama.cpp's converter writes no pooling type for rerankers: a classifier head is one.
    has_head = any(t.name in ("cls.weight", "cls.output.weight") for t in hdr.tensors)
    is_rank = gguf_pooling == "rank" or (
        cfg.kind == "rerank" and gguf_pooling in (None, "none") and has_head)
    if is_rank and arch.startswith("qwen3"):
        raise EngineError(
            "unsupported",
            "Qwen3 rerankers need their own prompt template; refusing rather than scoring wrong",
        )
    if is_rank and "tokenizer.chat_template.rerank" in hdr.kv:
        raise EngineError(
            "unsupported", "reranker with a prompt template; pairs would not match its training"
        )
    causal = _causal(hdr)
    if cfg.kind is not None:
        kind = cfg.kind
    elif is_rank:
        kind = "rerank"
    elif cfg.embedding or (cfg.embedding is None and (gguf_pooling not in (None, "none")
                                                      or not causal)):
        kind = "embed"
    else:
        kind = "generate"
    if cfg.embedding is not None and cfg.embedding != (kind != "generate"):
        raise EngineError("config_invalid", f"embedding={cfg.embedding} contradicts kind {kind}")
    if kind == "rerank":
        if not is_rank:
            raise EngineError("config_invalid", "rerank needs a GGUF with rank pooling")
        if cfg.pooling not in (None, "rank"):
            raise EngineError("config_invalid", "a reranker must use rank pooling")
        return kind, "rank"
    if kind == "embed":
        pooling = cfg.pooling or gguf_pooling or ("last" if causal else "mean")
        if pooling in ("none", "rank"):
            raise EngineError("config_invalid", f"pooling {pooling} cannot produce one vector")
        return kind, pooling
    if not causal:
        raise EngineError("config_invalid", f"{arch} is an encoder; it cannot generate")
    if cfg.pooling not in (None, "none"):
        raise EngineError("config_invalid", "pooling applies to embedding models only")
    return kind, "none"
