"""tokenbal.balance.partition.compose: which samples share a step, by their stage-cost vectors."""

import numpy as np
import pytest
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


def _best_equal_split(c: np.ndarray, R: int) -> float:
    """Σ_stage max_rank of the best split of one step's items ``c`` (m, K), m / R on every rank, by
    trying every split."""
    from itertools import combinations

    def best(items: tuple[int, ...], bins: int) -> list[np.ndarray]:
        if bins == 1:
            return [c[list(items)].sum(0)]
        k = len(items) // bins
        first, rest = items[0], items[1:]
        out = []
        for mates in combinations(rest, k - 1):
            load = c[[first, *mates]].sum(0)
            left = tuple(i for i in rest if i not in mates)
            out += [np.maximum(load, other) for other in best(left, bins - 1)]
        return out

    return min(float(x.sum()) for x in best(tuple(range(len(c))), R))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), R=st.sampled_from([2, 3]), k=st.sampled_from([1, 2, 3]),
       K=st.sampled_from([1, 2]), steps=st.integers(1, 3))
def test_equal_count_floor_bounds_every_equal_split_and_is_exact_for_pairs_of_one_stage(seed, R, k, K,
                                                                                       steps):
    from tokenbal.balance.simulate import equal_count_floor

    rng = np.random.default_rng(seed)
    m = R * k
    c = rng.integers(0, 50, (steps * m, K)) ** 2          # lumpy, with ties and zeros
    step = rng.permutation(np.arange(steps * m) // m)
    total = c.sum()
    best = sum(_best_equal_split(c[step == s], R) for s in range(steps)) / (total / R) if total else 1.0
    floor = equal_count_floor(step, c, R)
    assert composition_floor(step, c, R) <= floor * (1 + 1e-12)
    assert floor <= best * (1 + 1e-12)
    if K == 1 and k <= 2:                                  # one stage: sorted pairing is the best split
        assert np.isclose(floor, best)
    # A step of another size (no equal split) keeps composition_floor's bound.
    odd = np.append(step, steps)
    c_odd = np.vstack([c, np.ones((1, K), np.int64)])
    assert equal_count_floor(odd, c_odd, R) >= composition_floor(odd, c_odd, R) * (1 - 1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), R=st.sampled_from([2, 3, 4]), per=st.sampled_from([1, 2, 3]),
       K=st.sampled_from([1, 2]), steps=st.integers(1, 4))
def test_split_figure_is_a_split_of_the_given_steps(seed, R, per, K, steps):
    from tokenbal.balance.simulate import split_figure

    rng = np.random.default_rng(seed)
    m = R * per
    c = rng.integers(1, 50, (steps * m, K)) ** 2
    step = rng.permutation(np.arange(steps * m) // m)
    figure = split_figure(step, c, R)
    # A split of those steps: never under their floor, and on it where one sample per rank is best.
    assert figure >= composition_floor(step, c, R) * (1 - 1e-12)
    if per == 1:
        assert np.isclose(figure, composition_floor(step, c, R))
    # Only which samples share a step matters: the same steps under other labels (with gaps), and unplanned
    # samples (-1) added, give the same figure.
    relabel = (rng.permutation(steps) * 3)[step]
    assert np.isclose(split_figure(relabel, c, R), figure)
    extra = np.append(step, [-1, -1])
    assert np.isclose(split_figure(extra, np.vstack([c, np.full((2, K), 10**6)]), R), figure)
    # Every sample in a step of its own (R ranks, one each) of a single-stage cost: the figure is
    # Σ_steps largest over ideal.
    one = np.arange(R * 2) // R
    x = np.arange(1, R * 2 + 1)[:, None]
    assert np.isclose(split_figure(one, x, R), (R + 2 * R) / (x.sum() / R))


def _every_plan_figure(c: np.ndarray, R: int, N: int) -> float:
    """The lowest epoch figure by trying every order of the samples (steps = consecutive N) and every
    split of every step: the definition best_plan_figure's search must reach."""
    from itertools import permutations, product

    def best_split(items: tuple[int, ...]) -> float:
        return min(sum(max(sum(c[i, k] for i, r in zip(items, a, strict=True) if r == q) for q in range(R))
                       for k in range(c.shape[1])) for a in product(range(R), repeat=N))

    cache: dict[frozenset, float] = {}
    best = np.inf
    for order in permutations(range(len(c))):
        steps = [frozenset(order[i:i + N]) for i in range(0, len(c), N)]
        best = min(best, sum(cache.setdefault(s, best_split(tuple(sorted(s)))) for s in steps))
    return best / (c.sum() / R)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), R=st.sampled_from([2, 3]), N=st.sampled_from([2, 3]),
       S=st.sampled_from([1, 2]), K=st.sampled_from([1, 2]))
def test_best_plan_figure_is_the_lowest_figure_of_every_plan(seed, R, N, S, K):
    from tokenbal.balance.simulate import best_plan_figure, split_figure

    rng = np.random.default_rng(seed)
    c = (rng.integers(0, 30, (S * N, K)) ** 2).astype(np.float64)
    c[0] += 1                                                  # not all zero
    figure, step = best_plan_figure(c, R, N)
    assert np.isclose(figure, _every_plan_figure(c, R, N))
    assert np.array_equal(np.bincount(step), np.full(S, N))   # equal steps of N
    # Its composition: no split of those steps is under the figure's floor, and tokenbal's split is
    # one of the splits searched.
    assert composition_floor(step, c, R) <= figure * (1 + 1e-12)
    assert split_figure(step, c, R) >= figure * (1 - 1e-12)


def test_best_plan_figure_refuses_epochs_too_large_to_search():
    from tokenbal.balance.simulate import best_plan_figure

    with pytest.raises(ValueError, match="max_samples=16"):
        best_plan_figure(np.ones((20, 2)), 2, 4)
    with pytest.raises(ValueError, match="multiple of global_batch_size=4"):
        best_plan_figure(np.ones((6, 2)), 2, 4)
    assert best_plan_figure(np.zeros((4, 2)), 2, 2)[0] == 1.0
