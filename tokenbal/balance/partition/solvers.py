"""Bin packing: split item costs into bins with near-equal sums.

Two entry points, both pure numpy and deterministic:

* :func:`partition` — one problem: ``costs`` into ``num_bins`` bins. ``method`` picks the
  algorithm from :data:`METHODS`: ``"lpt"`` (the ``"auto"`` default: fast, and within 4/3 of
  optimal), ``"kk"`` (Karmarkar–Karp; what verl uses per step) and ``"cpsat"`` (exact-ish, small
  problems); :func:`refine_partition` is a swap-based polish for any of them.
* :func:`fill_windows` — many independent problems at once, each a *window* of consecutive
  training steps × ranks with a per-step item count (or a per-rank token capacity). This is the
  engine of :mod:`tokenbal.balance.plan`; it is vectorised across windows, and with ``batch`` it places
  many items per window per round, so an epoch of a million samples on 512 ranks is planned in
  under a second (scripts/bench_balance.py, docs/bench/balance.md).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["METHODS", "partition", "refine_partition", "refine_stages", "refine_stages_many",
           "swap_stages_across_steps", "stage_objective", "bin_loads", "fill_windows",
           "first_fit_decreasing"]

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


# refine_stages stops once a step is within this fraction of its lower bound: the last 0.1% is far
# below the noise of any real step time and costs most of the rounds.
_STAGE_TOLERANCE = 1e-3
# swap_stages_across_steps: items of the following steps a bottleneck item may be swapped with.
_SWAP_PARTNERS = 1024
# swap_stages_across_steps, first pass (_level_window): rounds of many disjoint swaps per window.
_LEVEL_ROUNDS = 16
# A step's target in a stage: its mean plus 8/10 of (max - mean), i.e. only the bins near the max.
_LEVEL_TARGET = (8, 10)
# Candidates per round for a bin over its target in stage k: for each of its items, this many items
# of about the same total (same bucket: 16 per octave, ~4%) with less of stage k ...
_LEVEL_SIMILAR = 2
# ... and every item pair with the bins that have the most room in stage k, about this many pairs.
_LEVEL_ROOMY_PAIRS = 16


def stage_objective(stage_costs: np.ndarray, bins: np.ndarray, num_bins: int) -> int:
    """``Σ_k max_b load[b, k]``: the time of a step whose K stages each end in a barrier."""
    c = np.asarray(stage_costs, np.int64)
    loads = np.zeros((int(num_bins), c.shape[1]), np.int64)
    np.add.at(loads, np.asarray(bins, np.int64), c)
    return int(loads.max(0).sum()) if num_bins else 0


def refine_stages(stage_costs: np.ndarray, bins: np.ndarray, num_bins: int, *,
                  capacity: int | None = None, capacity_costs: np.ndarray | None = None,
                  equal_counts: bool = False, max_rounds: int | None = None) -> np.ndarray:
    """Local search for steps made of K synchronised stages (ViT, then LLM, under FSDP).

    ``stage_costs`` is (n, K) int64. A step takes ``Σ_k max_b load[b, k]`` when every stage ends in a
    collective (each FSDP layer's all-gather waits for the slowest rank), not the largest row sum: a
    rank heavy in images and one heavy in text, equal in total, each wait for the other once.
    Every round applies the move or swap that lowers that objective most — an item out of a bin
    that is some stage's bottleneck, swapped with any item of another bin or moved to it — until
    none does or the step is within 0.1% of its lower bound. Strictly decreasing, so it stops;
    deterministic (first best in item order).

    Swaps only with ``equal_counts``; a move never empties a bin; with ``capacity`` no bin's sum of
    ``capacity_costs`` (default: the row sums) goes over it. :func:`refine_stages_many` does many
    independent steps at once (what the planner uses).
    """
    c = np.asarray(stage_costs, np.int64)
    if c.ndim != 2:
        raise ValueError(f"stage_costs must be (n, K), got shape {c.shape}")
    tot = c.sum(1) if capacity_costs is None else np.asarray(capacity_costs, np.int64)
    out = refine_stages_many(c[None], np.asarray(bins, np.int64)[None], int(num_bins), capacity=capacity,
                             capacity_costs=tot[None], equal_counts=equal_counts, max_rounds=max_rounds)
    return out[0]


def refine_stages_many(stage_costs: np.ndarray, bins: np.ndarray, num_bins: int, *,
                       capacity: int | None = None, capacity_costs: np.ndarray | None = None,
                       equal_counts: bool = False, max_rounds: int | None = None) -> np.ndarray:
    """:func:`refine_stages` on G independent steps at once: ``stage_costs`` (G, M, K), ``bins``
    (G, M) with -1 for padding (an absent item). Every round takes each unfinished step's best move
    in one vectorised pass, so the cost is rounds × passes, not steps × rounds × numpy calls."""
    c = np.asarray(stage_costs, np.int64)
    bins = np.asarray(bins, np.int64).copy()
    G, M, K = c.shape
    R = int(num_bins)
    if G == 0 or M < 2 or R < 2:
        return bins
    valid = bins >= 0
    c = np.where(valid[:, :, None], c, 0)
    tot = c.sum(2) if capacity_costs is None else np.where(valid, np.asarray(capacity_costs, np.int64), 0)
    cap = None if capacity is None else int(capacity)
    rows = np.arange(G)[:, None]
    home_of = np.where(valid, bins, 0)
    loads = np.zeros((G, R, K), np.int64)
    np.add.at(loads, (np.broadcast_to(rows, bins.shape)[valid], home_of[valid]), c[valid])
    tload = np.zeros((G, R), np.int64)
    np.add.at(tload, (np.broadcast_to(rows, bins.shape)[valid], home_of[valid]), tot[valid])
    counts = np.zeros((G, R), np.int64)
    np.add.at(counts, (np.broadcast_to(rows, bins.shape)[valid], home_of[valid]), 1)
    # Partners: every item (a swap), then one empty pseudo-item per bin (a move).
    pc = np.concatenate([c, np.zeros((G, R, K), np.int64)], 1)
    pt = np.concatenate([tot, np.zeros((G, R), np.int64)], 1)
    P = M + R
    is_move = np.r_[np.zeros(M, bool), np.ones(R, bool)]
    # No assignment beats the stage means or the largest item of a stage; close enough, stop.
    bound = np.maximum(-(-c.sum(1) // R), c.max(1)).sum(1) * (1 + _STAGE_TOLERANCE)
    active = np.flatnonzero(loads.max(1).sum(1) > bound)
    limit = 4 * M + R if max_rounds is None else int(max_rounds)
    never = np.iinfo(np.int64).max
    # Chunks of steps bound the (steps, items, partners, stages) temporaries to a few tens of MB.
    chunk = max(1, 4_000_000 // (M * P * K))
    for _ in range(limit):
        if not active.size:
            break
        still = []
        for lo in range(0, len(active), chunk):
            g = active[lo:lo + chunk]
            still.append(g[_best_moves(g, c, tot, bins, valid, loads, tload, counts, pc, pt, is_move, R, P,
                                       cap, equal_counts, never)])
        active = np.concatenate(still)
        if active.size:
            active = active[loads[active].max(1).sum(1) > bound[active]]
    return bins


def _best_moves(g: np.ndarray, c, tot, bins, valid, loads, tload, counts, pc, pt, is_move, R: int, P: int,
                cap: int | None, equal_counts: bool, never: int) -> np.ndarray:
    """One round of :func:`refine_stages_many` for steps ``g``: apply each step's best improving
    move or swap in place; returns a bool mask of the steps that improved."""
    L = loads[g]                                                    # (g, R, K)
    n_g = len(g)
    objective = L.max(1).sum(1)
    # Only moving load off a stage's fullest bin can lower that stage's max.
    is_source = np.zeros((n_g, R), bool)
    is_source[np.arange(n_g)[:, None], L.argmax(1)] = True
    b = bins[g]
    home_all = np.where(valid[g], b, 0)
    from_source = valid[g] & np.take_along_axis(is_source, home_all, 1)
    Q = int(from_source.sum(1).max())
    if Q == 0:
        return np.zeros(n_g, bool)
    sel = np.argsort(~from_source, axis=1, kind="stable")[:, :Q]   # source items first, in item order
    sel_ok = np.take_along_axis(from_source, sel, 1)
    home = np.take_along_axis(home_all, sel, 1)                    # (g, Q)
    ci = np.take_along_axis(c[g], sel[:, :, None], 1)              # (g, Q, K)
    pb = np.concatenate([home_all, np.broadcast_to(np.arange(R), (n_g, R))], 1)   # (g, P)
    p_ok = np.concatenate([valid[g], np.ones((n_g, R), bool)], 1)
    # The largest load of every stage outside bins a and b: the first of the top three that is
    # neither (padding bins -1 with load 0 never exceed a real maximum).
    order = np.argsort(-L, axis=1, kind="stable")[:, :3]
    topv = np.take_along_axis(L, order, 1)
    if R < 3:
        order = np.concatenate([order, np.full((n_g, 3 - R, L.shape[2]), -1)], 1)
        topv = np.concatenate([topv, np.zeros((n_g, 3 - R, L.shape[2]), np.int64)], 1)
    a4 = home[:, :, None, None]
    b4 = pb[:, None, :, None]
    t = [order[:, i][:, None, None, :] for i in range(3)]
    v = [topv[:, i][:, None, None, :] for i in range(3)]
    other = np.where((t[0] != a4) & (t[0] != b4), v[0], np.where((t[1] != a4) & (t[1] != b4), v[1], v[2]))
    d = pc[g][:, None, :, :] - ci[:, :, None, :]                    # what bin a gains, bin b loses
    La = np.take_along_axis(L, home[:, :, None], 1)[:, :, None, :]
    Lb = np.take_along_axis(L, pb[:, :, None], 1)[:, None, :, :]
    value = np.maximum(other, np.maximum(La + d, Lb - d)).sum(3)   # (g, Q, P)
    ok = sel_ok[:, :, None] & p_ok[:, None, :] & (pb[:, None, :] != home[:, :, None])
    if equal_counts:
        ok &= ~is_move[None, None, :]
    else:
        ok &= ~is_move[None, None, :] | (np.take_along_axis(counts[g], home, 1) > 1)[:, :, None]
    if cap is not None:
        dt = pt[g][:, None, :] - np.take_along_axis(tot[g], sel, 1)[:, :, None]
        ok &= ((np.take_along_axis(tload[g], home, 1)[:, :, None] + dt <= cap)
               & (np.take_along_axis(tload[g], pb, 1)[:, None, :] - dt <= cap))
    value = np.where(ok, value, never).reshape(n_g, -1)
    best = value.argmin(1)
    better = value[np.arange(n_g), best] < objective
    gi = g[better]
    u, w = np.divmod(best[better], P)
    item = sel[better, u]
    src = home[better, u]
    dst = pb[better, w]
    swap = ~is_move[w]
    partner = np.where(swap, w, 0)
    # Steps are distinct, so these scatters never collide.
    bins[gi, item] = dst
    bins[gi[swap], partner[swap]] = src[swap]
    moved_c = c[gi, item] - np.where(swap[:, None], c[gi, partner], 0)
    moved_t = tot[gi, item] - np.where(swap, tot[gi, partner], 0)
    loads[gi, src] -= moved_c
    loads[gi, dst] += moved_c
    tload[gi, src] -= moved_t
    tload[gi, dst] += moved_t
    counts[gi, src] -= np.where(swap, 0, 1)
    counts[gi, dst] += np.where(swap, 0, 1)
    return better


def swap_stages_across_steps(stage_costs: np.ndarray, group: np.ndarray, bins: np.ndarray, window: np.ndarray,
                             num_bins: int, *, capacity: int | None = None,
                             capacity_costs: np.ndarray | None = None, rounds_per_group: int = 4,
                             level_rounds: int = _LEVEL_ROUNDS) -> tuple[np.ndarray, np.ndarray]:
    """Swap items between bins of the groups (steps) of the same window where that lowers
    ``Σ_group Σ_stage max_bin load``; returns the items' new ``(group, bins)``.

    :func:`refine_stages_many` can only re-split the samples a step already holds. With a couple
    of samples per rank those are fixed by the fill, which sorts by the summed cost, and the stages
    stay unbalanced. Two passes per window:

    1. ``level_rounds`` rounds of many swaps at once (:func:`_level_window`): every bin near its
       step's maximum in some stage trades one item with a bin of any step of the window, each bin in
       at most one swap per round, no bin above its step's maximum afterwards. Wide steps need this:
       with hundreds of ranks, dozens of bins sit within a few percent of a stage's maximum, and the
       maximum only drops once all of them do.
    2. The step that is furthest above its ideal (perfectly balanced stages) gives one of its
       bottleneck items for an item of another step, whichever swap lowers the two steps' objectives
       most (by at least 0.1% of the step); at most ``rounds_per_group`` swaps per group
       (:func:`_swap_window`). With few ranks this exact search finds what the first pass misses.

    One item for one item: every bin keeps its item count, so every count guarantee of the plan
    holds; with ``capacity`` no bin's sum of ``capacity_costs`` (default: the row sums) goes over
    it. The sum of the objectives never increases. Deterministic.
    """
    c = np.asarray(stage_costs, np.int64)
    group = np.asarray(group, np.int64).copy()
    bins = np.asarray(bins, np.int64).copy()
    window = np.asarray(window, np.int64)
    R = int(num_bins)
    if R < 2 or len(c) < 2:
        return group, bins
    tot = c.sum(1) if capacity_costs is None else np.asarray(capacity_costs, np.int64)
    never = np.iinfo(np.int64).max
    order = np.argsort(window, kind="stable")
    bounds = np.searchsorted(window[order], np.arange(int(window.max(initial=-1)) + 2))
    for w in range(len(bounds) - 1):
        idx = order[bounds[w]:bounds[w + 1]]
        if len(idx) < 2:
            continue
        g_ids, g_local = np.unique(group[idx], return_inverse=True)
        if len(g_ids) < 2:
            continue
        new_g, new_b = _level_window(c[idx], tot[idx], g_local, bins[idx], len(g_ids), R, capacity,
                                     int(level_rounds))
        new_g, new_b = _swap_window(c[idx], tot[idx], new_g, new_b, len(g_ids), R, capacity,
                                    rounds_per_group * len(g_ids), never)
        group[idx] = g_ids[new_g]
        bins[idx] = new_b
    return group, bins


def _swap_window(c: np.ndarray, tot: np.ndarray, g: np.ndarray, b: np.ndarray, G: int, R: int,
                 capacity: int | None, max_rounds: int, never: int) -> tuple[np.ndarray, np.ndarray]:
    n, K = c.shape
    g, b = g.copy(), b.copy()
    loads = np.zeros((G, R, K), np.int64)
    np.add.at(loads, (g, b), c)
    tload = np.zeros((G, R), np.int64)
    np.add.at(tload, (g, b), tot)
    # How far a step is from perfectly balanced stages. Not its own lower bound (largest item per
    # stage): a step at that bound can still gain by trading the item that sets it.
    ideal = (-(-loads.sum(1) // R)).sum(1)
    obj = loads.max(1).sum(1)
    # The two largest loads of every (step, stage), kept up to date for the steps a swap touches.
    top = np.argsort(-loads, axis=1, kind="stable")[:, :2]                     # (G, 2, K)
    topv = np.take_along_axis(loads, top, 1)
    # Partners come from the next few steps of the window (cyclically), at most _SWAP_PARTNERS
    # items: enough choice for a step's bottleneck, and a round costs O(partners), not O(window).
    by_group = np.argsort(g, kind="stable")
    pos = np.empty(n, np.int64)
    pos[by_group] = np.arange(n)
    starts = np.searchsorted(g[by_group], np.arange(G + 1))
    per_group = max(1, int(np.diff(starts).max(initial=1)))
    reach = int(min(G - 1, max(1, _SWAP_PARTNERS // per_group)))
    stuck = np.zeros(G, bool)
    for _ in range(max_rounds):
        excess = np.where(stuck, -1, obj - ideal)
        s = int(np.argmax(excess))
        if excess[s] <= _STAGE_TOLERANCE * ideal[s]:
            break
        L = loads[s]
        hot = np.zeros(R, bool)
        hot[L.argmax(0)] = True
        mine = by_group[starts[s]:starts[s + 1]]
        mine = mine[hot[b[mine]]]
        # Steps s+1 .. s+reach, cyclically: one or two runs of by_group (groups are contiguous in it).
        end = s + 1 + reach
        theirs = by_group[starts[s + 1]:starts[min(end, G)]]
        if end > G:
            theirs = np.concatenate([theirs, by_group[:starts[end - G]]])
        gj, bj = g[theirs], b[theirs]
        other_j = np.where(top[gj, 0] != bj[:, None], topv[gj, 0], topv[gj, 1])          # (nj, K)
        other_i = np.where(top[s, 0][None, :] != b[mine][:, None], topv[s, 0][None, :], topv[s, 1][None, :])
        d = c[theirs][None, :, :] - c[mine][:, None, :]                       # step s's bin gains d
        new_s = np.maximum(other_i[:, None, :], L[b[mine]][:, None, :] + d).sum(2)
        new_j = np.maximum(other_j[None, :, :], loads[gj, bj][None, :, :] - d).sum(2)
        delta = new_s - obj[s] + new_j - obj[gj][None, :]
        if capacity is not None:
            dt = tot[theirs][None, :] - tot[mine][:, None]
            ok = (tload[s, b[mine]][:, None] + dt <= capacity) & (tload[gj, bj][None, :] - dt <= capacity)
            delta = np.where(ok, delta, never)
        best = int(np.argmin(delta)) if delta.size else 0
        # A swap worth less than the tolerance of refine_stages is not worth a round: with many
        # ranks they are many and tiny (the step's largest bin down to its second largest).
        if not delta.size or delta.flat[best] >= -_STAGE_TOLERANCE * ideal[s]:
            stuck[s] = True
            continue
        u, v = divmod(best, delta.shape[1])
        i, j = int(mine[u]), int(theirs[v])
        t = int(g[j])
        for item, frm, to in ((i, (s, b[i]), (t, b[j])), (j, (t, b[j]), (s, b[i]))):
            loads[frm] -= c[item]
            loads[to] += c[item]
            tload[frm] -= tot[item]
            tload[to] += tot[item]
        g[i], g[j] = t, s
        b[i], b[j] = b[j], b[i]
        # Group sizes do not change, so the two items just trade places in by_group.
        pi, pj = pos[i], pos[j]
        by_group[pi], by_group[pj] = j, i
        pos[i], pos[j] = pj, pi
        for q in (s, t):
            order = np.argsort(-loads[q], axis=0, kind="stable")[:2]
            top[q] = order
            topv[q] = np.take_along_axis(loads[q], order, 0)
            obj[q] = loads[q].max(0).sum()
            ideal[q] = (-(-loads[q].sum(0) // R)).sum()
        # The other step changed: it may have become improvable again.
        stuck[t] = False
    return g, b


def _level_window(c: np.ndarray, tot: np.ndarray, g: np.ndarray, b: np.ndarray, G: int, R: int,
                  capacity: int | None, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounds of many disjoint one-for-one swaps among the G·R bins of a window (any two bins, of
    the same step or not); returns the items' new (group, bin).

    A step's maximum in a stage only drops once *every* bin at it drops, and with many ranks many
    bins are close to it, so a swap that lowers one of them gains nothing on its own: the exact
    search of :func:`_swap_window` stops there. Here each round sets, per step and stage, a target
    near the maximum (``_LEVEL_TARGET``) and lowers ``Σ_bins Σ_stages max(0, load - target)²``
    instead, which every bin brought under the target lowers, with many swaps at once: for each bin
    over a target, the best candidate swap (items of about the same total with less of that stage,
    and the bins with the most room in it); then a subset in which no bin appears twice, so the
    swaps do not interact. No bin may end above its step's maximum of any stage (as of the round's
    start), hence no step's objective ever rises. Deterministic: stable sorts, ties to the first
    candidate, and the float64 penalty is computed elementwise in a fixed order.
    """
    n, K = c.shape
    nb = G * R
    cost = np.ascontiguousarray(c.T)                     # (K, n): stage-major, one row per stage
    home = g * R + b                                       # every item's bin
    counts = np.bincount(home, minlength=nb)               # never changes: swaps are one for one
    first_slot = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot_item = np.argsort(home, kind="stable")            # the items of bin 0, then of bin 1, ...
    slot_of = np.empty(n, np.int64)
    slot_of[slot_item] = np.arange(n)
    loads = np.zeros((K, nb), np.int64)
    for k in range(K):
        np.add.at(loads[k], home, cost[k])
    tload = np.zeros(nb, np.int64)
    np.add.at(tload, home, tot)
    step_of_bin = np.arange(nb) // R
    # Swapping items of about the same total keeps the fill's balance of the totals and moves only
    # the stages' shares: per stage, the items by (total bucket, stage cost). frexp is exact, so the
    # buckets (16 per octave) are the same on every machine.
    mantissa, exponent = np.frexp(c.sum(1).astype(np.float64))
    bucket = exponent.astype(np.int64) * 32 + (mantissa * 32).astype(np.int64)
    by_stage = [np.lexsort((cost[k], bucket)) for k in range(K)]
    place = np.empty((K, n), np.int64)
    for k in range(K):
        place[k, by_stage[k]] = np.arange(n)
    bucket_first = np.searchsorted(bucket[by_stage[0]], bucket)   # same bucket order for every k
    roomy_bins = max(1, int(_LEVEL_ROOMY_PAIRS // max(1.0, float(counts.mean())) ** 2))
    num, den = _LEVEL_TARGET
    for rnd in range(rounds):
        per_step = loads.reshape(K, G, R)
        top = per_step.max(2)
        mean = -(-per_step.sum(2) // R)
        over = loads - (mean + (top - mean) * num // den)[:, step_of_bin]
        room = top[:, step_of_bin] - loads               # what a bin may gain without raising its step's max
        excess = np.maximum(over, 0).astype(np.float64)
        penalty = (excess * excess).sum(0)
        # A different slice of the candidates every round (golden-ratio steps through [0, 1)).
        shift = rnd * 40503 % 65536
        cand_i, cand_j = [], []
        for k in range(K):
            src = np.flatnonzero(over[k] > 0)
            if not src.size:
                continue
            src = src[np.argsort(-over[k, src], kind="stable")]
            # Items of the same bucket with less of stage k, spread over all of them.
            n_src = counts[src]
            items = slot_item[np.repeat(first_slot[src] - np.cumsum(n_src) + n_src, n_src)
                              + np.arange(n_src.sum())]
            lower = place[k, items] - bucket_first[items]
            items, lower = items[lower > 0], lower[lower > 0]
            offsets = (np.arange(_LEVEL_SIMILAR)[None, :] * lower[:, None] // _LEVEL_SIMILAR
                       + shift * lower[:, None] // 65536) % lower[:, None]
            cand_i.append(np.repeat(items, _LEVEL_SIMILAR))
            cand_j.append(by_stage[k][bucket_first[items][:, None] + offsets].ravel())
            # Every item pair with the bins that have the most room in stage k: the worst source
            # gets the roomiest bins, the next source the next ones.
            roomy = np.argsort(over[k], kind="stable")
            a = np.repeat(src, roomy_bins)
            bb = roomy[(np.arange(len(a)) + rnd * roomy_bins) % nb]
            pairs = counts[a] * counts[bb]
            u, v = np.divmod(np.arange(pairs.sum()) - np.repeat(np.cumsum(pairs) - pairs, pairs),
                             np.repeat(counts[bb], pairs))
            cand_i.append(slot_item[np.repeat(first_slot[a], pairs) + u])
            cand_j.append(slot_item[np.repeat(first_slot[bb], pairs) + v])
        if not cand_i:
            break
        i, j = np.concatenate(cand_i), np.concatenate(cand_j)
        A, B = home[i], home[j]
        # First the cheap test that most candidates fail (a bin would rise above its step's max),
        # then the penalty of the rest.
        d = [cost[k][j] - cost[k][i] for k in range(K)]    # bin A gains d, bin B loses it
        ok = A != B
        for k in range(K):
            ok &= (d[k] <= room[k][A]) & (d[k] >= -room[k][B])
        if capacity is not None:
            dt = tot[j] - tot[i]
            ok &= (tload[A] + dt <= capacity) & (tload[B] - dt <= capacity)
        ok = np.flatnonzero(ok)
        i, j, A, B = i[ok], j[ok], A[ok], B[ok]
        gain = -(penalty[A] + penalty[B])
        for k in range(K):
            xa = np.maximum(over[k][A] + d[k][ok], 0).astype(np.float64)
            xb = np.maximum(over[k][B] - d[k][ok], 0).astype(np.float64)
            gain += xa * xa + xb * xb
        sel = np.flatnonzero(gain < 0)
        if not sel.size:
            continue
        # Each source bin's best candidate (first in candidate order on ties) ...
        sel = sel[np.lexsort((gain[sel], A[sel]))]
        sel = sel[np.concatenate([[True], A[sel][1:] != A[sel][:-1]])]
        # ... then a subset in which no bin appears twice: a candidate wins when it is the best of
        # every candidate that touches either of its bins; a few passes over the rest.
        rank = np.empty(len(sel), np.int64)
        rank[np.lexsort((A[sel], gain[sel]))] = np.arange(len(sel))
        a, bb = A[sel], B[sel]
        alive = np.ones(len(sel), bool)
        taken = np.zeros(nb, bool)
        won = np.zeros(len(sel), bool)
        for _ in range(3):
            alive &= ~taken[a] & ~taken[bb]
            if not alive.any():
                break
            best = np.full(nb, len(sel))
            np.minimum.at(best, a[alive], rank[alive])
            np.minimum.at(best, bb[alive], rank[alive])
            win = alive & (best[a] == rank) & (best[bb] == rank)
            won |= win
            taken[a[win]] = taken[bb[win]] = True
            alive &= ~win
        sel = sel[won]
        si, sj, sa, sb = i[sel], j[sel], A[sel], B[sel]
        moved = cost[:, sj] - cost[:, si]
        loads[:, sa] += moved
        loads[:, sb] -= moved
        tload[sa] += tot[sj] - tot[si]
        tload[sb] -= tot[sj] - tot[si]
        home[si], home[sj] = sb, sa
        pi, pj = slot_of[si], slot_of[sj]
        slot_item[pi], slot_item[pj] = sj, si
        slot_of[si], slot_of[sj] = pj, pi
    return home // R, home % R


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
# Batched level-fill over windows of steps (the planner's engine)
# --------------------------------------------------------------------------------------------

_BIG = np.iinfo(np.int64).max // 4


def fill_windows(costs: np.ndarray, caps: np.ndarray, num_ranks: int, *,
                 capacity: int | None = None, force_nonempty: bool = False, batch: int = 1,
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

    ``batch > 1`` (only without ``capacity`` and ``force_nonempty``): place up to ``batch`` items
    of every window per round, the round's items (largest first) into the ``batch`` best bins by
    the same key taken once per round (deficit judged against the round's largest item), at most
    one item per bin and no more than a step's remaining cap per step. ``batch=1`` is the rule
    above exactly; larger batches trade a little balance for far fewer sequential rounds.
    """
    if batch > 1 and capacity is None and not force_nonempty:
        return _fill_windows_batched(costs, caps, int(num_ranks), int(batch))
    G, M = costs.shape
    W = caps.shape[1]
    R = int(num_ranks)
    # Flat views: step (g, w) is row g*W + w, bin (g, w, r) is g*W*R + w*R + r. 1-D takes and puts
    # cost a fraction of 2-D fancy indexing, and this loop runs once per item of a window.
    loads = np.zeros((G * W, R), np.int64)
    minload = np.zeros((G, W), np.int64)      # least loaded bin of each step (== largest gap)
    minbin = np.zeros(G * W, np.int64)
    smax = np.zeros((G, W), np.int64)         # fullest bin of each step
    scnt = np.zeros((G, W), np.int64)
    caps = caps.astype(np.int64)
    ml_flat, sm_flat, sc_flat = minload.reshape(-1), smax.reshape(-1), scnt.reshape(-1)
    rows = np.arange(G)
    base = rows * W
    step_out = np.full((G, M), -1, np.int64)
    rank_out = np.full((G, M), -1, np.int64)
    failed = np.zeros(G, bool)
    any_failed = False
    if force_nonempty:
        empty_bins = (caps > 0).sum(1) * R
        left = (costs > 0).sum(1)
    big = np.int64(_BIG)
    for j in range(M):
        x = costs[:, j]
        valid = x > 0
        if any_failed:
            valid &= ~failed
        if not valid.any():
            break
        open_ = scnt < caps
        gap = smax - minload
        xcol = x[:, None]
        lpt_key = np.where(open_ if capacity is None else open_ & (minload + xcol <= capacity), minload, big)
        key = np.where(open_ & (gap >= xcol), -gap, lpt_key)
        if force_nonempty:
            forced = left <= empty_bins
            if forced.any():
                key[forced] = np.where(open_[forced] & (minload[forced] == 0), 0, big)
        s = key.argmin(1)
        flat = base + s
        fits = key.reshape(-1)[flat] < big
        place = valid & fits
        newly = valid & ~fits
        if newly.any():
            failed |= newly
            any_failed = True
        r = minbin[flat]
        step_out[:, j] = np.where(place, s, -1)
        rank_out[:, j] = np.where(place, r, -1)
        lf = loads.reshape(-1)
        cell = flat * R + r
        new_load = lf[cell] + np.where(place, x, 0)
        lf[cell] = new_load
        sm_flat[flat] = np.maximum(sm_flat[flat], new_load)
        sc_flat[flat] += place
        if force_nonempty:
            empty_bins -= place & (new_load == x)
            left -= valid
        seg = loads[flat]                                     # (G, R): the chosen steps' bins
        mb = seg.argmin(1)
        minbin[flat] = mb
        ml_flat[flat] = seg[rows, mb]
    return step_out, rank_out, failed


def _fill_windows_batched(costs: np.ndarray, caps: np.ndarray, R: int, P: int
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`fill_windows` placing up to ``P`` items per window per round (see its docstring).

    Within a step both keys grow with the bin's load (deficit key = load - step max, LPT key =
    load), so ranking every bin of a window by one int64 key reproduces the one-at-a-time choice
    for the round's first item and approximates it for the rest.
    """
    G, M = costs.shape
    W = caps.shape[1]
    nb = W * R
    caps = caps.astype(np.int64)
    nitems = (costs > 0).sum(1)
    total = int(costs.sum(1).max(initial=0))
    # Key of an open step's bin in [1, 2 * t + 1] (t = total >> shift); a closed step's bins are
    # pushed past 3 * t + 4. Times nb plus the bin index makes every key unique, so ties go to the
    # lowest step, then the lowest rank, as in the exact loop. Large windows (scaled costs are
    # tokens × items per window) would overflow int64: the key then drops `shift` low bits of the
    # loads, a 2**shift / (items + 1) token resolution, while loads themselves stay exact.
    shift = 0
    while (4 * (total >> shift) + 5) * nb >= 2**62:
        shift += 1
    t = total >> shift
    closed_from = np.int64((3 * t + 4) * nb)
    loads = np.zeros((G, W, R), np.int64)
    lflat = loads.reshape(-1)
    # lkey = (load >> shift) * nb + bin index, kept up to date (only the round's bins change), so
    # a round builds its keys in three passes over the bins: this loop's cost is those passes
    # plus one argpartition per round.
    lkey = np.broadcast_to(np.arange(nb, dtype=np.int64).reshape(W, R), (G, W, R)).copy()
    kflat = lkey.reshape(-1)
    smax = np.zeros((G, W), np.int64)
    scnt = np.zeros((G, W), np.int64)
    step_out = np.full((G, M), -1, np.int64)
    rank_out = np.full((G, M), -1, np.int64)
    rows = np.arange(G)[:, None]
    k = min(P, nb)
    ar = np.arange(k)
    ptr = np.zeros(G, np.int64)
    failed = np.zeros(G, bool)
    while (ptr < nitems).any():
        col = ptr[:, None] + ar
        x = np.where(col < nitems[:, None], costs[rows, np.minimum(col, M - 1)], 0)
        # Deficit-eligible bins (gap to the step max >= the round's largest item, i.e. load <=
        # smax - x0) rank by load - smax, the others by load; closed steps last.
        elig = loads <= (smax - x[:, :1])[:, :, None]
        key2 = lkey + (np.where(scnt < caps, t + 1, 3 * t + 4) * nb)[:, :, None]
        np.subtract(key2, ((smax >> shift) * nb)[:, :, None], out=key2, where=elig)
        key2 = key2.reshape(G, nb)
        part = np.argpartition(key2, k - 1, axis=1)[:, :k] if k < nb else np.broadcast_to(ar, (G, nb))
        sel = np.take_along_axis(part, np.argsort(np.take_along_axis(key2, part, 1), axis=1), 1)
        st = sel // R
        # A step takes no more of the round's items than its remaining cap: occurrence number of
        # each step along the round (stable sort by step, position minus the group's start).
        oo = np.argsort(st, axis=1, kind="stable")
        sst = np.take_along_axis(st, oo, 1)
        start = np.ones(sst.shape, bool)
        start[:, 1:] = sst[:, 1:] != sst[:, :-1]
        first = np.maximum.accumulate(np.where(start, ar, 0), axis=1)
        occ = np.empty_like(sst)
        np.put_along_axis(occ, oo, ar - first, 1)
        ok = (occ < np.take_along_axis(caps - scnt, st, 1)) & (np.take_along_axis(key2, sel, 1) < closed_from)
        # Item i of the round goes to the i-th accepted bin.
        nplace = np.minimum(ok.sum(1), (x > 0).sum(1))
        dest = np.cumsum(ok, axis=1) - 1
        use = ok & (dest < nplace[:, None])
        gi = np.broadcast_to(rows, use.shape)[use]
        bi = sel[use]
        di = dest[use]
        ci = ptr[gi] + di
        xi = x[gi, di]
        si, ri = np.divmod(bi, R)
        cell = gi * nb + bi
        lflat[cell] += xi                     # bins are distinct within a round
        kflat[cell] = (lflat[cell] >> shift) * nb + bi
        step_out[gi, ci] = si
        rank_out[gi, ci] = ri
        np.maximum.at(smax, (gi, si), lflat[cell])
        np.add.at(scnt, (gi, si), 1)
        # A window whose open steps cannot take its next item (caps sum below its items) fails,
        # as in the exact loop; its remaining items stay unplaced (-1).
        stuck = (ptr < nitems) & (nplace == 0)
        failed |= stuck
        nitems[stuck] = ptr[stuck]
        ptr += nplace
    return step_out, rank_out, failed


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
