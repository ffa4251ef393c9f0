"""Sample lengths for the sampler tests."""

from __future__ import annotations

import numpy as np


def lengths_for(n=300, seed=0):
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(6.0, 1.0, n)).astype(np.int64) + 1
    x[rng.random(n) < 0.02] = 15_000
    return x
