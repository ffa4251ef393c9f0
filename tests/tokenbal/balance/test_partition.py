import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.balance.partition import (
    METHODS,
    bin_loads,
    fill_windows,
    grouped_fill,
    grouped_stage_fill,
    partition,
)

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


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_fill_windows_respects_caps_and_fills_every_bin(batch):
    rng = np.random.default_rng(0)
    G, W, R = 3, 4, 5
    caps = np.array([[7, 7, 7, 7], [6, 9, 5, 0], [5, 5, 5, 5]])
    M = int(caps.sum(1).max())
    costs = np.zeros((G, M), np.int64)
    for g in range(G):
        m = int(caps[g].sum())
        costs[g, :m] = np.sort(rng.integers(1, 10_000, m))[::-1]
    step, rank, failed = fill_windows(costs, caps, R, batch=batch)
    assert not failed.any()
    for g in range(G):
        real = costs[g] > 0
        assert (step[g][~real] == -1).all()
        assert np.bincount(step[g][real], minlength=W).tolist() == caps[g].tolist()
        for w in range(W):
            if caps[g, w]:
                assert len(np.unique(rank[g][real & (step[g] == w)])) == R


def _exact_fill_reference(costs, caps, R):
    """The documented one-item-at-a-time rule (deficit fill, else LPT), written plainly."""
    G, M = costs.shape
    W = caps.shape[1]
    step, rank = np.full((G, M), -1), np.full((G, M), -1)
    for g in range(G):
        loads = np.zeros((W, R), np.int64)
        cnt = np.zeros(W, np.int64)
        for j in range(M):
            x = int(costs[g, j])
            if x <= 0:
                break
            open_ = cnt < caps[g]
            gap = np.where(open_, loads.max(1) - loads.min(1), -1)
            if gap.max() >= x:
                w = int(np.argmax(gap))
            else:
                w = int(np.argmin(np.where(open_, loads.min(1), np.iinfo(np.int64).max)))
            r = int(np.argmin(loads[w]))
            loads[w, r] += x
            cnt[w] += 1
            step[g, j], rank[g, j] = w, r
    return step, rank


@FAST
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.integers(1, 20), st.integers(0, 2**32 - 1))
def test_fill_windows_batches_are_valid_and_batch_one_is_the_exact_rule(G, W, R, batch, seed):
    rng = np.random.default_rng(seed)
    caps = rng.integers(0, 3 * R + 1, (G, W))
    caps[:, 0] = np.maximum(caps[:, 0], R)
    M = int(caps.sum(1).max())
    costs = np.zeros((G, M), np.int64)
    for g in range(G):
        m = int(caps[g].sum())
        costs[g, :m] = np.sort(rng.integers(1, 60, m))[::-1]
    exact = fill_windows(costs, caps, R)
    assert all(np.array_equal(a, b) for a, b in zip(exact[:2], _exact_fill_reference(costs, caps, R),
                                                      strict=True))
    step, rank, failed = fill_windows(costs, caps, R, batch=batch)
    again = fill_windows(costs, caps, R, batch=batch)
    assert np.array_equal(step, again[0]) and np.array_equal(rank, again[1])
    assert not failed.any()
    if batch == 1:
        assert np.array_equal(step, exact[0]) and np.array_equal(rank, exact[1])
    for g in range(G):
        real = costs[g] > 0
        assert ((step[g] >= 0) == real).all() and (rank[g][real] < R).all()
        assert np.bincount(step[g][real], minlength=W).tolist() == caps[g].tolist()
        for w in range(W):
            if caps[g, w] >= R:       # no empty bin in a step that has an item for every rank
                assert len(np.unique(rank[g][real & (step[g] == w)])) == R


def test_fill_windows_batched_handles_costs_near_the_int64_limit():
    # The batched key multiplies loads by the window's bin count; huge costs must still give a
    # valid packing (the key then drops low bits) and the same answer as the scaled-down costs.
    rng = np.random.default_rng(3)
    caps = np.array([[6, 6, 6]])
    small = np.sort(rng.integers(1, 1000, 18))[::-1][None, :].astype(np.int64) * 4
    huge = small << 48
    assert (4 * int(huge.sum()) + 5) * 9 >= 2**62
    step, rank, failed = fill_windows(huge, caps, 3, batch=4)
    ref = fill_windows(small, caps, 3, batch=4)
    assert not failed.any() and np.array_equal(step, ref[0]) and np.array_equal(rank, ref[1])
    assert np.bincount(step[0], minlength=3).tolist() == [6, 6, 6]


def test_fill_windows_batched_reports_windows_whose_caps_are_too_small():
    costs = np.array([[5, 4, 3, 2, 1], [5, 4, 3, 0, 0]], np.int64)
    step, rank, failed = fill_windows(costs, np.array([[2, 1], [2, 1]]), 2, batch=4)
    assert failed.tolist() == [True, False]
    assert (step[0] >= 0).sum() == 3 and (step[1][:3] >= 0).all()


def test_fill_windows_capacity_failure_is_reported_per_window():
    costs = np.array([[9, 9, 9, 0], [3, 2, 1, 1]], np.int64)
    step, rank, failed = fill_windows(costs, np.array([[4], [4]]), 2, capacity=10)
    assert failed.tolist() == [True, False]
    assert (step[1] == 0).all()


# ---------------------------------------------------------------------------------------------
# Karmarkar–Karp, CP-SAT, equal counts, refinement


def _optimal(costs, k, equal_counts=False):
    best = float("inf")
    n = len(costs)
    for assign in itertools.product(range(k), repeat=n):
        counts = np.bincount(assign, minlength=k)
        if n >= k and counts.min() == 0:
            continue
        if equal_counts and counts.max() - counts.min() > 1:
            continue
        best = min(best, max(np.bincount(assign, weights=costs, minlength=k)))
    return best


def _check_valid(costs, bins, k, equal_counts=False, capacity=None):
    assert bins.dtype == np.int64 and bins.shape == (len(costs),)
    assert ((bins >= 0) & (bins < k)).all()
    counts = np.bincount(bins, minlength=k)
    if len(costs) >= k:
        assert counts.min() >= 1, "every bin gets an item when there are enough items"
    if equal_counts and len(costs):
        assert counts.max() - counts.min() <= 1
    if capacity is not None:
        assert bin_loads(costs, bins, k).max() <= capacity


@FAST
@given(st.lists(st.integers(0, 10_000), max_size=50), st.integers(1, 8), st.booleans(),
       st.sampled_from(["lpt", "kk"]), st.booleans())
def test_kk_lpt_equal_counts_and_refine_are_valid_and_deterministic(costs, k, equal, method, refine):
    bins = partition(costs, k, method=method, equal_counts=equal, refine=refine)
    _check_valid(costs, bins, k, equal)
    assert np.array_equal(bins, partition(list(costs), k, method=method, equal_counts=equal, refine=refine))
    if refine:
        plain = partition(costs, k, method=method, equal_counts=equal)
        assert bin_loads(costs, bins, k).max() <= bin_loads(costs, plain, k).max()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=7), st.integers(1, 3))
def test_kk_within_four_thirds_of_the_optimum(costs, k):
    # Michiels et al. (2003): k-way largest differencing is within 4/3 - 1/(3k) of optimal.
    loads = bin_loads(costs, partition(costs, k, method="kk"), k)
    assert loads.max() <= (4 / 3 - 1 / (3 * k)) * _optimal(costs, k) + 1e-9


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=7), st.integers(1, 3), st.booleans())
def test_cpsat_matches_brute_force_on_small_inputs(costs, k, equal):
    bins = partition(costs, k, method="cpsat", equal_counts=equal)
    _check_valid(costs, bins, k, equal)
    assert bin_loads(costs, bins, k).max() == _optimal(costs, k, equal)


def test_cpsat_is_deterministic_and_honours_capacity():
    c = np.random.default_rng(1).integers(1, 500, 24)
    a = partition(c, 4, method="cpsat", capacity=int(c.sum() / 4) + 40, time_limit=0.5)
    b = partition(c, 4, method="cpsat", capacity=int(c.sum() / 4) + 40, time_limit=0.5)
    assert np.array_equal(a, b)
    _check_valid(c, a, 4, capacity=int(c.sum() / 4) + 40)
    with pytest.raises(ValueError, match="small problems"):
        partition(np.ones(1000), 300, method="cpsat")


def test_refine_fixes_a_bad_start_and_keeps_counts_with_equal_counts():
    from tokenbal.balance.partition import refine_partition

    c = np.array([9, 8, 7, 1, 1, 1])
    bad = np.array([0, 0, 0, 1, 1, 1])
    out = refine_partition(c, bad, 2)
    assert bin_loads(c, out, 2).max() == _optimal(c, 2) == 15     # {8, 7} vs {9, 1, 1, 1}
    eq = refine_partition(c, bad, 2, equal_counts=True)
    assert np.bincount(eq, minlength=2).tolist() == [3, 3]
    assert bin_loads(c, eq, 2).max() < 24


def test_kk_beats_lpt_on_its_textbook_case_and_capacity_falls_back():
    c = [8, 7, 6, 5, 4]                  # 2-way: LPT 17/13, KK 16/14, optimum 15/15
    assert bin_loads(c, partition(c, 2, method="kk"), 2).max() == 16
    assert bin_loads(c, partition(c, 2, method="lpt"), 2).max() == 17
    # KK ignores capacity; partition falls back to a capacity-aware packing instead of breaking it
    bins = partition(c, 2, method="kk", capacity=17)
    _check_valid(c, bins, 2, capacity=17)


# ---------------------------------------------------------------------------------------------
# grouped_fill: one large window in a few (radix) sorts


@FAST
@given(W=st.integers(1, 12), R=st.integers(1, 9), per_step=st.integers(1, 30), seed=st.integers(0, 2**32 - 1),
       heavy=st.booleans())
def test_grouped_fill_places_every_item_once_in_equal_steps(W, R, per_step, seed, heavy):
    rng = np.random.default_rng(seed)
    m = W * per_step
    x = (rng.lognormal(5, 2.0 if heavy else 0.5, m) + rng.integers(0, 2, m)).astype(np.int64)
    x = np.sort(x)[::-1]
    step, rank, place = grouped_fill(x, W, R)
    assert ((step >= 0) & (step < W)).all() and ((rank >= 0) & (rank < R)).all()
    assert np.bincount(step, minlength=W).tolist() == [per_step] * W, "every step holds its cap"
    slot = step * R + rank
    assert len(np.unique(slot * (m + 1) + place)) == m, "places are distinct inside a rank-step"
    counts = np.bincount(slot, minlength=W * R)
    if per_step >= R:
        assert (counts > 0).all(), "no rank is empty while the step has an item per rank"
    else:
        assert counts.reshape(W, R).max() == 1
    assert all(np.array_equal(a, b) for a, b in zip(grouped_fill(x, W, R), (step, rank, place), strict=True))


def test_grouped_fill_levels_a_heavy_tailed_window_to_its_floor():
    # 400 steps × 64 ranks, 2 samples per rank-step, log-normal sizes with a long tail: the sum over
    # steps of the slowest rank is within 1 % of the floor Σ_steps max(largest sample, mean).
    rng = np.random.default_rng(3)
    W, R = 400, 64
    x = np.sort(rng.lognormal(6, 1.3, W * R * 2).astype(np.int64) + 1)[::-1]
    step, rank, _ = grouped_fill(x, W, R)
    loads = np.bincount(step * R + rank, weights=x, minlength=W * R).reshape(W, R)
    big = np.zeros(W)
    np.maximum.at(big, step, x)
    floor = np.maximum(big, loads.mean(1)).sum()
    assert loads.max(1).sum() <= 1.01 * floor
    # and no rank-step holds two of the window's W·R largest samples
    assert np.bincount(step[:W * R] * R + rank[:W * R], minlength=W * R).max() == 1


@FAST
@given(W=st.integers(1, 10), R=st.integers(1, 8), per_step=st.integers(1, 24), K=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_grouped_stage_fill_keeps_the_guarantees_and_beats_the_total_cut(W, R, per_step, K, seed):
    from tokenbal.balance.partition.grouped import descending_order

    rng = np.random.default_rng(seed)
    m = W * per_step
    c = (rng.lognormal(4, 1.5, (m, K)) * (rng.random((m, K)) < 0.7)).astype(np.int64)
    c = c[descending_order(c.sum(1))]
    step, rank, place = grouped_stage_fill(c, W, R)
    assert np.bincount(step, minlength=W).tolist() == [per_step] * W, "every step holds its cap"
    slot = step * R + rank
    assert len(np.unique(slot * (m + 1) + place)) == m, "places are distinct inside a rank-step"
    counts = np.bincount(slot, minlength=W * R)
    assert (counts > 0).all() if per_step >= R else counts.max() == 1
    again = grouped_stage_fill(c, W, R)
    assert all(np.array_equal(a, b) for a, b in zip(again, (step, rank, place), strict=True))

    def time(s, r):
        loads = np.stack([np.bincount(s * R + r, weights=c[:, k], minlength=W * R) for k in range(K)], 1)
        return loads.reshape(W, R, K).max(1).sum()

    # The kept cut is no slower than cutting the same bins by their summed load (the first candidate),
    # which with one stage is exactly grouped_fill.
    total_step, total_rank, _ = grouped_fill(c.sum(1), W, R)
    assert time(step, rank) <= time(total_step, total_rank) + 1e-6
    if K == 1:
        assert time(step, rank) == time(total_step, total_rank)


def test_grouped_stage_fill_separates_bins_heavy_in_different_stages():
    # 2 steps × 2 ranks, one item per rank-step: two vision-heavy and two text-heavy samples of the
    # same total. Cut by total they may share steps (each step waits 9 + 9); cut apart, 9 + 1 each.
    c = np.array([[9, 1], [1, 9], [9, 1], [1, 9]], np.int64)
    step, rank, _ = grouped_stage_fill(c, 2, 2)
    assert step[0] == step[2] and step[1] == step[3] and step[0] != step[1]


def test_grouped_fill_rejects_unequal_steps():
    with pytest.raises(ValueError, match="do not make 3 equal steps"):
        grouped_fill(np.arange(10)[::-1], 3, 2)


def test_descending_order_is_stable_and_handles_constant_keys():
    from tokenbal.balance.partition.grouped import descending_order

    key = np.array([5, 1, 5, 3, 0, 3])
    assert descending_order(key).tolist() == [0, 2, 3, 5, 1, 4]
    assert descending_order(np.zeros(4)).tolist() == [0, 1, 2, 3]
    assert descending_order(np.zeros(0)).tolist() == []
