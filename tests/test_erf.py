"""The SPLADE head's erfc (workers/heads/erf.py) against the C library's, which transformers'
erf-form GELU is defined by."""

from __future__ import annotations

import math

import numpy as np

from workers.heads.erf import erfc, gelu


def test_erfc_and_gelu_match_the_c_library():
    x = np.concatenate([np.linspace(-40.0, 40.0, 400_001), [0.0, -0.0, 1e-300, -1e-300]])
    want = np.array([math.erfc(v) for v in x])
    got = erfc(x)
    normal = want >= np.finfo(np.float64).tiny  # below it both sides round subnormals apart
    assert np.all(np.abs(got - want)[normal] <= 2e-13 * want[normal])
    assert np.all(got[~normal] < 1e-300)
    ref_gelu = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])
    np.testing.assert_allclose(gelu(x), ref_gelu, rtol=1e-13, atol=1e-15)
    assert erfc(np.zeros((0, 3))).shape == (0, 3)
