"""Grouped fill: one window of equal-sized steps split into rank-steps in a few linear-time sorts.

The window fill (:mod:`tokenbal.balance.partition.window`) decides every item against every open
bin of its window, so its cost grows with the window squared; the windows it can afford (256
steps) leave heavy-tailed data visibly unbalanced. This fill works in two passes instead:

1. *Bins*: the window's ``steps × ranks`` rank-steps are filled in rounds, largest items first:
   round t gives each bin one item, the round's largest to the least loaded bin (LPT by rounds),
   so every bin gets ``cap // ranks`` items and the ``cap % ranks`` extra items of each step go to
   the least loaded bins of a last, partial round. Because round 1 gives every bin one item, no bin
   holds two of the window's largest items, and none is empty while items are left.
2. *Steps*: the bins are sorted by load and cut into steps of ``ranks`` neighbours (bins with an
   extra item and bins without are cut separately, so every step holds exactly ``cap`` items).
   A step's ranks then differ only by how far apart neighbouring loads are, which shrinks as the
   window grows — and a window of millions of items costs a few sorts (16-bit log buckets,
   radix-sorted: neighbours within ~0.03 % of each other may trade places).

Bins that hold one of the few giant samples end up in the same steps as the next-largest bins:
the steps the window fill would build around them, found by sorting instead of searching.

:func:`grouped_stage_fill` does the same for steps of K synchronised stages (``Σ_stage max_rank``):
the bins are filled on the summed cost, and several orders of them (by total; a grid of bands by
total and a stage's share inside them; by the stages weighted 3:1) are cut, the cheapest kept.
"""

from __future__ import annotations

import numpy as np

from tokenbal.balance.partition.stages import _row_sums, _stable_argsort

__all__ = ["grouped_fill", "grouped_stage_fill", "descending_order"]

# Sorts here only need nearby values next to each other: keys are bucketed on a log scale into
# 16 bits (2**16 buckets over the range's octaves: ~0.03 % apart for a 1:10^6 range), which numpy
# sorts stably by radix in linear time; equal buckets keep their input order.
_LEVELS = (1 << 16) - 1


def descending_order(key: np.ndarray) -> np.ndarray:
    """Order of ``key`` (>= 0, int or float) from largest to smallest, by log-bucket (ties, and
    keys within ~0.03 % of each other, in input order). Deterministic on every machine (a stable
    radix sort of 16-bit buckets)."""
    return np.argsort(_LEVELS - _log_buckets(key), kind="stable")


def _log_buckets(key: np.ndarray) -> np.ndarray:
    v = np.log2(np.asarray(key, np.float64) + 1.0)
    hi = float(v.max(initial=0.0))
    lo = float(v.min(initial=0.0))
    if hi <= lo:
        return np.zeros(len(v), np.uint16)
    return ((v - lo) * (_LEVELS / (hi - lo))).astype(np.uint16)


def grouped_fill(costs: np.ndarray, steps: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``steps`` steps of ``len(costs) // steps`` items each over ``num_ranks`` ranks.

    ``costs``: int64 in descending order (or nearly: the caller may jitter the order), ``len(costs)``
    a multiple of ``steps``. Returns ``(step, rank, place)`` per item: ``step`` in ``[0, steps)``,
    ``rank`` in ``[0, num_ranks)``, and ``place``, the item's place among its rank-step's items
    (0, 1, ...: distinct inside a rank-step). Every step gets exactly ``len(costs) // steps`` items,
    and every rank at least one when that is ``>= num_ranks``. Deterministic.
    """
    x = np.asarray(costs, np.int64)
    W, R = int(steps), int(num_ranks)
    if len(x) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    bin_of, load, plus, extra = _bins_by_rounds(x, W, R)
    step_of_bin = np.empty(W * R, np.int64)
    rank_of_bin = np.empty(W * R, np.int64)
    for members, width, first_rank in _bin_groups(plus, extra, R):
        members = members[descending_order(load[members])]
        j = np.arange(len(members))
        step_of_bin[members] = j // width
        rank_of_bin[members] = first_rank + j % width
    return step_of_bin[bin_of], rank_of_bin[bin_of], _places(len(x), W * R, len(x) // W // R)


def grouped_stage_fill(stage_costs: np.ndarray, steps: int, num_ranks: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`grouped_fill` for steps of K synchronised stages (a step takes ``Σ_k max_rank``).

    ``stage_costs`` (m, K) int64, its rows in descending order of their sums (or nearly). The bins
    are filled by rounds on the summed cost, as in :func:`grouped_fill`; then several orders of the
    bins are cut into steps and the one with the lowest ``Σ_steps Σ_k max_rank`` is kept: by total,
    by total in bands of 2, 4, ... steps and inside a band by a stage's share (:func:`_stage_orders`),
    and by the stages weighted 3:1 (so bins heavy in the same stage share a step). Returns
    ``(step, rank, place)`` as :func:`grouped_fill`, with the same guarantees. Deterministic.
    """
    c = np.asarray(stage_costs, np.int64)
    W, R = int(steps), int(num_ranks)
    m, K = c.shape
    if m == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    total = _row_sums(c)
    bin_of, load, plus, extra = _bins_by_rounds(total, W, R)
    nb = W * R
    loads = np.stack([np.bincount(bin_of, weights=c[:, k], minlength=nb) for k in range(K)], 1)
    loads_t = np.ascontiguousarray(loads.T)             # (K, bins): per step, a reduction over R in a row
    groups = _bin_groups(plus, extra, R)
    seg = _segment_steps(W)
    nseg = -(-W // seg)
    # Every candidate order is applied to both groups (bins with an extra item and without share the
    # steps) and judged on whole steps. The grid orders only permute bins inside segments of `seg`
    # steps of the order by total, so each segment keeps the grid order that is cheapest there; the
    # weighted orders are judged on the whole window against that combination.
    combined = None
    seg_cost = np.full(nseg, np.inf)
    best_global, global_cost = None, np.inf
    candidates = [_stage_orders(loads.take(members, axis=0), width, seg) for members, width, _ in groups]
    for tagged in zip(*candidates, strict=True):
        step_of_bin = np.empty(nb, np.int64)
        rank_of_bin = np.empty(nb, np.int64)
        for (members, width, first_rank), (order, _) in zip(groups, tagged, strict=True):
            j = np.arange(len(members))
            step_of_bin[members[order]] = j // width
            rank_of_bin[members[order]] = first_rank + j % width
        by_slot = np.empty_like(loads_t)
        slot = step_of_bin * R + rank_of_bin
        for k in range(K):                              # row by row: a 1-D scatter is faster
            by_slot[k, slot] = loads_t[k]
        per_step = sum_stages(by_slot.reshape(K, W, R).max(2))
        if not tagged[0][1]:                            # a weighted order: the whole window or nothing
            if per_step.sum() < global_cost:
                best_global, global_cost = (step_of_bin, rank_of_bin), float(per_step.sum())
            continue
        cost = np.bincount(np.arange(W) // seg, weights=per_step, minlength=nseg)
        if combined is None:
            combined = (step_of_bin, rank_of_bin)
            seg_cost = cost
            continue
        wins = cost < seg_cost
        if wins.any():
            take = wins[combined[0] // seg]              # a bin's segment is the same in every grid order
            combined[0][take], combined[1][take] = step_of_bin[take], rank_of_bin[take]
            seg_cost = np.where(wins, cost, seg_cost)
    step_of_bin, rank_of_bin = best_global if global_cost < seg_cost.sum() else combined
    return step_of_bin[bin_of], rank_of_bin[bin_of], _places(m, nb, m // W // R)


def sum_stages(top: np.ndarray) -> np.ndarray:
    """``Σ_k top[k]`` of (K, S) float stage maxima: the same values as ``top.T.sum(1)`` (numpy's sum of
    a (S, K) array; elementwise for K = 2, where that sum is exactly ``a + b``). Taking the maxima as
    ``(K, S, R).max(2)`` instead of ``(S, R, K).max(1)`` is ~40x faster (a contiguous reduction)."""
    if top.shape[0] == 2:
        return top[0] + top[1]
    return np.ascontiguousarray(top.T).sum(1)


def _segment_steps(W: int) -> int:
    """Steps per segment of the grid orders: the widest band tried, the largest power of two up to
    4√W (the best band grows with the window: about √W on random mixtures, 32 of 976 steps)."""
    m = 1
    while 2 * m <= 4 * W ** 0.5:
        m *= 2
    return m


def _stage_orders(L: np.ndarray, width: int, seg: int):
    """Orders of one group of bins (``L``: (bins, K) float loads, ``width`` bins per step) whose cut
    into steps :func:`grouped_stage_fill` tries, each tagged True when it only permutes bins inside
    segments of ``seg`` steps of the order by total (first kept on ties).

    By total; then a grid over (total, share): bands of ``m`` steps' bins by total, each band
    ordered by a stage's share and cut into its ``m`` steps (m = 2, 4, ... ``seg``). A step then holds
    bins whose totals lie within its band and whose shares within 1/m of the band's; ``m`` trades
    one spread for the other. Last, untagged, the stages weighted 3:1 and 1:3."""
    K = L.shape[1]
    total = L.sum(1)
    by_total = descending_order(total)
    yield by_total, True
    pos = np.arange(len(by_total), dtype=np.int64)
    for k in range(K if K > 2 else K - 1):
        share = (_LEVELS - _log_buckets(L[by_total, k] / np.maximum(total[by_total], 1.0) * 65535.0))
        share = share.astype(np.int64)
        m = 2
        while m <= seg:
            yield by_total[_stable_argsort(((pos // (m * width)) << 16) | share)], True
            m *= 2
        for a in (0.25, 0.75):
            yield descending_order(a * L[:, k] + (1.0 - a) * (total - L[:, k])), False


def _bins_by_rounds(x: np.ndarray, W: int, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Phase 1 of the grouped fill: ``(bin of every item, bin loads, bins with an extra item, extra items
    per step)`` for ``x`` (int64, descending) over ``W × R`` bins."""
    m = len(x)
    if W < 1 or m % W:
        raise ValueError(f"{m} items do not make {W} equal steps")
    per_bin, extra = divmod(m // W, R)
    nb = W * R
    load = np.zeros(nb, np.int64)
    bin_of = np.empty(m, np.int64)
    for t in range(per_bin):
        # Least loaded bins first (the round's items come largest first). After round 1 the loads
        # are the first items themselves, in descending order: the fold.
        if t == 0:
            to = np.arange(nb)
        elif t == 1:
            to = np.arange(nb - 1, -1, -1)
        else:
            to = descending_order(load)[::-1]
        seg = slice(t * nb, (t + 1) * nb)
        bin_of[seg] = to
        load[to] += x[seg]
    plus = np.zeros(nb, bool)
    if extra:
        to = descending_order(load)[::-1][:W * extra]
        bin_of[per_bin * nb:] = to
        load[to] += x[per_bin * nb:]
        plus[to] = True
    return bin_of, load, plus, extra


def _bin_groups(plus: np.ndarray, extra: int, R: int) -> list[tuple[np.ndarray, int, int]]:
    """Bins with an extra item and bins without, each cut into steps separately (so every step holds
    exactly its items): ``(members, ranks per step, first rank)``."""
    return [(members, width, first) for members, width, first in
            ((np.flatnonzero(plus), extra, 0), (np.flatnonzero(~plus), R - extra, extra)) if width]


def _places(m: int, nb: int, per_bin: int) -> np.ndarray:
    # Item p came in round p // nb, and every round gives a bin at most one item.
    return np.minimum(np.arange(m) // nb, per_bin)
