"""What the Module's calls return: the result types callers (service, batch, certification,
cli) read. `host.module` re-exports each under its old name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class EmbedResult:
    vectors: np.ndarray  # float32 (n, dims)
    usage: Usage
    model: str
    truncated: list[bool]
    prompt: str = ""  # the text prepended to every input (the model's default, if it has one)
    n_tokens: Sequence[int] = ()  # per input, what was embedded (the prompt's tokens included)
    lane: str = ""  # the lane that computed the vectors ("ane", "llama")


@dataclass(frozen=True)
class RerankResult:
    results: list[tuple[int, float]]  # (document index, score), best first
    usage: Usage
    model: str
    method: Literal["cross-encoder", "bi-encoder-cosine", "multi-vector-maxsim"]
    # Per document, in the order given: the tokens scored (the pair's, for a cross-encoder)
    # and whether the document (or the query, in its pair) was cut to fit.
    n_tokens: Sequence[int] = ()
    truncated: Sequence[bool] = ()
    lane: str = ""  # the lane that scored the documents


@dataclass(frozen=True)
class GenerateResult:
    text: str
    n_prompt: int
    n_gen: int
    finish_reason: str
    model: str
