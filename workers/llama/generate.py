"""Greedy generation through llama.cpp's low-level API: the prompt in n_batch chunks, then one
token a decode, argmax over the logits (masked by a GBNF grammar sampler when given).

The request is validated before it gets here (engine.py). A grammar is parsed by our own GBNF
validator first, a NULL grammar sampler is a refusal (handing NULL on, as
`LlamaSampler.add_grammar` does, crashes), and the grammar never `accept`s a token it
rejected (llama.cpp aborts/throws through the C API there).
"""

from __future__ import annotations

import ctypes
import math

import llama_cpp
import numpy as np

from workers.engine import EngineError, Generation, Progress
from workers.llama import native
from workers.llama.gbnf import GrammarError, validate_gbnf
from workers.llama.native import LoadedModel, Slot


def grammar_sampler(mdl: LoadedModel, grammar: str) -> ctypes.c_void_p:
    """A llama.cpp grammar sampler for `grammar` (the caller frees it), or a typed refusal."""
    if not grammar.strip():
        # llama.cpp treats "" as "no grammar": refusing beats silently ignoring it.
        raise EngineError("invalid_request", "empty grammar")
    try:
        validate_gbnf(grammar)
    except GrammarError as e:
        raise EngineError("invalid_request", f"grammar: {e}") from e
    g = llama_cpp.LlamaGrammar.from_string(grammar, verbose=False)
    smpl = llama_cpp.llama_sampler_init_grammar(
        mdl.vocab, g._grammar.encode("utf-8"), g._root.encode("utf-8")
    )
    if not smpl:
        raise EngineError("invalid_request", "grammar rejected by llama.cpp (see log)")
    return smpl


def generate(
    mdl: LoadedModel,
    ids: np.ndarray,
    max_tokens: int,
    grammar: ctypes.c_void_p | None,
    progress: Progress,
) -> Generation:
    """See `LlamaEngine.generate` for the stop rules and the text's decoding."""
    n_prompt = len(ids)
    slot = mdl.slots[0]
    native.clear_memory(slot)
    if max_tokens == 0:
        return Generation(text="", n_prompt=n_prompt, n_gen=0, finish_reason="length")
    for start in range(0, n_prompt, mdl.n_batch):
        chunk = ids[start : start + mdl.n_batch]
        _fill_single(slot, chunk, start, last_logits=start + len(chunk) == n_prompt)
        native.decode(slot, slot.batch)
        progress.advance("inference")

    cand = _Candidates(mdl.n_vocab) if grammar is not None else None
    pieces: list[bytes] = []
    n_gen = 0
    finish = "length"
    buf = ctypes.create_string_buffer(256)
    while n_gen < max_tokens:
        logits_ptr = llama_cpp.llama_get_logits_ith(slot.ctx, -1)
        logits = np.ctypeslib.as_array(logits_ptr, shape=(mdl.n_vocab,))
        if cand is not None:
            cand.load(logits)
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(cand.array))
            masked = cand.data["logit"]
            tok = int(np.argmax(masked))
            if not math.isfinite(float(masked[tok])):
                finish = "stop"  # the grammar allows nothing further
                break
        else:
            tok = int(np.argmax(logits))
        if llama_cpp.llama_vocab_is_eog(mdl.vocab, tok):
            finish = "stop"
            break
        if grammar is not None:
            llama_cpp.llama_sampler_accept(grammar, tok)
        pieces.append(_piece(mdl.vocab, tok, buf))
        n_gen += 1
        if n_gen == max_tokens:
            break
        _fill_single(slot, np.array([tok], dtype=np.int32), n_prompt + n_gen - 1, True)
        native.decode(slot, slot.batch)
        progress.advance("inference")
    text = b"".join(pieces).decode("utf-8", "ignore")
    return Generation(text=text, n_prompt=n_prompt, n_gen=n_gen, finish_reason=finish)


def _fill_single(slot: Slot, toks: np.ndarray, start: int, last_logits: bool) -> None:
    k = len(toks)
    slot.tok[:k] = toks
    slot.pos[:k] = np.arange(start, start + k, dtype=np.int32)
    slot.nsid[:k] = 1
    slot.out[:k] = 0
    if last_logits:
        slot.out[k - 1] = 1
    sid = slot.batch.seq_id
    for j in range(k):
        sid[j][0] = 0
    slot.batch.n_tokens = k


class _Candidates:
    """A llama_token_data_array over numpy memory, for applying the grammar sampler."""

    _dtype = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)

    def __init__(self, n_vocab: int) -> None:
        self.data = np.zeros(n_vocab, dtype=self._dtype)
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.array = llama_cpp.llama_token_data_array(
            data=self.data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=n_vocab,
            selected=-1,
            sorted=False,
        )
        self.n_vocab = n_vocab

    def load(self, logits: np.ndarray) -> None:
        self.data["id"] = self.ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        self.array.size = self.n_vocab
        self.array.selected = -1
        self.array.sorted = False


def _piece(vocab: ctypes.c_void_p, tok: int, buf: ctypes.Array) -> bytes:
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, False)
    if n < 0:
        big = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, tok, big, len(big), 0, False)
        return big.raw[:n]
    return buf.raw[:n]
