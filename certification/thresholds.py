"""THE gate table: every certification threshold, per lane and precision, with why.

One row per (lane, precision). A lane/precision without a row cannot be certified (refused
with a message naming the missing row) rather than judged by a borrowed tolerance. CLI and
test overrides go through `Thresholds.with_overrides` and are recorded in the certificate.

Measured on MiniLM-L6 (the default model) against the fp32 numpy reference, whole corpus:
llama.cpp f16 GGUF min cosine 0.9999955, mean 0.9999985; f32 GGUF about the same (llama.cpp's
own approximations dominate, not the weights); Core ML graph on the reference executor
(fp16 emulated after every op) min 0.9999948, mean 0.9999987. The thresholds leave 10-20x
room over what healthy lanes show, yet a degraded graph (layer-norm eps 1e-2: min 0.73;
weights cut to 4 mantissa bits: 0.978; a GGUF from 6-bit mantissas: 0.9988) fails clearly.
"""

from __future__ import annotations

import math

import msgspec


class Thresholds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    min_cosine: float  # per-item cosine(lane, reference), worst item
    mean_cosine: float  # per-item cosine, average over the corpus
    retrieval_top10: float  # mean top-10 overlap, lane vs reference rankings
    rerank_max_abs: float  # max |lane score - reference score| over the rerank pairs
    # LLM rerankers only: the bar grows by this much per unit of the reference's largest
    # |score| over the judged pairs (bar = rerank_max_abs + llm_rerank_rel * max|ref|); 0 in
    # certificates written before it existed. Cross-encoders are judged at rerank_max_abs.
    llm_rerank_rel: float = 0.0
    tokenizer_mismatches: int  # corpus items whose ids differ from the reference tokenizer
    placement_share: float | None  # min Neural Engine share after admission; None = n/a
    # Fingerprint grid cells (see certification.fingerprint): noise below grid/8 never
    # changes the digest; chosen >= 2x the lane's own run-to-run noise.
    fingerprint_grid_embed: float
    fingerprint_grid_rerank: float
    # The token-level kinds (certification.kind_gates). Defaults are the llama.cpp rows';
    # certificates written before these existed read them back without having applied them.
    # Sparse: llama.cpp's tanh GELU (through an f16 table) alone moves SPLADE values by up to
    # ~4 % against the erf GELU of the reference, so values get 10 % relative, the vector as a
    # whole a sparse cosine of 0.9999.
    sparse_value_rel: float = 0.10
    # ...of the value, or of this fraction of the vector's largest |value| where that is more:
    # relu near 0 keeps the logit's absolute error (about 2e-3 of the peak on llama.cpp), which
    # no relative bar holds: on the tiny bge-m3 a weight at 1.8 % of its vector's peak is
    # 10.2 % off at sparse cosine 0.999999.
    sparse_value_floor: float = 0.05
    sparse_min_cosine: float = 0.9999
    # Multi-vector: every token's vector at the embedders' cosine bar; MaxSim, a sum of one
    # best dot product per query vector, within 1e-3 per query vector.
    multivector_min_cosine: float = 0.9999
    maxsim_max_abs: float = 1e-3
    late_chunk_min_cosine: float = 0.9999  # every chunk's vector, as an embedder's

    def with_overrides(self, overrides: dict[str, float] | None) -> Thresholds:
        if not overrides:
            return self
        unknown = set(overrides) - set(self.__struct_fields__)
        if unknown:
            raise ValueError(
                f"unknown threshold(s) {sorted(unknown)}; known: "
                f"{', '.join(self.__struct_fields__)}"
            )
        merged = msgspec.to_builtins(self)
        for name, value in overrides.items():
            if not math.isfinite(float(value)):  # NaN passes no comparison: it would disable
                raise ValueError(f"threshold {name!r}: {value!r} is not a finite number")
            if merged[name] is None:  # e.g. placement_share on the llama lane
                raise ValueError(f"threshold {name!r} does not apply to this lane")
            if isinstance(merged[name], int) and not isinstance(merged[name], bool):
                if float(value) != int(value):
                    raise ValueError(f"threshold {name!r} is a count: {value!r}")
                value = int(value)
            merged[name] = value
        return msgspec.convert(merged, Thresholds)


TABLE: dict[tuple[str, str], Thresholds] = {
    # llama.cpp, f32 GGUF: weights exact, but llama.cpp still uses its tanh-GELU table and
    # f16 flash-attention accumulators, so it is no tighter than f16 in practice (~5e-6 off).
    ("llama", "f32"): Thresholds(
        min_cosine=0.9999,
        mean_cosine=0.99999,
        retrieval_top10=0.9,  # ranking ties among near-duplicates may swap; 9 of 10 must agree
        # Typed pairs (the worker feeds token types as input embeddings) against the typed
        # reference, the whole corpus on the seeded BERT cross-encoder: max 1.5e-3, p99
        # 9.7e-4. Other families cost more: llama.cpp's GELU is the tanh form through an f16
        # table, measured against CrossEncoder in-process at 6.4e-3 (XLM-RoBERTa) and 5.1e-3
        # (ModernBERT) on logits spread over 5, ~1e-2 at magnitude 10; 2e-2 holds that with
        # room and still fails a lost token type (it moves the seeded cross-encoder's logits
        # by 5.8e-2).
        rerank_max_abs=2e-2,
        tokenizer_mismatches=0,  # MiniLM's WordPiece is deterministic: ids must be identical
        placement_share=None,  # llama.cpp runs on the CPU: no Neural Engine placement
        fingerprint_grid_embed=1 / 128,  # cell 7.8e-3, margin 1e-3 > batching noise 5e-4
        fingerprint_grid_rerank=1 / 32,  # cell 3.1e-2, margin 3.9e-3 > a rerun's batching noise
    ),
    # llama.cpp, f16 GGUF: f16 weights (10-bit mantissa) cost ~5e-6 of cosine on MiniLM.
    ("llama", "f16"): Thresholds(
        min_cosine=0.9999,  # 20x the worst observed 1-cos (5e-6)
        mean_cosine=0.99999,  # 7x the observed mean 1-cos (1.4e-6)
        retrieval_top10=0.9,
        rerank_max_abs=2e-2,  # BERT typed pairs: max 2.2e-3, p99 1.1e-3; others as for f32
        tokenizer_mismatches=0,
        placement_share=None,
        fingerprint_grid_embed=1 / 128,
        fingerprint_grid_rerank=1 / 32,
    ),
    # Core ML owned graph, fp16 end to end (activations too). The emulating executor shows
    # ~5e-6, but the Neural Engine's own fp16 accumulation order is not what it emulates, so
    # the hardware gets 100x the room (5e-4 on the minimum cosine), still far above a broken
    # graph.
    ("ane", "fp16"): Thresholds(
        min_cosine=0.9995,
        mean_cosine=0.9999,
        retrieval_top10=0.9,
        rerank_max_abs=5e-3,  # real token types in both; fp16 head through tanh
        # LLM rerankers: 5e-3 + 4e-3 x max|ref|. Their raw score (logit[yes] - logit[no]) is
        # the score row dotted with the final normed state, so fp16's relative error in that
        # state reaches every pair in proportion to the scores' range, whatever the pair's
        # own score (on the tiny seeded Qwen3 reranker, whole corpus, reference executor:
        # max 2.0e-2, p99 1.5e-2, mean 5.5e-3 with max|ref| 8.4; error vs |ref| correlation
        # 0.04). At that range the bar is 3.9e-2, 1.9x the worst healthy pair, while real
        # faults still fail: weights cut to 6 mantissa bits 0.13 (3.4x over), RMS-norm eps
        # 1e-2 0.24, one template token lost 0.99 (the first) to 10 (the last), the
        # yes/no rows swapped 17. (8 mantissa bits, 4x fp16's own rounding: 0.037 on 42
        # pairs, at the bar's edge.) The emulator rounds after every op; the Neural
        # Engine's own accumulation order is not measured here.
        llm_rerank_rel=4e-3,
        tokenizer_mismatches=0,
        placement_share=0.9,  # a lane mostly on the CPU is not the Neural Engine lane it claims
        fingerprint_grid_embed=1 / 64,  # cell 1.6e-2, margin 2e-3: fp16 noise is larger
        fingerprint_grid_rerank=1 / 16,  # margin 7.8e-3 > the 5e-3 tolerance
        # Token-level kinds, the fp16 lane's own bars: the embedders' cosine bar (5e-4 of
        # 1 - cos) for every vector, sparse vector and chunk; MaxSim per query vector 10x the
        # llama bar (each best dot product moves by its vectors' fp16 error). Measured on the
        # tiny seeded models, reference executor, every 32nd corpus item: vectors >= 0.99992
        # (bge-m3, ColBERT), MaxSim <= 1.2e-3 per query vector, chunks 0.999996, sparse
        # cosine 0.99995 (bge-m3) and 0.9999997 (SPLADE); head files perturbed by a tenth of
        # their spread fail at 0.988 (sparse) and 0.991 (vectors).
        # Sparse values: 10 % of the value, or of HALF the vector's largest value where that is
        # more. A scalar read off fp16 states (bge-m3's relu(w . h + b)) carries the states'
        # error times |w| |h|, not times the weight: on the tiny seeded bge-m3, whole corpus,
        # reference executor, a weight is up to 2.4 % of its vector's peak off (median 0.6 %;
        # sparse cosine still >= 0.99985), so ids near 0 appear on one side only and small
        # weights are 37 % off at the llama rows' 5 % floor. At half the peak the bar is 5 %
        # of the peak absolute, 2x the worst, for the values and the active set alike.
        # SPLADE's pooled logits are 0.35 % off at worst.
        sparse_value_floor=0.5,
        sparse_min_cosine=0.9995,
        multivector_min_cosine=0.9995,
        maxsim_max_abs=1e-2,
        late_chunk_min_cosine=0.9995,
    ),
}


def thresholds_for(lane: str, precision: str) -> Thresholds:
    try:
        return TABLE[(lane, precision)]
    except KeyError:
        rows = ", ".join(f"{lane}/{p}" for lane, p in TABLE)
        raise ValueError(
            f"no certification thresholds for lane {lane!r} at precision {precision!r} "
            f"(rows: {rows}); add a row to certification/thresholds.py with its reasons"
        ) from None
