"""tokenbal.balance.partition.compose: which samples share a step, by their stage-cost vectors."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.balance.mixtures import random_stage_costs
from tokenbal.balance.partition.compose import COMPOSITIONS, compose_steps, steps_floor
from tokenbal.balance.simulate import composition_floor


@settings(max_examples=20, deadline=None)
@given(draw=st.integers(0, 10**6), R=st.sampled_from([2, 4, 8]), per=st.integers(1, 4),
       W=st.integers(1, 12), G=st.integers(1, 3))
def test_composition_keeps_windows_and_caps_and_never_loses_to_sorting_by_total(draw, R, per, W, G):
    N = R * per
    caps = np.full((G, W), N, np.int64)
    caps[-1, -1] = N + R - 1                       # a merged tail step
    n = int(caps.sum())
    c = np.round(random_stage_costs(n, draw)).astype(np.int64)
    window = np.repeat(np.arange(G), caps.sum(1))
    order, step, chosen = compose_steps(c, window, caps, R, np.random.default_rng(draw), 0.3)
    assert np.array_equal(np.sort(order), np.arange(n))
    assert np.array_equal(window[order], window)                       # every window keeps its items
    assert np.array_equal(np.bincount(window * W + step, minlength=G * W), caps.reshape(-1))
    assert chosen.shape == (G,) and ((0 <= chosen) & (chosen < len(COMPOSITIONS))).all()
    # Without jitter the kept order's floor is the lowest of the candidates, so never above a sort
    # by total (up to the sort key's 2**-14-octave resolution).
    order, step, _ = compose_steps(c, window, caps, R)
    gstep = np.empty(n, np.int64)
    gstep[order] = window * W + step
    by_total = np.empty(n, np.int64)
    for g in range(G):
        idx = np.flatnonzero(window == g)
        srt = idx[np.argsort(-c[idx].sum(1), kind="stable")]
        by_total[srt] = g * W + np.repeat(np.arange(W), caps[g])
    assert composition_floor(gstep, c, R) <= composition_floor(by_total, c, R) * (1 + 1e-3)
    a = compose_steps(c, window, caps, R, np.random.default_rng(draw), 0.3)
    b = compose_steps(c, window, caps, R, np.random.default_rng(draw), 0.3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_steps_floor_is_largest_or_mean_per_stage():
    c = np.array([[10, 0], [1, 1], [1, 1], [0, 8]], np.int64)
    # step 0 = items 0, 1 (2 ranks): vision max(10, 11/2) + language max(1, 1/2);
    # step 1: max(1, 1/2) + max(8, 9/2)
    assert np.allclose(steps_floor(c, np.array([0, 2]), 2), [11.0, 9.0])
