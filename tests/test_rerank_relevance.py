"""How a reranker's raw output becomes the relevance the rerank routes answer."""

from __future__ import annotations

import math

import pytest

from host.module import RerankResult, Usage
from service.rerank import relevance


def test_cross_encoder_logits_of_any_size_become_relevances_in_0_1():
    ranked = RerankResult([], Usage(0, 0), "m", "cross-encoder")
    for raw in (0.0, 2.5, -2.5, 30.0, -30.0):
        assert relevance(ranked, raw, False) == pytest.approx(1 / (1 + math.exp(-raw)), rel=1e-12)
    assert relevance(ranked, -1000.0, False) == 0.0  # exp(1000) would overflow: a 500 before
    assert relevance(ranked, 1000.0, False) == 1.0
    assert relevance(ranked, -1000.0, True) == -1000.0  # TEI's raw_scores skip the sigmoid


def test_a_bi_encoders_similarity_is_answered_as_it_is():
    ranked = RerankResult([], Usage(0, 0), "m", "bi-encoder-cosine")
    assert relevance(ranked, 0.25, False) == 0.25
