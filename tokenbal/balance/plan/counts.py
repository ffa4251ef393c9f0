"""Count mode without stages (``global_batch_size``, PLAN_VERSION 8): the epoch planned window by
window by the grouped fill, the window fill's split beside it where that is cheap, and the heaviest
steps refilled (``_plan_counts``)."""

from __future__ import annotations

import numpy as np

from tokenbal.balance.plan import common
from tokenbal.balance.plan.common import EpochPlan, _argsort_keys, _fill, default_window

# Count mode (no stages): items per window of the grouped fill (_plan_counts); the jitter of the sizes it
# sorts; the window fill is run beside it where ceil(items / batch) × bins is at most _FILL_WORK.
_GROUPED_ITEMS = 1 << 22
_GROUPED_JITTER = 0.3
_FILL_WORK = 1 << 26
# Count mode: the grouped fill's heaviest steps refilled by the window fill (_refill_heaviest).
_REFILL_STEPS = 16
# Count mode: jitter of the sizes the window-fill candidate sorts (0: exact sizes). Its short-epoch
# windows hold the same samples every epoch, so exact sizes rebuild nearly the same steps: at (512,
# 1024) with 200 steps, 0.69 of the step-mate pairs meet again next epoch (v7 the same); ×1.03 brings
# that to 0.10 at a median epoch figure of 1.021 instead of 1.015 (6 draws, scripts/bench_balance.py
# --token-mixtures --fill-jitter, docs/bench/balance.md). Balance first, as PLAN_VERSION 7.
_FILL_JITTER = 0.0


def _plan_counts(lens: np.ndarray, perm: np.ndarray, caps: np.ndarray, R: int, R_user: int, k: int,
                 window: int | None, rng: np.random.Generator | None, dropped: np.ndarray) -> EpochPlan:
    """Count mode without stages: the epoch planned window by window (``_plan_count_window``), each
    window's samples written straight to their place in the plan, so memory stays at the plan itself
    plus one window (100M samples plan in a few GB)."""
    S, n = len(caps), len(perm)
    indices = np.empty(n, np.int64)
    offsets = np.zeros(S * R + 1, np.int64)
    counts = offsets[1:]
    N = int(caps[0]) if S else 0
    tail = int(caps[-1]) if S > 1 and caps[-1] != N else 0      # the last step may differ in size
    full = S - (tail > 0)
    W = min(window or max(1, _GROUPED_ITEMS // max(N, 1)), max(full, 1))
    if window is None and full:
        W = -(-full // -(-full // W))                    # equal windows
    for s0 in range(0, full, W):
        s1 = min(s0 + W, full)
        last = s1 == full
        a, b = s0 * N, (n if last else s1 * N)
        steps = s1 - s0 + (last and tail > 0)
        indices[a:b], counts[s0 * R:(s0 + steps) * R] = _plan_count_window(
            lens, perm[a:b], s1 - s0, R, rng, tail if last else 0)
    np.cumsum(counts, out=counts)
    return EpochPlan(num_replicas=R_user, indices=indices, offsets=offsets, dropped=dropped.astype(np.int64),
                     grad_accum=k)


def _plan_count_window(lens: np.ndarray, items: np.ndarray, W: int, R: int, rng: np.random.Generator | None,
                       tail: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One window of ``W`` equal steps (and, with ``tail``, one more step of ``tail`` samples, kept last):
    ``(items ordered by slot, then index; samples per slot)``.

    The split is :func:`tokenbal.balance.partition.grouped_fill` on the costs in descending order;
    when shuffling they are jittered by up to ``_GROUPED_JITTER`` first, so which samples share a
    rank-step changes from epoch to epoch. Where the window fill's cost is small (short epochs, whose
    windows are too small for the grouped fill's sorts to find like neighbours) it is run too, and the
    split with the lower ``Σ_steps max_rank`` is kept. The tail step takes the window's smallest
    samples, which level over its ranks whatever its size. Then the steps are shuffled (unshuffled:
    ordered by their smallest dataset index) and each step's bins dealt to ranks at random."""
    from tokenbal.balance.partition.grouped import descending_order, grouped_fill

    x = lens[items]
    m = len(items)
    fill_key = None
    if rng is not None:
        u = rng.random(m)
        order = descending_order(x * (1.0 + _GROUPED_JITTER * u))
        if _FILL_JITTER > 0:
            fill_key = np.rint(x * (1.0 + _FILL_JITTER * u)).astype(np.int64)
    else:
        order = _argsort_keys(int(x.max(initial=0)) - x, items)
    k = m - tail
    in_main = np.ones(m, bool)
    in_main[order[k:]] = False
    main_in_perm = np.flatnonzero(in_main)              # the window's main items, in permutation order
    items, x = items[order], x[order]                   # from here on in descending order
    parts = [grouped_fill(x[:k], W, R)] + ([grouped_fill(x[k:], 1, R)] if tail else [])
    step, rank, place = (np.concatenate(a) for a in zip(*parts, strict=True))
    step[k:] += W
    if W > 1:
        _refill_heaviest(lens, items[:k], x[:k], step[:k], rank[:k], place[:k], W, R, rng is not None)
    found = _window_fill_candidate(lens, items, order, main_in_perm, W, R, rng is not None,
                                   None if fill_key is None else fill_key[main_in_perm])
    if found is not None:
        cost = [np.bincount(a * R + b, weights=x[:k], minlength=W * R).reshape(W, R).max(1).sum()
                for a, b in ((step[:k], rank[:k]), found)]
        if cost[1] < cost[0]:
            step[:k], rank[:k] = found
            place = None
    steps = W + (tail > 0)
    if rng is not None:
        step = np.append(rng.permutation(W), W)[step]
        deal = rng.permuted(np.broadcast_to(np.arange(R), (steps, R)), axis=1).reshape(-1)
        slot = step * R + deal[step * R + rank]
    else:
        first = np.full(steps, np.iinfo(np.int64).max)
        np.minimum.at(first, step, items)
        first[W:] = np.iinfo(np.int64).max               # the tail stays last
        new_pos = np.empty(steps, np.int64)
        new_pos[np.argsort(first, kind="stable")] = np.arange(steps)
        slot = new_pos[step] * R + rank
    return _slot_layout(items, slot, steps * R, place)


def _refill_heaviest(lens: np.ndarray, items: np.ndarray, x: np.ndarray, step: np.ndarray, rank: np.ndarray,
                     place: np.ndarray, W: int, R: int, shuffled: bool) -> None:
    """Refill the grouped fill's ``_REFILL_STEPS`` heaviest steps with the window fill, in place, where
    that lowers both their ``Σ max_rank`` and their summed max / mean. A step that holds one of the
    few giant samples gets the next largest bins from the sort, but no bin of two big samples: its
    other ranks wait. The window fill gives that step's other ranks several big samples each, which
    the rounds of the grouped fill cannot (one per bin per round); on a 1M-sample draw at 512 ranks
    one such step went from 5.2× to 3.1× its mean, and the epoch's mean per-step max/mean from
    1.0053 to 1.0031."""
    T = min(W, _REFILL_STEPS)
    loads = np.bincount(step * R + rank, weights=x, minlength=W * R).reshape(W, R)
    top = np.argsort(-loads.max(1), kind="stable")[:T]
    new_id = np.full(W, -1, np.int64)
    new_id[top] = np.arange(T)
    sel = np.flatnonzero(new_id[step] >= 0)
    cap = np.full((1, T), len(sel) // T, np.int64)
    _, s_b, r_b, _ = _fill(lens, items[sel], np.zeros(len(sel), np.int64), cap, R, None, False, shuffled)
    refilled = np.bincount(s_b * R + r_b, weights=x[sel], minlength=T * R).reshape(T, R)
    # Kept only if the steps' time (Σ max) and their level (Σ max / mean) both drop: the fill may
    # level the giant's step by leaving another of these steps with one big sample among small ones.
    old = loads[top]

    def level(t: np.ndarray) -> float:
        return float(np.divide(t.max(1), t.mean(1), out=np.ones(len(t)), where=t.mean(1) > 0).sum())

    if refilled.max(1).sum() >= old.max(1).sum() or level(refilled) > level(old):
        return
    step[sel], rank[sel] = top[s_b], r_b
    slot = step[sel] * R + rank[sel]
    o = _argsort_keys(slot, np.arange(len(sel)))        # a place inside each refilled rank-step
    start = np.searchsorted(slot[o], slot[o], side="left")
    place[sel[o]] = np.arange(len(sel)) - start


def _window_fill_candidate(lens: np.ndarray, items: np.ndarray, order: np.ndarray, main_in_perm: np.ndarray,
                           W: int, R: int, shuffled: bool, order_key: np.ndarray | None = None
                           ) -> tuple[np.ndarray, np.ndarray] | None:
    """The window fill's split of a window's first ``k`` (descending) items as (step, rank) in that
    order, over sub-windows of :func:`default_window` steps cut from the permutation (PLAN_VERSION 7's
    plan of the same samples); None where that would cost more than ``_FILL_WORK`` (items per round
    × bins: long epochs, where the grouped fill's one large window balances better anyway)."""
    k = len(main_in_perm)
    cap = k // W
    sub = default_window(R, max(cap, 1))
    sub = -(-W // max(1, W // sub))                      # equal sub-windows, as PLAN_VERSION 7
    batch = max(int(common._BATCH_PER_RANK * R), common._BATCH_MIN)
    if -(-(sub * cap) // batch) * W * R > _FILL_WORK:
        return None
    G = -(-W // sub)
    step_win = np.arange(W) // sub
    caps = np.zeros((G, sub), np.int64)
    caps[step_win, np.arange(W) % sub] = cap
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))             # permutation position -> descending position
    win = np.repeat(step_win, cap)
    _, step_w, rank_w, _ = _fill(lens, items[position[main_in_perm]], win, caps, R, None, False, shuffled,
                                 order_key)
    step, rank = np.empty(k, np.int64), np.empty(k, np.int64)
    step[position[main_in_perm]] = win * sub + step_w
    rank[position[main_in_perm]] = rank_w
    return step, rank


def _slot_layout(items: np.ndarray, slot: np.ndarray, slots: int, place: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(items ordered by slot, then dataset index; items per slot)``. With ``place`` (distinct
    within a slot, small) the items are laid out in a slots × places table whose short rows are
    sorted, instead of sorting them all."""
    counts = np.bincount(slot, minlength=slots)
    if place is None:
        return items[_argsort_keys(slot, items)], counts
    absent = np.iinfo(np.int64).max
    width = int(place.max(initial=0)) + 1
    table = np.full((slots, width), absent, np.int64)
    table.reshape(-1)[slot * width + place] = items
    if width == 2:                                   # the common case: a min / max pass
        lo = np.minimum(table[:, 0], table[:, 1])
        table[:, 1] = np.maximum(table[:, 0], table[:, 1])
        table[:, 0] = lo
    else:
        table.sort(axis=1)
    flat = table.reshape(-1)
    return flat[flat != absent], counts
