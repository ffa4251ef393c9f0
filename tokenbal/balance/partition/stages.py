"""Steps made of K synchronised stages (vision tower, then LLM, under FSDP): a step takes
``Σ_stage max_rank``. In-step refinement (:func:`refine_stages`, :func:`refine_stages_many`) and swaps
between the steps of a window (:func:`swap_stages_across_steps`), leveling swaps among all the
bins of many steps (:func:`level_stage_bins`), and the heaviest steps composed again from their pooled
samples (:func:`pool_heaviest_steps`); pure numpy, deterministic."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["stage_objective", "refine_stages", "refine_stages_many", "swap_stages_across_steps",
           "level_stage_bins", "pool_heaviest_steps"]

# refine_stages stops once a step is within this fraction of its lower bound: the last 0.1% is far
# below the noise of any real step time and costs most of the rounds.
_STAGE_TOLERANCE = 1e-3
# refine_stages_many: in a bin with more items than this, only its largest this many take part (token-
# budget steps of many small samples; count mode has fewer per rank and is unaffected).
_CROWDED_ITEMS = 8
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
# pool_heaviest_steps: the pools tried (the h heaviest steps, for each h here, at most _POOL_ITEMS
# samples), the directions their samples are sorted along, and the leveling of a pool (rounds, capped
# at _POOL_WORK samples x rounds, and patience). 4,096 ranks, 24 steps, draw 9 (prototype, pools of 2
# to 8, 512 rounds, patience 128): 1.1812 -> 1.1172 in ~23 s; pools of 2 / 4 / 8, 128 rounds, patience
# 32: 1.1193 in 2.7 s. 512 ranks, 40 steps, FLOPs, draws 19 / 2: 128 rounds, patience 32: 1.0406 /
# 1.0505; 512 rounds, patience 64: 1.0386 / 1.0495, ~1-2 s more. A pool whose new bins start more than
# _POOL_SLACK over the steps' time is not leveled (the winners started at most 8 % over).
_POOL_STEPS = (2, 4, 8, 16)
_POOL_ITEMS = 1 << 16
_POOL_DIRECTIONS = 19
_POOL_ROUNDS = 512
_POOL_WORK = 1 << 23
_POOL_PATIENCE = 64
_POOL_SLACK = (1, 10)
# PLAN_VERSION 15 (issue 49): every pool levels its first _POOL_RACE rounds, then only the pool that gains
# most so far levels the rest of its rounds (0: every pool all its rounds, version 14). The pools are
# nested (the heaviest 2 of the heaviest 4 ...), so most of their rounds repeat one another's work.
# Median figure version 14 -> 15 (scripts/bench_balance.py --mixture-points 8,64,512, 20 draws): square
# 1.0184 / 1.0424 / 1.0936 -> 1.0184 / 1.0417 / 1.0936, FLOPs 1.0152 / 1.0329 / 1.0642 -> 1.0152 / 1.0324 /
# 1.0642; 4,096 ranks (4 square draws) 2.7599 -> 2.7593; 30k samples on 64 ranks (8 square draws) 1.0669 ->
# 1.0667, CPU 0.42 -> 0.34 s. With 32 race rounds the 64-rank square median rose 1.0424 -> 1.0450 (+0.25 %).
# See docs/BENCHMARKS.md, "Issue 49 (part 5)".
_POOL_RACE = 64
# What a leveling round costs at least, in samples (PLAN_VERSION 13): a round is ~100 numpy calls, as much
# as a round over ~1,000 samples, so a small pool's rounds are charged this to its work budget.
_ROUND_ITEMS = 1024
# The pools' race rounds are leveled side by side (_race_pools) for the smallest pools up to this many samples
# together: pools of 30k samples on 64 ranks (256-2,048 samples) race in 41 ms instead of 58 ms, while 4,096
# ranks' pools (16k samples and up) cost their size, not their calls (all together: 493 -> 562 ms).
_RACE_ITEMS = 1 << 15
# _level_window: count-mode bin pairs offering at least this many candidates are sieved by the room
# test before the candidates are listed (fewer numpy calls below it; the same candidates either way).
_GRID_SIEVE = 4096


# Work done so far, in item visits: each round of the in-step refinement adds its steps' items x partners,
# each swap-search round its sources x partners, each leveling round the items it levels. Only read (and
# reset) by tests that bound the planner's work (tests/tokenbal/balance/test_stage_work.py); never used
# to plan, so plans do not depend on it.
work_done = {"refine": 0, "swap": 0, "level": 0}
# _stable_argsort / _ranked: up to this many values a stable argsort itself is the faster way to the same
# answer (the unique-key sort and partitions pay off on larger arrays).
_SMALL_SORT = 512


def _last_sum(x: np.ndarray) -> np.ndarray:
    """``x.sum(-1)`` of an integer array whose last axis is short (the K stages), as K - 1 elementwise
    additions: numpy's reduction over a short last axis is tens of times slower. Integers: same values."""
    out = x[..., 0].astype(np.int64)
    for k in range(1, x.shape[-1]):
        out += x[..., k]
    return out


def _row_sums(x: np.ndarray) -> np.ndarray:
    """``x.sum(1)`` of an (n, K) cost array: :func:`_last_sum` for integers (the same values, faster),
    numpy's sum otherwise."""
    return _last_sum(x) if np.issubdtype(x.dtype, np.integer) else x.sum(1)


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
    tot = _last_sum(c) if capacity_costs is None else np.asarray(capacity_costs, np.int64)
    out = refine_stages_many(c[None], np.asarray(bins, np.int64)[None], int(num_bins), capacity=capacity,
                             capacity_costs=tot[None], equal_counts=equal_counts, max_rounds=max_rounds)
    return out[0]


def refine_stages_many(stage_costs: np.ndarray, bins: np.ndarray, num_bins: int, *,
                       capacity: int | None = None, capacity_costs: np.ndarray | None = None,
                       equal_counts: bool = False, max_rounds: int | None = None) -> np.ndarray:
    """:func:`refine_stages` on G independent steps at once: ``stage_costs`` (G, M, K), ``bins``
    (G, M) with -1 for padding (an absent item). Every round takes each unfinished step's best move
    in one vectorised pass, so the cost is rounds × passes, not steps × rounds × numpy calls.

    Steps of very different sizes (token-budget steps: a few giants or a thousand small samples) are
    refined in classes of like size, so a round costs each step its own size, not the largest
    step's (PLAN_VERSION 13; the same moves, fewer padding slots). In a bin with more than
    ``_CROWDED_ITEMS`` items only its largest ``_CROWDED_ITEMS`` are moved or swapped: with a dozen
    items per rank the largest carry the imbalance, and a round stays linear in the step."""
    c = np.asarray(stage_costs, np.int64)
    bins = np.asarray(bins, np.int64).copy()
    G, M, K = c.shape
    R = int(num_bins)
    if G == 0 or M < 2 or R < 2:
        return bins
    valid = bins >= 0
    limit = 4 * M + R if max_rounds is None else int(max_rounds)
    size = valid.sum(1)
    # Size classes (powers of two of the step's item count), each with its items first in item order.
    cls = np.frexp(np.maximum(size, 1).astype(np.float64))[1]
    if cls.min() == cls.max() or M <= 64:
        return _refine_stages_class(c, bins, valid, R, capacity, capacity_costs, equal_counts, limit)
    cap_costs = None if capacity_costs is None else np.asarray(capacity_costs, np.int64)
    for e in np.unique(cls):
        rows = np.flatnonzero(cls == e)
        cols = np.argsort(~valid[rows], axis=1, kind="stable")[:, :int(size[rows].max())]
        sub = _refine_stages_class(np.take_along_axis(c[rows], cols[:, :, None], 1),
                                   np.take_along_axis(bins[rows], cols, 1),
                                   np.take_along_axis(valid[rows], cols, 1), R, capacity,
                                   None if cap_costs is None
                                   else np.take_along_axis(cap_costs[rows], cols, 1),
                                   equal_counts, limit)
        out = bins[rows]
        np.put_along_axis(out, cols, sub, 1)
        bins[rows] = out
    return bins


def _refine_stages_class(c: np.ndarray, bins: np.ndarray, valid: np.ndarray, R: int, capacity: int | None,
                         capacity_costs: np.ndarray | None, equal_counts: bool, limit: int) -> np.ndarray:
    """:func:`refine_stages_many` on steps of one size class (``bins`` is updated and returned)."""
    G, M, K = c.shape
    if M < 2:
        return bins
    c = np.where(valid[:, :, None], c, 0)
    tot = _last_sum(c) if capacity_costs is None else np.where(valid, np.asarray(capacity_costs, np.int64), 0)
    cap = None if capacity is None else int(capacity)
    rows = np.arange(G)[:, None]
    home_of = np.where(valid, bins, 0)
    loads = np.zeros((G, R, K), np.int64)
    np.add.at(loads, (np.broadcast_to(rows, bins.shape)[valid], home_of[valid]), c[valid])
    tload = np.zeros((G, R), np.int64)
    np.add.at(tload, (np.broadcast_to(rows, bins.shape)[valid], home_of[valid]), tot[valid])
    counts = np.zeros((G, R), np.int64)
    np.add.at(counts, (np.broadcast_to(rows, bins.shape)[valid], home_of[valid]), 1)
    crowded = int(counts.max(initial=0)) > _CROWDED_ITEMS
    size = _last_sum(c)
    # No assignment beats the stage means or the largest item of a stage; close enough, stop.
    bound = np.maximum(-(-c.sum(1) // R), c.max(1)).sum(1) * (1 + _STAGE_TOLERANCE)
    active = np.flatnonzero(loads.max(1).sum(1) > bound)
    never = np.iinfo(np.int64).max
    # Chunks of steps bound the (steps, items, partners, stages) temporaries to a few tens of MB.
    width = min(M, R * _CROWDED_ITEMS) if crowded else M
    chunk = max(1, 4_000_000 // (width * (width + R) * K))
    limit = min(limit, 4 * width + R)                   # (no change where no bin is crowded)
    for _ in range(limit):
        if not active.size:
            break
        still = []
        work_done["refine"] += len(active) * width * (width + R)
        for lo in range(0, len(active), chunk):
            g = active[lo:lo + chunk]
            still.append(g[_best_moves(g, c, tot, size, bins, valid, loads, tload, counts, R, cap,
                                       equal_counts, never, crowded)])
        active = np.concatenate(still)
        if active.size:
            active = active[loads[active].max(1).sum(1) > bound[active]]
    return bins


def _best_moves(g: np.ndarray, c, tot, size, bins, valid, loads, tload, counts, R: int, cap: int | None,
                equal_counts: bool, never: int, crowded: bool) -> np.ndarray:
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
    eligible = valid[g]
    if crowded:
        # Each bin's _CROWDED_ITEMS largest items (ties in item order) take part, no others.
        M = b.shape[1]
        order = np.lexsort((np.broadcast_to(np.arange(M), b.shape), -size[g], np.where(eligible, b, R)),
                           axis=-1)
        sb = np.take_along_axis(np.where(eligible, b, R), order, 1)
        first = np.concatenate([np.ones((n_g, 1), bool), sb[:, 1:] != sb[:, :-1]], 1)
        start = np.maximum.accumulate(np.where(first, np.arange(M), 0), axis=1)
        keep = np.empty_like(eligible)
        np.put_along_axis(keep, order, np.arange(M) - start < _CROWDED_ITEMS, 1)
        eligible = eligible & keep
    from_source = eligible & np.take_along_axis(is_source, home_all, 1)
    Q = int(from_source.sum(1).max())
    if Q == 0:
        return np.zeros(n_g, bool)
    sel = np.argsort(~from_source, axis=1, kind="stable")[:, :Q]   # source items first, in item order
    sel_ok = np.take_along_axis(from_source, sel, 1)
    home = np.take_along_axis(home_all, sel, 1)                    # (g, Q)
    ci = np.take_along_axis(c[g], sel[:, :, None], 1)              # (g, Q, K)
    # Partners: the eligible items (a swap; in item order), then one empty pseudo-item per bin (a move).
    if crowded:
        E = int(eligible.sum(1).max())
        pidx = np.argsort(~eligible, axis=1, kind="stable")[:, :E]
    else:
        E = b.shape[1]
        pidx = np.broadcast_to(np.arange(E), (n_g, E))
    pc = np.concatenate([np.take_along_axis(c[g], pidx[:, :, None], 1),
                         np.zeros((n_g, R, c.shape[2]), np.int64)], 1)
    pt = np.concatenate([np.take_along_axis(tot[g], pidx, 1), np.zeros((n_g, R), np.int64)], 1)
    P = E + R
    is_move = np.r_[np.zeros(E, bool), np.ones(R, bool)]
    pb = np.concatenate([np.take_along_axis(home_all, pidx, 1), np.broadcast_to(np.arange(R), (n_g, R))], 1)
    p_ok = np.concatenate([np.take_along_axis(eligible, pidx, 1), np.ones((n_g, R), bool)], 1)
    order = np.argsort(-L, axis=1, kind="stable")[:, :3]
    topv = np.take_along_axis(L, order, 1)
    if R < 3:
        order = np.concatenate([order, np.full((n_g, 3 - R, L.shape[2]), -1)], 1)
        topv = np.concatenate([topv, np.zeros((n_g, 3 - R, L.shape[2]), np.int64)], 1)
    # The largest load of a stage outside bins a and b: the first of the top three bins (distinct)
    # that is neither. Per (step, source item): the first two of them that are not a (e0 and the loads
    # ev0, ev1), then per partner: ev0 unless e0 is b. The same values as testing all three against a, b.
    a3 = home[:, :, None]                                          # (g, Q, 1)
    t0, t1 = order[:, 0][:, None, :], order[:, 1][:, None, :]
    v0, v1, v2 = topv[:, 0][:, None, :], topv[:, 1][:, None, :], topv[:, 2][:, None, :]
    not_a = t0 != a3                                               # (g, Q, K)
    e0, ev0 = np.where(not_a, t0, t1), np.where(not_a, v0, v1)
    ev1 = np.where(not_a & (t1 != a3), v1, v2)
    La = np.take_along_axis(L, home[:, :, None], 1)                # (g, Q, K)
    Lb = np.take_along_axis(L, pb[:, :, None], 1)                  # (g, P, K)
    pb3 = pb[:, None, :]
    value = np.zeros((n_g, sel.shape[1], P), np.int64)             # (g, Q, P), summed stage by stage
    for k in range(L.shape[2]):
        other = np.where(e0[:, :, k, None] != pb3, ev0[:, :, k, None], ev1[:, :, k, None])
        d = pc[:, None, :, k] - ci[:, :, None, k]                  # what bin a gains, bin b loses
        value += np.maximum(other, np.maximum(La[:, :, k, None] + d, Lb[:, None, :, k] - d))
    ok = sel_ok[:, :, None] & p_ok[:, None, :] & (pb[:, None, :] != home[:, :, None])
    if equal_counts:
        ok &= ~is_move[None, None, :]
    else:
        ok &= ~is_move[None, None, :] | (np.take_along_axis(counts[g], home, 1) > 1)[:, :, None]
    if cap is not None:
        dt = pt[:, None, :] - np.take_along_axis(tot[g], sel, 1)[:, :, None]
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
    partner = np.where(swap, pidx[better][np.arange(len(gi)), np.minimum(w, E - 1)], 0)
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
                             level_rounds: int = _LEVEL_ROUNDS, max_swaps: int | None = None,
                             items_per_swap: float | None = None) -> tuple[np.ndarray, np.ndarray]:
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
       At most ``max_swaps`` per window, and with ``items_per_swap`` at most one per that many of the
       window's items (at least one): a swap search costs about the same whatever the window, so
       this keeps the pass linear in the epoch.

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
    tot = _last_sum(c) if capacity_costs is None else np.asarray(capacity_costs, np.int64)
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
        cap_swaps = max(1, int(len(idx) / items_per_swap)) if items_per_swap else 1 << 62
        new_g, new_b = _swap_window(c[idx], tot[idx], new_g, new_b, len(g_ids), R, capacity,
                                    min(rounds_per_group * len(g_ids), max_swaps or 1 << 62, cap_swaps),
                                    never)
        group[idx] = g_ids[new_g]
        bins[idx] = new_b
    return group, bins


def level_stage_bins(stage_costs: np.ndarray, group: np.ndarray, bins: np.ndarray, num_bins: int, *,
                     rounds: int = _LEVEL_ROUNDS, patience: int | None = None, capacity: int | None = None,
                     capacity_costs: np.ndarray | None = None,
                     stall: tuple[int, tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``rounds`` rounds of leveling swaps among all the bins of all the groups (steps of
    ``num_bins`` bins each), stopping early once ``Σ_group Σ_stage max_bin`` has not fallen for
    ``patience`` rounds; returns the items' new ``(group, bins)``.

    The first pass of :func:`swap_stages_across_steps` with every group in one window: per round,
    the bins near their step's maximum in some stage each trade one item for an item of about the
    same total with less of that stage, or with a bin that has room in it, many disjoint swaps at
    once (:func:`_level_window`). The maximum of a stage only falls once every bin at it does, so
    this keeps gaining over hundreds of rounds where single greedy swaps stop. One item for one
    item (every bin keeps its count, with ``capacity`` no bin's sum of ``capacity_costs`` goes over
    it); no step's ``Σ_stage max_bin`` ever rises. Deterministic.
    """
    c = np.asarray(stage_costs, np.int64)
    group = np.asarray(group, np.int64)
    bins = np.asarray(bins, np.int64)
    R = int(num_bins)
    if R < 2 or len(c) < 2 or rounds <= 0:
        return group.copy(), bins.copy()
    tot = _last_sum(c) if capacity_costs is None else np.asarray(capacity_costs, np.int64)
    g_ids, g_local = np.unique(group, return_inverse=True)
    new_g, new_b = _level_window(c, tot, g_local.reshape(-1), bins, len(g_ids), R, capacity, int(rounds),
                                 patience, stall)
    return g_ids[new_g], new_b


def _swap_window(c: np.ndarray, tot: np.ndarray, g: np.ndarray, b: np.ndarray, G: int, R: int,
                 capacity: int | None, max_rounds: int, never: int) -> tuple[np.ndarray, np.ndarray]:
    n, K = c.shape
    g, b = g.copy(), b.copy()
    loads = np.zeros((G, R, K), np.int64)
    np.add.at(loads, (g, b), c)
    flat_loads = loads.reshape(G * R, K)                                        # a view: follows loads
    tload = np.zeros((G, R), np.int64)
    np.add.at(tload, (g, b), tot)
    size = _last_sum(c)
    cost_t = np.ascontiguousarray(c.T)                                          # (K, n)
    # How far a step is from perfectly balanced stages. Not its own lower bound (largest item per
    # stage): a step at that bound can still gain by trading the item that sets it.
    ideal = (-(-loads.sum(1) // R)).sum(1)
    obj = loads.max(1).sum(1)
    # The two largest loads of every (step, stage), kept up to date for the steps a swap touches.
    top = np.argsort(-loads, axis=1, kind="stable")[:, :2]                     # (G, 2, K)
    topv = np.take_along_axis(loads, top, 1)
    top0, cols = top[:, 0], np.arange(K)                                        # (a view of top)
    both = np.arange(2)[:, None]
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
        if len(mine) > _CROWDED_ITEMS * K:
            # Crowded bins (token-budget steps of many small samples): each hot bin offers its
            # _CROWDED_ITEMS largest items (ties in item order), as in refine_stages_many.
            key = np.lexsort((mine, -size[mine], b[mine]))
            mine = mine[key]
            first = np.r_[True, b[mine][1:] != b[mine][:-1]]
            start = np.maximum.accumulate(np.where(first, np.arange(len(mine)), 0))
            mine = np.sort(mine[np.arange(len(mine)) - start < _CROWDED_ITEMS])
        # Steps s+1 .. s+reach, cyclically: one or two runs of by_group (groups are contiguous in it).
        end = s + 1 + reach
        theirs = by_group[starts[s + 1]:starts[min(end, G)]]
        if end > G:
            theirs = np.concatenate([theirs, by_group[:starts[end - G]]])
        gj, bj = g.take(theirs), b.take(theirs)
        work_done["swap"] += len(mine) * len(theirs)
        bi = b.take(mine)
        # Stage by stage on (mine, theirs) planes: integer sums, so the same values as summing a
        # (mine, theirs, K) array over K, without its slow reduction over a short last axis (the
        # steps' objectives subtracted last: exact in integers, the same values).
        top_j, topv_j = top0.take(gj, axis=0), topv.take(gj, axis=0)   # (nj, K), (nj, 2, K)
        load_j = flat_loads.take(gj * R + bj, axis=0)                               # (nj, K)
        load_i = L.take(bi, axis=0)                                                 # (ni, K)
        delta = None
        for k in range(K):
            other_j = np.where(top_j[:, k] != bj, topv_j[:, 0, k], topv_j[:, 1, k])   # (nj,)
            other_i = np.where(top[s, 0, k] != bi, topv[s, 0, k], topv[s, 1, k])        # (ni,)
            d = cost_t[k].take(theirs)[None, :] - cost_t[k].take(mine)[:, None]   # s's bin gains d
            gain_i = np.maximum(load_i[:, k, None] + d, other_i[:, None])
            if delta is None:
                delta = gain_i
            else:
                delta += gain_i
            np.subtract(load_j[:, k], d, out=d)
            delta += np.maximum(d, other_j[None, :], out=d)
        delta -= (obj.take(gj) + obj[s])[None, :]
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
        # Both steps at once (s != t): the two largest loads of each stage, ties in bin order (= a
        # stable argsort's first two), the objective Σ_stage max_bin and the ideal.
        q = np.array([s, t])
        lq = loads.take(q, axis=0)                      # (2, R, K)
        first = lq.argmax(1)                            # (2, K)
        masked = lq.copy()
        masked[both, first, cols] = np.iinfo(np.int64).min
        order = np.stack([first, masked.argmax(1)], 1)  # (2, 2, K)
        top[q] = order
        topv[q] = vals = lq[both[:, None], order, cols]   # the same values as take_along_axis
        obj[q] = vals[:, 0].sum(1)
        ideal[q] = (-(-lq.sum(1) // R)).sum(1)
        # The other step changed: it may have become improvable again.
        stuck[t] = False
    return g, b


def _level_window(c: np.ndarray, tot: np.ndarray, g: np.ndarray, b: np.ndarray, G: int, R: int,
                  capacity: int | None, rounds: int, patience: int | None = None,
                  stall: tuple[int, tuple[int, int]] | None = None, parts: np.ndarray | None = None,
                  part_rounds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
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

    ``parts`` (the part of every group, non-decreasing) levels several windows side by side, part p
    for ``part_rounds[p]`` rounds, in one call: every candidate stays within its part (the total
    buckets are per part, so are the roomy bins' ranks) and every ranking keeps each part's own
    order, so each part ends as a call of its own would end it, while the rounds' numpy calls are
    shared (the pools of :func:`pool_heaviest_steps`: a round over a few hundred samples costs as
    many calls as one over thousands). Its parts' bins must all hold the same count, and it takes
    no ``patience`` or ``stall`` (whose objective is the window's).
    """
    n, K = c.shape
    nb = G * R
    if parts is not None and (patience is not None or stall is not None):
        raise ValueError("_level_window: parts take no patience or stall")
    cost = np.ascontiguousarray(c.T)                     # (K, n): stage-major, one row per stage
    home = g * R + b                                       # every item's bin
    counts = np.bincount(home, minlength=nb)               # never changes: swaps are one for one
    first_slot = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot_item = _stable_argsort(home)                      # the items of bin 0, then of bin 1, ...
    slot_of = np.empty(n, np.int64)
    slot_of[slot_item] = np.arange(n)
    loads = np.zeros((K, nb), np.int64)
    for k in range(K):
        np.add.at(loads[k], home, cost[k])
    tload = np.zeros(nb, np.int64)
    np.add.at(tload, home, tot)
    # Swapping items of about the same total keeps the fill's balance of the totals and moves only
    # the stages' shares: per stage, the items by (total bucket, stage cost). frexp is exact, so the
    # buckets (16 per octave) are the same on every machine.
    mantissa, exponent = np.frexp(_last_sum(c).astype(np.float64))
    bucket = exponent.astype(np.int64) * 32 + (mantissa * 32).astype(np.int64)
    part_of_bin = None
    if parts is not None:
        # Buckets per part (a bucket is below 2^12: 32 per binary exponent, and those of int64 sums are at
        # most 64).
        bucket += parts[g] << 12
        part_of_bin = np.repeat(parts, R)
        part_first_bin = np.searchsorted(part_of_bin, np.arange(int(parts[-1]) + 1))
        part_bins = np.bincount(part_of_bin)
        part_items = np.bincount(parts[g], minlength=len(part_bins))
        rounds = int(max(part_rounds, default=0))
    by_stage = [_lexsort2(cost[k], bucket) for k in range(K)]
    place = np.empty((K, n), np.int64)
    for k in range(K):
        place[k, by_stage[k]] = np.arange(n)
    bucket_first = np.searchsorted(bucket[by_stage[0]], bucket)   # same bucket order for every k
    roomy_bins = max(1, int(_LEVEL_ROOMY_PAIRS // max(1.0, float(counts.mean())) ** 2))
    crowded = int(counts.max(initial=0)) > _CROWDED_ITEMS
    # Every bin the same count (count mode, no tail step): its items are a row of slot_grid (a view of
    # slot_item, so it follows the swaps), and a pair of bins offers the same q x q item pairs.
    slot_grid = None
    q = int(counts[0]) if nb else 0
    if nb and q and not crowded and (counts == q).all():
        slot_grid = slot_item.reshape(nb, q)
    num, den = _LEVEL_TARGET
    fastest, idle = None, 0                               # Σ_step Σ_stage max so far; rounds since it fell
    history = []
    state = None           # what a round derives from the loads, kept through rounds that swap nothing
    live, live_count = None, -1                          # (parts) the bins of parts with rounds left
    for rnd in range(rounds):
        if part_of_bin is not None:
            live_parts = part_rounds > rnd
            work_done["level"] += int(part_items[live_parts].sum())
            if int(live_parts.sum()) != live_count:
                # A part out of rounds offers no sources (its bins are no other part's partners).
                live, live_count = live_parts[part_of_bin], int(live_parts.sum())
                state = None
        else:
            work_done["level"] += n
        fresh = state is None
        if fresh:
            per_step = loads.reshape(K, G, R)
            top = per_step.max(2)
            mean = -(-per_step.sum(2) // R)
            over = (per_step - (mean + (top - mean) * num // den)[:, :, None]).reshape(K, nb)
            room = (top[:, :, None] - per_step).reshape(K, nb)   # what a bin may gain, its step's max kept
            sources = []
            for k in range(K):
                src = (over[k] > 0 if live is None else (over[k] > 0) & live).nonzero()[0]
                if not src.size:
                    sources.append(None)
                    continue
                # By over[k], the worst first (in each part: the parts one after the other).
                src = src[_stable_argsort(-over[k, src]) if live is None
                          else _lexsort2(-over[k, src], part_of_bin[src])]
                # Items of the same bucket with less of stage k, spread over all of them.
                if slot_grid is not None:
                    items = slot_grid[src].ravel()
                else:
                    n_src = counts[src]
                    items = slot_item[np.repeat(first_slot[src] - np.cumsum(n_src) + n_src, n_src)
                                      + np.arange(n_src.sum())]
                lower = place[k, items] - bucket_first[items]
                items, lower = items[lower > 0], lower[lower > 0]
                # Each item's _LEVEL_SIMILAR candidates sit at bucket start + (spread + shift) mod lower,
                # the shift a round's: per item (repeated), its lower count, bucket start and spreads.
                lower = np.repeat(lower, _LEVEL_SIMILAR)
                spread = np.tile(np.arange(_LEVEL_SIMILAR), len(items)) * lower // _LEVEL_SIMILAR
                # [items, lower counts, bucket starts, spreads, the roomy pairs' sources, then cached on a
                # round that swapped nothing: the bins by over[k], the grid pairs' items of a]
                sources.append([np.repeat(items, _LEVEL_SIMILAR), lower,
                                np.repeat(bucket_first[items], _LEVEL_SIMILAR), spread,
                                np.repeat(src, roomy_bins), None, None])
            state = (int(top.sum()), over, room, sources)
        objective, over, room, sources = state
        if patience is not None or stall is not None:
            idle = 0 if fastest is None or objective < fastest else idle + 1
            fastest = objective if fastest is None else min(fastest, objective)
            if patience is not None and idle >= patience:
                break
            if stall is not None:
                # Anytime: stop once the last `span` rounds gained less than `rate` of the objective
                # (integer test, the same on every machine).
                span, (num_r, den_r) = stall
                history.append(objective)
                if len(history) > span and (history[-span - 1] - objective) * den_r < num_r * objective:
                    break
        # A different slice of the candidates every round (golden-ratio steps through [0, 1)).
        shift = rnd * 40503 % 65536
        cand_i, cand_j = [], []
        for k in range(K):
            if sources[k] is None:
                continue
            rep_items, lower, first_of, spread, a, by_over, grid_i = sources[k]
            # (spread + shift · lower / 65536) mod lower: both terms are below lower, so the modulo is
            # one subtraction where the sum reaches it (the same offsets as `%`, without a division).
            offsets = spread + (shift * lower >> 16)
            np.subtract(offsets, lower, out=offsets, where=offsets >= lower)
            cand_i.append(rep_items)
            cand_j.append(by_stage[k].take(first_of + offsets))
            # Every item pair with the bins that have the most room in stage k: the worst source
            # gets the roomiest bins, the next source the next ones.
            if part_of_bin is not None:
                # Per part: its sources (their order within it) get its roomiest bins.
                if by_over is None:
                    by_over = sources[k][5] = _lexsort2(over[k], part_of_bin)
                pa = part_of_bin[a]
                within = np.arange(len(a)) - np.searchsorted(pa, pa)
                bb = by_over[part_first_bin[pa] + (rnd * roomy_bins + within) % part_bins[pa]]
            elif fresh:
                bb = _ranked(over[k], rnd * roomy_bins, len(a))
            else:
                # The loads did not change: the same ranking as _ranked's, sorted once for these rounds.
                if by_over is None:
                    by_over = sources[k][5] = _stable_argsort(over[k])
                bb = by_over[(rnd * roomy_bins + np.arange(len(a))) % nb]
            # Crowded bins (more than _CROWDED_ITEMS items: token-budget steps) offer _CROWDED_ITEMS
            # of their items a round, a different run of them every round, so a round stays linear.
            if slot_grid is not None:
                # Every bin holds the same count (count mode): the same pairs as below, as a grid.
                if len(a) * q * q >= _GRID_SIEVE:
                    # Many: only those that raise no bin above its step's maximum (the test below,
                    # done here on (q, q, pairs) planes: costs gathered per item, not per pair).
                    si, sj = _sieve_grid(a, bb, slot_grid, cost, room)
                    cand_i.append(si)
                    cand_j.append(sj)
                    continue
                if grid_i is None:
                    grid_i = sources[k][6] = np.repeat(slot_grid[a], q, axis=1).reshape(-1)
                cand_i.append(grid_i)
                cand_j.append(slot_grid[bb][:, None, :].repeat(q, axis=1).reshape(-1))
                continue
            na, nbb = np.minimum(counts[a], _CROWDED_ITEMS), np.minimum(counts[bb], _CROWDED_ITEMS)
            pairs = na * nbb
            padded = len(a) * int(na.max(initial=0)) * int(nbb.max(initial=0))
            if not crowded and padded >= _GRID_SIEVE and padded <= 2 * int(pairs.sum()):
                # Many (bins of nearly equal counts, e.g. count mode with a tail step): sieved by the
                # room test as in count mode's grid, the bins' items padded to the largest count.
                si, sj = _sieve_pairs(a, bb, na, nbb, slot_item, first_slot, cost, room)
                cand_i.append(si)
                cand_j.append(sj)
                continue
            u, v = np.divmod(np.arange(pairs.sum()) - np.repeat(np.cumsum(pairs) - pairs, pairs),
                             np.repeat(nbb, pairs))
            if crowded:
                ra = np.where(counts[a] > _CROWDED_ITEMS, rnd * _CROWDED_ITEMS, 0)
                rb = np.where(counts[bb] > _CROWDED_ITEMS, rnd * _CROWDED_ITEMS, 0)
                u = (u + np.repeat(ra, pairs)) % np.repeat(counts[a], pairs)
                v = (v + np.repeat(rb, pairs)) % np.repeat(counts[bb], pairs)
            cand_i.append(slot_item[np.repeat(first_slot[a], pairs) + u])
            cand_j.append(slot_item[np.repeat(first_slot[bb], pairs) + v])
        if not cand_i:
            break
        i, j = np.concatenate(cand_i), np.concatenate(cand_j)
        # (.take: the same gathers as fancy indexing, without its overhead on these sizes.)
        A, B = home.take(i), home.take(j)
        # First the cheap test that most candidates fail (a bin would rise above its step's max),
        # then the penalty of the rest.
        # Stage by stage, each test on the candidates that passed the previous ones (the same set as
        # testing all at once, fewer gathers: most fail the first).
        d0 = cost[0].take(j) - cost[0].take(i)   # bin A gains d, bin B loses it
        ok = ((A != B) & (d0 <= room[0].take(A)) & (d0 >= -room[0].take(B))).nonzero()[0]
        i, j, A, B = i.take(ok), j.take(ok), A.take(ok), B.take(ok)
        for k in range(1, K):
            dk = cost[k].take(j) - cost[k].take(i)
            ok = ((dk <= room[k].take(A)) & (dk >= -room[k].take(B))).nonzero()[0]
            i, j, A, B = i.take(ok), j.take(ok), A.take(ok), B.take(ok)
        if capacity is not None:
            dt = tot[j] - tot[i]
            ok = ((tload[A] + dt <= capacity) & (tload[B] - dt <= capacity)).nonzero()[0]
            i, j, A, B = i.take(ok), j.take(ok), A.take(ok), B.take(ok)
        d = cost.take(j, axis=1) - cost.take(i, axis=1)   # (K, m): bin A gains d, bin B loses it
        over_a, over_b = over.take(A, axis=1), over.take(B, axis=1)
        xa = np.maximum(over_a + d, 0).astype(np.float64)
        xb = np.maximum(over_b - d, 0).astype(np.float64)
        terms = xa * xa + xb * xb
        # The two bins' penalties now, Σ_k max(over, 0)² summed stage by stage as a (K, bins) sum over
        # its first axis is (the same floats), on the candidates' bins only.
        ea = np.maximum(over_a, 0).astype(np.float64)
        eb = np.maximum(over_b, 0).astype(np.float64)
        ea *= ea
        eb *= eb
        pen_a, pen_b = ea[0].copy(), eb[0].copy()
        for k in range(1, K):
            pen_a += ea[k]
            pen_b += eb[k]
        gain = -(pen_a + pen_b)
        for k in range(K):                                 # stage by stage: the float sums in one order
            gain += terms[k]
        sel = (gain < 0).nonzero()[0]
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
        state = None                                      # the loads change
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


def _sieve_grid(a: np.ndarray, bb: np.ndarray, slot_grid: np.ndarray, cost: np.ndarray, room: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """The candidate swaps of :func:`_level_window` between the items of bins ``a`` and ``bb``
    (pair r: a[r]'s u-th item for bb[r]'s v-th, in the order r, u, v) that pass its room test (no
    bin above its step's maximum in any stage, as of the round's start): their items ``(i, j)`` in
    that order. The same test on the same values; it only runs on fewer candidates afterwards."""
    si, sj = slot_grid[a].T, slot_grid[bb].T                # (q, m): the items of bins a, bb
    return _room_passing(si, sj, (a != bb)[None, None, :], a, bb, cost, room)


def _sieve_pairs(a: np.ndarray, bb: np.ndarray, na: np.ndarray, nbb: np.ndarray, slot_item: np.ndarray,
                 first_slot: np.ndarray, cost: np.ndarray, room: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_sieve_grid` for bins of unequal counts (none crowded): pair r offers bin a[r]'s first
    na[r] items x bin bb[r]'s first nbb[r] (in the order r, u, v); the bins' items padded to the largest
    count, the padding never kept. Returns the items ``(i, j)`` of the pairs that pass the room test."""
    qa, qb = int(na.max()), int(nbb.max())
    last = len(slot_item) - 1
    ua, ub = np.arange(qa)[:, None], np.arange(qb)[:, None]
    si = slot_item[np.minimum(first_slot[a] + ua, last)]     # (qa, m), padded past a bin's items
    sj = slot_item[np.minimum(first_slot[bb] + ub, last)]    # (qb, m)
    ok = (ua < na)[:, None, :] & (ub < nbb)[None, :, :] & (a != bb)[None, None, :]
    return _room_passing(si, sj, ok, a, bb, cost, room)


def _room_passing(si: np.ndarray, sj: np.ndarray, ok: np.ndarray, a: np.ndarray, bb: np.ndarray,
                  cost: np.ndarray, room: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The room test of :func:`_level_window` on the (u, v, pair) planes of items ``si`` (bin a's u-th
    item per pair) and ``sj`` (bin bb's v-th), on top of the mask ``ok``: the items ``(i, j)`` of the
    pairs that pass, in the order pair, u, v."""
    for k in range(cost.shape[0]):
        d = np.take(cost[k], sj)[None, :, :] - np.take(cost[k], si)[:, None, :]   # (u, v, m)
        ok = ok & (d <= np.take(room[k], a)) & (d >= -np.take(room[k], bb))
    qa, qb = si.shape[0], sj.shape[0]
    r, uv = np.divmod(np.flatnonzero(ok.transpose(2, 0, 1)), qa * qb)
    u, v = np.divmod(uv, qb)
    return si[u, r], sj[v, r]


def _stable_argsort(x: np.ndarray) -> np.ndarray:
    """``np.argsort(x, kind="stable")`` of an integer array, by sorting the unique key ``x·len + index``
    (whose order is the stable order of ``x``): a plain sort of int64 is several times faster than a
    stable argsort. Same answer."""
    n = len(x)
    if not n:
        return np.zeros(0, np.int64)
    if n <= _SMALL_SORT:
        return np.argsort(x, kind="stable")
    lo = int(x.min())
    if (int(x.max()) - lo + 1) >= (1 << 62) // n:
        return np.argsort(x, kind="stable")
    return np.sort((x - lo) * n + np.arange(n)) % n


def _lexsort2(minor: np.ndarray, major: np.ndarray) -> np.ndarray:
    """``np.lexsort((minor, major))`` of two integer arrays, by sorting the unique key
    ``(major·span + minor)·len + index`` where it fits in 63 bits. Same answer."""
    n = len(minor)
    if not n:
        return np.zeros(0, np.int64)
    lo_a, lo_b = int(minor.min()), int(major.min())
    span_a, span_b = int(minor.max()) - lo_a + 1, int(major.max()) - lo_b + 1
    if span_a * span_b * n >= 1 << 62:
        return np.lexsort((minor, major))
    return np.sort(((major - lo_b) * span_a + (minor - lo_a)) * n + np.arange(n)) % n


def _ranked(x: np.ndarray, start: int, m: int) -> np.ndarray:
    """``np.argsort(x, kind="stable")[(start + np.arange(m)) % len(x)]`` without sorting all of ``x``
    when ``m`` is small: the ranks wanted are one or two runs, found by a partition on the unique key
    ``x·len + index`` (whose order is the stable order of ``x``) and sorted alone. Same answer."""
    n = len(x)
    if n <= _SMALL_SORT:
        return np.argsort(x, kind="stable")[(start + np.arange(m)) % n]
    lo = int(x.min(initial=0))
    span = int(x.max(initial=0)) - lo + 1
    if span >= (1 << 62) // max(n, 1):
        return np.argsort(x, kind="stable")[(start + np.arange(m)) % n]
    key = (x - lo) * n + np.arange(n)
    if 4 * m >= n:
        return (np.sort(key) % n)[(start + np.arange(m)) % n]
    start %= n
    runs = [(start, min(n, start + m))] + ([(0, start + m - n)] if start + m > n else [])
    out = []
    for a, b in runs:
        # The keys of ranks a .. b-1, by value (unique keys: the same set as an argpartition, and
        # key % n is the index), with single-pivot partitions, cheaper than one at (a, b - 1).
        if b <= n - a:
            part = np.partition(key, b - 1)[:b] if b < n else key
            part = np.partition(part, a)[a:] if a else part
        else:
            part = np.partition(key, a)[a:] if a else key
            part = np.partition(part, b - a - 1)[:b - a] if b < n else part
        out.append(np.sort(part) % n)
    return np.concatenate(out) if len(out) > 1 else out[0]


def pool_heaviest_steps(stage_costs: np.ndarray, group: np.ndarray, bins: np.ndarray, num_bins: int, *,
                        pools: tuple[int, ...] = _POOL_STEPS, max_items: int = _POOL_ITEMS,
                        work: int | None = None, stall: tuple[int, tuple[int, int]] | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The ``h`` heaviest steps (by ``Σ_stage max_bin``) composed again from their pooled samples, for
    each ``h`` in ``pools``; the pool that gains most is kept, none where none gains. Returns the
    items' new ``(group, bins)``.

    Leveling trades samples one for one, and with two samples per rank it cannot fix a heavy step
    whose samples do not pair off: step 16 of a 4,096-rank epoch (draw 9 of the benchmark) holds
    vision costs from 0.23 to 0.71 of its mean rank load, bunched at 0.45 and at 0.7, so its best
    pairing is 1.057 x the mean while the next heavy steps hold the small partners it lacks. Here the
    pool's samples are sorted along one of a few directions of stage-cost space (normalised by the
    pool's mean bin) and dealt to its bins in a snake, so every bin gets a large and a small sample;
    the bins, sorted by their largest normalised stage, are cut into steps of like bins, and the pool
    is leveled (:func:`level_stage_bins`'s swaps). Only steps of the most common size are pooled, and
    only when that size is a multiple of ``num_bins`` (so every step keeps its sample count); bins
    may change their item counts. No pool is kept unless its steps get faster. Every pool is leveled
    ``_POOL_RACE`` rounds, then only the one ahead the rest of its rounds (PLAN_VERSION 15). Deterministic.
    """
    c = np.asarray(stage_costs, np.int64)
    group = np.asarray(group, np.int64)
    bins = np.asarray(bins, np.int64)
    R = int(num_bins)
    if R < 2 or len(c) < 4 or c.ndim != 2:
        return group.copy(), bins.copy()
    g_ids, g_local = np.unique(group, return_inverse=True)
    g_local = g_local.reshape(-1)
    G, K = len(g_ids), c.shape[1]
    size = np.bincount(g_local, minlength=G)
    N = int(np.bincount(size).argmax())
    if N % R or N < R:
        return group.copy(), bins.copy()
    loads = np.zeros((G, R, K), np.int64)
    np.add.at(loads, (g_local, bins), c)
    times = loads.max(1).sum(1)
    eligible = np.flatnonzero(size == N)
    heaviest = eligible[np.argsort(-times[eligible], kind="stable")]
    dealt = []
    for h in sorted(set(int(v) for v in pools)):
        if h < 2 or h > len(heaviest) or h * N > max_items:
            continue
        chosen = heaviest[:h]
        mine = np.flatnonzero(np.isin(g_local, chosen))
        x = c[mine]
        new_g, new_b, start = _deal_pool(x, h, R)
        if start * _POOL_SLACK[1] > int(times[chosen].sum()) * (_POOL_SLACK[0] + _POOL_SLACK[1]):
            continue
        rounds = min(_POOL_ROUNDS, (_POOL_WORK if work is None else work) // max(len(x), _ROUND_ITEMS))
        race = min(rounds, _POOL_RACE) if _POOL_RACE else rounds
        dealt.append(_Pool(chosen, mine, x, new_g, new_b, race, rounds - race))
    g_local, bins = g_local.copy(), bins.copy()
    if not dealt:
        return g_ids[g_local], bins
    # Every pool levels its first _POOL_RACE rounds; the one ahead (the first of equals) levels the rest of
    # its rounds, and is kept if its steps got faster.
    _race_pools(dealt, R, stall)

    def gain(p: _Pool) -> int:
        return int(times[p.chosen].sum()) - _pool_time(p.costs, p.step, p.bin, len(p.chosen), R)

    ahead = max(dealt, key=gain)
    if ahead.more > 0:
        ahead.step, ahead.bin = _level_window(ahead.costs, _last_sum(ahead.costs), ahead.step, ahead.bin,
                                              len(ahead.chosen), R, None, ahead.more, _POOL_PATIENCE, stall)
    if gain(ahead) > 0:
        g_local[ahead.mine], bins[ahead.mine] = ahead.chosen[ahead.step], ahead.bin
    return g_ids[g_local], bins


@dataclass
class _Pool:
    """One pool of :func:`pool_heaviest_steps`: its steps (``chosen``, local ids), its samples (``mine``,
    their ``costs``), where they are now (``step`` in the pool, ``bin``), and its leveling rounds (``race``
    first, ``more`` if it gets ahead)."""

    chosen: np.ndarray
    mine: np.ndarray
    costs: np.ndarray
    step: np.ndarray
    bin: np.ndarray
    race: int
    more: int


def _race_pools(pools: list[_Pool], R: int, stall: tuple[int, tuple[int, int]] | None) -> None:
    """The pools' first ``race`` leveling rounds (their ``step`` and ``bin`` replaced by the leveled ones).
    Rounds that neither the patience nor the stall test can end (both look back further) are leveled side by
    side in one call (:func:`_level_window`'s ``parts``: the same swaps as a call per pool, with a round's
    numpy calls shared by all pools); otherwise, or with unequal bin counts, one call per pool."""
    span = _POOL_PATIENCE if stall is None else min(_POOL_PATIENCE, stall[0])
    per_bin = {len(p.costs) // (len(p.chosen) * R) for p in pools}
    joint = 0
    if max(p.race for p in pools) <= span and len(per_bin) == 1:
        # The smallest pools (the first ones) side by side, up to _RACE_ITEMS samples: larger pools'
        # rounds cost their size, not their calls, and gain nothing together.
        joint = int((np.cumsum([len(p.costs) for p in pools]) <= _RACE_ITEMS).sum())
    if joint > 1:
        _level_side_by_side(pools[:joint], R)
    else:
        joint = 0
    for p in pools[joint:]:
        p.step, p.bin = _level_window(p.costs, _last_sum(p.costs), p.step, p.bin, len(p.chosen), R, None,
                                      p.race, _POOL_PATIENCE, stall)


def _level_side_by_side(pools: list[_Pool], R: int) -> None:
    """:func:`_race_pools`' pools leveled in one call of :func:`_level_window` (``parts``)."""
    steps = [len(p.chosen) for p in pools]
    first_step = np.cumsum([0] + steps)[:-1]
    ends = np.cumsum([len(p.costs) for p in pools])
    x = np.concatenate([p.costs for p in pools])
    step = np.concatenate([p.step + first for p, first in zip(pools, first_step, strict=True)])
    new_g, new_b = _level_window(x, _last_sum(x), step, np.concatenate([p.bin for p in pools]), sum(steps), R,
                                 None, 0, parts=np.repeat(np.arange(len(pools)), steps),
                                 part_rounds=np.array([p.race for p in pools]))
    for p, first, end in zip(pools, first_step, ends, strict=True):
        p.step, p.bin = new_g[end - len(p.costs):end] - first, new_b[end - len(p.costs):end]


def _pool_time(x: np.ndarray, g: np.ndarray, b: np.ndarray, h: int, R: int) -> int:
    """Σ_step Σ_stage max_bin of a pool's samples ``x`` at (step, bin)."""
    pooled = np.zeros((h, R, x.shape[1]), np.int64)
    np.add.at(pooled, (g, b), x)
    return int(pooled.max(1).sum())


def _deal_pool(x: np.ndarray, h: int, R: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The pool's samples ``x`` dealt to ``h·R`` bins in a snake along the best of
    ``_POOL_DIRECTIONS`` directions, the bins cut into ``h`` steps of like bins: ``(step, bin, time)``."""
    n, K = x.shape
    B = h * R
    mean = np.maximum(x.sum(0) / B, 1.0)
    u = x / mean
    # Integer weights, and the projection summed elementwise: every rank sorts the same floats (no
    # libm cos / sin, no BLAS dot product whose rounding depends on the CPU).
    if K == 2:
        k = np.arange(_POOL_DIRECTIONS, dtype=np.float64)
        directions = np.stack([_POOL_DIRECTIONS - 1 - k, k], 1)
    else:
        directions = np.concatenate([np.eye(K), np.ones((1, K))])
    pos = np.arange(n)
    rnd, j = np.divmod(pos, B)
    snake = np.where(rnd % 2 == 0, j, B - 1 - j)           # bin of the i-th sample along a direction
    best = None
    for w in directions:
        along = u[:, 0] * w[0]
        for d in range(1, K):
            along = along + u[:, d] * w[d]
        order = np.argsort(along, kind="stable")
        bin_of = np.empty(n, np.int64)
        bin_of[order] = snake
        vec = np.zeros((B, K), np.int64)
        np.add.at(vec, bin_of, x)
        by_size = np.argsort(-(vec / mean).max(1), kind="stable")
        place = np.empty(B, np.int64)
        place[by_size] = np.arange(B)                     # bins of like size share a step
        t = int(vec[by_size].reshape(h, R, K).max(1).sum())
        if best is None or t < best[2]:
            best = (place[bin_of] // R, place[bin_of] % R, t)
    return best
