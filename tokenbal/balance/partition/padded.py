"""Padded cost: plan steps for collators that pad every micro-batch to its longest sample.

A padding collator (transformers' ``DataCollatorForSeq2Seq``, trl's ``DataCollatorForLanguageModeling``
without ``padding_free``, ``collate.train.tiny.pad_collate``) turns a micro-batch of ``b`` samples whose
longest has ``L`` tokens into a ``b × L`` tensor: the model runs on ``b · L`` tokens whatever the real
lengths are. Under FSDP every micro-batch ends in collectives, so a step costs
``Σ_micro max_rank (b · L)`` — the number :func:`padded_summary` reports as ``sum_max_padded``.

Balancing *real* tokens (the default cost) ignores that: two ranks with 600 real tokens each may
hold 1 × 600 and 6 × 100 (= 600 padded) or 1 × 500 + 1 × 100 (= 1000 padded). ``cost="padded"`` plans
for the padded cost instead, in ``global_batch_size`` mode (every step keeps exactly ``N`` samples,
the Trainer's ``per_device_train_batch_size × ranks × gradient_accumulation_steps``):

1. The epoch's permutation is cut into windows of ``W`` steps (as for every plan, so which samples
   can share a step changes every epoch).
2. A window's samples are sorted longest first (ties in permutation order) and cut into its steps
   in that order: each step holds samples of similar length, so little is padded. The steps are then
   shuffled inside the window (no length curriculum); a short tail step stays the last of the epoch.
3. Each step's ``N`` sorted samples are cut into ``R·k`` contiguous groups (at least one sample each)
   minimising the largest group's ``count × longest`` exactly (:func:`min_max_padded_split`: bisection
   on the bound, with a greedy that is optimal for contiguous groups because a sub-range never pads
   more than the range holding it). Groups ``[j·R, (j+1)·R)`` are micro-batch ``j``; each micro-batch
   is then split again over the ``R`` ranks on its own (which can only lower its max), and the groups
   are dealt to ranks (and micro-batches to positions) at random.

What this trades: a step's samples are of similar length (like ``group_by_length``), and the step
holding the window's longest samples is as large in padded tokens as a ``DistributedSampler`` batch
that drew its longest sample (``per_device × L``); for a hard memory bound use ``max_tokens_per_rank``
with a packing collator instead. Measured against transformers' ``BatchRebalanceSampler`` and
``DistributedSampler`` by ``scripts/bench_balance.py --padded`` (docs/BENCHMARKS.md, issue 30); the
metrics and those baselines are in :mod:`tokenbal.balance.baselines`, the epoch's plan is made by
:func:`tokenbal.balance.plan.plan_epoch` (``cost="padded"``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PADDED_COST", "min_max_padded_split", "plan_padded", "check_padded"]

PADDED_COST = "padded"


def min_max_padded_split(lens_desc: np.ndarray, num_groups: int) -> np.ndarray:
    """Group sizes (``num_groups`` entries) cutting ``lens_desc`` (sorted longest first) into
    contiguous groups that minimise ``max(count × longest)``; every group gets >= 1 sample when
    there are enough samples (the surplus groups get 0 otherwise)."""
    lens = np.asarray(lens_desc, np.int64).reshape(1, -1)
    return _split_rows(lens, np.array([lens.shape[1]]), int(num_groups))[0]


def _split_rows(L: np.ndarray, n: np.ndarray, K: int) -> np.ndarray:
    """Row-wise :func:`min_max_padded_split`: ``L`` (rows, width) sorted descending in its first
    ``n[row]`` columns. Returns (rows, K) group sizes. Vectorised over rows: one bisection per row,
    every probe a K-step greedy over all rows at once."""
    rows = L.shape[0]
    n = np.asarray(n, np.int64)
    safe = np.maximum(L, 1)                          # a 0-token sample pads like a 1-token one here
    top = safe[:, 0] if L.shape[1] else np.ones(rows, np.int64)
    total = np.where(np.arange(L.shape[1])[None, :] < n[:, None], safe, 0).sum(1)
    lo = np.maximum(top, -(-total // K)) - 1         # below both lower bounds: infeasible
    hi = top * np.maximum(n - K + 1, 1)              # n-K+1 in the first group, 1 in each other: feasible
    while True:
        todo = hi - lo > 1
        if not todo.any():
            break
        mid = np.where(todo, (lo + hi) // 2, hi)
        ok = _greedy(safe, n, K, mid)[1]
        hi = np.where(todo & ok, mid, hi)
        lo = np.where(todo & ~ok, mid, lo)
    # Both greedies meet the optimal bound; the forward one pads the long samples' groups fully,
    # the backward one packs the short ones: keep whichever pads fewer tokens in all.
    fwd, back = _greedy(safe, n, K, hi)[0], _greedy_back(safe, n, K, hi)
    pad_f = (fwd * _heads(safe, fwd)).sum(1)
    pad_b = (back * _heads(safe, back)).sum(1)
    return np.where((pad_b < pad_f)[:, None], back, fwd)


def _greedy_back(L: np.ndarray, n: np.ndarray, K: int, bound: np.ndarray) -> np.ndarray:
    """The K groups built from the short end: each takes the most samples before it whose
    ``count × longest`` stays within ``bound`` (found by bisection, the cost grows as the group
    reaches longer samples), leaving one sample for every earlier group. Where ``bound`` is
    feasible it ends at the row's start; elsewhere the first group absorbs what is left."""
    rows = L.shape[0]
    r = np.arange(rows)
    end = np.asarray(n, np.int64).copy()
    counts = np.zeros((rows, K), np.int64)
    last = max(L.shape[1] - 1, 0)
    for g in range(K - 1, 0, -1):
        room = end > g                       # at least one sample here and one per earlier group
        # smallest start in [g, end-1] that fits: a = g-1 is a sentinel, end-1 always fits (L <= bound)
        a, b = np.full(rows, g - 1, np.int64), np.maximum(end - 1, g)
        while True:
            todo = room & (b - a > 1)
            if not todo.any():
                break
            mid = (a + b) // 2
            fits = (end - mid) * L[r, np.clip(mid, 0, last)] <= bound
            b = np.where(todo & fits, mid, b)
            a = np.where(todo & ~fits, mid, a)
        start = np.where(room, b, np.maximum(end - 1, 0))
        counts[:, g] = end - start
        end = start
    counts[:, 0] = end
    return counts


def _greedy(L: np.ndarray, n: np.ndarray, K: int, bound: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K groups per row, each as long as ``bound`` allows while leaving one sample for every later
    group; feasible where the K groups reach the row's end."""
    rows = L.shape[0]
    pos = np.zeros(rows, np.int64)
    counts = np.zeros((rows, K), np.int64)
    r = np.arange(rows)
    for g in range(K):
        left = n - pos
        head = L[r, np.minimum(pos, max(L.shape[1] - 1, 0))] if L.shape[1] else np.ones(rows, np.int64)
        fit = bound // head
        c = np.minimum(fit, left - (K - g - 1)) if g < K - 1 else left
        c = np.where(left > 0, np.maximum(c, 1), 0)
        counts[:, g] = c
        pos += c
    ok = (pos == n) & ((counts * _heads(L, counts)).max(1, initial=0) <= bound)
    return counts, ok


def _heads(L: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The longest sample of every group (its first, rows sorted descending); 0 for empty groups."""
    if not L.shape[1]:
        return np.zeros_like(counts)
    start = np.concatenate([np.zeros((counts.shape[0], 1), np.int64), np.cumsum(counts, 1)[:, :-1]], 1)
    heads = np.take_along_axis(L, np.minimum(start, L.shape[1] - 1), 1)
    return np.where(counts > 0, heads, 0)


def plan_padded(lens: np.ndarray, perm: np.ndarray, caps: np.ndarray, R: int, k: int, W: int,
                rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The padded-cost plan of the permuted samples ``perm`` (already cut by ``caps``, samples per
    step): returns ``(perm, slot, num_steps)`` with ``slot = (step · R + rank) · k + micro`` per item
    of the returned ``perm`` (its order: windows, then sorted within each). ``W``: steps per window;
    ``rng``: None keeps the sorted step order and maps group g to rank g (unshuffled plans)."""
    S = len(caps)
    if S == 0:
        return perm, np.zeros(0, np.int64), np.int64(0)
    step_start = np.concatenate([[0], np.cumsum(caps)])
    out_perm = np.empty_like(perm)
    step_of = np.empty(len(perm), np.int64)
    order_of_step = np.arange(S)
    for w0 in range(0, S, W):
        w1 = min(S, w0 + W)
        a, b = step_start[w0], step_start[w1]
        items = perm[a:b]
        # Longest first; ties keep the (random) permutation order.
        items = items[np.argsort(-lens[items], kind="stable")]
        out_perm[a:b] = items
        step_of[a:b] = np.repeat(np.arange(w0, w1), caps[w0:w1])
        if rng is not None:
            steps = np.arange(w0, w1)
            tail = w1 == S and S > 1 and caps[-1] != caps[0]
            movable = steps[:-1] if tail else steps
            order_of_step[movable] = rng.permutation(movable)
    # Every step: R·k groups, then each micro-batch's R groups again on their own.
    width = int(caps.max())
    L = np.zeros((S, width), np.int64)
    col = np.arange(len(perm)) - step_start[step_of]
    L[step_of, col] = lens[out_perm]
    counts = _split_rows(L, caps, R * k)                                   # (S, R·k)
    if k > 1:
        counts = _split_micro_steps(L, caps, counts.reshape(S, k, R).sum(2), R)
    # group g of step s -> (micro j = g // R, rank position g % R), then shuffled.
    group_of = np.repeat(np.tile(np.arange(R * k), S), counts.reshape(-1))
    j, rpos = np.divmod(group_of, R)
    if rng is not None:
        rank_map = np.argsort(rng.random((S, R)), axis=1)
        micro_map = np.argsort(rng.random((S, k)), axis=1)
        rank = rank_map[step_of, rpos]
        j = micro_map[step_of, j]
    else:
        rank = rpos
    step = order_of_step[step_of]
    slot = (step * R + rank) * k + j
    return out_perm, slot, np.int64(S)


def check_padded(global_batch_size: int | None, stages: Any) -> None:
    """What ``cost="padded"`` supports: ``global_batch_size`` mode without stages."""
    if global_batch_size is None:
        raise ValueError("cost='padded' plans fixed-size padded batches (global_batch_size); with "
                         "max_tokens_per_rank use a packing collator (PackedCollator), whose cost is the "
                         "real tokens")
    if stages is not None:
        raise ValueError("cost='padded' does not combine with stages=")


def _micro_rows(L: np.ndarray, micro_n: np.ndarray) -> np.ndarray:
    """(S·k, width) rows of every step's micro-steps (contiguous runs of ``micro_n`` samples)."""
    S, k = micro_n.shape
    width = max(1, int(micro_n.max()))
    start = np.concatenate([np.zeros((S, 1), np.int64), np.cumsum(micro_n, 1)[:, :-1]], 1)
    cols = np.arange(width)[None, None, :]
    idx = np.minimum(start[:, :, None] + cols, max(L.shape[1] - 1, 0))
    rows = np.take_along_axis(L[:, None, :].repeat(k, 1), idx, 2) if L.shape[1] else np.zeros((S, k, width),
                                                                                             np.int64)
    return np.where(cols < micro_n[:, :, None], rows, 0).reshape(S * k, width)


def _micro_cost(L: np.ndarray, micro_n: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Each micro-step split over the R ranks on its own: ((S, k·R) group sizes, (S,) Σ_micro max)."""
    S, k = micro_n.shape
    rows = _micro_rows(L, micro_n)
    counts = _split_rows(rows, micro_n.reshape(-1), R)
    worst = (counts * _heads(np.maximum(rows, 1), counts)).max(1).reshape(S, k).sum(1)
    return counts.reshape(S, k * R), worst


def _split_micro_steps(L: np.ndarray, n: np.ndarray, micro_n: np.ndarray, R: int) -> np.ndarray:
    """Micro-step sizes for ``Σ_micro max_rank``: start from the R·k-group split's boundaries, then
    move each boundary between neighbouring micro-steps (by ±1, ±2, ±4, ±8 samples, each micro-step
    keeping >= R) while that lowers the step's sum. Returns (S, k·R) group sizes."""
    S, k = micro_n.shape
    counts, best = _micro_cost(L, micro_n, R)
    floor = np.minimum(R, micro_n.min(1))          # fewer samples than slots: keep what pass 1 gave
    # A few sizes of move and two rounds: most of the gain for a bounded planning time (each try
    # re-splits every micro-step, ~30 vectorised bisection probes).
    shifts = (1, -1, 2, -2, 4, -4, 8, -8)
    for _ in range(2):
        improved = False
        for j in range(k - 1):
            for d in shifts:
                trial = micro_n.copy()
                trial[:, j] += d
                trial[:, j + 1] -= d
                ok = (trial[:, j] >= floor) & (trial[:, j + 1] >= floor)
                if not ok.any():
                    continue
                trial = np.where(ok[:, None], trial, micro_n)
                c, cost = _micro_cost(L, trial, R)
                better = ok & (cost < best)
                if better.any():
                    improved = True
                    micro_n = np.where(better[:, None], trial, micro_n)
                    counts = np.where(better[:, None], c, counts)
                    best = np.where(better, cost, best)
        if not improved:
            break
    return counts
