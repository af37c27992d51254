"""The owned Qwen3 decoder graph, built with coremltools' MIL builder in the Neural Engine's
form: the embedder (Qwen3-Embedding) and, on the same layers, the reranker (Qwen3-Reranker:
one raw score, logit[yes] - logit[no], at the last real token).

The same principles as the BERT graph (`builder`), each named where it is applied below:

- [layout] activations are channels-first `(B, C, 1, S)` from the embedding to the pooled
  output, the ANE's native (N, C, H, W) with the sequence on the 64-byte-aligned last axis;
- [conv] every linear layer (q/k/v/o, gate/up/down) is a 1x1 `conv` with HF's (out, in)
  weight as stored;
- [heads] attention runs per head on channel chunks (`split` along C) with `einsum`
  "nchw,nwhu->nchu", no reshape to (B, heads, S, d); the only transpose per layer is K's;
- [fp16] fp16 compute, with every constant representable in fp16 and every activation kept
  inside fp16's range (below);
- [static] static shapes only, so nothing is sent to the CPU for a dynamic dim;
- [once] what depends only on the inputs (masks, rotary tables, pooling weights) is computed
  once per prediction, before the layers, never per layer or per head.

What is new for a decoder:

- RMSNorm as the ANE's own `layer_norm` over `concat([x, -x, c, -c])` (ANEMLL's formulation,
  extended): the mirrored half makes the mean exactly 0, so layer_norm's variance is the
  mean square and no mean is subtracted; the fixed pair `c, -c` carries RMSNorm's epsilon as
  data (`c^2 = C * s^2 * eps`), because the op's own epsilon is cast to fp16, where Qwen3's
  1e-6 times the residual scale squared would round to 0; the sqrt(C / (C + 1)) the two extra
  channels cost is folded into gamma. No x*x is ever formed as an fp16 tensor (it would
  overflow at |x| > 256): the statistics are the norm op's own.
- Rotary embeddings from constant cos/sin tables: unpacked rows use positions 0..S-1, a
  constant; packed rows gather the tables by `position_ids` (positions restart per segment)
  once per prediction. rotate_half's sign lives in the sin table, so rotating a head is a
  split, a concat (the halves swapped), two muls and an add, all on the ANE.
- Grouped-query attention: each K/V head is normalised, rotated and transposed once and
  shared by its group of query heads (no repeat_kv copies).
- A causal mask that is also block-diagonal across packed segments, computed in-graph from
  segment ids and positions (a token sees the earlier tokens of its own segment only).
- Last-token pooling per segment (the end-of-text the tokenizer appends), then the final
  RMSNorm on the pooled tokens only (it is per token, so norm-then-pick equals pick-then-norm)
  and L2 normalisation. A reranker picks the same last real token (the end of its template's
  assistant prefix), norms it, and applies its one score row as a 1x1 conv: one f32 per
  sequence, packed or not, with no vocabulary-wide head.
- fp16 range: Qwen-family residual streams grow channels far beyond fp16's 65504 in large
  checkpoints. The residual stream is carried scaled by RESIDUAL_SCALE (a power of two, so
  scaling is exact wherever fp16 values are normal): the embedding table, o_proj and up_proj
  are multiplied by it, so both branch outputs and the SwiGLU product (its other big value)
  enter the stream already scaled; RMSNorm is scale-invariant, so every norm reading the
  stream undoes it for free (its epsilon scaled by s^2, as above). Nothing else changes.
"""

from __future__ import annotations

import math

import numpy as np

from formats.owned.manifest import Manifest
from formats.owned.model import RANK_HEADS, ModelConfig
from formats.owned.rank_head import SCORE_WEIGHT
from workers.ane.build_options import BuildOptions
from workers.ane.builder import MASK_BIAS, convert_and_save, truncate_mantissa  # noqa: F401
from workers.ane.ct_quiet import Function, Program, Var, ct, mb, quiet_numpy_warnings, types
from workers.ane.shapes import Shape

# The residual stream's scale. 2^-6 keeps true values up to 4.2e6 inside fp16 (Qwen-family
# "massive activations" reach 1e4 and more), while true values down to 4e-3 stay normal fp16
# numbers (same relative precision as unscaled); smaller ones become subnormal, with an
# absolute error (~2e-6 in true units) far below the rounding of the channels that set the
# norm. A power of two, so scaling itself rounds nothing.
RESIDUAL_SCALE = 2.0**-6


def input_names(shape: Shape) -> list[str]:
    # No token types: a decoder has none (the host's token_type_ids are not fed).
    if shape.packed:
        return ["input_ids", "segment_ids", "position_ids"]
    return ["input_ids", "attention_mask"]


def output_names(manifest: Manifest) -> list[str]:
    if manifest.head.type in RANK_HEADS:
        return ["logits"]  # one raw score per sequence, named as the cross-encoders' is
    return ["embedding", "embedding_l2"]


def _conv_w(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], w.shape[1], 1, 1)


def rotary_tables(cfg: ModelConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, signed sin), each (positions, head_dim), NEOX layout: the frequencies repeat over
    both halves, and sin's first half is negated so that rotate_half(x) * sin equals
    swap_halves(x) * signed_sin."""
    d = cfg.head_dim
    assert cfg.rope_theta is not None  # a Qwen3 config always sets it (manifest_qwen3)
    inv_freq = 1.0 / (float(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))
    # transformers computes the angles in float32; so do we, then the tables in float64.
    angles = (
        np.arange(positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    ).astype(np.float64)
    emb = np.concatenate([angles, angles], axis=1)
    sin = np.sin(emb)
    sin[:, : d // 2] *= -1.0
    return np.cos(emb).astype(np.float32), sin.astype(np.float32)


def rms_norm(
    x: Var, gamma: np.ndarray, eps: float, in_scale: float = 1.0, out_scale: float = 1.0
) -> Var:
    """RMSNorm over the channels of (B, C, 1, T) whose values are `in_scale` times the true
    ones; the result is `out_scale` times RMSNorm(true values) * gamma.
    [layout] over axis 1, no transpose; [fp16] no square is formed in fp16."""
    b, c, _, t = x.shape
    # c^2 = C * s^2 * eps: the pair's share of the variance is exactly s^2 * eps after the
    # C / (C + 1) below, whatever fp16 would do to a small epsilon.
    pad = in_scale * math.sqrt(c * eps)
    pair = mb.const(
        val=np.broadcast_to(
            np.array([pad, -pad], np.float32).reshape(1, 2, 1, 1), (b, 2, 1, t)
        ).copy()
    )
    z = mb.concat(values=[x, mb.mul(x=x, y=-1.0), pair], axis=1)
    # layer_norm divides by sqrt((sum x^2 + c^2) / (C + 1)), RMSNorm by sqrt(sum x^2 / C +
    # s^2 eps): sqrt(C / (C + 1)) apart, folded into gamma. The mirror half and the pair get
    # gamma 0 (they are sliced away).
    g = np.zeros(2 * c + 2, np.float32)
    g[:c] = np.asarray(gamma, np.float32) * np.float32(out_scale * math.sqrt(c / (c + 1)))
    # The op's own epsilon is 0: the pair already adds RMSNorm's (and keeps an all-zero row,
    # such as an empty packed segment's pooled token, finite).
    normed = mb.layer_norm(x=z, axes=[1], gamma=g, epsilon=0.0)
    return mb.slice_by_index(x=normed, begin=[0, 0, 0, 0], end=[b, c, 1, t])


class _Graph:
    def __init__(
        self, manifest: Manifest, shape: Shape, options: BuildOptions, residual_scale: float
    ) -> None:
        self.cfg = cfg = manifest.config
        self.shape = shape
        w = manifest.load_weights()
        if options.weight_mantissa_bits is not None:
            w = {k: truncate_mantissa(v, options.weight_mantissa_bits) for k, v in w.items()}
        self.w = w
        self.eps = (
            float(options.ln_eps_override)
            if options.ln_eps_override is not None
            else cfg.layer_norm_eps
        )
        self.s = float(residual_scale)
        self.group = cfg.num_heads // cfg.kv_heads  # query heads per K/V head

    # ---- building blocks ---------------------------------------------------------------------

    def conv(self, x: Var, name: str, scale: float = 1.0) -> Var:
        # [conv] a linear layer as a 1x1 conv on (B, C, 1, S) as is; no biases in Qwen3.
        weight = self.w[f"{name}.weight"] * np.float32(scale)
        return mb.conv(x=x, weight=_conv_w(weight), pad_type="valid")

    def rms_norm(self, x: Var, name: str, in_scale: float = 1.0, out_scale: float = 1.0) -> Var:
        return rms_norm(x, self.w[f"{name}.weight"], self.eps, in_scale, out_scale)

    def rope(self, x: Var, cos: Var, sin: Var) -> Var:
        # x * cos + rotate_half(x) * sin, with rotate_half's sign in `sin`: the halves swapped
        # along channels ([heads] no reshape), elementwise on the ANE.
        lo, hi = mb.split(x=x, num_splits=2, axis=1)
        swapped = mb.concat(values=[hi, lo], axis=1)
        return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=swapped, y=sin))

    # ---- embeddings, masks, rotary tables, pooling weights: [once] per prediction -------------

    def embed(self, input_ids: Var) -> Var:
        # The table is stored pre-scaled: the stream starts at RESIDUAL_SCALE ([fp16]).
        table = self.w["embed_tokens.weight"] * np.float32(self.s)
        tok = mb.gather(x=table, indices=input_ids, axis=0)  # (B, S, H)
        # The graph's one layout change: token-major lookup -> channels-first [layout].
        return mb.expand_dims(x=mb.transpose(x=tok, perm=[0, 2, 1]), axes=[2])

    def unpacked_inputs(self, attention_mask: Var) -> tuple[Var, Var, Var, Var]:
        s = self.shape
        n = s.seq_len
        # Rows are right-padded, so plain causality already keeps every real token away from
        # the padding after it: the mask is a constant (B broadcast), (S_k, 1, S_q) like the
        # scores. Padding queries see the real tokens and themselves: never an empty row.
        causal = np.where(np.arange(n)[:, None] <= np.arange(n)[None, :], 0.0, MASK_BIAS)
        # One const op each, read by every layer and head (not a copy per use).
        bias = mb.const(val=causal.astype(np.float32).reshape(1, n, 1, n))
        cos, sin = rotary_tables(self.cfg, n)
        cos = mb.const(val=np.ascontiguousarray(cos.T.reshape(1, -1, 1, n)))
        sin = mb.const(val=np.ascontiguousarray(sin.T.reshape(1, -1, 1, n)))
        # The last real token of each row: the one at index count - 1, as a one-hot
        # (B, 1, S, 1) so pooling is one matmul. Counts <= 2048 are exact in fp16.
        m = mb.cast(x=attention_mask, dtype="fp32")
        count = mb.reduce_sum(x=m, axes=[1], keep_dims=True)  # (B, 1)
        index = np.arange(1, n + 1, dtype=np.float32).reshape(1, n)
        last = mb.cast(x=mb.equal(x=index, y=count), dtype="fp32")
        weights = mb.reshape(x=last, shape=[s.rows, 1, n, 1])
        return bias, cos, sin, weights

    def packed_inputs(self, segment_ids: Var, position_ids: Var) -> tuple[Var, Var, Var, Var]:
        s = self.shape
        b, n, k = s.rows, s.seq_len, s.max_segments
        seg = mb.cast(x=segment_ids, dtype="fp32")  # small integers: exact in fp16
        pos = mb.cast(x=position_ids, dtype="fp32")
        # Causal and block-diagonal (B, S_k, 1, S_q): a query sees the keys of its own segment
        # at positions up to its own. Padding (segment 0, position 0) sees only padding.
        same = mb.equal(
            x=mb.reshape(x=seg, shape=[b, n, 1, 1]), y=mb.reshape(x=seg, shape=[b, 1, 1, n])
        )
        earlier = mb.less_equal(
            x=mb.reshape(x=pos, shape=[b, n, 1, 1]), y=mb.reshape(x=pos, shape=[b, 1, 1, n])
        )
        allowed = mb.cast(x=mb.logical_and(x=same, y=earlier), dtype="fp32")
        bias = mb.mul(x=mb.sub(x=allowed, y=1.0), y=-MASK_BIAS)
        # Rotary tables gathered by position: one (S, 2d) table, one gather and one transpose
        # for every layer and head, then split into cos and signed sin.
        cos, sin = rotary_tables(self.cfg, n)
        table = np.concatenate([cos, sin], axis=1)
        rot = mb.gather(x=table, indices=position_ids, axis=0)  # (B, S, 2d)
        rot = mb.expand_dims(x=mb.transpose(x=rot, perm=[0, 2, 1]), axes=[2])
        cos, sin = mb.split(x=rot, num_splits=2, axis=1)
        # Segment k's last token: in segment k, at position (its length - 1).
        ids = np.arange(1, k + 1, dtype=np.float32).reshape(1, 1, k)
        member = mb.equal(x=mb.reshape(x=seg, shape=[b, n, 1]), y=ids)  # (B, S, K)
        length = mb.reduce_sum(x=mb.cast(x=member, dtype="fp32"), axes=[1], keep_dims=True)
        at_end = mb.equal(x=mb.reshape(x=pos, shape=[b, n, 1]), y=mb.sub(x=length, y=1.0))
        last = mb.cast(x=mb.logical_and(x=member, y=at_end), dtype="fp32")
        weights = mb.expand_dims(x=last, axes=[1])  # (B, 1, S, K): pooling is one matmul
        return bias, cos, sin, weights

    # ---- decoder layer -----------------------------------------------------------------------

    def layer(self, x: Var, i: int, bias: Var, cos: Var, sin: Var) -> Var:
        cfg = self.cfg
        p = f"layers.{i}."
        d = cfg.head_dim
        # Pre-norm reads the scaled stream; its output is in true units for the projections.
        n = self.rms_norm(x, p + "input_layernorm", in_scale=self.s)
        q = self.conv(n, p + "self_attn.q_proj")
        k = self.conv(n, p + "self_attn.k_proj")
        v = self.conv(n, p + "self_attn.v_proj")
        # [heads] channel chunks. q/k norms are per head (over d), then rotary; 1/sqrt(d) is
        # folded into q_norm's gamma (RMSNorm and rotation are linear in it).
        qs = [
            self.rope(
                self.rms_norm(qh, p + "self_attn.q_norm", out_scale=1.0 / math.sqrt(d)), cos, sin
            )
            for qh in _split(q, cfg.num_heads)
        ]
        ks = [
            self.rope(self.rms_norm(kh, p + "self_attn.k_norm"), cos, sin)
            for kh in _split(k, cfg.kv_heads)
        ]
        vs = _split(v, cfg.kv_heads)
        # K to (B, S, 1, C) once per layer [heads], then one chunk per K/V head.
        k_t = mb.transpose(x=_concat(ks), perm=[0, 3, 2, 1])
        ks_t = _split(k_t, cfg.kv_heads, axis=3)
        heads = []
        for h, qh in enumerate(qs):
            g = h // self.group  # grouped-query attention: query head h reads K/V head g
            # scores (B, S_k, 1, S_q): keys on channels, softmax a channel reduction.
            scores = mb.einsum(values=(ks_t[g], qh), equation="nchw,nwhu->nchu")
            probs = mb.softmax(x=mb.add(x=scores, y=bias), axis=1)
            heads.append(mb.einsum(values=(vs[g], probs), equation="nchw,nwhu->nchu"))
        # o_proj emits the branch already at the stream's scale [fp16].
        x = mb.add(x=x, y=self.conv(_concat(heads), p + "self_attn.o_proj", scale=self.s))
        n = self.rms_norm(x, p + "post_attention_layernorm", in_scale=self.s)
        # SwiGLU: silu(gate) * up -> down, all 1x1 convs [conv]. up_proj carries the scale, so
        # the product (the MLP's largest value) is already scaled, and so is down's output.
        gate = mb.silu(x=self.conv(n, p + "mlp.gate_proj"))
        up = self.conv(n, p + "mlp.up_proj", scale=self.s)
        return mb.add(x=x, y=self.conv(mb.mul(x=gate, y=up), p + "mlp.down_proj"))

    # ---- head ------------------------------------------------------------------------------

    def outputs(self, x: Var, weights: Var, rank: bool = False) -> list[Var]:
        # (B, H, 1, S) x (B, 1, S, K) -> (B, H, 1, K): each segment's last token, exactly
        # (one-hot weights), still channels-first and still at the stream's scale.
        pooled = mb.matmul(x=x, y=weights)
        pooled = self.rms_norm(pooled, "norm", in_scale=self.s)
        if rank:
            # The reranker's score: the LM head's true row minus its false row, one output
            # channel of a 1x1 conv [conv] on the normed last token (true units), which is
            # logit[true] - logit[false] without forming either logit (see
            # formats.owned.rank_head.score_row for why in fp16).
            score = mb.conv(x=pooled, weight=_conv_w(self.w[SCORE_WEIGHT]), pad_type="valid")
            return [self.to_output(score, "logits")]
        # L2 over channels; max() guards an empty segment's zero vector against 0/0.
        norm = mb.maximum(x=mb.reduce_l2_norm(x=pooled, axes=[1], keep_dims=True), y=1e-6)
        normed = mb.real_div(x=pooled, y=norm)
        return [self.to_output(pooled, "embedding"), self.to_output(normed, "embedding_l2")]

    def to_output(self, v: Var, name: str) -> Var:
        """(B, C, 1, K) -> (B, C) unpacked, (B, K, C) packed: the one output relayout."""
        s = self.shape
        c = v.shape[1]
        if not s.packed:
            return mb.reshape(x=v, shape=[s.rows, c], name=name)
        return mb.transpose(x=mb.squeeze(x=v, axes=[2]), perm=[0, 2, 1], name=name)


def _split(x: Var, n: int, axis: int = 1) -> list[Var]:
    return [x] if n == 1 else list(mb.split(x=x, num_splits=n, axis=axis))


def _concat(xs: list[Var]) -> Var:
    return xs[0] if len(xs) == 1 else mb.concat(values=xs, axis=1)


def build_program(
    manifest: Manifest,
    shape: Shape,
    options: BuildOptions | None = None,
    *,
    residual_scale: float = RESIDUAL_SCALE,
) -> Program:
    """The MIL program of `manifest`'s Qwen3 embedder at `shape` (every dim static).
    `residual_scale=1.0` builds the unscaled formulation (tests show it overflowing)."""
    options = options or BuildOptions()
    cfg = manifest.config
    if cfg.family != "qwen3":
        raise ValueError(f"a {cfg.family} model: this builder builds Qwen3 only")
    if shape.seq_len > cfg.max_positions:
        raise ValueError(f"seq_len {shape.seq_len} > the graph's {cfg.max_positions} positions")
    rank = manifest.head.type in RANK_HEADS
    if manifest.head.type != "embed_last" and not rank:
        raise ValueError(f"head {manifest.head.type}: the Qwen3 graph reads the last token")
    g = _Graph(manifest, shape, options, residual_scale)
    placeholders = {
        n: mb.placeholder(shape=(shape.rows, shape.seq_len), dtype=types.int32)
        for n in input_names(shape)
    }
    with quiet_numpy_warnings(), Function(placeholders, ct.target.macOS14) as func:
        inp = func.inputs
        x = g.embed(inp["input_ids"])
        if shape.packed:
            bias, cos, sin, weights = g.packed_inputs(inp["segment_ids"], inp["position_ids"])
        else:
            bias, cos, sin, weights = g.unpacked_inputs(inp["attention_mask"])
        for i in range(cfg.num_layers):
            x = g.layer(x, i, bias, cos, sin)
        func.set_outputs(g.outputs(x, weights, rank))
    prog = Program()
    prog.add_function("main", func)
    return prog
