"""Which samples share a step, chosen by their stage-cost vectors (stage mode's step composition).

A step of K synchronised stages takes ``Σ_k max_rank load[k]``, and no split of a step's samples
beats its *floor* ``Σ_k max(largest sample in k, Σ_k / ranks)``. The composition decides the floor:
a step holding a 10k-token document needs the other ranks as busy in the vision tower, so it must
hold the window's other big vision samples, not text of the same total. Sorting a window's
samples and cutting the order into steps (largest first) puts samples of similar cost together,
which is what a length-grouped sampler does on the summed cost; but which order is best depends
on the mixture (by total, by the dominant stage, by stage share), so :func:`compose_steps` makes
several candidate orders of every window, computes each one's floor (cheap: per step a sum and a
max) and keeps, per window, the order with the lowest floor. The split inside the steps comes
after; the planner (``tokenbal.balance.plan._compose_fill``) also refines version 6's profile fill
of the same window and keeps, per window, whichever ends with the lower stage time.

Candidates (every one sorted largest first inside its groups, jittered so that samples of nearly
equal size trade places from epoch to epoch):

* ``total``: one group, by the summed cost (a length-grouped composition over the whole window);
* ``dominant``: one group per dominant stage (the stage with the largest cost), by that cost;
* ``share/B``: groups by dominant stage and its share of the sample's cost in B buckets, by total.

In the grouped candidates each group fills whole steps; what is left of every group (less than one
step each) is pooled at the end of the window, by total. Pure numpy, deterministic given ``rng``.
"""

from __future__ import annotations

import numpy as np

from tokenbal.balance.partition.stages import _lexsort2, _row_sums, _stable_argsort

__all__ = ["compose_steps", "steps_floor", "COMPOSITIONS"]

# Candidate orders: (name, share buckets) — 0 buckets: the plain dominant-stage groups; None: total.
COMPOSITIONS = (("total", None), ("dominant", 0), ("share/2", 2), ("share/4", 4), ("share/8", 8))
_LOG_STEPS = 1 << 14          # resolution of the sort key: 2**-14 of an octave


def steps_floor(costs: np.ndarray, starts: np.ndarray, num_ranks: int) -> np.ndarray:
    """Per step ``Σ_k max(largest, sum / ranks)`` of items laid out step after step:
    ``costs`` (n, K) in order, step j = rows ``starts[j]:starts[j + 1]`` (every step non-empty)."""
    c = np.asarray(costs, np.float64)
    if not len(starts):
        return np.zeros(0)
    sums = np.add.reduceat(c, starts, axis=0)
    big = np.maximum.reduceat(c, starts, axis=0)
    return np.maximum(big, sums / num_ranks).sum(1)


def _log_key(x: np.ndarray) -> np.ndarray:
    """int64 sort key increasing with ``x >= 0`` (log scale, fixed resolution, same on every machine)."""
    return np.round(np.log2(x.astype(np.float64) + 1.0) * _LOG_STEPS).astype(np.int64)


def compose_steps(stage_costs: np.ndarray, window: np.ndarray, caps: np.ndarray, num_ranks: int,
                  rng: np.random.Generator | None = None, jitter: float = 0.0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order the items of every window so that cutting the order into the window's steps gives a low
    floor; returns ``(order, step, chosen)``.

    ``stage_costs`` (n, K) int64 or float in window order (``window`` non-decreasing, window g's items
    contiguous), ``caps`` (G, W) items per step of each window (0: no step; the caps of a window sum
    to its items). ``order`` is a permutation of ``0..n-1`` keeping every window's items in its own
    positions, ``step`` the step in its window of every position of ``order``, ``chosen`` (G,) the
    index into :data:`COMPOSITIONS` each window took. ``jitter``: sizes are multiplied by up to
    ``1 + jitter`` at random (``rng``) before sorting.
    """
    c = np.asarray(stage_costs)
    n, K = c.shape
    window = np.asarray(window, np.int64)
    caps = np.asarray(caps, np.int64)
    G, W = caps.shape
    R = int(num_ranks)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(G, np.int64)
    total = _row_sums(c)
    dom = c.argmax(1) if K > 1 else np.zeros(n, np.int64)
    top = c[np.arange(n), dom]
    noise = np.zeros(n, np.int64)
    if rng is not None and jitter > 0:
        noise = np.round(rng.random(n) * np.log2(1.0 + jitter) * _LOG_STEPS).astype(np.int64)
    tot_key = _log_key(total) + noise
    top_key = _log_key(top) + noise
    share = np.where(total > 0, top / np.where(total > 0, total, 1), 1.0)
    # Steps of the epoch, in window order: step j holds positions starts[j]:starts[j] + caps.
    step_caps = caps.reshape(-1)
    exists = step_caps > 0
    step_caps = step_caps[exists]
    step_win = np.repeat(np.arange(G), W)[exists]
    starts = np.concatenate([[0], np.cumsum(step_caps)[:-1]])
    step_in_win = (np.cumsum(caps > 0, axis=1) - 1).reshape(-1)[exists]
    step = np.repeat(step_in_win, step_caps)
    full_step = np.repeat(caps.max(1, initial=0), np.bincount(window, minlength=G))   # per item
    win_span = int(window.max()) + 1
    orders, floors = [], []
    for _, buckets in COMPOSITIONS:
        if buckets is None:
            group = np.zeros(n, np.int64)
            key = tot_key
        else:
            b = 0 if buckets == 0 else np.minimum((share * buckets).astype(np.int64), buckets - 1)
            group = dom * max(buckets, 1) + b
            key = top_key if buckets == 0 else tot_key
        order = _grouped_order(window, group, key, full_step, win_span)
        orders.append(order)
        floors.append(np.bincount(step_win, weights=steps_floor(c[order], starts, R), minlength=G))
    chosen = np.argmin(np.stack(floors), axis=0)           # first candidate on ties
    pos_win = window                                        # windows occupy the same positions
    order = np.stack(orders)[chosen[pos_win], np.arange(n)]
    return order, step, chosen


def _grouped_order(window: np.ndarray, group: np.ndarray, key: np.ndarray, full_step: np.ndarray,
                   win_span: int) -> np.ndarray:
    """Per window: groups one after the other, each largest ``key`` first, whole steps of
    ``full_step`` items; every group's remainder pooled at the window's end, largest first."""
    n = len(window)
    kmax = int(key.max(initial=0)) + 1
    gmax = int(group.max(initial=0)) + 1
    # Stable argsort of one packed key: (window, group, -key); ties keep window order.
    packed = (window * gmax + group) * kmax + (kmax - 1 - key)
    if win_span * gmax * kmax >= 2**62:
        o = np.lexsort((kmax - 1 - key, group, window))
    else:
        o = _stable_argsort(packed)
    wg = window[o] * gmax + group[o]
    first = np.r_[0, np.flatnonzero(np.diff(wg)) + 1]
    size = np.diff(np.r_[first, n])
    pos = np.arange(n) - np.repeat(first, size)
    rem = pos >= np.repeat(size // full_step[o][first] * full_step[o][first], size)
    if not rem.any():
        return o
    # Remainders after the whole steps of their window, by key.
    tail = np.where(rem, kmax - 1 - key[o], 0)
    o2 = _lexsort2(tail, window[o] * 2 + rem)
    return o[o2]

