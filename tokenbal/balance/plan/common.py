"""What every planning mode shares: the plan itself (:class:`EpochPlan`), the default window, the
step sizes of ``global_batch_size`` mode, and the window fill (``_fill``: costs laid out window by
window, :func:`tokenbal.balance.partition.fill_windows`, the steps renumbered)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tokenbal.balance.partition import fill_windows

# global_batch_size mode: the window fill places up to this many items per rank per window in
# one vectorised round (0 or 1/R: the exact one-item-at-a-time loop). Measured with
# scripts/bench_balance.py at (512 ranks, N=1024, 400 steps, seed 0), mean / p95 of per-step
# max/mean: exact 1.0085 / 1.0215; R/4 items per round 1.0091 / 1.0219; R 1.0093 / 1.0233;
# 2R 1.0096 / 1.0253 (seeds 1-3: <= 1.0097 / 1.0276). Rounds cost about the same whatever their
# size (one pass over every bin of a window), so 2R plans 1M samples 4.7-6.6x faster than exact.
# At least _BATCH_MIN items per round: with 8 ranks, 2R = 16 is no faster than the exact loop
# for 1M samples (~2.3 s), 64 takes ~0.9 s at the same balance ((8, 16): 1.0019 / 1.0057 vs exact
# 1.0017 / 1.0060; (8, 64): 1.0003 / 1.0011 vs 1.0002 / 1.0011).
_BATCH_PER_RANK = 2
_BATCH_MIN = 64
# Count mode: equal costs in permutation order (0: in dataset index order, as PLAN_VERSION 5).
_TIE_BY_POS = 1


@dataclass(frozen=True)
class EpochPlan:
    """Steps × ranks × micro-batches lists of dataset indices, stored flat.

    Micro-batch ``j`` of (step s, rank r) is ``indices[offsets[m]:offsets[m + 1]]`` with
    ``m = (s * num_replicas + r) * grad_accum + j``, in ascending dataset index order. With
    ``grad_accum == 1`` a micro-batch is the rank-step.
    """

    num_replicas: int
    indices: np.ndarray                 # int64, every planned sample once
    offsets: np.ndarray                 # int64, num_steps * num_replicas * grad_accum + 1
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # drop_last tail
    grad_accum: int = 1
    skipped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # oversize="skip"

    @property
    def num_steps(self) -> int:
        return (len(self.offsets) - 1) // (self.num_replicas * self.grad_accum)

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def slot(self, step: int, rank: int) -> np.ndarray:
        """All of (step, rank)'s samples (its micro-batches one after the other)."""
        i = (step * self.num_replicas + rank) * self.grad_accum
        return self.indices[self.offsets[i]:self.offsets[i + self.grad_accum]]

    def micro(self, step: int, rank: int, j: int) -> np.ndarray:
        i = (step * self.num_replicas + rank) * self.grad_accum + j
        return self.indices[self.offsets[i]:self.offsets[i + 1]]

    def rank_steps(self, rank: int, start: int = 0) -> list[list[int]]:
        """Rank ``rank``'s dataset indices for steps ``start, start + 1, ...``."""
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas}), got {rank}")
        return [self.slot(s, rank).tolist() for s in range(start, self.num_steps)]

    def micro_counts(self) -> np.ndarray:
        """(num_steps, num_replicas, grad_accum) number of samples per micro-batch."""
        return np.diff(self.offsets).reshape(self.num_steps, self.num_replicas, self.grad_accum)

    def counts(self) -> np.ndarray:
        """(num_steps, num_replicas) number of samples per rank-step."""
        return self.micro_counts().sum(2)

    @property
    def num_empty(self) -> int:
        """Empty micro-batches (rank-steps when ``grad_accum == 1``)."""
        return int((self.micro_counts() == 0).sum())

    def step_max_item(self, lengths: np.ndarray) -> np.ndarray:
        """(num_steps,) largest single sample of each step (for :func:`step_lower_bound`)."""
        lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
        per_step = self.num_replicas * self.grad_accum
        step_of = np.repeat(np.arange(len(self.offsets) - 1) // per_step, np.diff(self.offsets))
        out = np.zeros(self.num_steps, np.int64)
        np.maximum.at(out, step_of, lens[self.indices])
        return out

    def micro_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """(num_steps, num_replicas, grad_accum) int64 tokens per micro-batch."""
        lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
        csum = np.concatenate([[0], np.cumsum(lens[self.indices])])
        return (csum[self.offsets[1:]] - csum[self.offsets[:-1]]).reshape(
            self.num_steps, self.num_replicas, self.grad_accum)

    def step_rank_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """(num_steps, num_replicas) int64 tokens per rank-step for the given per-sample lengths."""
        return self.micro_tokens(lengths).sum(2)


def default_window(num_replicas: int, global_batch_size: int | None = None, *,
                   max_tokens_per_rank: int | None = None, mean_length: float = 1.0) -> int:
    """Steps per balancing window when the caller does not choose.

    ``global_batch_size`` mode: at least 16 steps, enough for ~512 samples per rank and ~16k
    samples in a window. Measured (scripts/bench_balance.py, docs/bench/balance.md): with 2
    samples per rank per step, balance improves with the window because the fill can build the
    steps that hold giant samples out of other big samples from more steps (64 ranks, N=128:
    window 32 -> mean max/mean 1.016, 128 -> 1.004; 512 ranks, N=1024: window 64 -> 1.010 / p95
    1.025, 256 -> 1.002 / 1.006). Planning time grows linearly with the window (a round is a pass
    over a window's bins; a window of W steps needs ~W·N / 2R rounds): 1M samples on 512 ranks
    take ~2.7 s CPU at 256 steps, ~1 s at 64. Capped at 256 steps. With ``stages`` (and
    ``grad_accum=1``) :func:`plan_epoch` pools twice this many steps (see ``_profile_fill``).

    ``max_tokens_per_rank`` mode: the window is the chunk of the permutation that first-fit
    decreasing packs on its own (``_budget_fill``): up to 16 steps, kept near 4096 samples, so
    which samples can share a step is redrawn every epoch.
    """
    R = int(num_replicas)
    if max_tokens_per_rank is not None:
        per_step = R * max_tokens_per_rank / max(mean_length, 1.0)
        return int(min(16, max(1, round(4096 / per_step))))
    if global_batch_size is None:
        raise ValueError("give global_batch_size or max_tokens_per_rank")
    N = int(global_batch_size)
    return int(min(256, max(16, math.ceil(512 * R / N), math.ceil(16384 / N))))


def _count_steps(n: int, N: int, R: int, drop_last: bool) -> tuple[np.ndarray, int]:
    """Items per step and how many samples are kept, for global_batch_size mode."""
    if drop_last:
        S = n // N
        return np.full(S, N, np.int64), S * N
    if n == 0:
        return np.zeros(0, np.int64), 0
    S = -(-n // N)
    caps = np.full(S, N, np.int64)
    caps[-1] = n - (S - 1) * N
    if S > 1 and caps[-1] < R:
        # A last step with fewer samples than ranks would leave ranks empty: merge it.
        caps = caps[:-1].copy()
        caps[-1] += n - S * N + N
    return caps, n


def _sorted_windows(lens: np.ndarray, perm: np.ndarray, win_of_item: np.ndarray, G: int,
                    shuffled: bool = False, order_key: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Lay the windows' items out as rows sorted by length desc (or by ``order_key``, int >= 0 per
    item of ``perm``), then (``shuffled``) by position in the permutation, else by dataset index."""
    key = lens[perm] if order_key is None else order_key

    # Equal lengths in permutation order: the fill is a function of the costs alone, so breaking
    # ties by dataset index would give equal-length samples the same places every epoch.
    tie = np.arange(len(perm)) if shuffled and _TIE_BY_POS else perm
    order = _argsort_keys(win_of_item, int(key.max(initial=0)) - key, tie)
    counts = np.bincount(win_of_item, minlength=G)
    start = np.concatenate([[0], np.cumsum(counts)])
    w_sorted = win_of_item[order]
    pos = np.arange(len(order)) - start[w_sorted]
    M = int(counts.max()) if G else 0
    return order, w_sorted, pos, M


def _argsort_keys(*keys: np.ndarray) -> np.ndarray:
    """Lexicographic argsort, first key most significant, all keys int >= 0, the last key unique
    (both callers end with the permutation), so every packed value is distinct.

    Packs the keys into one int64 when they fit (one argsort is ~5x faster than np.lexsort on a
    million items); falls back to lexsort otherwise. Distinct values make the order independent
    of the sort's stability, so the faster unstable sort gives the same answer (~2x on 1M).
    """
    if not len(keys[0]):
        return np.zeros(0, np.int64)
    packed = np.zeros(len(keys[0]), np.int64)
    span = 1
    for k in reversed(keys):
        top = int(k.max()) + 1
        if span * top >= 2**62:
            return np.lexsort(keys[::-1])
        packed += k.astype(np.int64) * span
        span *= top
    return np.argsort(packed)


def _scaled(lens_sorted: np.ndarray, M: int, exact: bool = True) -> tuple[np.ndarray, int]:
    # Cost' = tokens * C + 1 with C > items per window: loads then compare by (tokens, item count),
    # every item costs >= 1 (so an empty rank is always the least loaded), and a token budget B
    # maps exactly to load' <= B * C + C - 1.
    C = M + 1
    limit = (np.iinfo(np.int64).max >> 2) // C
    top = int(lens_sorted.max()) if lens_sorted.size else 0
    if top * max(M, 1) >= limit:
        if exact:
            raise ValueError("lengths too large to plan exactly in int64 (tokens × window size overflow)")
        # Costs this large (tokens² stage costs, FLOPs, over a window of 100k+ items) do not fit
        # the key: without a budget to hold exactly, balance them in units of `unit`, rounded up so
        # no cost becomes 0; the error per item is below unit / top < (M + 1)² / 2**61 of the largest.
        unit = top * max(M, 1) // limit + 1
        lens_sorted = -(-lens_sorted // unit)
    return lens_sorted * C + 1, C


def _fill(lens: np.ndarray, perm: np.ndarray, win_of_item: np.ndarray, cap2d: np.ndarray, R: int,
          capacity: int | None, force_nonempty: bool, shuffled: bool = False,
          order_key: np.ndarray | None = None, batch_per_rank: float | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Run the window fill; returns (steps per window, step-in-window, rank, failed windows).

    Steps left without any sample (possible only in token mode) are squeezed out, so the steps
    of window g are always numbered 0 .. steps[g] - 1.
    """
    G = cap2d.shape[0]
    order, w_sorted, pos, M = _sorted_windows(lens, perm, win_of_item, G, shuffled, order_key)
    x, C = _scaled(lens[perm[order]], M, exact=capacity is not None)
    costs = np.zeros((G, M), np.int64)
    costs[w_sorted, pos] = x
    # A bin never holds more than its whole window, so clamping the budget there changes nothing
    # and keeps the scaled budget inside int64.
    cap_scaled = None if capacity is None else min(capacity, int(x.sum()) // C + 1) * C + C - 1
    # Count mode places max(_BATCH_PER_RANK * R, _BATCH_MIN) items per window per round (a few %
    # of a window's items at a time); token mode keeps the exact one-at-a-time fill (its windows
    # are small). _BATCH_PER_RANK = 0 selects the exact fill everywhere (benchmarks, tests).
    batch = 1
    if capacity is None and not force_nonempty and _BATCH_PER_RANK > 0:
        batch = max(int((_BATCH_PER_RANK if batch_per_rank is None else batch_per_rank) * R), _BATCH_MIN)
    s2d, r2d, failed = fill_windows(costs, cap2d, R, capacity=cap_scaled, force_nonempty=force_nonempty,
                                    batch=batch)
    step_w = np.full(len(perm), -1, np.int64)
    rank_w = np.full(len(perm), -1, np.int64)
    step_w[order] = s2d[w_sorted, pos]
    rank_w[order] = r2d[w_sorted, pos]
    placed = step_w >= 0
    used = np.zeros(cap2d.shape, bool)
    used[win_of_item[placed], step_w[placed]] = True
    renum = np.cumsum(used, axis=1) - 1
    step_w[placed] = renum[win_of_item[placed], step_w[placed]]
    return used.sum(1), step_w, rank_w, failed
