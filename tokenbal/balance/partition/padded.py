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
``DistributedSampler`` by ``scripts/bench_balance.py --padded`` (docs/BENCHMARKS.md, issue 30).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PADDED_COST", "min_max_padded_split", "plan_padded", "plan_epoch_padded", "check_padded",
           "padded_micro_tokens", "padded_summary", "padded_comparison", "batch_rebalance_plan",
           "distributed_sampler_plan"]

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


def plan_epoch_padded(lens: np.ndarray, R: int, N: int, *, seed: int, epoch: int, shuffle: bool,
                      drop_last: bool, window: int | None, grad_accum: int) -> Any:
    """:func:`tokenbal.balance.plan.plan_epoch` for ``cost="padded"`` (its hook; same guarantees:
    exactly N samples per step but a merged tail, every sample once, no empty rank when n >= R·k)."""
    from tokenbal.balance.plan import EpochPlan, _count_steps, default_window

    k = int(grad_accum)
    rng = np.random.default_rng([seed, epoch])
    n = len(lens)
    perm = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    caps, kept = _count_steps(n, N, R * k, drop_last)
    dropped = np.sort(perm[kept:])
    perm = perm[:kept]
    W = min(window or default_window(R * k, N), max(1, len(caps)))
    if window is None and len(caps):
        W = -(-len(caps) // max(1, len(caps) // W))      # equal windows, as plan_epoch's count mode
    perm, slot, S = plan_padded(lens, perm, caps, R, k, W, rng if shuffle else None)
    order = np.lexsort((perm, slot))
    offsets = np.zeros(int(S) * R * k + 1, np.int64)
    np.cumsum(np.bincount(slot, minlength=int(S) * R * k), out=offsets[1:])
    return EpochPlan(num_replicas=R, indices=perm[order].astype(np.int64), offsets=offsets,
                     dropped=dropped.astype(np.int64), grad_accum=k)


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


# -- metrics and the baselines ------------------------------------------------------------------


def padded_micro_tokens(plan: Any, lengths: np.ndarray) -> np.ndarray:
    """(num_steps, num_replicas, grad_accum) padded tokens of every micro-batch of an
    :class:`~tokenbal.balance.plan.EpochPlan`: samples × longest sample (0 when empty)."""
    lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
    counts = np.diff(plan.offsets)
    vals = lens[plan.indices]
    longest = np.zeros(len(counts), np.int64)
    nonempty = counts > 0
    if vals.size:
        longest[nonempty] = np.maximum.reduceat(vals, plan.offsets[:-1][nonempty])
    return (counts * longest).reshape(plan.num_steps, plan.num_replicas, plan.grad_accum)


def padded_summary(plan: Any, lengths: np.ndarray) -> dict[str, float]:
    """What a padded step costs under this plan:

    * ``sum_max_padded``: Σ over steps and micro-batches of the slowest rank's padded tokens (the
      time every rank spends when each micro-batch waits for its largest one);
    * ``padded_over_real``: all padded tokens / all real tokens (1.0 = nothing padded);
    * ``peak_padded``: the largest micro-batch in padded tokens (what activation memory must hold);
    * ``real_max_over_mean``: mean over steps of the real-token max/mean across ranks.
    """
    lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
    padded = padded_micro_tokens(plan, lens)
    real = plan.micro_tokens(lens)
    rank_real = real.sum(2).astype(np.float64)
    mean = rank_real.mean(1)
    ratio = np.divide(rank_real.max(1), mean, out=np.ones(len(mean)), where=mean > 0)
    return {"steps": int(plan.num_steps), "sum_max_padded": int(padded.max(1).sum()),
            "padded_over_real": float(padded.sum() / max(1, real.sum())),
            "peak_padded": int(padded.max(initial=0)),
            "real_max_over_mean": float(ratio.mean()) if ratio.size else 1.0}


def padded_comparison(lengths: Any, num_replicas: int, global_batch_size: int, grad_accum: int = 1, *,
                      seed: int = 0) -> str:
    """The table ``tokenbal plan simulate --padded`` prints: padded and packed cost of
    DistributedSampler, transformers' BatchRebalanceSampler (when transformers has it) and tokenbal's
    plans (token cost, padded cost), on the same lengths."""
    from tokenbal.balance.plan import plan_epoch

    lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
    R, N, k = int(num_replicas), int(global_batch_size), int(grad_accum)
    if N % (R * k):
        raise ValueError(f"--padded needs a global batch size divisible by ranks x grad_accum ({R * k}): the "
                         "padded baselines take per-device batches of global / (ranks x grad_accum)")
    b = N // (R * k)
    plans = {"DistributedSampler": distributed_sampler_plan(lens, R, b, k, seed=seed)}
    try:
        plans["batch_rebalance (transformers)"] = batch_rebalance_plan(lens, R, b, k, seed=seed)
    except ImportError:
        pass
    plans["tokenbal (cost tokens)"] = plan_epoch(lens, R, global_batch_size=N, grad_accum=k, seed=seed)
    plans["tokenbal (cost padded)"] = plan_epoch(lens, R, global_batch_size=N, grad_accum=k, seed=seed,
                                                 cost="padded")
    lines = [f"padded micro-batches of {b} per rank (each padded to its longest sample), {k} per step; "
             "packed = the same batches with no padding",
             f"{'method':<34}{'Σ max padded':>14}{'padded/real':>12}{'peak':>9}{'Σ max packed':>14}"]
    for name, plan in plans.items():
        r = padded_summary(plan, lens)
        packed = int(plan.micro_tokens(lens).max(1).sum())
        lines.append(f"{name:<34}{r['sum_max_padded']:14d}{r['padded_over_real']:12.3f}{r['peak_padded']:9d}"
                     f"{packed:14d}")
    return "\n".join(lines)


def _plan_from_lists(per_rank: list[list[list[int]]], R: int, k: int) -> Any:
    """An EpochPlan holding ``per_rank[r]`` = rank r's micro-batches (all ranks the same count)."""
    from tokenbal.balance.plan import EpochPlan

    steps = len(per_rank[0]) // k
    flat, offsets = [], [0]
    for s in range(steps):
        for r in range(R):
            for j in range(k):
                mb = per_rank[r][s * k + j]
                flat.extend(mb)
                offsets.append(offsets[-1] + len(mb))
    return EpochPlan(R, np.asarray(flat, np.int64), np.asarray(offsets, np.int64), grad_accum=k)


def batch_rebalance_plan(lengths: np.ndarray, num_replicas: int, per_device_batch: int, grad_accum: int = 1,
                         *, seed: int = 42, drop_last: bool = False, epoch: int = 0) -> Any:
    """transformers' own ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``) run
    for every rank, as the Trainer builds it (effective batch = per-device × ranks × accumulation),
    collected into an EpochPlan. Needs transformers >= 5.24."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    R, k = int(num_replicas), int(grad_accum)
    lens = [int(x) for x in np.asarray(getattr(lengths, "lengths", lengths))]
    per_rank = []
    for r in range(R):
        s = BatchRebalanceSampler(lengths=lens, effective_batch_size=int(per_device_batch) * R * k, dp_size=R,
                                  grad_accum=k, seed=seed, rank=r, drop_last=drop_last)
        s.set_epoch(epoch)
        per_rank.append([list(b) for b in s])
    return _plan_from_lists(per_rank, R, k)


def distributed_sampler_plan(lengths: np.ndarray, num_replicas: int, per_device_batch: int,
                             grad_accum: int = 1, *, seed: int = 0, epoch: int = 0) -> Any:
    """``DistributedSampler(shuffle=True, drop_last=False)`` + ``per_device_batch`` batches per rank,
    as the Trainer's default loader does: a seeded permutation padded by repeating its head to a
    multiple of the ranks, rank r taking every R-th sample; a last short batch is kept."""
    from torch.utils.data import BatchSampler, DistributedSampler

    R, k, b = int(num_replicas), int(grad_accum), int(per_device_batch)
    n = len(np.asarray(getattr(lengths, "lengths", lengths)))
    per_rank = []
    for r in range(R):
        ds = DistributedSampler(range(n), num_replicas=R, rank=r, shuffle=True, seed=seed, drop_last=False)
        ds.set_epoch(epoch)
        per_rank.append([list(x) for x in BatchSampler(ds, b, drop_last=False)])
    # Whole optimizer steps only (the Trainer also runs a last partial one, with fewer micro-batches).
    m = len(per_rank[0]) - len(per_rank[0]) % k
    return _plan_from_lists([p[:m] for p in per_rank], R, k)
