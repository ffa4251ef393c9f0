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
"""

from __future__ import annotations

import numpy as np

__all__ = ["grouped_fill", "descending_order"]

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
    m = len(x)
    if m == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
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
    step_of_bin = np.empty(nb, np.int64)
    rank_of_bin = np.empty(nb, np.int64)
    for members, width, first_rank in ((np.flatnonzero(plus), extra, 0),
                                       (np.flatnonzero(~plus), R - extra, extra)):
        if width == 0:
            continue
        members = members[descending_order(load[members])]
        j = np.arange(len(members))
        step_of_bin[members] = j // width
        rank_of_bin[members] = first_rank + j % width
    # Item p came in round p // nb, and every round gives a bin at most one item.
    place = np.minimum(np.arange(m) // nb, per_bin)
    return step_of_bin[bin_of], rank_of_bin[bin_of], place
