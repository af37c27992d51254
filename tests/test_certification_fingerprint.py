"""The margin-masked fingerprint: noise below the margin never changes it, real change does."""

from __future__ import annotations

import numpy as np
import pytest

from certification.fingerprint import MARGIN_FRACTION, digest_under, fingerprint
from certification.shapes import parse_shapes

GRID = 1 / 128


@pytest.fixture
def vectors() -> np.ndarray:
    rng = np.random.default_rng(0)
    v = rng.standard_normal((26, 384))
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_noise_below_the_margin_never_changes_the_digest(vectors):
    fp = fingerprint(vectors, GRID)
    assert 0.7 < fp.n_kept / fp.n_values < 0.8  # ~75% of the values kept
    rng = np.random.default_rng(1)
    for _ in range(20):
        # Worst-case noise just under the margin, in every single component.
        noise = rng.choice([-1.0, 1.0], vectors.shape) * GRID * MARGIN_FRACTION * 0.99
        assert digest_under(vectors + noise, fp) == fp.digest


def test_a_change_of_a_grid_cell_is_seen(vectors):
    fp = fingerprint(vectors, GRID)
    assert digest_under(vectors + GRID, fp) != fp.digest
    moved = vectors.copy()
    moved[3] += GRID  # one probe item off by a full cell: every watched value moves a cell
    assert digest_under(moved, fp) != fp.digest
    assert digest_under(vectors[:, :100], fp) is None  # other dims: not comparable


def test_naive_rounding_would_flip_where_the_mask_does_not(vectors):
    # Why the mask exists: plain rounding of thousands of values flips on tiny noise.
    noise = np.full(vectors.shape, GRID * MARGIN_FRACTION * 0.5)
    naive = np.floor(vectors / GRID) != np.floor((vectors + noise) / GRID)
    assert naive.any()
    fp = fingerprint(vectors, GRID)
    assert digest_under(vectors + noise, fp) == fp.digest


def test_shape_specs_parse():
    assert parse_shapes("8x128,4x256p,2x512p/16") == [
        {"rows": 8, "seq_len": 128},
        {"rows": 4, "seq_len": 256, "packed": True},
        {"rows": 2, "seq_len": 512, "packed": True, "max_segments": 16},
    ]
    for bad in ("8by128", "x128", "8x128/4"):
        with pytest.raises(ValueError):
            parse_shapes(bad)
