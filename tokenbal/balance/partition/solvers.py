"""Bin packing solvers: split item costs into bins with near-equal sums; pure numpy, deterministic.

* :func:`partition` — one problem: ``costs`` into ``num_bins`` bins. ``method`` picks the
  algorithm from :data:`METHODS`: ``"lpt"`` (the ``"auto"`` default: fast, and within 4/3 of
  optimal), ``"kk"`` (Karmarkar–Karp; what verl uses per step) and ``"cpsat"`` (exact-ish, small
  problems); :func:`refine_partition` is a swap-based polish for any of them.
* :func:`first_fit_decreasing` — as few bins of a capacity as FFD finds (token-budget mode).

Many problems at once (windows of steps × ranks, the planner's engine) are in
:mod:`tokenbal.balance.partition.window`, steps of synchronised stages in
:mod:`tokenbal.balance.partition.stages`.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Sequence

import numpy as np

from tokenbal._checks import check_costs as _check_costs

__all__ = ["METHODS", "partition", "refine_partition", "bin_loads", "first_fit_decreasing"]

# method name -> implementation(costs, num_bins, capacity) -> bins. A new solver registers here.
METHODS: dict[str, Callable[[np.ndarray, int, float | None], np.ndarray]] = {}
_AUTO = "lpt"


def partition(costs: Sequence[float] | np.ndarray, num_bins: int, method: str = "auto",
              capacity: float | None = None, *, equal_counts: bool = False, refine: bool = False,
              time_limit: float = 2.0) -> np.ndarray:
    """Assign every item to one of ``num_bins`` bins so that the bins' cost sums are close.

    Returns an int64 array of bin ids, one per item. Deterministic: equal costs are taken in
    index order and equally loaded bins are chosen by fewest items, then lowest id. When
    ``len(costs) >= num_bins`` every bin gets at least one item.

    ``method``: ``"lpt"`` (= ``"auto"``; heap, O(n log k)), ``"kk"`` (Karmarkar–Karp largest
    differencing, k-way) or ``"cpsat"`` (OR-tools CP-SAT minimising the largest bin, hinted with
    the LPT result; one worker and a *deterministic* time limit of ``time_limit`` units, so the
    answer does not depend on machine speed; small problems only).
    ``equal_counts``: bin item counts differ by at most one. ``refine``: then improve the result
    by moving / swapping items out of the fullest bin while that lowers it (never makes it worse).

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
    k = int(num_bins)
    if name == "cpsat":
        bins = _cpsat(c, k, capacity, equal_counts, float(time_limit))
    elif equal_counts:
        bins = _EQUAL[name](c, k, capacity)
    else:
        bins = METHODS[name](c, k, capacity)
    if capacity is not None and bin_loads(c, bins, k).max() > capacity:
        # KK balances but knows no capacity: fall back to the capacity-aware packing.
        bins = _capacity_fallback(c, k, capacity, equal_counts)
    if refine:
        bins = refine_partition(c, bins, k, capacity=capacity, equal_counts=equal_counts)
    return bins


def bin_loads(costs: Sequence[float] | np.ndarray, bins: np.ndarray, num_bins: int) -> np.ndarray:
    """Sum of costs per bin (float64), e.g. to check a partition."""
    return np.bincount(np.asarray(bins), weights=np.asarray(costs, np.float64), minlength=num_bins)




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


def _lpt_equal(c: np.ndarray, k: int, capacity: float | None) -> np.ndarray:
    """LPT with a cardinality cap: counts differ by at most one (ceil(n/k) items per bin at most,
    and exactly ``n mod k`` bins may take the extra one)."""
    n = c.size
    lo, extra = divmod(n, k)
    bins = np.empty(n, np.int64)
    loads = np.zeros(k, np.float64)
    counts = np.zeros(k, np.int64)
    big_left = extra                       # bins that may still grow to lo + 1
    values = c.tolist()
    for i in _descending(c).tolist():
        limit = np.where(counts < lo, True, (counts == lo) & (big_left > 0))
        ok = limit if capacity is None else limit & (loads + values[i] <= capacity)
        cand = np.flatnonzero(ok)
        if cand.size == 0:
            raise ValueError(f"cannot place item {i} (cost {values[i]:g}) with equal counts within "
                             f"capacity {capacity:g}")
        b = int(cand[np.lexsort((cand, counts[cand], loads[cand]))[0]])
        if counts[b] == lo:
            big_left -= 1
        bins[i] = b
        loads[b] += values[i]
        counts[b] += 1
    return bins


def _kk(c: np.ndarray, k: int, capacity: float | None, equal_counts: bool = False) -> np.ndarray:
    """Karmarkar–Karp largest differencing, k-way (as in verl's ``karmarkar_karp``).

    Each state is k partial bins (sums sorted descending, with their items); the two states with
    the largest spread are merged pairing the first's largest bin with the second's smallest.
    ``equal_counts``: initial states are k consecutive items of the sorted list, one per bin
    (padded with zero-cost dummies), so every bin gets one item of every group.
    """
    n = c.size
    order = _descending(c).tolist()
    values = c.astype(np.float64)
    heap: list[tuple[float, int, np.ndarray, list[list[int]]]] = []
    tick = 0
    if equal_counts:
        pad = (-n) % k
        seq = order + [-1] * pad
        for g in range(0, len(seq), k):
            members = seq[g:g + k]
            sums = np.array([values[i] if i >= 0 else 0.0 for i in members])
            sets = [[i] if i >= 0 else [] for i in members]
            heapq.heappush(heap, (-(sums[0] - sums[-1]), tick, sums, sets))
            tick += 1
    else:
        for i in order:
            sums = np.zeros(k)
            sums[0] = values[i]
            heapq.heappush(heap, (-values[i], tick, sums, [[i]] + [[] for _ in range(k - 1)]))
            tick += 1
    while len(heap) > 1:
        _, _, sa, a = heapq.heappop(heap)
        _, _, sb, b = heapq.heappop(heap)
        sums = sa + sb[::-1]
        sets = [a[j] + b[k - 1 - j] for j in range(k)]
        o = np.argsort(-sums, kind="stable")
        sums = sums[o]
        sets = [sets[j] for j in o.tolist()]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tick, sums, sets))
        tick += 1
    bins = np.empty(n, np.int64)
    for b, members in enumerate(heap[0][3]):
        bins[members] = b
    return _fill_empty_bins(c, bins, k) if not equal_counts else bins


def _fill_empty_bins(c: np.ndarray, bins: np.ndarray, k: int) -> np.ndarray:
    """Move the smallest movable item into each empty bin (never breaks a capacity)."""
    counts = np.bincount(bins, minlength=k)
    for b in np.flatnonzero(counts == 0).tolist():
        donors = np.flatnonzero(counts > 1)
        if donors.size == 0:
            break
        members = np.flatnonzero(np.isin(bins, donors))
        i = int(members[np.lexsort((members, c[members]))[0]])
        counts[bins[i]] -= 1
        bins[i] = b
        counts[b] += 1
    return bins


def _capacity_fallback(c: np.ndarray, k: int, capacity: float, equal_counts: bool) -> np.ndarray:
    if equal_counts:
        return _lpt_equal(c, k, capacity)
    return _lpt(c, k, capacity)


METHODS["kk"] = _kk
_EQUAL: dict[str, Callable[[np.ndarray, int, float | None], np.ndarray]] = {
    "lpt": _lpt_equal, "kk": lambda c, k, cap: _kk(c, k, cap, equal_counts=True)}


def refine_partition(costs: Sequence[float] | np.ndarray, bins: np.ndarray, num_bins: int, *,
                     capacity: float | None = None, equal_counts: bool = False,
                     max_rounds: int | None = None, max_partners: int | None = None) -> np.ndarray:
    """Swap-based local search: lower the fullest bin by moving one of its items to another bin
    or swapping one of its items with a smaller one, as long as that strictly lowers the pair's
    maximum. Keeps item counts with ``equal_counts`` (swaps only), never empties a bin, never
    exceeds ``capacity``, and never raises the largest bin. Deterministic. ``max_partners``: only
    try the that many least loaded bins each round (for many bins)."""
    c = np.asarray(costs, np.float64)
    bins = np.asarray(bins, np.int64).copy()
    k = int(num_bins)
    loads = np.bincount(bins, weights=c, minlength=k)
    counts = np.bincount(bins, minlength=k)
    cap = np.inf if capacity is None else float(capacity)
    rounds = 0
    limit = max_rounds if max_rounds is not None else 4 * c.size + k
    while rounds < limit:
        rounds += 1
        hi = int(np.argmax(loads))
        mine = np.flatnonzero(bins == hi)
        best: tuple[float, int, int, int] | None = None      # (new pair max, item out, bin, item in)
        partners = np.argsort(loads, kind="stable")
        if max_partners is not None:
            partners = partners[:max_partners]
        for b in partners.tolist():
            if b == hi:
                continue
            gap = loads[hi] - loads[b]
            if gap <= 0:
                break
            if not equal_counts and counts[hi] > 1:
                # move: item x from hi to b; new pair max = max(L_hi - x, L_b + x)
                x = c[mine]
                ok = (x < gap) & (loads[b] + x <= cap)
                if ok.any():
                    pm = np.maximum(loads[hi] - x, loads[b] + x)
                    pm[~ok] = np.inf
                    j = int(np.argmin(pm))
                    if best is None or pm[j] < best[0]:
                        best = (float(pm[j]), int(mine[j]), b, -1)
            theirs = np.flatnonzero(bins == b)
            if theirs.size:
                d = c[mine][:, None] - c[theirs][None, :]          # what hi gives away net
                ok = (d > 0) & (d < gap) & (loads[b] + d <= cap)
                if ok.any():
                    pm = np.maximum(loads[hi] - d, loads[b] + d)
                    pm[~ok] = np.inf
                    j = int(np.argmin(pm))
                    u, v = divmod(j, theirs.size)
                    if best is None or pm[u, v] < best[0]:
                        best = (float(pm[u, v]), int(mine[u]), b, int(theirs[v]))
        if best is None or best[0] >= loads[hi]:
            break
        _, i, b, j = best
        bins[i] = b
        loads[hi] -= c[i]
        loads[b] += c[i]
        counts[hi] -= 1
        counts[b] += 1
        if j >= 0:
            bins[j] = hi
            loads[b] -= c[j]
            loads[hi] += c[j]
            counts[b] -= 1
            counts[hi] += 1
    return bins


def _cpsat(c: np.ndarray, k: int, capacity: float | None, equal_counts: bool, time_limit: float
           ) -> np.ndarray:
    """Minimise the largest bin with CP-SAT, starting from the LPT (or refined) result."""
    from ortools.sat.python import cp_model

    n = c.size
    if n * k > 200_000:
        raise ValueError(f"method='cpsat' is for small problems ({n} items x {k} bins is too many); "
                         "use 'lpt' or 'kk'")
    # CP-SAT needs integers: scale so the largest cost is ~1e9 (ties and order are kept).
    scale = 1.0 if c.dtype.kind in "iu" and c.max(initial=0) <= 10**12 else 1e9 / max(float(c.max()), 1e-300)
    w = np.round(c * scale).astype(np.int64)
    cap = None if capacity is None else int(np.floor(capacity * scale + 1e-9))
    hint = None
    try:
        hint = (_lpt_equal if equal_counts else _lpt)(c, k, capacity)
        hint = refine_partition(c, hint, k, capacity=capacity, equal_counts=equal_counts)
    except ValueError:
        hint = None
    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x{i}_{b}") for b in range(k)] for i in range(n)]
    total = int(w.sum())
    top = total if cap is None else min(total, cap)
    z = m.new_int_var(0, top, "max_load")
    lo, extra = divmod(n, k)
    for i in range(n):
        m.add_exactly_one(x[i])
    for b in range(k):
        load = sum(int(w[i]) * x[i][b] for i in range(n))
        m.add(load <= z)
        cnt = sum(x[i][b] for i in range(n))
        if equal_counts:
            m.add(cnt >= lo)
            m.add(cnt <= lo + (1 if extra else 0))
        elif n >= k:
            m.add(cnt >= 1)
    if hint is not None:
        for i in range(n):
            for b in range(k):
                m.add_hint(x[i][b], int(hint[i]) == b)
    m.minimize(z)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = float(time_limit)
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is not None:
            return hint
        raise ValueError(f"cpsat found no packing within capacity {capacity!r} in the time limit "
                         f"({solver.status_name(status)})")
    bins = np.empty(n, np.int64)
    for i in range(n):
        bins[i] = next(b for b in range(k) if solver.boolean_value(x[i][b]))
    if hint is not None and bin_loads(c, hint, k).max() < bin_loads(c, bins, k).max():
        return hint
    return bins


METHODS["cpsat"] = lambda c, k, cap: _cpsat(c, k, cap, False, 2.0)


# --------------------------------------------------------------------------------------------
# Bin count minimisation under a capacity (the token-budget planner's engine)
# --------------------------------------------------------------------------------------------


def first_fit_decreasing(sizes: Sequence[int] | np.ndarray, capacity: int,
                         tiebreak: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Pack integer ``sizes`` (each <= ``capacity``) into as few bins of ``capacity`` as first-fit
    decreasing finds; returns ``(bin id per item, number of bins)``.

    FFD fills one bin at a time: it opens a bin with the largest item left, then keeps adding the
    largest item left that still fits. That form runs in O(n log n) without scanning the open
    bins: the items sit in ascending order, a bisection finds the largest size that fits and a
    union-find over taken positions ("nearest free position at or below") skips the items already
    packed. Equal sizes are taken in ``tiebreak`` order, lowest first (default: item order), so
    the caller decides which of them share a bin. Bins are numbered in the order they are opened;
    deterministic. Zero-size items join the first bin that has room (any bin has).
    """
    c = np.asarray(sizes)
    if c.ndim != 1:
        raise ValueError(f"sizes must be 1-D, got shape {c.shape}")
    cap = int(capacity)
    n = int(c.size)
    if n == 0:
        return np.zeros(0, np.int64), 0
    c = c.astype(np.int64)
    if int(c.min()) < 0:
        raise ValueError(f"sizes must be >= 0; item {int(np.argmin(c))} is {int(c.min())}")
    over = np.flatnonzero(c > cap)
    if over.size:
        raise ValueError(f"item {int(over[0])} (size {int(c[over[0]])}) exceeds capacity {cap} on its own")
    tb = np.arange(n) if tiebreak is None else np.asarray(tiebreak)
    # Ascending by size; among equal sizes the lowest tiebreak is taken first, i.e. sits highest.
    order = np.lexsort((-tb.astype(np.int64), c))
    a = c[order].tolist()
    # par[p] (p = position + 1, 0 = none): a pointer towards the highest free position <= p.
    par = list(range(n + 1))
    out = [0] * n
    b = 0
    p = n
    while True:
        r = p
        while par[r] != r:
            r = par[r]
        while par[p] != r:
            par[p], p = r, par[p]
        p = r
        if not p:
            break
        room = cap - a[p - 1]
        par[p] = p - 1
        out[p - 1] = b
        while True:
            q = bisect_right(a, room)
            if not q:
                break
            r = q
            while par[r] != r:
                r = par[r]
            while par[q] != r:
                par[q], q = r, par[q]
            q = r
            if not q:
                break
            room -= a[q - 1]
            par[q] = q - 1
            out[q - 1] = b
        b += 1
    bins = np.empty(n, np.int64)
    bins[order] = out
    return bins, b
