"""Bin packing: split item costs into bins with near-equal sums.

Two entry points, both pure numpy and deterministic:

* :func:`partition` — one problem: ``costs`` into ``num_bins`` bins. ``method`` picks the
  algorithm from :data:`METHODS` (today only ``"lpt"``; Karmarkar–Karp and CP-SAT register
  there when they land, and ``"auto"`` keeps meaning "the best default").
* :func:`fill_windows` — many independent problems at once, each a *window* of consecutive
  training steps × ranks with a per-step item count (or a per-rank token capacity). This is the
  engine of :mod:`tokenbal.plan`; it is vectorised across windows so an epoch of a million
  samples is planned in well under a second.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["METHODS", "partition", "bin_loads", "fill_windows"]

# method name -> implementation(costs, num_bins, capacity) -> bins. A new solver registers here.
METHODS: dict[str, Callable[[np.ndarray, int, float | None], np.ndarray]] = {}
_AUTO = "lpt"


def partition(costs: Sequence[float] | np.ndarray, num_bins: int, method: str = "auto",
              capacity: float | None = None) -> np.ndarray:
    """Assign every item to one of ``num_bins`` bins so that the bins' cost sums are close.

    Returns an int64 array of bin ids, one per item. Deterministic: equal costs are taken in
    index order and equally loaded bins are chosen by fewest items, then lowest id. When
    ``len(costs) >= num_bins`` every bin gets at least one item.

    ``capacity`` is a hard maximum per bin sum. An item that alone exceeds it, or a set of items
    the heuristic cannot place within it, raises ``ValueError`` naming the item.
    """
    c = _check_costs(costs)
    if isinstance(num_bins, bool) or not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")
    name = _AUTO if method == "auto" else method
    if name not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; available: "
                         f"{', '.join(['auto', *METHODS])}")
    if capacity is not None:
        if not np.isfinite(capacity) or capacity < 0:
            raise ValueError(f"capacity must be a finite number >= 0, got {capacity!r}")
        over = np.flatnonzero(c > capacity)
        if over.size:
            i = int(over[0])
            raise ValueError(f"item {i} (cost {c[i]:g}) exceeds capacity {capacity:g} on its own"
                             + (f"; {over.size - 1} more items do too" if over.size > 1 else ""))
    if c.size == 0:
        return np.zeros(0, np.int64)
    return METHODS[name](c, int(num_bins), capacity)


def bin_loads(costs: Sequence[float] | np.ndarray, bins: np.ndarray, num_bins: int) -> np.ndarray:
    """Sum of costs per bin (float64), e.g. to check a partition."""
    return np.bincount(np.asarray(bins), weights=np.asarray(costs, np.float64), minlength=num_bins)


def _check_costs(costs: Sequence[float] | np.ndarray) -> np.ndarray:
    c = np.asarray(costs)
    if c.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {c.shape}")
    if c.size and not np.issubdtype(c.dtype, np.number):
        raise TypeError(f"costs must be numbers, got dtype {c.dtype}")
    c = c.astype(np.float64) if not np.issubdtype(c.dtype, np.integer) else c.astype(np.int64)
    bad = np.flatnonzero(~np.isfinite(c) | (c < 0)) if c.dtype.kind == "f" else np.flatnonzero(c < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"costs must be finite and >= 0; item {i} has cost {c[i]!r}")
    return c


def _descending(c: np.ndarray) -> np.ndarray:
    # Stable sort on the negated key: largest first, equal costs in index order.
    return np.argsort(-c, kind="stable")


def _lpt(c: np.ndarray, k: int, capacity: float | None) -> np.ndarray:
    """Longest processing time first: largest item to the least loaded bin (heap, O(n log k))."""
    bins = np.empty(c.size, np.int64)
    # (load, items, bin): fewest items breaks load ties so zero-cost items still spread out.
    heap = [(0, 0, b) for b in range(k)]
    values = c.tolist()
    for i in _descending(c).tolist():
        load, count, b = heap[0]
        v = values[i]
        if capacity is not None and load + v > capacity:
            # The least loaded bin cannot take it, so no bin can: LPT is stuck here.
            return _best_fit_decreasing(c, k, capacity, stuck_item=i)
        bins[i] = b
        heapq.heapreplace(heap, (load + v, count + 1, b))
    return bins


def _best_fit_decreasing(c: np.ndarray, k: int, capacity: float, stuck_item: int) -> np.ndarray:
    """Fallback when LPT cannot honour ``capacity``: BFD packs tighter than LPT's spreading."""
    loads = np.zeros(k, np.float64)
    counts = np.zeros(k, np.int64)
    bins = np.empty(c.size, np.int64)
    for i in _descending(c).tolist():
        room = capacity - loads - c[i]
        fits = np.flatnonzero(room >= 0)
        if fits.size == 0:
            raise ValueError(
                f"cannot honour capacity {capacity:g} with {k} bins: item {i} (cost {c[i]:g}) fits in "
                f"no bin (LPT got stuck at item {stuck_item}, best-fit-decreasing at item {i}); "
                f"total cost {c.sum():g} vs total capacity {k * capacity:g}. Use more bins or a larger "
                f"capacity (an exact solver may still find a packing).")
        b = int(fits[np.argmin(room[fits])])
        bins[i] = b
        loads[b] += c[i]
        counts[b] += 1
    # BFD may leave bins empty; moving an item into an empty bin never breaks the capacity.
    for b in np.flatnonzero(counts == 0).tolist():
        donors = np.flatnonzero(counts > 1)
        if donors.size == 0:
            break
        members = np.flatnonzero(np.isin(bins, donors))
        i = int(members[np.lexsort((members, c[members]))[0]])  # smallest movable item
        counts[bins[i]] -= 1
        bins[i] = b
        counts[b] += 1
    return bins


METHODS["lpt"] = _lpt


# --------------------------------------------------------------------------------------------
# Batched level-fill over windows of steps (the planner's engine)
# --------------------------------------------------------------------------------------------

_BIG = np.iinfo(np.int64).max // 4


def fill_windows(costs: np.ndarray, caps: np.ndarray, num_ranks: int, *,
                 capacity: int | None = None, force_nonempty: bool = False,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack G independent windows at once; window g has ``caps.shape[1]`` steps × ``num_ranks`` bins.

    ``costs`` is (G, M) int64, each row sorted in descending order, every real item >= 1 and
    padding = 0 at the end of the row. ``caps`` is (G, W): the most items step w of window g may
    hold (0: the step does not exist). Returns ``(step, rank, failed)``: (G, M) step-in-window
    and rank of every item (-1 for padding or unplaced items) and a (G,) bool of windows where
    some item fitted nowhere (only possible with ``capacity``).

    Rule, per item, largest first:
      1. *Deficit fill*: if some open step has a bin whose gap to that step's fullest bin is at
         least the item, put it in the largest such gap. This is what lets a step holding one
         huge sample collect the big items it needs on its other ranks, while ordinary steps
         keep a mix of sizes — per-step LPT cannot do that, it only sees one step.
      2. Otherwise LPT: the least loaded bin over all open steps (within ``capacity``).
      3. ``force_nonempty``: once the items left are no more than the empty bins, each item
         goes to an empty bin, so no bin is left empty when the window has enough items.
    Ties go to the lowest step, then the lowest rank, so the result is deterministic. Because
    costs are >= 1, an empty bin is always the least loaded and has the largest gap in its step;
    hence a step whose cap is >= ``num_ranks`` never ends with an empty bin.
    """
    G, M = costs.shape
    W = caps.shape[1]
    R = int(num_ranks)
    loads = np.zeros((G, W, R), np.int64)
    minload = np.zeros((G, W), np.int64)      # least loaded bin of each step (== largest gap)
    minbin = np.zeros((G, W), np.int64)
    smax = np.zeros((G, W), np.int64)         # fullest bin of each step
    scnt = np.zeros((G, W), np.int64)
    caps = caps.astype(np.int64)
    rows = np.arange(G)
    step_out = np.full((G, M), -1, np.int64)
    rank_out = np.full((G, M), -1, np.int64)
    failed = np.zeros(G, bool)
    if force_nonempty:
        empty_bins = (caps > 0).sum(1) * R
        left = (costs > 0).sum(1)
    for j in range(M):
        x = costs[:, j]
        valid = (x > 0) & ~failed
        if not valid.any():
            break
        open_ = scnt < caps
        gap = smax - minload
        xcol = x[:, None]
        lpt_ok = open_ if capacity is None else open_ & (minload + xcol <= capacity)
        key = np.where(open_ & (gap >= xcol), -gap, np.where(lpt_ok, minload, _BIG))
        if force_nonempty:
            forced = left <= empty_bins
            if forced.any():
                key[forced] = np.where(open_[forced] & (minload[forced] == 0), 0, _BIG)
        s = key.argmin(1)
        fits = key[rows, s] < _BIG
        failed |= valid & ~fits
        place = valid & fits
        r = minbin[rows, s]
        step_out[:, j] = np.where(place, s, -1)
        rank_out[:, j] = np.where(place, r, -1)
        if force_nonempty:
            empty_bins -= place & (loads[rows, s, r] == 0)
            left -= valid
        loads[rows, s, r] += np.where(place, x, 0)
        smax[rows, s] = np.maximum(smax[rows, s], loads[rows, s, r])
        scnt[rows, s] += place
        seg = loads[rows, s]                                  # (G, R): the chosen steps' bins
        mb = seg.argmin(1)
        minbin[rows, s] = mb
        minload[rows, s] = seg[rows, mb]
    return step_out, rank_out, failed
