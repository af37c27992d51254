"""The fp32 references of the token-level kinds, on the CPU: what `synapse certify` judges a
lane's sparse vectors, multi-vectors and late-chunked vectors against.

Each kind as its own reference computes it, never through the lane's heads
(`workers/heads/`) or the host's late-chunking code:

- SPLADE and inference-free SPLADE: sentence-transformers 6 `SparseEncoder(DIR)`, its own
  module pipeline (masked-LM transformer, `SpladePooling`; a `Router` with its
  `SparseStaticEmbedding` query route) run on the very ids the lane got, then the model's
  `max_active_dims` cut as `SparseEncoder.encode` applies it (`select_max_active_dims`).
- bge-m3's lexical weights: FlagEmbedding's formulas on transformers' `last_hidden_state`
  (`BGEM3FlagModel` is not installed here; its source, restated):
  `relu(sparse_linear(h))` per token, the largest weight per token id, the tokenizer's
  cls/eos/pad/unk ids dropped (`_process_token_weights`).
- bge-m3's colbert vectors: `colbert_linear(h[1:])` (CLS dropped), normalized, the
  sequence's own `n - 1` rows (`colbert_vecs`).
- ColBERT: `MultiVectorEncoder(DIR).encode_query / encode_document` of the texts: its own
  prefixes, cut, query expansion, skiplist, Dense layers and normalization (the id building
  is part of what it computes, so it is given texts, not the lane's ids).
- MaxSim: sentence-transformers' `maxsim` over the reference's own vectors.
- Late chunking: transformers' `last_hidden_state` of each window (the tokenizer's own
  special tokens around it), a token's state from the window where it is furthest from a
  cut edge, a chunk's vector the normalized mean of the tokens whose character offsets start
  inside it (the rule `host/late_chunking.py` states, restated here).

Imported only where torch and sentence-transformers are (the `reference` extra). Every
forward runs in float32 with `threads` intra-op threads (the runner keeps the other core for
the lane), restoring the caller's count after.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

SparseVector = tuple[np.ndarray, np.ndarray]  # (int32 ids ascending, float32 values)

_BATCH_ROWS = 16
# FlagEmbedding's unused tokens (m3.py `_process_token_weights`).
_M3_DROPPED = ("cls_token", "eos_token", "pad_token", "unk_token")


class KindsReference:
    """The references of one model directory, each model loaded on first use."""

    def __init__(self, model_dir: str | Path, threads: int = 1) -> None:
        self.dir = Path(model_dir)
        self.threads = threads
        self._lock = threading.Lock()
        self._models: dict[str, object] = {}

    # ---- models -----------------------------------------------------------------------------

    def _load(self, name: str, build):
        with self._lock:
            if name not in self._models:
                self._models[name] = build()
            return self._models[name]

    def sparse_encoder(self):
        from sentence_transformers import SparseEncoder

        return self._load(
            "sparse",
            lambda: _fp32(
                SparseEncoder(
                    str(self.dir),
                    device="cpu",
                    local_files_only=True,
                    model_kwargs={"dtype": torch.float32},
                )
            ),
        )

    def multivector_encoder(self):
        from sentence_transformers import MultiVectorEncoder

        return self._load(
            "multivector",
            lambda: _fp32(MultiVectorEncoder(str(self.dir), device="cpu", local_files_only=True)),
        )

    def transformer(self, sub: str = ""):
        """transformers' base model and tokenizer of `DIR/sub` (a plain HF directory, or the
        transformer of a sentence-transformers save at its root)."""

        def build():
            from transformers import AutoModel, AutoTokenizer

            path = str(self.dir / sub)
            model = AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True)
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            return _fp32(model), tok

        return self._load(f"transformer:{sub}", build)

    @contextmanager
    def _threads(self) -> Iterator[None]:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                yield
        finally:
            torch.set_num_threads(before)

    # ---- sparse -----------------------------------------------------------------------------

    def splade(self, ids: Sequence[np.ndarray], task: str) -> list[SparseVector]:
        """`SparseEncoder`'s vector of each id sequence on the route of `task` ("query" or
        "document"), `max_active_dims` applied as `encode` applies it."""
        from sentence_transformers.util import select_max_active_dims

        model = self.sparse_encoder()
        pad = _pad_of(model.tokenizer)
        out: list[SparseVector | None] = [None] * len(ids)
        with self._threads():
            for batch in _batches(ids):
                feats = _features([ids[i] for i in batch], pad)
                got = model(feats, task=task, modality="text")["sentence_embedding"]
                if model.max_active_dims is not None:
                    got = select_max_active_dims(got, max_active_dims=model.max_active_dims)
                dense = got.to_dense() if got.is_sparse else got
                for j, i in enumerate(batch):
                    out[i] = _sparse(dense[j].float().numpy())
        return out  # type: ignore[return-value]

    def m3_lexical_weights(self, ids: Sequence[np.ndarray]) -> list[SparseVector]:
        """bge-m3's lexical weights, FlagEmbedding's formula on transformers' states."""
        model, tok = self.transformer()
        linear = _linear(self.dir / "sparse_linear.pt")
        dropped = {
            tok.convert_tokens_to_ids(tok.special_tokens_map[t])
            for t in _M3_DROPPED
            if t in tok.special_tokens_map
        }
        out = []
        for seq, states in zip(ids, self.hidden_states(ids), strict=True):
            with self._threads():
                weights = torch.relu(linear(torch.from_numpy(states))).squeeze(-1).numpy()
            result: dict[int, float] = defaultdict(float)
            for w, idx in zip(weights.tolist(), np.asarray(seq).tolist(), strict=True):
                if idx not in dropped and w > result[idx]:
                    result[idx] = w
            keys = sorted(k for k, v in result.items() if v > 0)
            out.append(
                (np.asarray(keys, np.int32), np.asarray([result[k] for k in keys], np.float32))
            )
        return out

    # ---- multi-vector -----------------------------------------------------------------------

    def m3_colbert_vecs(self, ids: Sequence[np.ndarray]) -> list[np.ndarray]:
        """bge-m3's colbert vectors: colbert_linear on every state but CLS's, normalized."""
        linear = _linear(self.dir / "colbert_linear.pt")
        out = []
        for states in self.hidden_states(ids):
            with self._threads():
                v = linear(torch.from_numpy(states[1:]))
                out.append(torch.nn.functional.normalize(v, dim=-1).numpy().astype(np.float32))
        return out

    def colbert(self, texts: Sequence[str], side: str) -> list[np.ndarray]:
        """`MultiVectorEncoder`'s vectors of each text on `side` ("query" or "document")."""
        model = self.multivector_encoder()
        encode = model.encode_query if side == "query" else model.encode_document
        with self._threads():
            got = encode(list(texts), convert_to_numpy=True, batch_size=_BATCH_ROWS)
        return [np.asarray(v, np.float32) for v in got]

    def special_strings(self) -> list[str]:
        """The special tokens' own strings, which the host tokenizes as text (its policy:
        caller text is data) and a tokenizer given the text parses as the token."""
        _, tok = self.transformer()
        return [s for s in tok.all_special_tokens if s]

    @staticmethod
    def maxsim(queries: Sequence[np.ndarray], documents: Sequence[np.ndarray]) -> np.ndarray:
        """sentence-transformers' raw MaxSim of every query against every document."""
        from sentence_transformers.util.similarity import maxsim

        q = [torch.from_numpy(np.asarray(x, np.float32)) for x in queries]
        d = [torch.from_numpy(np.asarray(x, np.float32)) for x in documents]
        with torch.inference_mode():
            return maxsim(q, d).double().numpy()

    # ---- token states and late chunking -----------------------------------------------------

    def hidden_states(self, ids: Sequence[np.ndarray]) -> list[np.ndarray]:
        """transformers' `last_hidden_state` of each id sequence (T, H), padded on the right in
        batches (the attention mask keeps the padding out of every real token)."""
        model, tok = self.transformer()
        pad = _pad_of(tok)
        out: list[np.ndarray | None] = [None] * len(ids)
        with self._threads():
            for batch in _batches(ids):
                feats = _features([ids[i] for i in batch], pad)
                last = model(**feats).last_hidden_state.float().numpy()
                for j, i in enumerate(batch):
                    out[i] = last[j, : len(ids[i])].copy()
        return out  # type: ignore[return-value]

    def late_chunks(self, chunks: Sequence[str], context: int) -> tuple[np.ndarray, int]:
        """(normalized vector per chunk, windows read) of one document read in windows of
        `context` tokens (its special tokens included) half a window apart."""
        _, tok = self.transformer()
        text = "".join(chunks)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        pre, post = _template(tok)
        window = context - len(pre) - len(post)
        n, step = len(ids), max(1, window // 2)
        starts = [0] if n <= window else list(range(0, n - window + step, step))
        seqs, spans = [], []
        for a in starts:
            b = min(n, a + window)
            seqs.append(np.asarray([*pre, *ids[a:b], *post], np.int64))
            spans.append((a, b, len(pre)))
        states = self.hidden_states(seqs)
        picked = np.zeros((n, states[0].shape[1]), np.float32)
        room = np.full(n, -1.0)
        for (a, b, first), h in zip(spans, states, strict=True):
            for t in range(a, b):
                r = min(np.inf if a == 0 else t - a, np.inf if b == n else b - 1 - t)
                if r > room[t]:
                    room[t], picked[t] = r, h[first + t - a]
        vectors, at = [], 0
        for c in chunks:
            mine = [t for t, (s0, _) in enumerate(offsets) if at <= s0 < at + len(c)]
            v = picked[mine].astype(np.float64).mean(axis=0)
            vectors.append(v / max(float(np.linalg.norm(v)), 1e-12))
            at += len(c)
        return np.stack(vectors).astype(np.float32), len(seqs)


def _template(tok) -> tuple[list[int], list[int]]:
    """The special ids the tokenizer puts before and after one text, read off one text
    tokenized with and without them."""
    bare = list(tok("a", add_special_tokens=False)["input_ids"])
    full = list(tok("a", add_special_tokens=True)["input_ids"])
    at = next(k for k in range(len(full)) if full[k : k + len(bare)] == bare)
    return full[:at], full[at + len(bare) :]


def _fp32(model):
    model.float()
    model.eval()
    return model


def _pad_of(tok) -> int:
    pad = getattr(tok, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _batches(ids: Sequence[np.ndarray]) -> list[list[int]]:
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    return [order[k : k + _BATCH_ROWS] for k in range(0, len(order), _BATCH_ROWS)]


def _features(seqs: list[np.ndarray], pad: int) -> dict:
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        input_ids[r, : len(s)] = torch.as_tensor(np.asarray(s, np.int64))
        mask[r, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def _linear(path: Path) -> torch.nn.Linear:
    state = torch.load(path, map_location="cpu", weights_only=True)
    out_features, in_features = state["weight"].shape
    linear = torch.nn.Linear(in_features, out_features, bias="bias" in state)
    linear.load_state_dict(state)
    return linear.float().eval()


def _sparse(row: np.ndarray) -> SparseVector:
    idx = np.flatnonzero(row).astype(np.int32)
    return idx, row[idx].astype(np.float32)
