"""`LlamaEngine`: the llama.cpp engine over llama-cpp-python's low-level API.

One engine holds several models at once (e.g. an embedder and a generator), each with its own
llama_model, llama_contexts and llama_batches, keyed by `model_ref`. This module takes the
requests apart and validates them; the contexts' shape is planned in context_plan.py, the
model's kind in model_kind.py, the decodes run in encode.py (embed, rerank) and generate.py,
and the ctypes handles live in native.py.

Every input that could reach a GGML_ASSERT/abort in llama.cpp is validated here first and
refused with `EngineError("invalid_request")`, the engine staying usable:
- token ids in [0, n_vocab) (llama.cpp also checks, but only by failing the whole decode);
- per-item length 1..min(n_ctx, n_ubatch, n_ctx_train) for embed/rerank, since an encoder
  decode must fit one micro-batch (`GGML_ASSERT(n_ubatch >= n_tokens)`) and positions index
  the position-embedding table (n_ctx_train rows for BERT);
- decodes are packed to at most min(n_batch, n_ubatch) tokens and n_seq_max sequences
  (`GGML_ASSERT(n_tokens_all <= n_batch)`; see decode_plan.py);
- grammars are parsed by our GBNF validator, and a NULL grammar sampler is a refusal (see
  generate.py).
`SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE=1` turns the request validation off so that tests can
trip a real GGML_ASSERT in a worker process. Never set it in production.
"""

from __future__ import annotations

import ctypes
import os
import time
from concurrent.futures import ThreadPoolExecutor

import llama_cpp
import numpy as np

from formats.digest import sha256_file
from formats.gguf_header import GGUFFormatError, GGUFHeader, read_gguf_header
from workers.cpus import usable_cpu_count
from workers.engine import (
    Engine,
    EngineError,
    Generation,
    Progress,
    Section,
    dense_section,
    ragged_section,
)
from workers.llama import (
    encode,
    generate,
    heads,
    last_token,
    llm_head,
    model_kind,
    native,
    token_states,
)
from workers.llama.config import Kind, RuntimeConfig, parse_runtime_config
from workers.llama.context_plan import flash_attention, plan_context
from workers.llama.decode_plan import decode_tokens_for
from workers.llama.device import (
    describe_build,
    env_gpu_layers,
    offload_device,
    resolve_gpu_layers,
)
from workers.llama.last_states import LastStates
from workers.llama.model_kind import POOLING_NAMES
from workers.llama.typed_pairs import TypedPairs, pair_types
from workers.protocol import messages as m

UNSAFE_ENV = "SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE"


def _unsafe() -> bool:
    return os.environ.get(UNSAFE_ENV) == "1"


def _split(ids: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    bounds = np.cumsum([0, *lengths])
    return [ids[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]


class LlamaEngine(Engine):
    """See the module docstring. Rerank pair composition is documented on `rerank`."""

    def __init__(self) -> None:
        native.init_backend()
        self._models: dict[str, native.LoadedModel] = {}
        self._backends = native.registered_backends()
        self._decode_tokens = decode_tokens_for(self._backends)

    # ---- identity --------------------------------------------------------------------------

    def info(self) -> m.EngineInfo:
        # The flags name the device: a certificate earned on the CPU must not cover a Metal
        # lane (their numerics differ), and HELLO is what the identity is built from.
        info = native.system_info().rstrip(" |")
        return m.EngineInfo(
            engine="llama.cpp",
            version=llama_cpp.__version__,
            build_flags=f"{info} | backends={','.join(self._backends)}"
            f" | device={self._auto_device()}",
        )

    def _offload_device(self) -> str:
        return offload_device(native.system_info(), bool(llama_cpp.llama_supports_gpu_offload()))

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
        ref = cfg.model_ref or model_kind.default_ref(path)
        if ref in self._models:
            raise EngineError("config_invalid", f"model_ref {ref!r} is already loaded")

        self._verify_digest(path, req.artifact_digest)
        progress.advance("control")
        try:
            hdr = read_gguf_header(path, want_arrays=frozenset())
        except (OSError, GGUFFormatError) as e:
            raise EngineError("artifact_invalid", f"{path}: not a valid GGUF: {e}") from e
        kind, pooling = model_kind.decide_kind(hdr, cfg)
        # A rank-pooled model of any head width loads: RERANK needs its one logit (see
        # `rerank`), CLASSIFY reads every label's.
        n_cls_out = model_kind.n_cls_out(hdr)

        try:
            gpu_layers = resolve_gpu_layers(
                cfg.gpu_layers,
                bool(llama_cpp.llama_supports_gpu_offload()),
                describe_build(llama_cpp.__version__, native.system_info()),
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
        if cfg.heads:
            try:
                if kind != "embed":
                    raise EngineError("config_invalid", f"heads on a {kind} model")
                loaded.heads = heads.load_heads(cfg.heads)
                loaded.head_limits = {k: h.limit for k, h in cfg.heads.items()}
            except BaseException:
                loaded.free()
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
            refuses=heads.refusals(loaded.heads),
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
        out = encode.encode(mdl, seqs, progress, self._decode_tokens)
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
        if mdl.decoder_head is not None:
            raise EngineError(
                "invalid_request",
                f"{mdl.ref} is a decoder scored at its last token: the host composes its "
                "pairs (through its chat template, if any) and sends RERANK_SEQUENCES",
            )
        if mdl.n_cls_out != 1:
            raise EngineError(
                "unsupported",
                f"rerank needs a single-logit classifier, this one has {mdl.n_cls_out} labels "
                "(score it with CLASSIFY)",
            )
        lengths = [req.query_n_tokens] + [c.n_tokens for c in req.candidates]
        if not req.candidates:
            return np.zeros(0, dtype=np.float32)
        ids = self._check_ids(mdl, ids, lengths, allow_empty=True)
        parts = _split(ids, lengths)
        pre, mid, post = encode.pair_template(mdl)
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
        scores = encode.encode(mdl, pairs, progress, self._decode_tokens, types)
        return np.ascontiguousarray(scores[:, 0], dtype=np.float32)

    def classify(self, req: m.CLASSIFY, ids: np.ndarray, progress: Progress) -> np.ndarray:
        """Every label's raw logit for each sequence, from the model's RANK head.

        The host composed the sequences with the model's own tokenizer (`[CLS] a [SEP]`, or a
        pair through its pair template), so the worker adds nothing; `n_first` gives a BERT
        pair its token types (1 after segment A), as for a cross-encoder. No activation: the
        host applies softmax or sigmoid as the model's problem type says.
        """
        mdl = self._get(req.model_ref, "rerank")
        if mdl.decoder_head is not None and mdl.decoder_head.kind == "llm-rerank":
            raise EngineError(
                "invalid_request", f"{mdl.ref} is an LLM reranker, not a sequence classifier"
            )
        lengths = [s.n_tokens for s in req.sequences]
        ids = self._check_ids(mdl, ids, lengths)
        if not _unsafe():
            for i, s in enumerate(req.sequences):
                if not 1 <= s.n_tokens <= mdl.item_limit:
                    raise EngineError(
                        "invalid_request",
                        f"sequence {i} has {s.n_tokens} tokens; allowed 1..{mdl.item_limit}",
                    )
                if s.n_first > s.n_tokens:
                    raise EngineError(
                        "invalid_request",
                        f"sequence {i}: n_first {s.n_first} exceeds its {s.n_tokens} tokens",
                    )
        seqs = _split(ids, lengths)
        if mdl.decoder_head is not None:  # a decoder: its rows on the last non-pad token's state
            seqs = [mdl.decoder_head.strip_pads(s) for s in seqs]
            hidden = last_token.encode_last(mdl, seqs, progress, self._decode_tokens)
            return np.ascontiguousarray(mdl.decoder_head.apply(hidden))
        types = None
        if mdl.typed is not None:
            types = [pair_types(s.n_first, s.n_tokens) for s in req.sequences]
        logits = encode.encode(mdl, seqs, progress, self._decode_tokens, types)
        return np.ascontiguousarray(logits, dtype=np.float32)

    def rerank_sequences(
        self, req: m.RERANK_SEQUENCES, ids: np.ndarray, progress: Progress
    ) -> np.ndarray:
        """Score pairs the host composed: an LLM reranker's (query, document) rendered through
        the checkpoint's chat template, the assistant suffix last, or a one-label decoder
        sequence classifier's pair. Each sequence is decoded on its own sequence id (packed
        sequences never attend to each other; a prefix all of them share is decoded once and
        borrowed through the KV cache, see last_token.py), so the scored state is each
        sequence's own last (non-pad) token whatever else shares the decode; the score is the
        raw `logit[true] - logit[false]` there, or the classifier's one logit (llm_head.py).
        `n_first` is the Core ML cross-encoders' token-type boundary; a causal decoder has no
        token types, so it is not read."""
        mdl = self._get(req.model_ref, "rerank")
        if mdl.decoder_head is None:
            raise EngineError(
                "unsupported",
                f"{mdl.ref} composes its own pairs from the GGUF's specials: send RERANK",
            )
        if mdl.decoder_head.rows.shape[0] != 1:
            raise EngineError(
                "unsupported",
                f"rerank needs a single-logit classifier, this one has {mdl.n_cls_out} labels "
                "(score it with CLASSIFY)",
            )
        lengths = [s.n_tokens for s in req.sequences]
        ids = self._check_ids(mdl, ids, lengths)
        if not _unsafe():
            for i, n in enumerate(lengths):
                if not 1 <= n <= mdl.item_limit:
                    raise EngineError(
                        "invalid_request",
                        f"sequence {i} has {n} tokens; allowed 1..{mdl.item_limit}",
                    )
        seqs = [mdl.decoder_head.strip_pads(s) for s in _split(ids, lengths)]
        hidden = last_token.encode_last(mdl, seqs, progress, self._decode_tokens)
        return np.ascontiguousarray(mdl.decoder_head.apply(hidden)[:, 0])

    def encode(self, req: m.ENCODE, ids: np.ndarray, progress: Progress) -> list[Section]:
        """Every requested output from ONE decode of each item's tokens (token_states.py):
        `dense` is the model's pooling of those states (normalized if asked), `tokens` the
        states themselves, `sparse` / `multivector` the model's heads on them."""
        mdl = self._get(req.model_ref, "embed")
        if not req.outputs or len(set(req.outputs)) != len(req.outputs):
            raise EngineError("invalid_request", f"outputs {list(req.outputs)}: name each once")
        missing = [k for k in req.outputs if k in ("sparse", "multivector") and k not in mdl.heads]
        if missing:
            raise EngineError("unsupported", f"{mdl.ref} has no {missing[0]} head")
        lengths = [it.n_tokens for it in req.items]
        ids = self._check_ids(mdl, ids, lengths)
        seqs = _split(ids, lengths)
        if "multivector" in req.outputs:
            mv = mdl.heads["multivector"]
            limit = mdl.head_limits.get("multivector") or mdl.item_limit
            prepared = heads.multivector_inputs(mv, seqs, req.side, min(limit, mdl.item_limit))
            same = all(np.array_equal(p, q) for p, q in zip(prepared, seqs, strict=True))
            if not same and list(req.outputs) != ["multivector"]:
                raise EngineError(
                    "unsupported",
                    f"{mdl.ref}'s multi-vector input is not its text's tokens (a prefix or "
                    "query expansion): ask for the multi-vector output alone",
                )
            seqs = prepared
        # An inference-free sparse query side alone reads no states: no forward pass at all.
        forward = any(k != "sparse" for k in req.outputs) or heads.sparse_needs_states(
            mdl, req.side
        )
        states = (
            token_states.token_states(mdl, seqs, progress, self._decode_tokens) if forward else []
        )
        sections: list[Section] = []
        for kind in req.outputs:
            if kind == "dense":
                dense = np.stack([token_states.pool(s, mdl.pooling) for s in states])
                if req.normalize:
                    dense /= np.maximum(np.linalg.norm(dense, axis=1, keepdims=True), 1e-12)
                sections.append(dense_section(dense))
            elif kind == "tokens":
                sections.append(ragged_section("tokens", states, mdl.n_embd))
            else:
                if kind == "sparse":
                    sections.append(heads.sparse_outputs(mdl, states, seqs, req.side))
                else:
                    mv = mdl.heads["multivector"]
                    got = mv.apply_many(states, seqs, req.side)
                    sections.append(ragged_section("multivector", got, mv.spec.dim))
        return sections

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
        grammar = generate.grammar_sampler(mdl, req.grammar) if req.grammar is not None else None
        try:
            return generate.generate(mdl, ids, req.max_tokens, grammar, progress)
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
            mparams = native.model_params(gpu_layers, cfg.use_mmap)
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
    ) -> native.LoadedModel:
        n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(model))
        encoder = kind in ("embed", "rerank")
        # What llama.cpp's reservation sees: a decoder served as an embedder stays causal.
        causal = model_kind.is_causal(hdr)
        plan = plan_context(
            cfg,
            encoder=encoder,
            causal=causal,
            offloaded=offloaded,
            n_ctx_train=n_ctx_train,
            max_parallel_sequences=llama_cpp.llama_max_parallel_sequences(),
            cpu_count=usable_cpu_count(),
        )
        cparams = native.planned_context_params(
            plan,
            offloaded=offloaded,
            encoder=encoder,
            pooling=pooling,
            flash_attn=flash_attention(cfg.flash_attn, kind, offloaded),
        )
        typed = None
        head = None
        if kind == "rerank" and model_kind.has_decoder_head(hdr):
            try:
                head = llm_head.load_head(path, hdr)
            except (OSError, ValueError, NotImplementedError) as e:
                raise EngineError("artifact_invalid", f"{path}: {llm_head.CLS_OUT}: {e}") from e
        if kind == "rerank" and hdr.architecture == "bert":
            try:
                typed = TypedPairs.from_gguf(path, hdr)
            except (OSError, ValueError, GGUFFormatError, NotImplementedError) as e:
                raise EngineError("artifact_invalid", f"{path}: token-type tensors: {e}") from e
        slots: list[native.Slot] = []
        try:
            n_embd = int(llama_cpp.llama_model_n_embd(model))
            for _ in range(plan.streams):
                last = LastStates(n_embd) if head is not None else None
                slots.append(native.make_slot(model, cparams, last))
                if typed is not None:
                    slots[-1].typed = native.EmbdBatch.create(slots[-1].capacity, typed.n_embd)
            ctx = slots[0].ctx
            got_pooling = POOLING_NAMES.get(int(llama_cpp.llama_pooling_type(ctx)), "none")
            if encoder and got_pooling != pooling:
                raise EngineError(
                    "config_invalid", f"llama.cpp resolved pooling {got_pooling}, not {pooling}"
                )
        except BaseException:
            for slot in slots:
                slot.free()
            raise
        vocab = llama_cpp.llama_model_get_vocab(model)
        token_cparams = None
        if kind == "embed":
            # Token outputs are read per token, unpooled and unbounded (a MaxSim sums them, a
            # sparse head reads every one): like a reranker's logit, they keep K and V in f32.
            token_cparams = native.planned_context_params(
                plan,
                offloaded=offloaded,
                encoder=True,
                pooling="none",
                flash_attn=flash_attention(cfg.flash_attn, "rerank", offloaded),
            )
        return native.LoadedModel(
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
            pool=ThreadPoolExecutor(plan.streams, thread_name_prefix=f"encode-{ref}")
            if plan.streams > 1
            else None,
            stream_threads=plan.stream_threads,
            all_threads=plan.all_threads,
            typed=typed,
            decoder_head=head,
            token_cparams=token_cparams,
        )

    # ---- internals: requests -----------------------------------------------------------------

    def _get(self, ref: str, kind: Kind) -> native.LoadedModel:
        mdl = self._models.get(ref)
        if mdl is None:
            raise EngineError("model_not_loaded", f"{ref!r} is not loaded")
        if mdl.kind != kind:
            raise EngineError("invalid_request", f"{ref!r} is a {mdl.kind} model, not {kind}")
        return mdl

    def _check_ids(
        self,
        mdl: native.LoadedModel,
        ids: np.ndarray,
        lengths: list[int],
        allow_empty: bool = False,
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
