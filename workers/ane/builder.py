"""The owned BERT encoder graph, built with coremltools' MIL builder in the Neural Engine's form.

The layout follows Apple's "Deploying Transformers on the Apple Neural Engine" (2022) and its
reference code ml-ane-transformers; each choice below is commented with the principle it serves:

- activations are channels-first `(B, C, 1, S)` from the embedding to the pooled output: the
  ANE's native tensor layout is (N, C, H, W) with the last axis packed in 64-byte-aligned rows,
  so a 4-D channels-first tensor with the sequence on the last axis is moved without relayout;
- every linear layer (Q, K, V, attention output, FFN up/down, pooler, classifier) is a 1x1
  `conv`, the op the ANE runs fastest, with the weight used as stored (HF Linear is (out, in));
- attention runs per head on channel chunks (`split` along C) with `einsum` "nchw,nwhu->nchu",
  which the ANE executes as a batched matmul without reshaping to (B, heads, S, d) and back;
  the only transpose per layer is K's (to (B, S, 1, C)), as in ml-ane-transformers;
- fp16 compute (the ANE has no fp32 datapath), with a layer-norm epsilon fp16 can hold;
- static shapes only: the ANE compiles fixed shapes, a dynamic dim sends the graph to the CPU.

Heads: embedders mean-pool over valid tokens (and also emit the L2-normalised vector); cross-
encoders take [CLS] -> pooler (tanh(dense)) -> classifier, with REAL token types (segment A = 0,
segment B = 1) - the classifier was trained with them, unlike llama.cpp's rerank which drops them.

Packed shapes put several sequences in one row: `segment_ids` (0 = pad, 1..K) and
`position_ids` (restarting per segment) are inputs; the block-diagonal attention mask and the
per-segment pooling are computed INSIDE the graph from the segment ids, so the host sends only
ids. An embedder's packed graph (BERT / XLM-RoBERTa, which has token outputs) also takes an
`attention_mask` key mask, multiplied into the block-diagonal one.

XLM-RoBERTa (`ModelConfig.family == "xlm-roberta"`) is this graph with three differences, all
in constants, none in the ops: HF numbers its positions from `pad_token_id + 1`, so the
position table is sliced past those rows when the graph is built (inputs stay 0-based per
segment, the first token of a segment is still the one at position 0, and packing is
unchanged); it has one token type, added as a constant (token_type_ids is then unread); its
cross-encoder head is `classifier.dense` -> tanh -> `classifier.out_proj` on `<s>`, the same
function as BERT's pooler + classifier under other names. Embedders of either family pool by
mean or by the first token (`embed_cls`), as their sentence-transformers Pooling says.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from formats.owned.manifest import Manifest
from formats.owned.model import classifier_layers
from workers.ane.build_options import BuildOptions
from workers.ane.builder_tokens import token_outputs
from workers.ane.ct_quiet import Function, Program, Var, ct, mb, quiet_numpy_warnings, types
from workers.ane.identity import (  # noqa: F401  (re-exported for callers of the builder)
    DEPLOYMENT_TARGET,
    KERNEL_REVISION,
    PRECISION,
)
from workers.ane.shapes import Shape
from workers.ane.token_heads import GraphHeads, has_token_outputs

# KERNEL_REVISION (workers.ane.identity) names this graph: bump it whenever the graph changes.

# BERT's 1e-12 is below fp16's smallest subnormal (6e-8), so it rounds to 0 when the graph is
# cast to fp16 and a constant channel vector would divide by sqrt(0). 1e-5 (PyTorch's default,
# what ml-ane-transformers uses) survives the cast (as the subnormal 1.0014e-5) and is far
# below the variance of real hidden states (~1e-1..1e1), so it moves outputs by < 1e-5 relative.
LN_EPS_FLOOR = 1e-5

# Additive attention bias for masked keys: exp(-1e4) is exactly 0 in fp16, yet the value is
# finite (-inf would turn an all-masked padding row into NaN) and representable in fp16.
MASK_BIAS = -1.0e4


def truncate_mantissa(arr: np.ndarray, bits: int) -> np.ndarray:
    """float32 with the low (23 - bits) mantissa bits cleared (rounding toward zero)."""
    a = np.ascontiguousarray(arr, dtype=np.float32)
    mask = np.uint32((0xFFFFFFFF << (23 - bits)) & 0xFFFFFFFF)
    return (a.view(np.uint32) & mask).view(np.float32)


def output_names(manifest: Manifest) -> list[str]:
    """The pooled outputs (the token-level ones: `token_heads.GraphHeads.output_names`)."""
    if manifest.head.type == "cross_encoder":
        return ["logits"]
    return ["embedding", "embedding_l2"]


def input_names(shape: Shape, token_outputs: bool = False) -> list[str]:
    """The graph's int32 (rows, seq_len) inputs. A packed graph with token outputs also takes
    `attention_mask`, a key mask over the segments' own (a multi-vector query's unattended
    expansion is 0 there)."""
    if shape.packed:
        names = ["input_ids", "token_type_ids", "segment_ids", "position_ids"]
        return [*names, "attention_mask"] if token_outputs else names
    return ["input_ids", "token_type_ids", "attention_mask"]


def _conv_w(w: np.ndarray) -> np.ndarray:
    # HF Linear (out, in) is already the 1x1 conv weight (C_out, C_in, 1, 1): no transpose.
    return w.reshape(w.shape[0], w.shape[1], 1, 1)


def _chan(v: np.ndarray) -> np.ndarray:
    """A per-channel vector as a (1, C, 1, 1) constant that broadcasts over (B, C, 1, S)."""
    return v.reshape(1, -1, 1, 1)


class _Graph:
    """Emits the ops of one program (called inside the mb.program function)."""

    def __init__(self, manifest: Manifest, shape: Shape, options: BuildOptions) -> None:
        cfg = manifest.config
        self.cfg = cfg
        self.head = manifest.head
        self.shape = shape
        w = manifest.load_weights()
        if options.weight_mantissa_bits is not None:
            w = {k: truncate_mantissa(v, options.weight_mantissa_bits) for k, v in w.items()}
        self.w = w
        self.eps = (
            float(options.ln_eps_override)
            if options.ln_eps_override is not None
            else max(cfg.layer_norm_eps, LN_EPS_FLOOR)
        )

    def conv(self, x: Var, name: str, scale: float = 1.0) -> Var:
        # Linear layer as 1x1 conv: the ANE's fastest op, on the (B, C, 1, S) layout as is.
        weight = self.w[f"{name}.weight"] * np.float32(scale)
        bias = self.w[f"{name}.bias"] * np.float32(scale)
        return mb.conv(x=x, weight=_conv_w(weight), bias=bias, pad_type="valid")

    def layer_norm(self, x: Var, name: str) -> Var:
        # Normalise over the channel axis of (B, C, 1, S): the layout stays channels-first, no
        # transpose to (B, S, C) and back around every norm.
        return mb.layer_norm(
            x=x,
            axes=[1],
            gamma=self.w[f"{name}.weight"],
            beta=self.w[f"{name}.bias"],
            epsilon=self.eps,
        )

    # ---- embeddings --------------------------------------------------------------------------

    def embeddings(self, input_ids: Var, token_type_ids: Var, position_ids: Var | None) -> Var:
        s = self.shape
        word = self.w["embeddings.word_embeddings.weight"]
        # XLM-RoBERTa's position 0 is row pad_token_id + 1 (HF counts from the padding index):
        # sliced here, on the constant, so position ids stay 0-based on the wire and per
        # segment, and no op is added for it.
        pos_table = self.w["embeddings.position_embeddings.weight"][self.cfg.position_offset :]
        types_table = self.w["embeddings.token_type_embeddings.weight"]
        tok = mb.gather(x=word, indices=input_ids, axis=0)  # (B, S, H)
        if position_ids is not None:
            # Packed rows restart positions per segment: a gather, added before the one
            # transpose so both lookups share it.
            tok = mb.add(x=tok, y=mb.gather(x=pos_table, indices=position_ids, axis=0))
        # The single layout change of the graph: token-major lookups -> channels-first
        # (B, H, 1, S), which every later op keeps.
        x = mb.transpose(x=tok, perm=[0, 2, 1])
        x = mb.expand_dims(x=x, axes=[2])
        if position_ids is None:
            # Unpacked positions are 0..S-1 in every row: fold them and token type 0 into one
            # constant added on the ANE instead of a gather.
            const = (pos_table[: s.seq_len] + types_table[0]).T.reshape(1, -1, 1, s.seq_len)
        else:
            const = _chan(types_table[0])
        x = mb.add(x=x, y=const)
        if self.cfg.type_vocab_size == 2:
            # Token type 1 as arithmetic on a (B, 1, 1, S) fp16 row: elementwise broadcast the
            # ANE runs, instead of a second gather and transpose.
            tt = mb.cast(x=token_type_ids, dtype="fp32")
            tt = mb.reshape(x=tt, shape=[s.rows, 1, 1, s.seq_len])
            x = mb.add(x=x, y=mb.mul(x=tt, y=_chan(types_table[1] - types_table[0])))
        return self.layer_norm(x, "embeddings.LayerNorm")

    # ---- encoder -----------------------------------------------------------------------------

    def layer(self, x: Var, i: int, bias: Var) -> Var:
        cfg = self.cfg
        p = f"encoder.layer.{i}."
        n_h, d_h = cfg.num_heads, cfg.head_dim
        # 1/sqrt(d_head) folded into Q's weights: one op fewer per head and layer.
        q = self.conv(x, p + "attention.self.query", scale=1.0 / math.sqrt(d_h))
        k = self.conv(x, p + "attention.self.key")
        v = self.conv(x, p + "attention.self.value")
        # K to (B, S, 1, C) once per layer, so each head's scores are a plain einsum.
        k_t = mb.transpose(x=k, perm=[0, 3, 2, 1])
        qs = mb.split(x=q, num_splits=n_h, axis=1)  # n_h x (B, d, 1, S): channel chunks
        ks = mb.split(x=k_t, num_splits=n_h, axis=3)  # n_h x (B, S, 1, d)
        vs = mb.split(x=v, num_splits=n_h, axis=1)  # n_h x (B, d, 1, S)
        heads = []
        for qh, kh, vh in zip(qs, ks, vs, strict=True):
            # scores (B, S_k, 1, S_q): keys on the channel axis, so softmax over axis 1 is a
            # channel reduction and the mask broadcasts as (B, S_k, 1, 1 | S_q).
            scores = mb.einsum(values=(kh, qh), equation="nchw,nwhu->nchu")
            probs = mb.softmax(x=mb.add(x=scores, y=bias), axis=1)
            heads.append(mb.einsum(values=(vh, probs), equation="nchw,nwhu->nchu"))
        ctx = mb.concat(values=heads, axis=1)  # (B, H, 1, S): heads back along channels
        x = self.layer_norm(
            mb.add(x=x, y=self.conv(ctx, p + "attention.output.dense")),
            p + "attention.output.LayerNorm",
        )
        # Exact (erf) GELU, what BERT was trained with (hidden_act="gelu"); MIL's gelu has an
        # EXACT mode the ANE implements, so the tanh approximation would only add error.
        h = mb.gelu(x=self.conv(x, p + "intermediate.dense"), mode="EXACT")
        return self.layer_norm(
            mb.add(x=x, y=self.conv(h, p + "output.dense")), p + "output.LayerNorm"
        )

    # ---- masks and pooling weights -----------------------------------------------------------

    def unpacked_masks(self, attention_mask: Var) -> tuple[Var, Var]:
        s = self.shape
        m = mb.cast(x=attention_mask, dtype="fp32")  # (B, S) in {0, 1}
        # Key bias (B, S_k, 1, 1): 0 for real tokens, MASK_BIAS for padding.
        bias = mb.mul(
            x=mb.sub(x=mb.reshape(x=m, shape=[s.rows, s.seq_len, 1, 1]), y=1.0), y=-MASK_BIAS
        )
        # Mean-pooling weights m / count as (B, 1, S, 1): pooling becomes one matmul of
        # (B, H, 1, S) x (B, 1, S, 1), and dividing first keeps the fp16 sum small.
        count = mb.maximum(x=mb.reduce_sum(x=m, axes=[1], keep_dims=True), y=1.0)
        weights = mb.reshape(x=mb.real_div(x=m, y=count), shape=[s.rows, 1, s.seq_len, 1])
        return bias, weights

    def packed_masks(
        self, segment_ids: Var, position_ids: Var, key_mask: Var | None = None
    ) -> tuple[Var, Var]:
        s = self.shape
        seg = mb.cast(x=segment_ids, dtype="fp32")  # small ints: exact in fp16
        seg_k = mb.reshape(x=seg, shape=[s.rows, s.seq_len, 1, 1])
        seg_q = mb.reshape(x=seg, shape=[s.rows, 1, 1, s.seq_len])
        # Block-diagonal mask (B, S_k, 1, S_q): a query sees the keys of its own segment and
        # never padding (segment 0).
        allowed = mb.logical_and(x=mb.equal(x=seg_k, y=seg_q), y=mb.not_equal(x=seg_k, y=0.0))
        # As a 0/1 fp16 tensor, then the same (m - 1) * 1e4 as the unpacked mask. (Not
        # select(allowed, 0, -1e4): coremltools types select by a and b only, so scalar
        # branches would declare a scalar output for a (B, S, 1, S) result.)
        allowed = mb.cast(x=allowed, dtype="fp32")
        if key_mask is not None:
            # The key mask hides a token from every query of its segment, its own row
            # included, as the unpacked graph's key bias does.
            keys = mb.cast(x=key_mask, dtype="fp32")
            allowed = mb.mul(x=allowed, y=mb.reshape(x=keys, shape=[s.rows, s.seq_len, 1, 1]))
        bias = mb.mul(x=mb.sub(x=allowed, y=1.0), y=-MASK_BIAS)
        # One-hot segment membership (B, S, K) against the constants 1..K.
        ids = np.arange(1, s.max_segments + 1, dtype=np.float32).reshape(1, 1, -1)
        onehot = mb.cast(
            x=mb.equal(x=mb.reshape(x=seg, shape=[s.rows, s.seq_len, 1]), y=ids), dtype="fp32"
        )
        if self.head.pooling == "cls":
            # [CLS] (<s>) of each segment = its token at position 0.
            first = mb.equal(x=mb.cast(x=position_ids, dtype="fp32"), y=0.0)
            first = mb.reshape(x=mb.cast(x=first, dtype="fp32"), shape=[s.rows, s.seq_len, 1])
            weights = mb.mul(x=onehot, y=first)
        else:
            count = mb.maximum(x=mb.reduce_sum(x=onehot, axes=[1], keep_dims=True), y=1.0)
            weights = mb.real_div(x=onehot, y=count)
        # (B, 1, S, K): per-segment pooling is one matmul (B, H, 1, S) x (B, 1, S, K).
        weights = mb.expand_dims(x=weights, axes=[1])
        return bias, weights

    # ---- heads -------------------------------------------------------------------------------

    def pool(self, x: Var, weights: Var) -> Var:
        """(B, H, 1, S) x (B, 1, S, K) -> (B, H, 1, K), still channels-first."""
        return mb.matmul(x=x, y=weights)

    def embed_outputs(self, pooled: Var) -> list[Var]:
        # L2 over channels; max() guards all-padding rows (norm 0) against 0/0.
        norm = mb.maximum(x=mb.reduce_l2_norm(x=pooled, axes=[1], keep_dims=True), y=1e-6)
        normed = mb.real_div(x=pooled, y=norm)
        return [self.to_output(pooled, "embedding"), self.to_output(normed, "embedding_l2")]

    def classify(self, pooled: Var) -> list[Var]:
        # pooler and classifier are linear layers too: 1x1 convs on (B, H, 1, K).
        dense, out = classifier_layers(self.cfg)
        h = mb.tanh(x=self.conv(pooled, dense))
        return [self.to_output(self.conv(h, out), "logits")]

    def to_output(self, v: Var, name: str) -> Var:
        """(B, C, 1, K) -> (B, C) unpacked, (B, K, C) packed: the one output relayout."""
        s = self.shape
        c = v.shape[1]
        if not s.packed:
            return mb.reshape(x=v, shape=[s.rows, c], name=name)
        v = mb.squeeze(x=v, axes=[2])
        return mb.transpose(x=v, perm=[0, 2, 1], name=name)

    def cls_token(self, x: Var) -> Var:
        s = self.shape
        return mb.slice_by_index(x=x, begin=[0, 0, 0, 0], end=[s.rows, self.cfg.hidden_size, 1, 1])


def build_program(
    manifest: Manifest,
    shape: Shape,
    options: BuildOptions | None = None,
    heads: GraphHeads | None = None,
) -> Program:
    """The MIL program of `manifest`'s encoder + head at `shape` (every dim static). An
    embedder's graph, packed or not, also outputs every token's final state and the `heads`
    built on them (`workers.ane.token_heads`)."""
    options = options or BuildOptions()
    cfg = manifest.config
    if shape.seq_len > cfg.max_positions:
        raise ValueError(f"seq_len {shape.seq_len} > the model's {cfg.max_positions} positions")
    g = _Graph(manifest, shape, options)
    tokens = has_token_outputs(manifest)
    names = input_names(shape, tokens)
    placeholders = {
        n: mb.placeholder(shape=(shape.rows, shape.seq_len), dtype=types.int32) for n in names
    }
    with quiet_numpy_warnings(), Function(placeholders, ct.target.macOS14) as func:
        inp = func.inputs
        pos = inp.get("position_ids")
        x = g.embeddings(inp["input_ids"], inp["token_type_ids"], pos)
        if shape.packed:
            bias, weights = g.packed_masks(inp["segment_ids"], pos, inp.get("attention_mask"))
        else:
            bias, weights = g.unpacked_masks(inp["attention_mask"])
        for i in range(cfg.num_layers):
            x = g.layer(x, i, bias)
        # Unpacked rows hold one sequence: its first token is a slice, no pooling matmul.
        if shape.packed:
            pooled = g.pool(x, weights)
        else:
            pooled = g.cls_token(x) if manifest.head.pooling == "cls" else g.pool(x, weights)
        if manifest.head.type == "cross_encoder":
            outputs = g.classify(pooled)
        else:
            outputs = g.embed_outputs(pooled)
        if tokens:
            outputs += token_outputs(
                x, inp["attention_mask"], heads or GraphHeads(), shape, inp.get("segment_ids")
            )
        func.set_outputs(outputs)
    prog = Program()
    prog.add_function("main", func)
    return prog


def convert_and_save(prog: Program, out_dir: str | os.PathLike[str]) -> Path:
    """Convert to an fp16 ML Program for macOS 14 and save `<out_dir>/model.mlpackage`."""
    out = Path(out_dir) / "model.mlpackage"
    with quiet_numpy_warnings():
        ct.convert(
            prog,
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.macOS14,
            compute_precision=ct.precision.FLOAT16,
            # Linux cannot load the model; macOS loads it when the backend asks, not here.
            skip_model_load=True,
            # Written in place. Without it coremltools writes a temp package under /tmp that only
            # atexit removes: a long-lived worker kept one per build (44 MB for MiniLM), and a
            # worker the host SIGKILLs left them behind for good.
            package_dir=str(out),
        )
    return out
