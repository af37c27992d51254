"""The final hidden state (after the output norm) at a decode's output tokens only, for the
heads that read one state per sequence (llm_head.py): an LLM reranker's two rows, a decoder
sequence classifier's N rows.

llama.cpp's embedding mode makes every token an output (`output_all = cparams.embeddings`
in llama_context::decode), so its causal graphs run the last layer's FFN and the full
vocabulary LM head for every token, pooled or not: at Qwen3-Reranker-0.6B's shape the LM head
(151669 x 1024) is a quarter of the decode's work. A head on the last token needs neither.

So these contexts decode with embeddings off and only each sequence's last token marked as an
output: the graph keeps just those rows after the last layer's attention (`inp_out_ids`), and
the state is read from the graph itself through ggml's scheduler callback at the tensor every
llama.cpp decoder graph names `result_norm` (the tensor embedding mode would have returned;
the LM head is the next op). Answering false once that tensor is read stops the scheduler's
walk of that split (ggml_backend_sched_compute_splits), so the LM head is skipped too when it
shares the split, as on the CPU backend; a BLAS backend, when one takes the head's matmul
(32+ outputs in a decode), computes it over those outputs only, never a row per token.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
from llama_cpp import _ggml

RESULT_NORM = b"result_norm"

_lib = _ggml.libggml
_lib.ggml_get_name.argtypes = [ctypes.c_void_p]
_lib.ggml_get_name.restype = ctypes.c_char_p
_lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
_lib.ggml_nbytes.restype = ctypes.c_size_t
_lib.ggml_backend_tensor_get.argtypes = [
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
]
_lib.ggml_backend_tensor_get.restype = None


class LastStates:
    """One context's capture: `callback` goes in its llama_context_params (`cb_eval`); after
    each llama_decode, `take()` returns the (n_outputs, n_embd) float32 states of that decode,
    in the order of its output tokens (one ubatch per decode, split in batch order: an
    encoder context keeps a unified KV cache, so llama.cpp splits it with `split_simple`)."""

    def __init__(self, n_embd: int) -> None:
        self.n_embd = n_embd
        self._rows: list[np.ndarray] = []
        self._error: str | None = None
        # The ctypes thunk must outlive the context that calls it: kept here, on the slot.
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)

    def _eval(self, tensor: int, ask: bool, _user: int) -> bool:
        if _lib.ggml_get_name(tensor) != RESULT_NORM:
            return not ask  # not needed; (never asked to observe it)
        if ask:
            return True
        size = int(_lib.ggml_nbytes(tensor))
        if size % (4 * self.n_embd):
            self._error = f"result_norm of {size} bytes is not rows of {self.n_embd} f32"
            return False
        rows = np.empty((size // (4 * self.n_embd), self.n_embd), np.float32)
        _lib.ggml_backend_tensor_get(tensor, rows.ctypes.data, 0, size)
        self._rows.append(rows)
        return False  # the rest of the split is the LM head: not needed

    def take(self, n_outputs: int) -> np.ndarray:
        """The states the last decode captured, checked to be `n_outputs` rows."""
        rows, self._rows = self._rows, []
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(error)
        got = np.concatenate(rows) if rows else np.empty((0, self.n_embd), np.float32)
        if got.shape[0] != n_outputs:
            raise RuntimeError(f"the graph gave {got.shape[0]} final states, not {n_outputs}")
        return got

    def discard(self) -> None:
        """Drop whatever a failed decode left."""
        self._rows, self._error = [], None
