"""`POST /predict`'s `inputs` read as TEI reads them, and the host's activation rule for
label scores (transformers' text-classification pipeline's); the served scores are judged
against the pipeline itself in tests/test_classify.py."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidRequest
from host.classify import ClassifyResult, activate, activation_for, split_inputs
from service.predict import parse_inputs


@pytest.mark.parametrize(
    "inputs, want, batch",
    [
        ("a text", ["a text"], False),
        (["a text"], ["a text"], False),
        (["text", "text pair"], [("text", "text pair")], False),  # a pair, not a batch of 2
        ([["a"], ["b", "c"]], ["a", ("b", "c")], True),
        ([["a"]], ["a"], True),
    ],
)
def test_inputs_are_read_as_tei_reads_them(inputs, want, batch):
    assert parse_inputs(inputs) == (want, batch)


@pytest.mark.parametrize(
    "inputs, match",
    [
        ([], "non-empty"),
        (None, "non-empty"),
        (3, "non-empty"),
        (["a", "b", "c"], "1 or 2 strings"),
        (["a", ["b"]], "1 or 2 strings"),
        ([["a"], "b"], r"inputs\[1\]"),
        ([["a", "b", "c"]], r"inputs\[0\]"),
        ([[]], r"inputs\[0\]"),
        ([["a", 1]], r"inputs\[0\]"),
    ],
)
def test_malformed_inputs_are_a_typed_400(inputs, match):
    with pytest.raises(InvalidRequest, match=match) as info:
        parse_inputs(inputs)
    assert info.value.http_status == 400 and info.value.details["param"] == "inputs"


def test_split_inputs_refuses_anything_but_texts_and_pairs():
    assert split_inputs(["a", ("b", "c"), "d"]) == ([0, 1, 0], ["a", "d"], [("b", "c")])
    with pytest.raises(InvalidRequest, match="input 1: .* a list of 3"):
        split_inputs(["a", ("b", "c", "d")])  # type: ignore[list-item]
    with pytest.raises(InvalidRequest, match="input 0: .* got int"):
        split_inputs([7])  # type: ignore[list-item]


def test_the_activation_follows_the_pipelines_rule():
    assert activation_for(None, 3) == "softmax"
    assert activation_for("single_label_classification", 3) == "softmax"
    assert activation_for("multi_label_classification", 3) == "sigmoid"
    assert activation_for(None, 1) == "sigmoid"  # one logit: a cross-encoder's relevance
    assert activation_for("regression", 1) == "none"
    logits = np.array([[1000.0, 0.0, -1000.0], [0.5, -0.25, 2.0]], np.float32)
    soft = activate(logits, "softmax")
    assert np.allclose(soft.sum(axis=1), 1.0) and np.isfinite(soft).all()
    e = np.exp(logits[1] - logits[1].max())
    assert np.allclose(soft[1], e / e.sum(), atol=1e-7)
    sig = activate(logits, "sigmoid")  # no overflow at +-1000
    assert np.allclose(sig[0], [1.0, 0.5, 0.0]) and np.isfinite(sig).all()
    assert np.allclose(sig[1], 1 / (1 + np.exp(-logits[1].astype(np.float64))), atol=1e-7)
    assert (activate(logits, "none") == logits).all()


def test_ranked_is_best_first_and_ties_keep_the_label_order():
    result = ClassifyResult(
        logits=np.array([[0.0, 2.0, 0.0]], np.float32),
        labels=["a", "b", "c"],
        activation="softmax",
        model="m",
        n_tokens=[3],
        truncated=[False],
    )
    assert [label for label, _ in result.ranked()[0]] == ["b", "a", "c"]
    assert result.ranked(raw_scores=True)[0][0] == ("b", 2.0)
