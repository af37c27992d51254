"""The owned NomicBERT encoder graph (nomic-embed-text v1 / v1.5), BERT's graph (`builder`) with
the three things NomicBERT does differently:

- positions are rotary, not a table: each head's q and k are rotated by constant cos/sin
  tables (NEOX halves over the whole head, rotate_half's sign folded into sin, as
  `builder_qwen3.rotary_tables` builds them at the config's base). Unpacked rows use positions
  0..S-1, a constant; packed rows gather both tables by `position_ids` once per prediction
  (positions restart per segment), never per layer or head. The embedding is then token +
  token type -> LayerNorm, with no position term.
- the MLP is SwiGLU, `fc2(silu(fc12(x)) * fc11(x))` (fc11 = up, fc12 = gate), as three 1x1
  convs and two elementwise ops, where BERT's is dense -> GELU -> dense.
- no linear layer has a bias: the fused `Wqkv` is split into q, k, v weights on the constant
  (three convs, no op for the split), and no bias is added anywhere but in the LayerNorms.

Everything else is BERT's, reused as is: channels-first `(B, C, 1, S)`, every linear layer a
1x1 conv, per-head `split` + `einsum` attention with one K transpose per layer, 1/sqrt(d)
folded into q's weights (rotation is linear, so it commutes), post-norm LayerNorms with an
epsilon fp16 can hold, fp16, static shapes, the unpacked and block-diagonal packed masks, and
mean or first-token pooling per segment, then L2.
"""

from __future__ import annotations

import math

import numpy as np

from formats.owned.manifest import Manifest
from workers.ane.build_options import BuildOptions
from workers.ane.builder import _Graph as _BertGraph
from workers.ane.builder import convert_and_save, input_names, output_names  # noqa: F401
from workers.ane.builder_qwen3 import rotary_tables
from workers.ane.ct_quiet import Function, Program, Var, ct, mb, quiet_numpy_warnings, types
from workers.ane.shapes import Shape


def _conv_w(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], w.shape[1], 1, 1)


class _Graph(_BertGraph):
    def linear(self, x: Var, weight: np.ndarray) -> Var:
        # A 1x1 conv without bias: NomicBERT's linear layers have none.
        return mb.conv(x=x, weight=_conv_w(weight), pad_type="valid")

    def rope(self, x: Var, cos: Var, sin: Var) -> Var:
        # x * cos + rotate_half(x) * sin with rotate_half's sign in `sin`: the halves swapped
        # along channels (no reshape), elementwise on the ANE.
        lo, hi = mb.split(x=x, num_splits=2, axis=1)
        return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=mb.concat(values=[hi, lo], axis=1), y=sin))

    # ---- embeddings and rotary tables: once per prediction ----------------------------------

    def nomic_embeddings(self, input_ids: Var, token_type_ids: Var) -> Var:
        s = self.shape
        word = self.w["embeddings.word_embeddings.weight"]
        types_table = self.w["embeddings.token_type_embeddings.weight"]
        tok = mb.gather(x=word, indices=input_ids, axis=0)  # (B, S, H)
        # The one layout change: token-major lookup -> channels-first (B, H, 1, S).
        x = mb.expand_dims(x=mb.transpose(x=tok, perm=[0, 2, 1]), axes=[2])
        x = mb.add(x=x, y=types_table[0].reshape(1, -1, 1, 1))
        if self.cfg.type_vocab_size == 2:
            # Token type 1 as arithmetic on a (B, 1, 1, S) row, as in BERT's graph.
            tt = mb.reshape(
                x=mb.cast(x=token_type_ids, dtype="fp32"), shape=[s.rows, 1, 1, s.seq_len]
            )
            diff = (types_table[1] - types_table[0]).reshape(1, -1, 1, 1)
            x = mb.add(x=x, y=mb.mul(x=tt, y=diff))
        return self.layer_norm(x, "emb_ln")

    def rotary(self, position_ids: Var | None) -> tuple[Var, Var]:
        """cos and signed sin as (1 | B, d, 1, S), shared by every layer and head."""
        n = self.shape.seq_len
        cos, sin = rotary_tables(self.cfg, n)
        if position_ids is None:
            return (
                mb.const(val=np.ascontiguousarray(cos.T.reshape(1, -1, 1, n))),
                mb.const(val=np.ascontiguousarray(sin.T.reshape(1, -1, 1, n))),
            )
        # One (S, 2d) table, one gather and one transpose, then split into cos and sin.
        rot = mb.gather(x=np.concatenate([cos, sin], axis=1), indices=position_ids, axis=0)
        rot = mb.expand_dims(x=mb.transpose(x=rot, perm=[0, 2, 1]), axes=[2])
        cos_v, sin_v = mb.split(x=rot, num_splits=2, axis=1)
        return cos_v, sin_v

    # ---- encoder layer ----------------------------------------------------------------------

    def nomic_layer(self, x: Var, i: int, bias: Var, cos: Var, sin: Var) -> Var:
        cfg = self.cfg
        p = f"encoder.layers.{i}."
        n_h, d_h, h = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        wq, wk, wv = np.split(self.w[p + "attn.Wqkv.weight"], 3, axis=0)  # rows: q, k, v
        q = self.linear(x, wq * np.float32(1.0 / math.sqrt(d_h)))
        k = self.linear(x, wk)
        v = self.linear(x, wv)
        qs = [self.rope(qh, cos, sin) for qh in mb.split(x=q, num_splits=n_h, axis=1)]
        ks = [self.rope(kh, cos, sin) for kh in mb.split(x=k, num_splits=n_h, axis=1)]
        # K to (B, S, 1, C) once per layer, so each head's scores are a plain einsum.
        k_t = mb.transpose(x=mb.concat(values=ks, axis=1), perm=[0, 3, 2, 1])
        ks_t = mb.split(x=k_t, num_splits=n_h, axis=3)
        vs = mb.split(x=v, num_splits=n_h, axis=1)
        heads = []
        for qh, kh, vh in zip(qs, ks_t, vs, strict=True):
            scores = mb.einsum(values=(kh, qh), equation="nchw,nwhu->nchu")  # (B, S_k, 1, S_q)
            probs = mb.softmax(x=mb.add(x=scores, y=bias), axis=1)
            heads.append(mb.einsum(values=(vh, probs), equation="nchw,nwhu->nchu"))
        ctx = mb.concat(values=heads, axis=1)
        assert ctx.shape[1] == h
        x = self.layer_norm(
            mb.add(x=x, y=self.linear(ctx, self.w[p + "attn.out_proj.weight"])), p + "norm1"
        )
        # SwiGLU: fc12 is the gate, fc11 the up projection, fc2 the down.
        gate = mb.silu(x=self.linear(x, self.w[p + "mlp.fc12.weight"]))
        up = self.linear(x, self.w[p + "mlp.fc11.weight"])
        down = self.linear(mb.mul(x=gate, y=up), self.w[p + "mlp.fc2.weight"])
        return self.layer_norm(mb.add(x=x, y=down), p + "norm2")


def build_program(manifest: Manifest, shape: Shape, options: BuildOptions | None = None) -> Program:
    """The MIL program of `manifest`'s NomicBERT embedder at `shape` (every dim static)."""
    options = options or BuildOptions()
    cfg = manifest.config
    if cfg.family != "nomic_bert":
        raise ValueError(f"a {cfg.family} model: this builder builds NomicBERT only")
    if shape.seq_len > cfg.max_positions:
        raise ValueError(f"seq_len {shape.seq_len} > the model's {cfg.max_positions} positions")
    if manifest.head.type not in ("embed_mean", "embed_cls"):
        raise ValueError(f"head {manifest.head.type}: the NomicBERT graph embeds")
    g = _Graph(manifest, shape, options)
    placeholders = {
        n: mb.placeholder(shape=(shape.rows, shape.seq_len), dtype=types.int32)
        for n in input_names(shape)
    }
    with quiet_numpy_warnings(), Function(placeholders, ct.target.macOS14) as func:
        inp = func.inputs
        pos = inp.get("position_ids")
        x = g.nomic_embeddings(inp["input_ids"], inp["token_type_ids"])
        cos, sin = g.rotary(pos)
        if shape.packed:
            bias, weights = g.packed_masks(inp["segment_ids"], pos)
        else:
            bias, weights = g.unpacked_masks(inp["attention_mask"])
        for i in range(cfg.num_layers):
            x = g.nomic_layer(x, i, bias, cos, sin)
        if shape.packed:
            pooled = g.pool(x, weights)
        else:
            pooled = g.cls_token(x) if manifest.head.pooling == "cls" else g.pool(x, weights)
        func.set_outputs(g.embed_outputs(pooled))
    prog = Program()
    prog.add_function("main", func)
    return prog
