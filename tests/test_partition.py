import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.partition import METHODS, bin_loads, fill_windows, partition

FAST = settings(max_examples=60, deadline=None)


def _optimal_makespan(costs, k):
    best = float("inf")
    for assign in itertools.product(range(k), repeat=len(costs)):
        best = min(best, max(np.bincount(assign, weights=costs, minlength=k)))
    return best


@FAST
@given(st.lists(st.integers(0, 10_000), max_size=60), st.integers(1, 9))
def test_lpt_is_a_valid_deterministic_partition(costs, k):
    bins = partition(costs, k)
    assert bins.dtype == np.int64 and bins.shape == (len(costs),)
    assert ((bins >= 0) & (bins < k)).all()
    assert np.array_equal(bins, partition(costs, k, method="lpt"))
    if len(costs) >= k:
        assert len(np.unique(bins)) == k, "every bin gets an item when there are enough items"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=7), st.integers(1, 3))
def test_lpt_within_grahams_bound_of_the_optimum(costs, k):
    loads = bin_loads(costs, partition(costs, k), k)
    assert loads.max() <= (4 / 3 - 1 / (3 * k)) * _optimal_makespan(costs, k) + 1e-9


def test_lpt_examples_and_tie_breaking():
    # Equal costs go round-robin in index order; zero costs still spread over every bin.
    assert partition([5, 5, 5, 5, 5], 2).tolist() == [0, 1, 0, 1, 0]
    assert partition([0, 0, 0], 3).tolist() == [0, 1, 2]
    bins = partition([7, 5, 4, 3, 3, 2], 2)
    assert sorted(bin_loads([7, 5, 4, 3, 3, 2], bins, 2)) == [12, 12]
    assert partition(np.array([1.5, 0.25, 2.0]), 2).tolist() == [1, 1, 0]


def test_auto_is_lpt_and_unknown_method_lists_the_available_ones():
    c = np.random.default_rng(0).integers(0, 1000, 200)
    assert np.array_equal(partition(c, 7), partition(c, 7, method="lpt"))
    assert "lpt" in METHODS
    with pytest.raises(ValueError, match="available: auto, lpt"):
        partition(c, 7, method="kk-not-yet")


@FAST
@given(st.lists(st.integers(0, 50), max_size=40), st.integers(1, 6), st.integers(50, 400))
def test_capacity_is_honoured_or_reported(costs, k, cap):
    try:
        bins = partition(costs, k, capacity=cap)
    except ValueError as e:
        assert "capacity" in str(e) and "item" in str(e)
        assert sum(costs) > cap  # one bin alone would have been enough otherwise
        return
    assert bin_loads(costs, bins, k).max() <= cap
    if len(costs) >= k:
        assert len(np.unique(bins)) == k


def test_capacity_errors_name_the_item():
    with pytest.raises(ValueError, match=r"item 2 \(cost 11\) exceeds capacity 10"):
        partition([3, 4, 11, 2], 2, capacity=10)
    with pytest.raises(ValueError, match="cannot honour capacity 10 with 2 bins"):
        partition([6, 6, 6, 6], 2, capacity=10)


def test_capacity_falls_back_when_lpt_gets_stuck():
    # LPT: 5|5, 4 -> 9|5, 3 -> 9|8, and the last 3 fits nowhere. Best-fit-decreasing: 5+5 | 4+3+3.
    costs = [5, 5, 4, 3, 3]
    assert sorted(bin_loads(costs, partition(costs, 2, capacity=10), 2).tolist()) == [10, 10]


@pytest.mark.parametrize("bad, err", [([1, -2], ValueError), ([1.0, float("nan")], ValueError),
                                      ([[1, 2]], ValueError), (["a"], TypeError)])
def test_bad_costs(bad, err):
    with pytest.raises(err):
        partition(bad, 2)


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_bad_num_bins(k):
    with pytest.raises(ValueError, match="num_bins"):
        partition([1, 2], k)


def test_empty_input():
    assert partition([], 4).shape == (0,)


def test_fill_windows_respects_caps_and_fills_every_bin():
    rng = np.random.default_rng(0)
    G, W, R = 3, 4, 5
    caps = np.array([[7, 7, 7, 7], [6, 9, 5, 0], [5, 5, 5, 5]])
    M = int(caps.sum(1).max())
    costs = np.zeros((G, M), np.int64)
    for g in range(G):
        m = int(caps[g].sum())
        costs[g, :m] = np.sort(rng.integers(1, 10_000, m))[::-1]
    step, rank, failed = fill_windows(costs, caps, R)
    assert not failed.any()
    for g in range(G):
        real = costs[g] > 0
        assert (step[g][~real] == -1).all()
        assert np.bincount(step[g][real], minlength=W).tolist() == caps[g].tolist()
        for w in range(W):
            if caps[g, w]:
                assert len(np.unique(rank[g][real & (step[g] == w)])) == R


def test_fill_windows_capacity_failure_is_reported_per_window():
    costs = np.array([[9, 9, 9, 0], [3, 2, 1, 1]], np.int64)
    step, rank, failed = fill_windows(costs, np.array([[4], [4]]), 2, capacity=10)
    assert failed.tolist() == [True, False]
    assert (step[1] == 0).all()
