"""The token-level outputs of the BERT / XLM-RoBERTa encoder graph (`workers.ane.token_heads`
names them): the final states themselves and the heads built on them, in the graph's
channels-first `(B, C, 1, S)` layout, every linear layer a 1x1 conv.

- multi-vector: each Dense layer a 1x1 conv (bias, tanh or relu as the layer says), then L2
  per token over the channels, computed on the vectors scaled by 1/sqrt(dim): the squares'
  sum is then a mean of squares, which fp16 holds for any |x| < 256, where the plain sum of
  128 squares overflows 65504 from |x| ~ 23. The scale cancels in x / |x|.
- SPLADE: the MLM head's transform (dense 1x1 conv -> GELU -> LayerNorm over channels), then
  the vocabulary projection one chunk of `vocab_chunk` entries at a time: a 1x1 conv to the
  chunk's logits, pooled over the row's attended tokens at once, so one chunk's
  (B, chunk, 1, S) logits are the most the graph holds of it. Max pooling takes the max of the
  raw logits (padding pushed down by MASK_BIAS) and applies log1p(relu(.)) once per entry:
  both are non-decreasing, so it is the max of the activated logits. Sum pooling activates
  every logit and zeroes padding before the sum. log1p is log(1 + x): MIL has no log1p, and
  fp16's rounding of 1 + x costs at most 2^-11 absolute, within the fp16 logits' own error.
- bge-m3's lexical weights: relu of a one-channel 1x1 conv.

Packed shapes: the per-token outputs are the row's columns as they are (segments side by
side; the worker slices them), and SPLADE pools per SEGMENT through a membership mask
(B, S, K): token t counts for segment k when its segment id is k and its key mask is 1.
Sum pooling is then one matmul (B, chunk, 1, S) x (B, 1, S, K), as the encoder pools its
vectors; max pooling adds a per-segment bias (B, 1, K, S) to the chunk's logits and reduces
over S, a (B, chunk, K, S) tensor that `vocab_chunk` bounds like the logits themselves.
"""

from __future__ import annotations

import math

import numpy as np

from workers.ane.ct_quiet import Var, mb
from workers.ane.shapes import Shape
from workers.ane.token_heads import (
    MULTIVECTOR,
    SPARSE_POOLED,
    TOKEN_STATES,
    TOKEN_WEIGHTS,
    GraphHeads,
    vocab_chunk,
)
from workers.heads.sparse import SpladeHead

# The same floor and padding bias as the encoder (workers.ane.builder), restated to keep this
# module a leaf of it.
LN_EPS_FLOOR = 1e-5
MASK_BIAS = -1.0e4
_GELU_MODES = {
    "gelu": "EXACT",
    "gelu_new": "TANH_APPROXIMATION",
    "gelu_pytorch_tanh": "TANH_APPROXIMATION",
    "gelu_fast": "TANH_APPROXIMATION",
}


def _conv(x: Var, w: np.ndarray, b: np.ndarray | None) -> Var:
    w = np.asarray(w, np.float32)
    weight = w.reshape(w.shape[0], w.shape[1], 1, 1)
    if b is None:
        return mb.conv(x=x, weight=weight, pad_type="valid")
    return mb.conv(x=x, weight=weight, bias=np.asarray(b, np.float32), pad_type="valid")


def _rows(v: Var, shape: Shape, name: str) -> Var:
    """(B, C, 1, S) -> (B, C, S), named: the one op on the way out."""
    return mb.squeeze(x=v, axes=[2], name=name)


def _multivector(x: Var, heads: GraphHeads, shape: Shape) -> Var:
    head = heads.multivector
    assert head is not None
    v = x
    for layer, (w, b) in zip(head.spec.layers, head.layers, strict=True):
        v = _conv(v, w, b)
        if layer.activation == "tanh":
            v = mb.tanh(x=v)
        elif layer.activation == "relu":
            v = mb.relu(x=v)
    if head.spec.normalize:
        v = mb.mul(x=v, y=np.float32(1.0 / math.sqrt(head.spec.dim)))
        norm = mb.maximum(x=mb.reduce_l2_norm(x=v, axes=[1], keep_dims=True), y=1e-6)
        v = mb.real_div(x=v, y=norm)
    return _rows(v, shape, MULTIVECTOR)


def _log1p_relu(v: Var, twice: bool) -> Var:
    v = mb.log(x=mb.add(x=mb.relu(x=v), y=np.float32(1.0)))
    if twice:  # log1p_relu: log1p(log1p(relu(x))), the inner value already >= 0
        v = mb.log(x=mb.add(x=v, y=np.float32(1.0)))
    return v


def _splade(x: Var, mask: Var, head: SpladeHead, shape: Shape) -> Var:
    """(B, V) pooled vocabulary vector unpacked, (B, K, V) packed. `mask` is (B, 1, 1, S)
    unpacked, 1 for attended tokens; (B, 1, S, K) packed, each segment's membership."""
    spec, t = head.spec, head.tensors
    h = _conv(x, t["dense.weight"], t["dense.bias"])
    if spec.hidden_act == "relu":
        h = mb.relu(x=h)
    else:
        h = mb.gelu(x=h, mode=_GELU_MODES[spec.hidden_act])
    h = mb.layer_norm(
        x=h,
        axes=[1],
        gamma=np.asarray(t["norm.weight"], np.float32),
        beta=np.asarray(t["norm.bias"], np.float32),
        epsilon=max(spec.layer_norm_eps, LN_EPS_FLOOR),
    )
    twice = spec.activation == "log1p_relu"
    is_max = spec.pooling == "max"
    packed = shape.packed
    pad_bias = None
    if is_max:
        # Tokens outside the pool as an additive bias, broadcast over the chunk: (B, 1, 1, S)
        # unpacked, (B, 1, K, S) packed (one row of biases per segment).
        member = mb.transpose(x=mask, perm=[0, 1, 3, 2]) if packed else mask
        pad_bias = mb.mul(x=mb.sub(x=member, y=np.float32(1.0)), y=np.float32(-MASK_BIAS))
    dec_w, dec_b = t["decoder.weight"], t["decoder.bias"]
    vocab = spec.vocab_size
    step = vocab_chunk(shape, vocab, is_max)
    pooled = []
    for start in range(0, vocab, step):
        stop = min(vocab, start + step)
        logits = _conv(h, dec_w[start:stop], dec_b[start:stop])  # (B, chunk, 1, S)
        if is_max:
            # (B, chunk, 1 | K, 1): the max over the pool's tokens, per segment when packed.
            top = mb.reduce_max(x=mb.add(x=logits, y=pad_bias), axes=[3], keep_dims=True)
            pooled.append(_log1p_relu(top, twice))
        elif packed:
            # (B, chunk, 1, K): each segment's sum as one matmul with its membership.
            pooled.append(mb.matmul(x=_log1p_relu(logits, twice), y=mask))
        else:
            act = mb.mul(x=_log1p_relu(logits, twice), y=mask)
            pooled.append(mb.reduce_sum(x=act, axes=[3], keep_dims=True))
    v = pooled[0] if len(pooled) == 1 else mb.concat(values=pooled, axis=1)
    if not packed:
        return mb.reshape(x=v, shape=[shape.rows, vocab], name=SPARSE_POOLED)
    v = mb.reshape(x=v, shape=[shape.rows, vocab, shape.max_segments])
    return mb.transpose(x=v, perm=[0, 2, 1], name=SPARSE_POOLED)  # (B, K, V) as `embedding`


def _token_weights(x: Var, heads: GraphHeads, shape: Shape) -> Var:
    head = heads.token_weights
    assert head is not None
    w = mb.relu(x=_conv(x, head.tensors["weight"], head.tensors["bias"]))  # (B, 1, 1, S)
    return mb.reshape(x=w, shape=[shape.rows, shape.seq_len], name=TOKEN_WEIGHTS)


def _membership(attention_mask: Var, segment_ids: Var, shape: Shape) -> Var:
    """(B, 1, S, K): 1 where token t is in segment k (ids 1..K) and its key mask is 1."""
    s = shape
    seg = mb.reshape(x=mb.cast(x=segment_ids, dtype="fp32"), shape=[s.rows, s.seq_len, 1])
    ids = np.arange(1, s.max_segments + 1, dtype=np.float32).reshape(1, 1, -1)
    onehot = mb.cast(x=mb.equal(x=seg, y=ids), dtype="fp32")  # (B, S, K)
    keys = mb.reshape(x=mb.cast(x=attention_mask, dtype="fp32"), shape=[s.rows, s.seq_len, 1])
    return mb.expand_dims(x=mb.mul(x=onehot, y=keys), axes=[1])


def token_outputs(
    x: Var,
    attention_mask: Var,
    heads: GraphHeads,
    shape: Shape,
    segment_ids: Var | None = None,
) -> list[Var]:
    """The token-level outputs of the final states `x` (B, H, 1, S), in
    `GraphHeads.output_names` order. `attention_mask` is the graph's (B, S) int input;
    `segment_ids` too on a packed shape."""
    outputs = [_rows(x, shape, TOKEN_STATES)]
    if heads.multivector is not None:
        outputs.append(_multivector(x, heads, shape))
    if heads.splade is not None:
        if shape.packed:
            assert segment_ids is not None
            m = _membership(attention_mask, segment_ids, shape)
        else:
            m = mb.cast(x=attention_mask, dtype="fp32")
            m = mb.reshape(x=m, shape=[shape.rows, 1, 1, shape.seq_len])
        outputs.append(_splade(x, m, heads.splade, shape))
    if heads.token_weights is not None:
        outputs.append(_token_weights(x, heads, shape))
    return outputs
