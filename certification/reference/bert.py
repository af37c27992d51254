"""Independent fp32 reference forward of BERT in numpy: the ground truth lanes are certified on.

Written from the BERT equations (Devlin et al. 2019; the HF `BertModel` weight layout), not
from any engine in this project:

    h0 = LayerNorm(word[ids] + position[0..S) + token_type[tt])
    per layer:
        a  = softmax(Q K^T / sqrt(d_head) + mask) V           (per head, keys masked to real tokens)
        h' = LayerNorm(h + a Wo + bo)
        h  = LayerNorm(h' + GELU(h' Wi + bi) Wo2 + bo2)       (GELU = x * Phi(x), erf form)
    embedding: mean (or CLS) pooling over real tokens, optional L2 normalization
    sequence classification: logits = tanh(h[CLS] Wp + bp) Wc + bc

Precision, stated: weights and activations are float32 and every matmul is a float32 BLAS
GEMM (float32 accumulation) — what the checkpoint is. Two cheap places use float64: softmax
and LayerNorm statistics (exp/normalise over small rows, so padding and ordering cannot move
them), and GELU, whose erf is evaluated in float64 by `erf` below (absolute error < 1e-13,
checked against `math.erf` in the tests) and rounded once to float32. numpy has no erf, and a
float32-grade approximation would add error the lanes could hide behind.

Batches of varying length: sequences are grouped in length-sorted buckets; every per-token
layer (embeddings, projections, FFN, LayerNorm) runs on the real tokens only, and attention
scatters them into a zero-padded layout with an additive -inf mask on padded keys (exactly
zero weight). Batching therefore changes results only by GEMM blocking/summation order
(tests: batched vs one-at-a-time agree to ~1e-6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.polynomial import chebyshev as cheb

from formats.hf_config import HfConfig
from formats.safetensors_io import read_safetensors

# Bucket sizes: enough rows for efficient GEMMs, attention scores bounded in memory.
_MAX_BATCH_TOKENS = 8192
_MAX_SCORE_ELEMS = 1 << 24  # batch * heads * S * S


# -- erf / GELU --------------------------------------------------------------------------------
#
# Two fits made at import time from math.erf/math.erfc (the C library's, correctly rounded to
# within an ulp), sampled at Chebyshev points:
#   |z| < 1 : erf(z) = z * A(z^2),        A a degree-10 polynomial in z^2 (power basis)
#   |z| >= 1: erfc(|z|) = exp(-z^2) * B(t), t an affine map of w = 1/|z| in [1/9, 1] onto
#             [-1, 1], B a degree-20 polynomial in t (fitted in Chebyshev, evaluated by Horner)
# so 1 + erf(z) is computed without cancellation on the negative tail (where GELU is tiny).
# Beyond |z| = 9 (|x| > 12.7) w is clamped: erfc there is < 5e-37, below float32 resolution of
# anything it is added to.

_ERF_Z_MAX = 9.0


def _fit_small() -> np.ndarray:
    def f(t: np.ndarray) -> np.ndarray:  # t in [-1, 1] -> u = z^2 in [0, 1]
        z = np.sqrt((t + 1.0) / 2.0)
        return np.array([math.erf(v) / v if v > 0 else 2.0 / math.sqrt(math.pi) for v in z])

    # numpy's stub bounds the function's return to scalars; it evaluates f on an array of
    # points, as here (an ndarray in, an ndarray out).
    c: np.ndarray = cheb.chebinterpolate(f, 10)  # type: ignore[type-var]
    # Re-express in powers of u (t = 2u - 1): well conditioned at this degree.
    return np.polynomial.Polynomial(cheb.cheb2poly(c))(np.polynomial.Polynomial([-1.0, 2.0])).coef


def _fit_tail() -> np.ndarray:
    w_lo = 1.0 / _ERF_Z_MAX

    def f(t: np.ndarray) -> np.ndarray:  # t in [-1, 1] -> w in [w_lo, 1]
        z = 1.0 / (w_lo + (t + 1.0) / 2.0 * (1.0 - w_lo))
        return np.array([math.erfc(v) * math.exp(v * v) for v in z])

    return cheb.chebinterpolate(f, 20)


_ERF_SMALL = _fit_small()
_ERF_TAIL = np.polynomial.Polynomial(cheb.cheb2poly(_fit_tail())).coef  # powers of t


def _horner(coef: np.ndarray, u: np.ndarray) -> np.ndarray:
    r = np.full_like(u, coef[-1])
    for c in coef[-2::-1]:
        r *= u
        r += c
    return r


def one_plus_erf(z: np.ndarray) -> np.ndarray:
    """1 + erf(z) in float64: < 1e-14 absolute everywhere, ~1e-13 relative on the lower tail."""
    z = np.asarray(z, dtype=np.float64)
    a = np.abs(z)
    # Both branches over the whole array, then a select: cheaper than boolean gathers.
    small = _horner(_ERF_SMALL, z * z)
    small *= z
    small += 1.0
    w_lo = 1.0 / _ERF_Z_MAX
    t = np.reciprocal(np.maximum(a, 1.0))
    np.maximum(t, w_lo, out=t)
    t -= w_lo
    t *= 2.0 / (1.0 - w_lo)
    t -= 1.0
    erfc = _horner(_ERF_TAIL, t)
    erfc *= np.exp(-(z * z))
    tail = np.where(z > 0, 2.0 - erfc, erfc)
    return np.where(a < 1.0, small, tail)


def erf(z: np.ndarray) -> np.ndarray:
    return one_plus_erf(z) - 1.0


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, x * Phi(x), evaluated in float64 and returned as float32.

    Processed in cache-sized chunks: the float64 temporaries then stay in cache, which is
    several times faster than whole-array evaluation on (tokens x intermediate) activations.
    """
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(flat)
    step = 1 << 15
    inv_sqrt2 = 1.0 / math.sqrt(2.0)
    for i in range(0, flat.size, step):
        v = flat[i : i + step].astype(np.float64)
        out[i : i + step] = 0.5 * v * one_plus_erf(v * inv_sqrt2)
    return out.reshape(np.shape(x))


# -- model -----------------------------------------------------------------------------------


POOLINGS = ("mean", "cls")  # what `embed` computes


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    num_labels: int  # 0 for a plain encoder
    architecture: str

    @classmethod
    def from_dict(cls, cfg: dict) -> BertConfig:
        return cls.from_hf(HfConfig(cfg))

    @classmethod
    def from_hf(cls, cfg: HfConfig) -> BertConfig:
        """The config.json facts the forward needs, read (defaults included) as every other
        reader of the directory reads them (formats.hf_config)."""
        act = cfg.string("hidden_act")
        if act != "gelu":
            # "gelu_new"/tanh approximations are different functions; refuse, do not guess.
            raise ValueError(f"hidden_act={act!r}: the reference implements exact erf GELU only")
        if cfg.string("position_embedding_type") != "absolute":
            raise ValueError("only absolute position embeddings are implemented")
        arch = (cfg.architectures or ["BertModel"])[0]
        labels = len(cfg.labels()) if arch == "BertForSequenceClassification" else 0
        return cls(
            hidden_size=cfg.positive_int("hidden_size"),
            num_layers=cfg.positive_int("num_hidden_layers"),
            num_heads=cfg.positive_int("num_attention_heads"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            max_positions=cfg.positive_int("max_position_embeddings"),
            type_vocab_size=cfg.positive_int("type_vocab_size"),
            layer_norm_eps=cfg.number("layer_norm_eps"),
            num_labels=labels,
            architecture=arch,
        )


@dataclass(frozen=True)
class _Layer:
    w_qkv: np.ndarray  # (H, 3H), input-major so activations multiply on the left
    b_qkv: np.ndarray
    w_o: np.ndarray
    b_o: np.ndarray
    ln1_g: np.ndarray
    ln1_b: np.ndarray
    w_i: np.ndarray  # (H, I)
    b_i: np.ndarray
    w_o2: np.ndarray  # (I, H)
    b_o2: np.ndarray
    ln2_g: np.ndarray
    ln2_b: np.ndarray


class BertReference:
    def __init__(self, config: BertConfig, weights: dict[str, np.ndarray]) -> None:
        self.config = config
        w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        prefix = _prefix(w)

        def get(name: str) -> np.ndarray:
            key = prefix + name
            if key not in w and name.endswith("LayerNorm.weight"):
                key = key[: -len("weight")] + "gamma"  # original TF-port naming
            if key not in w and name.endswith("LayerNorm.bias"):
                key = key[: -len("bias")] + "beta"
            if key not in w:
                raise KeyError(f"missing weight {key!r}")
            return w[key]

        self.word = get("embeddings.word_embeddings.weight")
        self.position = get("embeddings.position_embeddings.weight")
        self.token_type = get("embeddings.token_type_embeddings.weight")
        self.emb_ln_g = get("embeddings.LayerNorm.weight")
        self.emb_ln_b = get("embeddings.LayerNorm.bias")
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"encoder.layer.{i}."
            q, k, v = (get(p + f"attention.self.{n}.weight") for n in ("query", "key", "value"))
            bq, bk, bv = (get(p + f"attention.self.{n}.bias") for n in ("query", "key", "value"))
            # HF Linear stores (out, in); transpose once so x @ W is the layer.
            self.layers.append(
                _Layer(
                    w_qkv=np.ascontiguousarray(np.concatenate([q, k, v], axis=0).T),
                    b_qkv=np.concatenate([bq, bk, bv]),
                    w_o=np.ascontiguousarray(get(p + "attention.output.dense.weight").T),
                    b_o=get(p + "attention.output.dense.bias"),
                    ln1_g=get(p + "attention.output.LayerNorm.weight"),
                    ln1_b=get(p + "attention.output.LayerNorm.bias"),
                    w_i=np.ascontiguousarray(get(p + "intermediate.dense.weight").T),
                    b_i=get(p + "intermediate.dense.bias"),
                    w_o2=np.ascontiguousarray(get(p + "output.dense.weight").T),
                    b_o2=get(p + "output.dense.bias"),
                    ln2_g=get(p + "output.LayerNorm.weight"),
                    ln2_b=get(p + "output.LayerNorm.bias"),
                )
            )
        self.pooler_w: np.ndarray | None = None
        self.pooler_b: np.ndarray | None = None
        self.classifier_w: np.ndarray | None = None
        self.classifier_b: np.ndarray | None = None
        if config.num_labels:
            self.pooler_w = np.ascontiguousarray(get("pooler.dense.weight").T)
            self.pooler_b = get("pooler.dense.bias")
            self.classifier_w = np.ascontiguousarray(w["classifier.weight"].T)
            self.classifier_b = w["classifier.bias"]
            if self.classifier_w.shape[1] != config.num_labels:
                raise ValueError("classifier rows do not match num_labels")

    @classmethod
    def from_dir(cls, path: str | Path) -> BertReference:
        d = Path(path)
        config = BertConfig.from_hf(HfConfig.read(d))
        return cls(config, read_safetensors(d / "model.safetensors"))

    # -- public API ------------------------------------------------------------------------

    def hidden_states(
        self, ids: Sequence[int] | np.ndarray, token_type_ids: Sequence[int] | None = None
    ) -> np.ndarray:
        """Last-layer hidden states of ONE sequence: float32 (len(ids), hidden)."""
        ids_arr = self._check_ids(ids)
        tt = self._check_types(token_type_ids, len(ids_arr))
        return self._forward([ids_arr], [tt])

    def embed(
        self,
        sequences: Sequence[Sequence[int] | np.ndarray],
        pooling: str = "mean",
        normalize: bool = True,
    ) -> np.ndarray:
        """Pooled sentence embeddings, float32 (n, hidden). `pooling`: "mean" or "cls"."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r}: expected 'mean' or 'cls'")
        seqs = [self._check_ids(s) for s in sequences]
        out = np.zeros((len(seqs), self.config.hidden_size), dtype=np.float32)
        for idx in self._buckets([len(s) for s in seqs]):
            group = [seqs[i] for i in idx]
            h = self._forward(group, [np.zeros(len(g), np.int64) for g in group])
            starts = _starts(group)
            if pooling == "cls":
                out[idx] = h[starts]
            else:
                # Sum over each sequence's own (real) tokens only: there is no padding here.
                lengths = np.array([len(g) for g in group], dtype=np.float32)[:, None]
                out[idx] = np.add.reduceat(h, starts, axis=0) / lengths
        if normalize:
            norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
            out = (out / np.maximum(norms, 1e-12)).astype(np.float32)
        return out

    def score(
        self, ids: Sequence[int] | np.ndarray, token_type_ids: Sequence[int] | None = None
    ) -> np.float32 | np.ndarray:
        """Sequence-classification logits of one composed pair (`[CLS] q [SEP] d [SEP]`).

        num_labels == 1 -> a float32 scalar; otherwise float32 (num_labels,).
        """
        logits = self.score_many([ids], [token_type_ids])
        return logits[0] if self.config.num_labels == 1 else logits[0].copy()

    def score_many(
        self,
        sequences: Sequence[Sequence[int] | np.ndarray],
        token_type_ids: Sequence[Sequence[int] | np.ndarray | None] | None = None,
    ) -> np.ndarray:
        """Logits for many composed pairs: float32 (n,) for one label, else (n, num_labels)."""
        if not self.config.num_labels:
            raise ValueError(f"{self.config.architecture} has no classification head")
        assert self.pooler_w is not None and self.classifier_w is not None
        seqs = [self._check_ids(s) for s in sequences]
        types = list(token_type_ids) if token_type_ids is not None else [None] * len(seqs)
        if len(types) != len(seqs):
            raise ValueError("one token_type_ids entry per sequence")
        tts = [self._check_types(t, len(s)) for s, t in zip(seqs, types, strict=True)]
        out = np.zeros((len(seqs), self.config.num_labels), dtype=np.float32)
        for idx in self._buckets([len(s) for s in seqs]):
            group = [seqs[i] for i in idx]
            h = self._forward(group, [tts[i] for i in idx])
            cls = h[_starts(group)]
            pooled = np.tanh(cls @ self.pooler_w + self.pooler_b)
            out[idx] = pooled @ self.classifier_w + self.classifier_b
        return out[:, 0] if self.config.num_labels == 1 else out

    # -- forward ---------------------------------------------------------------------------

    def _forward(self, seqs: list[np.ndarray], types: list[np.ndarray]) -> np.ndarray:
        """Sequences -> their hidden states concatenated: float32 (sum of lengths, H).

        Every per-token layer runs on the real tokens only (rows of a flat matrix). Only
        attention, which mixes tokens of one sequence, scatters them into a zero-padded
        (B, S) layout, with padded keys masked to -inf so they get exactly zero weight.
        """
        cfg = self.config
        b, s = len(seqs), max(len(q) for q in seqs)
        n_h = cfg.num_heads
        d_h = cfg.hidden_size // n_h
        mask = np.zeros((b, s), dtype=bool)
        for row, q in enumerate(seqs):
            mask[row, : len(q)] = True
        ids = np.concatenate(seqs)
        pos = np.concatenate([np.arange(len(q)) for q in seqs])
        x = self.word[ids] + self.position[pos] + self.token_type[np.concatenate(types)]
        x = _layer_norm(x, self.emb_ln_g, self.emb_ln_b, cfg.layer_norm_eps)
        bias = np.where(mask, 0.0, -np.inf)[:, None, None, :]  # (B, 1, 1, S) float64
        scale = 1.0 / math.sqrt(d_h)
        for layer in self.layers:
            qkv = np.zeros((b, s, 3 * cfg.hidden_size), dtype=np.float32)
            qkv[mask] = x @ layer.w_qkv + layer.b_qkv
            qkv = qkv.reshape(b, s, 3, n_h, d_h)
            q = qkv[:, :, 0].transpose(0, 2, 1, 3)  # (B, nH, S, dH)
            k = qkv[:, :, 1].transpose(0, 2, 3, 1)  # (B, nH, dH, S)
            v = qkv[:, :, 2].transpose(0, 2, 1, 3)
            scores = np.matmul(q, k).astype(np.float64) * scale + bias
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            ctx = np.matmul(p.astype(np.float32), v)  # (B, nH, S, dH)
            ctx = ctx.transpose(0, 2, 1, 3).reshape(b, s, cfg.hidden_size)[mask]
            x = _layer_norm(
                x + (ctx @ layer.w_o + layer.b_o), layer.ln1_g, layer.ln1_b, cfg.layer_norm_eps
            )
            inter = gelu(x @ layer.w_i + layer.b_i)
            x = _layer_norm(
                x + (inter @ layer.w_o2 + layer.b_o2), layer.ln2_g, layer.ln2_b, cfg.layer_norm_eps
            )
        return x

    def _buckets(self, lengths: list[int]) -> list[np.ndarray]:
        """Index groups in length order, bounded in tokens and in attention-score memory."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        n_h = self.config.num_heads
        groups: list[np.ndarray] = []
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order):
                s = lengths[order[end]]  # the longest so far: sorted
                rows = end + 1 - start
                if rows * s > _MAX_BATCH_TOKENS or rows * n_h * s * s > _MAX_SCORE_ELEMS:
                    break
                end += 1
            groups.append(np.array(order[start:end]))
            start = end
        return groups

    def _check_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise ValueError("empty sequence")
        if arr.size > self.config.max_positions:
            raise ValueError(f"{arr.size} tokens > {self.config.max_positions} positions")
        if arr.min() < 0 or arr.max() >= self.word.shape[0]:
            raise ValueError("token id out of vocabulary")
        return arr

    def _check_types(self, tt: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
        if tt is None:
            return np.zeros(n, dtype=np.int64)
        arr = np.asarray(tt, dtype=np.int64).reshape(-1)
        if arr.size != n:
            raise ValueError("token_type_ids length differs from ids")
        if arr.size and (arr.min() < 0 or arr.max() >= self.config.type_vocab_size):
            raise ValueError("token type out of range")
        return arr


def _starts(seqs: list[np.ndarray]) -> np.ndarray:
    """Row index where each sequence begins in the flat (tokens, H) matrix."""
    return np.concatenate([[0], np.cumsum([len(q) for q in seqs])[:-1]]).astype(np.int64)


def _prefix(weights: dict[str, np.ndarray]) -> str:
    for prefix in ("", "bert."):
        if prefix + "embeddings.word_embeddings.weight" in weights:
            return prefix
    raise KeyError("no embeddings.word_embeddings.weight (with or without 'bert.' prefix)")


def _layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)  # biased, as BERT
    return ((x64 - mean) / np.sqrt(var + eps) * g + b).astype(np.float32)
