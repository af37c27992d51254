"""Label scores per item: the host's one result type for sequence classifiers, and the
activation that turns a classifier head's raw logits into the scores its model was trained
for.

The worker returns raw logits (one row of `n_labels` per input, `LABEL_SCORES` on the wire);
the activation is the host's, chosen as transformers' text-classification pipeline chooses
it from the model's config: `problem_type` "regression" -> none, "multi_label_classification"
or a single label -> sigmoid, "single_label_classification" or several labels -> softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from common.errors import InvalidRequest

Activation = Literal["softmax", "sigmoid", "none"]
# One input: a text, or a (text, text_pair) pair scored as one sequence.
ClassifyInput = str | bytes | tuple[str | bytes, str | bytes]


def activation_for(problem_type: str | None, n_labels: int) -> Activation:
    """transformers' pipeline rule (TextClassificationPipeline.postprocess's default)."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or n_labels == 1:
        return "sigmoid"
    return "softmax"


def activate(logits: np.ndarray, function: Activation) -> np.ndarray:
    """`function` over each row of `logits` (n, n_labels), in float64 as the pipeline's numpy
    post-processing computes it, returned as float32."""
    x = np.asarray(logits, dtype=np.float64)
    if function == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        out = e / e.sum(axis=-1, keepdims=True)
    elif function == "sigmoid":
        # The form whose exp() cannot overflow for any logit.
        e = np.exp(-np.abs(x))
        out = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    else:
        out = x
    return out.astype(np.float32)


@dataclass(frozen=True)
class ClassifyResult:
    """Every label's score for every input, in input order; `labels[j]` names column j."""

    logits: np.ndarray  # float32 (n, n_labels): the head's raw outputs
    labels: list[str]
    activation: Activation
    model: str
    n_tokens: Sequence[int]  # per input, the tokens scored (the composed pair's for a pair)
    truncated: Sequence[bool]

    @property
    def total_tokens(self) -> int:
        return int(sum(self.n_tokens))

    def scores(self, raw_scores: bool = False) -> np.ndarray:
        """(n, n_labels) float32: the activated scores, or the raw logits."""
        return self.logits if raw_scores else activate(self.logits, self.activation)

    def ranked(self, raw_scores: bool = False) -> list[list[tuple[str, float]]]:
        """Per input, (label, score) best first; ties keep the labels' id order."""
        scores = self.scores(raw_scores)
        order = np.argsort(-scores, axis=1, kind="stable")
        return [
            [(self.labels[j], float(row[j])) for j in idx]
            for row, idx in zip(scores, order, strict=True)
        ]


def split_inputs(
    inputs: Sequence[ClassifyInput],
) -> tuple[list[int], list[str | bytes], list[tuple[str | bytes, str | bytes]]]:
    """(pair flags as 0/1 per input, the single texts, the pairs), each list in input order;
    anything but a text or a 2-tuple of texts is refused."""
    kinds: list[int] = []
    singles: list[str | bytes] = []
    pairs: list[tuple[str | bytes, str | bytes]] = []
    for i, item in enumerate(inputs):
        if isinstance(item, str | bytes):
            kinds.append(0)
            singles.append(item)
        elif (
            isinstance(item, tuple | list)
            and len(item) == 2
            and all(isinstance(x, str | bytes) for x in item)
        ):
            kinds.append(1)
            pairs.append((item[0], item[1]))
        else:
            raise InvalidRequest(
                f"input {i}: expected a text or a pair of two texts, got {_describe(item)}",
                param="inputs",
                index=i,
            )
    return kinds, singles, pairs


def _describe(item: object) -> str:
    if isinstance(item, tuple | list):
        return f"a list of {len(item)}"
    return type(item).__name__
