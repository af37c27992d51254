"""BERT cross-encoder pairs with their token types, fed to llama.cpp as input embeddings.

A BERT pair is `[CLS] q [SEP] d [SEP]` with token type 1 on the document half. llama.cpp's
BERT graph adds token-type row 0 to every position (`models/bert.cpp`: it has no token-type
input), so fed token ids a cross-encoder scores a pair its training never saw (measured: up to
6 logits off, in another order). The graph also accepts input embeddings instead of ids
(`llama_batch.embd`, the vector path of `build_inp_embd`) and then still adds type row 0 and
the position embedding. So each token's input row is

    token_embd[id] + (token_types[t] - token_types[0])

and after llama.cpp's own `+ token_types[0] + position_embd[pos]` the sum is exactly BERT's
embedding input (token + type + position) before its LayerNorm, in f32 as llama.cpp computes
it (`get_rows` widens f16 and quantized rows to f32 the same way `gguf.quants.dequantize`
does here).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from formats.gguf_header import GGUFHeader, read_gguf_header

TOKEN_EMBD = "token_embd.weight"
TOKEN_TYPES = "token_types.weight"


class TypedPairs:
    """The two tensors a typed pair needs, mapped from the GGUF (rows gathered on use)."""

    def __init__(
        self, token_rows: np.ndarray, qtype: gguf.GGMLQuantizationType, type_rows: np.ndarray
    ) -> None:
        self._token_rows = token_rows  # (n_vocab, bytes of one row), memory-mapped
        self._qtype = qtype
        self._delta = (type_rows - type_rows[0]).astype(np.float32)  # (n_types, n_embd)
        self.n_embd = int(type_rows.shape[1])

    @classmethod
    def from_gguf(cls, path: str | Path, hdr: GGUFHeader | None = None) -> TypedPairs | None:
        """None when the model has fewer than two token types (nothing to fold in). `hdr`:
        the file's header when the caller has scanned it already; the tensors are mapped."""
        hdr = hdr or read_gguf_header(path)
        tensors = {t.name: t for t in hdr.tensors}
        types, tokens = tensors.get(TOKEN_TYPES), tensors.get(TOKEN_EMBD)
        if types is None or tokens is None:
            return None

        def rows(t) -> np.ndarray:  # ggml order: shape[0] is the row width, shape[1] the rows
            n_rows = int(np.prod(t.shape[1:]))
            return np.memmap(
                path, np.uint8, "r", hdr.data_offset + t.offset, (n_rows, t.nbytes // n_rows)
            )

        type_rows = gguf.quants.dequantize(
            np.asarray(rows(types)), gguf.GGMLQuantizationType(types.type)
        )
        type_rows = np.asarray(type_rows, np.float32).reshape(-1, int(types.shape[0]))
        if type_rows.shape[0] < 2:
            return None
        return cls(rows(tokens), gguf.GGMLQuantizationType(tokens.type), type_rows)

    def embeddings(self, ids: np.ndarray, types: np.ndarray) -> np.ndarray:
        """(len(ids), n_embd) float32 input rows of one sequence."""
        rows = gguf.quants.dequantize(np.asarray(self._token_rows[ids]), self._qtype)
        rows = np.asarray(rows, np.float32).reshape(len(ids), self.n_embd)
        return rows + self._delta[types]


def pair_types(n_first: int, n_total: int) -> np.ndarray:
    """Token types of a composed pair: 0 on the first `n_first` tokens, 1 on the rest."""
    types = np.ones(n_total, dtype=np.intp)
    types[:n_first] = 0
    return types
