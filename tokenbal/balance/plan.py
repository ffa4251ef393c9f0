"""Plan one epoch: which samples every rank reads at every step.

:func:`plan_epoch` is a pure function of ``(lengths, num_replicas, settings, seed, epoch)``: every
rank calls it with the same arguments and gets the same :class:`EpochPlan` without talking to
the others. The sampler (:mod:`tokenbal.balance.sampler`) only slices it.

How a plan is made
------------------
1. Permute the samples with ``np.random.default_rng([seed, epoch])`` (identity if not shuffling).
2. Cut the permutation into steps of ``global_batch_size`` samples each and group consecutive
   steps into *windows*. (``max_tokens_per_rank`` mode instead packs the epoch into budget-sized
   rank-steps with first-fit decreasing over chunks of ``window`` steps' tokens, see
   ``_budget_fill``, and then continues at 4 with the whole epoch as one window.)
3. Inside each window, decide which samples share a step and which rank gets each one.
   *Count mode without stages* (``_plan_counts``, PLAN_VERSION 8): windows of up to
   ``_GROUPED_ITEMS`` (4M) samples, each split by :func:`tokenbal.balance.partition.grouped_fill`
   (rank-steps filled by rounds of least-loaded bins, then bins of like load cut into steps: a
   few linear-time sorts, so 1M samples on 512 ranks plan in ~0.5 s as one window, and 100M on
   4,096 ranks in ~1 min, window by window, written straight into the plan). Sizes are jittered
   before the sort when shuffling. Where it is cheap (short epochs) the window fill below runs
   too and the better split is kept. *With stages* (count mode, ``grad_accum=1``, PLAN_VERSION 9):
   the same windows, split by :func:`tokenbal.balance.partition.grouped.grouped_stage_fill` (the
   rounds on the summed cost, then the bins cut into steps along the order with the lowest
   ``Σ_stage max_rank``), and the heaviest steps (up to ``_STAGE_REFILL_ITEMS`` samples) composed
   again by version 7's stage composition, kept where faster (``_plan_stage_window``); a short epoch
   is also planned whole by version 7 and the faster plan kept, then leveled by swaps among all its
   steps (PLAN_VERSION 10), and its heaviest steps composed again from their pooled samples where
   that is faster (PLAN_VERSION 11, ``_level_stage_plan``). *With a token budget*:
   :func:`tokenbal.balance.partition.fill_windows` (largest first; fill the gaps of steps that
   hold a big sample with the next big ones, otherwise least-loaded rank) over windows of
   :func:`default_window` steps. Balancing a whole window is what makes heavy-tailed data
   balance: a step holding a 16k-token video gets enough other big samples to keep its other
   ranks busy, which per-step balancing cannot arrange.
4. Shuffle the order of the steps inside each window (the fills work largest-first, and
   without this the window would be a length curriculum) and which rank gets which bin.

Guarantees (tested in tests/tokenbal/balance/test_plan.py)
-----------------------------------------
* Every rank has the same number of steps (``plan.num_steps``).
* ``drop_last=False``: every sample appears exactly once. ``global_batch_size`` mode: every step
  has exactly N samples except the last; if the last would have fewer than ``num_replicas``
  samples it is merged into the one before (which then has N + t < N + R samples).
* ``drop_last=True`` (``global_batch_size`` mode): the last ``n % N`` samples of this epoch's
  permutation are left out (``plan.dropped``) and every step has exactly N samples. In
  ``max_tokens_per_rank`` mode there is no partial step to drop and ``drop_last`` has no effect.
* ``global_batch_size`` mode: if ``n >= num_replicas`` samples are planned, every rank gets at
  least one sample in every step (each step has >= R samples, and the fill never gives a rank a
  second sample while another rank of the same step has none). With ``n < R`` (and
  ``drop_last=False``) there is one step, and ``R - n`` ranks get an empty list in it; the step
  count is still the same everywhere. ``drop_last=True`` with ``n < N`` plans zero steps.
* ``max_tokens_per_rank``: no rank-step ever exceeds the budget. The epoch is packed into about
  as few rank-steps as first-fit decreasing needs (chunks of the random permutation, small samples
  placed in random order, so step composition changes every epoch; see ``_budget_fill``), the
  bins are dealt to steps at random, and the one step with spare rank-steps is re-spread over all
  ranks. A rank-step is empty only when the samples are too few for the plan's ``steps × R`` rank
  slots (e.g. samples close to the budget size, or fewer samples than ranks).
  ``plan.num_empty`` counts them.
  Samples over the budget follow ``oversize``: ``"error"`` (default, lists them), ``"skip"``
  (left out, ``plan.skipped``) or ``"alone"`` (each alone in a rank-step of extra steps).
* ``grad_accum=k``: every rank has exactly k micro-batches in every step. The step is planned
  over R·k virtual ranks, so micro-batch j of every rank is balanced against the others (each
  micro-batch runs its own FSDP collectives) and the budget of ``max_tokens_per_rank`` holds per
  micro-batch. With ``global_batch_size >= R·k`` no micro-batch is empty.
* ``cost=``: the planner balances any integer cost per sample (:mod:`tokenbal.balance.cost`), e.g. FLOPs
  as token-equivalents; the guarantees above hold for it unchanged.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field

import numpy as np

from tokenbal._checks import check_lengths
from tokenbal._checks import nonneg_int as _nonneg_int
from tokenbal.balance.cost import resolve
from tokenbal.balance.partition import fill_windows
from tokenbal.balance.settings import PlanSettings, plan_settings

logger = logging.getLogger("tokenbal")

__all__ = ["EpochPlan", "plan_epoch", "default_window", "check_lengths", "check_settings", "PLAN_VERSION"]

# Bump when the same inputs would give a different plan (the sampler's resume fingerprint uses it).
PLAN_VERSION = 11
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
# Token mode: bins a chunk's first-fit leaves below this fill are packed again, _REPACK_FAN chunks'
# worth together, then _REPACK_FAN of those groups, ... (see _budget_fill).
_REPACK_BELOW = 0.99
_REPACK_FAN = 8
# Token mode: items up to budget / _SMALL_ITEM are packed after the others, in random order.
_SMALL_ITEM = 32
_BATCH_MIN = 64
# Stage mode (count mode, grad_accum 1): the items of a window (of _STAGE_WINDOW × the default
# window's steps) are ordered by their stage shares and cut into sub-windows of _STAGE_GROUP steps,
# each filled on its own (see _profile_fill). Measured with scripts/bench_balance.py --stages.
_STAGE_GROUP = 32
_STAGE_WINDOW = 2
_CROSS_MAX_RANKS = 64
# Stage mode: the share key gets a random offset of up to this fraction, so samples of nearby
# shares (not only equal ones) trade sub-windows from epoch to epoch.
_STAGE_JITTER = 0.1
# Stage mode: sizes are multiplied by up to 1 + this at random before the composition sorts them.
_COMPOSE_JITTER = 0.3
# Stage mode (compose): at most this many rounds of the in-step refinement after the cross-step
# swaps. At (512, 1024) on 4 random mixtures (sorted composition alone, before the profile-fill
# candidate was added): 16 rounds 1.0972 / 1.0815 / 1.0924 / 1.0991 in 5.6 s, unlimited 1.0939 /
# 1.0740 / 1.0924 / 1.0984 in 9.7 s.
_REFINE_ROUNDS = 16
# Stage mode: compose steps by stage-cost vectors (_compose_fill, PLAN_VERSION 7); 0: version 6's
# profile fill (_profile_fill), kept for comparison.
_STAGE_COMPOSE = 1
# Stage mode (compose): per window, also try version 6's profile fill and keep the better split.
_COMPOSE_WITH_FILL = 1
# Stage mode (compose): leveling rounds of the cross-step swaps (16 elsewhere). At (512, 1024), 40
# steps, on the 4 random mixtures that missed their target with 16 (figure / target): 16 rounds
# 1.0407 / 1.0238 / 1.0309 / 1.0238 in 5.9 s, 32: 1.0368 / 1.0197 / 1.0187 / 1.0187 in 7.1 s,
# 48: 1.0358 / 1.0179 / 1.0168 / 1.0137 in 8.5 s, 96: 1.0275 / 1.0166 / 1.0102 / 1.0069 in 12.9 s.
_COMPOSE_LEVEL_ROUNDS = 32
# Stage mode (PLAN_VERSION 9): windows of up to _GROUPED_ITEMS samples split by the grouped stage fill
# (_plan_stage_window); the heaviest steps, up to _STAGE_REFILL_ITEMS samples, planned again by
# version 7's composition (_compose_fill) and kept where that is faster. 0: version 7's plan.
_STAGE_GROUPED = 1
# Stage mode: items per rank per round of the fill that splits each composed step (_BATCH_PER_RANK = 2
# elsewhere). At 2 (and at 1) a round gives every rank one item, so every rank of a step gets the
# same count and a giant sample gets partners it cannot afford; a quarter of the ranks per round
# leaves the giants' ranks alone while the others take several (draw 4 at 4,096 ranks, 24 steps:
# epoch figure 1.445 -> 1.349, length-grouped floor 1.317; draw 0: 3.563 -> 3.490).
_COMPOSE_SPLIT_BATCH = 0.25
# Refilled samples per window: 1M samples on 512 ranks, draws 0 / 1 / 2 (with _STAGE_SHARE_GROUPS):
# 2^16 1.0368 / 1.0507 / 1.0355 in ~3.8 s, 3·2^15 1.0364 / 1.0533 / 1.0294, 2^17 1.0349 / 1.0556 / 1.0319
# in ~5 s.
_STAGE_REFILL_ITEMS = 1 << 16
# Stage mode: the grouped stage fill runs on G groups of the window's samples by stage share, for each G
# here, the fastest kept. 1M samples on 512 ranks, draws 0 / 1 / 2: G = 1 1.0442 / 1.0692 / 1.0390,
# 2 1.0392 / 1.0549 / 1.0323, 4 1.0348 / 1.0620 / 1.0316 (PLAN_VERSION 8: 1.0315 / 1.0510 / 1.0282).
_STAGE_SHARE_GROUPS = (2, 4)
# Long epochs' refill: in-step refinement rounds (16 elsewhere). 1M samples on 512 ranks, draws 0 / 1 / 2
# (2^17 refilled, one group): 16 rounds 1.0606 / 1.0719 / 1.0400, 4 rounds 1.0608 / 1.0723 (6) / 1.0401
# in ~1 s less.
_STAGE_REFILL_ROUNDS = 4
_STAGE_REFILL_FRACTIONS = (1, 2, 4)
_STAGE_WHOLE_ITEMS = 1 << 18
# The final leveling of a short stage epoch (_level_stage_plan): every step trades samples with every
# other, up to _STAGE_LEVEL_ROUNDS rounds and _STAGE_LEVEL_WORK samples x rounds (a round costs
# ~0.2 us per sample: 40k samples ~9 ms, 196k ~40 ms; the budget caps it near 7 s), stopping once the
# epoch's stage time has not fallen for _STAGE_LEVEL_PATIENCE rounds. 512 ranks, 40 steps of 1,024,
# draw 9: 1.1197 unleveled, 1.0996 / 1.0897 / 1.0859 / 1.0829 after 64 / 256 / 512 / 1,024 rounds;
# 20 draws, worst figure over target: 1.0253 unleveled, 1.0033 after 256 rounds, 1.0018 with a budget
# of 2^24, 1.0009 with 1,024 rounds. With 8 ranks the time falls in rare steps (every bin at a
# maximum must drop): patience 64 stopped draw 9 at 1.0186, 256 reached 1.0166 (as 1,024 rounds did).
# See docs/bench/balance.md, "PLAN_VERSION 10".
_STAGE_LEVEL_ROUNDS = 1024
_STAGE_LEVEL_WORK = 1 << 25
_STAGE_LEVEL_PATIENCE = 256
# Short stage epochs, after the leveling (PLAN_VERSION 11): the heaviest 2 / 4 / 8 / 16 steps
# (up to 2^16 samples) composed again from their pooled samples, the best pool kept where faster;
# 0: off. 4,096 ranks, 24 steps, 20 square draws: 11 faster, none slower, draw 9 1.1812 -> 1.1205
# (target 1.1496), worst over target 2.75 % -> 1.20 %, for ~3 s more CPU per plan. See
# docs/bench/balance.md, "PLAN_VERSION 11".
_STAGE_POOL = 1
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


def plan_epoch(lengths: object, num_replicas: int | None = None, *, global_batch_size: int | None = None,
               max_tokens_per_rank: int | None = None, seed: int = 0, epoch: int = 0,
               shuffle: bool = True, drop_last: bool = False, window: int | None = None,
               grad_accum: int = 1, cost: object = None, oversize: str = "error",
               stages: object = None, settings: PlanSettings | None = None) -> EpochPlan:
    """Plan one epoch for ``num_replicas`` ranks. See the module docstring for the guarantees.

    Two spellings of the same plan: ``plan_epoch(lengths, R, global_batch_size=N, ...)``, or
    ``plan_epoch(resolve(lengths, cost, stages), settings=PlanSettings(R, N, ...), seed=, epoch=)``
    (:func:`tokenbal.balance.cost.resolve`, :class:`tokenbal.balance.settings.PlanSettings`): the
    arrays and the settings checked once, by whoever made them (the sampler replans every epoch
    that way). Keyword settings next to ``settings=`` must agree with it.

    ``lengths``: per-sample non-negative integer costs (tokens), an object with ``.lengths``, or a
    :class:`tokenbal.balance.cost.Resolved` (then without ``cost`` / ``stages``).
    Exactly one of ``global_batch_size`` (samples per step, all ranks together, >= num_replicas
    × grad_accum) and ``max_tokens_per_rank`` (budget per rank per step, per micro-batch when
    ``grad_accum > 1``) must be given. ``window``: steps balanced together (default
    :func:`default_window`); 1 means per-step balancing only.

    ``cost``: what to balance (:func:`tokenbal.balance.cost.resolve_costs`: ``"tokens"``, ``"flops"``, a
    FlopsModel, an array or a callable); the budget of ``max_tokens_per_rank`` is then in those
    (token-equivalent) units. ``grad_accum=k``: every rank gets exactly k micro-batches per step,
    and micro-batch j is balanced across ranks and against the other micro-batches (the step is
    planned over R·k virtual ranks). ``oversize`` (token mode, samples over the budget):
    ``"error"`` lists them, ``"skip"`` leaves them out (``plan.skipped``), ``"alone"`` gives each
    its own micro-batch in extra steps (one per rank, at random places in the epoch; the last
    such step may leave ranks empty).

    ``stages``: per-sample costs of K stages that each end in a synchronisation of the ranks (under
    FSDP: the vision tower, then the language model): ``True`` splits a FLOPs ``cost`` into vision
    and language, or an (n, K) array (:func:`tokenbal.balance.cost.resolve_stage_costs`). The steps are
    planned on ``cost``, but (with ``grad_accum=1`` in ``global_batch_size`` mode) which samples share
    a step is chosen by their stage-cost vectors: windows of up to 4M samples are split by the grouped
    stage fill, and their heaviest steps by version 7's composition (``_plan_stage_windows``; a short
    epoch also wholly by version 7, the faster kept, then leveled by swaps among all its steps,
    ``_level_stage_plan``). Version 7 (``_compose_fill``): per window,
    several sorted orders
    (by total, by dominant stage, by stage share; sizes jittered per epoch) are cut into steps and the
    one with the lowest floor is kept (:func:`tokenbal.balance.partition.compose.compose_steps`), each
    step split largest first over its ranks; version 6's profile fill (samples ordered by stage share,
    32-step sub-windows filled on the total) is the other candidate; both are refined (samples swapped
    one for one between the steps of the window, then moved and swapped between the ranks of each
    step, while that lowers ``Σ_stage max_rank``) and each window keeps the faster one; the steps are
    then shuffled over the window. Otherwise samples are swapped one for one between micro-steps of
    the same window, and moved and swapped between the ranks of each micro-step, while that lowers
    ``Σ_stage max_rank`` (:func:`tokenbal.balance.partition.swap_stages_across_steps`,
    :func:`tokenbal.balance.partition.refine_stages_many`). The step count, every step's sample count and
    every guarantee above stay the same.
    """
    # A Resolved was checked when it was made; anything else is resolved (and checked) here, once.
    resolved = resolve(lengths, cost, stages)
    settings = plan_settings(settings, num_replicas=num_replicas, global_batch_size=global_batch_size,
                             max_tokens_per_rank=max_tokens_per_rank, window=window, grad_accum=grad_accum,
                             shuffle=shuffle, drop_last=drop_last, oversize=oversize)
    lens, stages = resolved.costs, resolved.stages
    settings.check_against(lens)
    R, N, B, window = (settings.num_replicas, settings.global_batch_size, settings.max_tokens_per_rank,
                       settings.window)
    k, oversize = settings.grad_accum, settings.oversize
    shuffle, drop_last = settings.shuffle, settings.drop_last
    if resolved.cost_name == "padded":
        # Padding collators: steps composed for count x longest (tokenbal.balance.partition.padded).
        from tokenbal.balance.partition.padded import check_padded

        check_padded(N, stages)
        return _plan_epoch_padded(lens, R, N, seed=_nonneg_int("seed", seed),
                                 epoch=_nonneg_int("epoch", epoch), shuffle=shuffle, drop_last=drop_last,
                                 window=window, grad_accum=k)
    rng = np.random.default_rng([_nonneg_int("seed", seed), _nonneg_int("epoch", epoch)])
    n = len(lens)
    perm = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    big = np.zeros(0, np.int64)
    if B is not None and oversize != "error":
        over = lens[perm] > B
        big, perm = perm[over], perm[~over]
    profile = False
    R_user, R = R, R * k      # plan k micro-batches per rank as R·k virtual ranks

    if N is not None:
        caps, kept = _count_steps(n, N, R, drop_last)
        dropped = np.sort(perm[kept:])
        perm = perm[:kept]
        # Stages with one micro-batch per step: steps are built from items of similar stage shares
        # (_profile_fill), out of a larger pool. With grad_accum > 1 the plain fill is kept (its
        # per-micro-batch sample counts are what the stage refinement preserves).
        profile = stages is not None and k == 1 and _STAGE_GROUP > 0
        W = min(window or default_window(R, N) * (_STAGE_WINDOW if profile else 1), max(1, len(caps)))
        if window is None and len(caps):
            # Equal windows of >= W steps: a short last window (few steps to spread its giants
            # over) was the worst-balanced part of an epoch.
            W = -(-len(caps) // max(1, len(caps) // W))
        step_win = np.arange(len(caps)) // W
        G = int(step_win[-1]) + 1 if len(caps) else 0
        cap2d = np.zeros((G, W), np.int64)
        cap2d[step_win, np.arange(len(caps)) % W] = caps
        win_of_item = np.repeat(step_win, caps)
        if stages is None or not len(caps):              # (no steps: drop_last with n < N)
            return _plan_counts(lens, perm, caps, R, R_user, k, window, rng if shuffle else None, dropped)
        if profile and _STAGE_COMPOSE and _STAGE_GROUPED:
            perm, win_of_item, steps_in_win, step_w, rank_w = _plan_stage_windows(
                lens, stages, perm, caps, R, window, rng if shuffle else None)
        elif profile and _STAGE_COMPOSE:
            perm, steps_in_win, step_w, rank_w = _compose_fill(lens, stages, perm, win_of_item, cap2d, R,
                                                               rng if shuffle else None)
        elif profile:
            perm, steps_in_win, step_w, rank_w = _profile_fill(lens, stages, perm, win_of_item, cap2d, R,
                                                               min(_STAGE_GROUP, W), rng if shuffle else None)
        else:
            steps_in_win, step_w, rank_w, _ = _fill(lens, perm, win_of_item, cap2d, R, None, False, shuffle)
    else:
        assert B is not None
        caps = None
        dropped = np.zeros(0, np.int64)
        W = window or default_window(R, max_tokens_per_rank=B,
                                     mean_length=float(lens.mean()) if n else 1.0)
        # One window: the whole epoch is packed at once; its steps are shuffled below.
        steps_in_win, step_w, rank_w = _budget_fill(lens, perm, R, B, W, rng if shuffle else None)
        win_of_item = np.zeros(len(perm), np.int64)

    # Step order inside a window: random when shuffling (the fill puts big seeds in the first
    # steps), else by the smallest dataset index in the step so an unshuffled run reads forward.
    G, Wmax = len(steps_in_win), (int(steps_in_win.max()) if len(steps_in_win) else 0)
    exists = np.arange(Wmax)[None, :] < steps_in_win[:, None]
    if shuffle:
        key = rng.random((G, Wmax))
    else:
        key = np.full((G, Wmax), np.inf)
        np.minimum.at(key, (win_of_item, step_w), perm.astype(np.float64))
    key[~exists] = np.inf
    if caps is not None and len(caps) and caps[-1] != N:
        # The one step whose size differs from N (the tail) stays the last step of the epoch.
        key[-1, steps_in_win[-1] - 1] = np.finfo(np.float64).max
    order = np.argsort(key, axis=1, kind="stable")
    new_pos = np.empty_like(order)
    np.put_along_axis(new_pos, order, np.arange(Wmax)[None, :].repeat(G, 0), axis=1)
    win_start = np.concatenate([[0], np.cumsum(steps_in_win)])
    step = win_start[win_of_item] + new_pos[win_of_item, step_w]
    S = int(win_start[-1])
    rank = rank_w
    if shuffle:
        # Which rank gets which bin: the fill gives bin 0 the biggest seed of every step; a
        # random mapping keeps that from always landing on rank 0.
        rank_map = np.argsort(rng.random((S, R)), axis=1)
        rank = rank_map[step, rank_w]

    if stages is not None and not (profile and _STAGE_COMPOSE):    # the composition refined already
        if B is not None:
            # Token mode plans one window; stage swaps stay among W consecutive (shuffled) steps.
            win_of_item = step // W
        # After the profile fill, swaps across steps gain little at many ranks and cost the most
        # there (docs/bench/balance.md); with few ranks they still pay.
        step, rank = _refine_stages(stages, perm, win_of_item, step, rank, S, R_user, k,
                                    lens if B is not None else None, B,
                                    cross=not profile or R_user <= _CROSS_MAX_RANKS)
    slot = step * R + rank
    if B is not None and oversize == "alone" and big.size:
        slot, perm, S = _insert_alone_steps(slot, perm, S, R, big[np.argsort(-lens[big], kind="stable")],
                                            rng, shuffle)
    order = _argsort_keys(slot, perm)
    offsets = np.zeros(S * R + 1, np.int64)
    np.cumsum(np.bincount(slot, minlength=S * R), out=offsets[1:])
    skipped = np.sort(big) if oversize == "skip" else np.zeros(0, np.int64)
    if skipped.size:
        # Counted, never silent: the plan keeps the list (plan.skipped) and the log says how many.
        logger.info("epoch %d: %d sample(s) over max_tokens_per_rank left out (oversize='skip'), "
                    "e.g. %s", epoch, skipped.size, skipped[:5].tolist())
    return EpochPlan(num_replicas=R_user, indices=perm[order].astype(np.int64), offsets=offsets,
                     dropped=dropped.astype(np.int64), grad_accum=k, skipped=skipped.astype(np.int64))


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
    batch = max(int(_BATCH_PER_RANK * R), _BATCH_MIN)
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


def _refine_stages(stages: np.ndarray, perm: np.ndarray, window: np.ndarray, step: np.ndarray,
                   vrank: np.ndarray, S: int, R: int, k: int, lens: np.ndarray | None, budget: int | None,
                   cross: bool = True, rounds: int | None = None, level_rounds: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Balance the stages of every micro-step (step s, micro-batch j: virtual ranks r·k + j): first
    swaps between the micro-steps of a window (:func:`tokenbal.balance.partition.swap_stages_across_steps`),
    then moves and swaps inside each (:func:`tokenbal.balance.partition.refine_stages_many`). Returns the new
    (step, virtual rank) of every item."""
    from tokenbal.balance.partition import refine_stages_many, swap_stages_across_steps

    if not len(perm):
        return step, vrank
    c = stages[perm]
    cap_costs = None if lens is None else lens[perm]
    group, bins = step * k + vrank % k, vrank // k
    if cross:
        more = {} if level_rounds is None else {"level_rounds": level_rounds}
        group, bins = swap_stages_across_steps(c, group, bins, window, R, capacity=budget,
                                               capacity_costs=cap_costs, **more)
    step, vrank = group // k, bins * k + group % k
    group = step * k + vrank % k
    order = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=S * k)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    col = np.arange(len(order)) - starts[group[order]]
    M = int(counts.max())
    bins = np.full((S * k, M), -1, np.int64)
    bins[group[order], col] = vrank[order] // k
    costs = np.zeros((S * k, M, stages.shape[1]), np.int64)
    costs[group[order], col] = stages[perm[order]]
    cap_costs = None
    if lens is not None:
        cap_costs = np.zeros((S * k, M), np.int64)
        cap_costs[group[order], col] = lens[perm[order]]
    new = refine_stages_many(costs, bins, R, capacity=budget, capacity_costs=cap_costs,
                             max_rounds=rounds)
    out = vrank.copy()
    out[order] = new[group[order], col] * k + group[order] % k
    return step, out


def _insert_alone_steps(slot: np.ndarray, perm: np.ndarray, S: int, R: int, big: np.ndarray,
                        rng: np.random.Generator, shuffle: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Extra steps holding the oversize samples, one per (virtual) rank, mixed into the epoch."""
    E = -(-len(big) // R)
    pos = np.sort(rng.choice(S + E, E, replace=False)) if shuffle else np.arange(S, S + E)
    is_extra = np.zeros(S + E, bool)
    is_extra[pos] = True
    new_of_old = np.flatnonzero(~is_extra)          # old step s -> new step
    old_step, r = np.divmod(slot, R)
    j = np.arange(len(big))
    slot = np.concatenate([new_of_old[old_step] * R + r, pos[j // R] * R + j % R])
    return slot, np.concatenate([perm, big]), S + E


def check_settings(lengths: np.ndarray, num_replicas: object, global_batch_size: object,
                   max_tokens_per_rank: object, window: object = None, *, grad_accum: int = 1,
                   oversize: str = "error") -> tuple[int, int | None, int | None, int | None]:
    """Validate planning settings against (checked) lengths without planning: builds a
    :class:`~tokenbal.balance.settings.PlanSettings` (the data-free checks) and runs its
    ``check_against(lengths)`` (a sample over the token budget, listing them).

    Returns ``(num_replicas, global_batch_size, max_tokens_per_rank, window)`` as ints/None.
    Raises ``ValueError`` for N < R, a sample over the token budget (listing them), etc.
    """
    settings = PlanSettings(num_replicas=num_replicas, global_batch_size=global_batch_size,
                            max_tokens_per_rank=max_tokens_per_rank, window=window,
                            grad_accum=grad_accum, oversize=oversize)
    settings.check_against(lengths)
    return settings.num_replicas, settings.global_batch_size, settings.max_tokens_per_rank, settings.window


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


def _compose_fill(lens: np.ndarray, stages: np.ndarray, perm: np.ndarray, win_of_item: np.ndarray,
                  cap2d: np.ndarray, R: int, rng: np.random.Generator | None, with_fill: bool = True,
                  refine_rounds: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Version 7's stage fill: which samples share a step, chosen by their stage-cost vectors; per window
    the better of two ways, judged by the stage time after both are refined here (cross-step
    leveling and swaps, then in-step moves; the caller skips its own refinement):

    * sorted: :func:`tokenbal.balance.partition.compose.compose_steps` (the sorted order with the
      lowest floor), each step then split on its own (the window fill with one step per window:
      largest first into the least loaded rank);
    * filled: version 6's profile fill (:func:`_profile_fill`), which builds steps and their split
      together and so splits better where sorted steps cannot be cut into equal bins.

    Returns (perm reordered, steps per window, step in the window, rank) aligned with the returned perm.
    Costs two refinements: 1M samples on 512 ranks plan in ~41 s CPU (version 6: ~7 s), see
    docs/bench/balance.md.
    """
    from tokenbal.balance.partition.compose import compose_steps

    G, W = cap2d.shape
    order, step_a, _ = compose_steps(stages[perm], win_of_item, cap2d, R, rng, _COMPOSE_JITTER)
    perm_a = perm[order]
    one = win_of_item * W + step_a                      # every step its own window of one step
    _, _, rank_a, _ = _fill(lens, perm_a, one, cap2d.reshape(-1, 1), R, None, False, rng is not None,
                            batch_per_rank=_COMPOSE_SPLIT_BATCH)
    candidates = [(perm_a, step_a, rank_a)]
    if _COMPOSE_WITH_FILL and with_fill:
        perm_b, _, step_b, rank_b = _profile_fill(lens, stages, perm, win_of_item, cap2d, R,
                                                  min(_STAGE_GROUP, W), rng)
        candidates.append((perm_b, step_b, rank_b))
    best = None
    base = win_of_item * W
    for p, st, rk in candidates:
        # The stage refinement (swaps across the window's steps, then inside each) depends on which
        # samples share a window and a step, not on the steps' order or the ranks' labels, so it runs
        # here, before the caller shuffles both; each window keeps the candidate that ends faster.
        st, rk = _refine_stages(stages, p, win_of_item, base + st, rk, G * W, R, 1, None, None,
                                cross=True, rounds=refine_rounds or _REFINE_ROUNDS,
                                level_rounds=_COMPOSE_LEVEL_ROUNDS)
        st = st - base
        t = _split_time(stages[p], win_of_item, st, rk, G, W, R)
        if best is None:
            best = [p, st, rk, t]
            continue
        b = (t < best[3])[win_of_item]                  # windows occupy the same positions in all
        best = [np.where(b, p, best[0]), np.where(b, st, best[1]), np.where(b, rk, best[2]),
                np.minimum(t, best[3])]
    return best[0], (cap2d > 0).sum(1), best[1], best[2]


def _plan_stage_windows(lens: np.ndarray, stages: np.ndarray, perm: np.ndarray, caps: np.ndarray, R: int,
                        window: int | None, rng: np.random.Generator | None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stage mode's fill (PLAN_VERSION 9): the full steps in windows of up to ``_GROUPED_ITEMS`` samples
    (or ``window`` steps), each split by :func:`_plan_stage_window`; a tail step of another size takes
    the last window's smallest samples and is a window of its own, planned by :func:`_compose_fill`.
    Returns (perm reordered, window of every item,
    steps per window, step in the window, rank), aligned with the returned perm."""
    S, N = len(caps), int(caps[0])
    tail = int(caps[-1]) if S > 1 and caps[-1] != N else 0
    full = S - (tail > 0)
    W = min(window or max(1, _GROUPED_ITEMS // max(N, 1)), max(full, 1))
    if window is None and full:
        W = -(-full // -(-full // W))                    # equal windows
    short = len(perm) <= _STAGE_WHOLE_ITEMS
    parts = []
    rest = perm[full * N:]
    for s0 in range(0, full, W):
        s1 = min(s0 + W, full)
        items = perm[s0 * N:s1 * N]
        if s1 == full and tail:
            # The tail step takes the last window's smallest samples: alone in its step, a giant
            # would set that step's time by itself.
            both = perm[s0 * N:]
            small = np.zeros(len(both), bool)
            small[np.argsort(stages[both].sum(1), kind="stable")[:len(rest)]] = True
            items, rest = both[~small], both[small]
        parts.append(_plan_stage_window(lens, stages, items, s1 - s0, R, rng, short))
    if tail or not full:
        items = rest
        one = np.zeros(len(items), np.int64)
        p, _, st, rk = _compose_fill(lens, stages, items, one, np.full((1, 1), len(items), np.int64), R, rng)
        parts.append((p, st, rk))
    win = np.concatenate([np.full(len(p), g, np.int64) for g, (p, _, _) in enumerate(parts)])
    steps_in_win = np.array([int(st.max()) + 1 for _, st, _ in parts], np.int64)
    grouped = (np.concatenate([p for p, _, _ in parts]), win, steps_in_win,
               np.concatenate([st for _, st, _ in parts]), np.concatenate([rk for _, _, rk in parts]))
    if not short:
        # No leveling or pooling: 1M samples on 512 ranks would pay ~3.5 s for the pooling alone
        # (1.0370 -> 1.0252 on draw 0, nothing on draw 1), against the 5 s the whole plan may take.
        return grouped
    # A short epoch is also planned whole by version 7's composition (with its tail step, which then
    # trades samples with the others); the faster of the two plans is kept.
    zero = np.zeros(len(perm), np.int64)
    p, _, st, rk = _compose_fill(lens, stages, perm, zero, caps[None, :], R, rng)
    whole = (p, zero, np.array([S], np.int64), st, rk)
    chosen = whole if _plan_time(stages, *whole, R) <= _plan_time(stages, *grouped, R) else grouped
    rounds = min(_STAGE_LEVEL_ROUNDS, _STAGE_LEVEL_WORK // max(len(perm), 1))
    return _level_stage_plan(stages, *chosen, R, rounds)


def _level_stage_plan(stages: np.ndarray, perm: np.ndarray, win: np.ndarray, steps_in_win: np.ndarray,
                      step_w: np.ndarray, rank: np.ndarray, R: int, rounds: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A short stage epoch's plan (perm, window, steps per window, step, rank) after ``rounds`` rounds
    of leveling swaps among all its rank-steps (:func:`tokenbal.balance.partition.level_stage_bins`)
    and the pooling of its heaviest steps.

    The composition and the split were chosen by floors, and by greedy swaps that stop where one swap
    alone gains nothing. With a couple of samples per rank what remains is the pairing: a step of like
    samples still has ranks whose two samples are both heavy in one stage, and the cure is to trade
    one of them for a sample of about the same total with less of that stage, from any step. No step
    gets slower and every step keeps its sample count; samples may change windows (the caller only
    shuffles steps inside a window).

    Swaps cannot fix a heavy step whose samples do not pair off, so the heaviest steps are then
    composed again from their pooled samples (:func:`tokenbal.balance.partition.pool_heaviest_steps`,
    PLAN_VERSION 11): every step keeps its sample count, and the pooled steps are kept only where
    together they get faster."""
    from tokenbal.balance.partition import level_stage_bins, pool_heaviest_steps

    first = np.concatenate([[0], np.cumsum(steps_in_win)])
    c = stages[perm]
    g, rank = level_stage_bins(c, first[win] + step_w, rank, R, rounds=rounds, patience=_STAGE_LEVEL_PATIENCE)
    if _STAGE_POOL:
        g, rank = pool_heaviest_steps(c, g, rank, R)
    win = np.searchsorted(first, g, side="right") - 1
    return perm, win, steps_in_win, g - first[win], rank


def _plan_time(stages: np.ndarray, perm: np.ndarray, win: np.ndarray, steps_in_win: np.ndarray,
               step_w: np.ndarray, rank: np.ndarray, R: int) -> float:
    """``Σ_steps Σ_stages max_rank`` of a fill's (perm, window, steps per window, step, rank)."""
    first = np.concatenate([[0], np.cumsum(steps_in_win)])
    S = int(first[-1])
    return float(_step_times(stages[perm], (first[win] + step_w) * R + rank, S, R).sum())


def _plan_stage_window(lens: np.ndarray, stages: np.ndarray, items: np.ndarray, W: int, R: int,
                       rng: np.random.Generator | None, short: bool = False
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One window of ``W`` equal steps of stage mode: ``(items reordered, step in the window, rank)``.

    :func:`tokenbal.balance.partition.grouped.grouped_stage_fill` splits the window in a few sorts: its
    bins (rounds of the largest items into the least loaded rank-steps) level the window's bulk. It runs
    on groups of whole steps of samples of like stage share (``_STAGE_SHARE_GROUPS``: text-only samples
    fill steps of their own instead of adding a little language work to every step). Steps that hold
    the window's few giant samples need more: their other ranks must be as busy as the giant's in
    every stage, which takes several big samples per rank, and the rounds give each rank-step one.
    So the heaviest steps (by ``Σ_stage max_rank``,
    up to ``_STAGE_REFILL_ITEMS`` samples) are planned again by version 7's composition
    (:func:`_compose_fill`: sorted orders cut into steps, on short epochs the profile fill too, then
    swaps between and inside the steps), which is kept where it is faster."""
    from tokenbal.balance.partition.grouped import descending_order, grouped_stage_fill

    c = stages[items]
    N = len(items) // W
    tot = c.sum(1)
    # Jittered as in tokens mode (_GROUPED_JITTER): the window is the same samples every epoch, and
    # exact sizes would rebuild nearly the same steps (1M samples on 512 ranks, draw 0: 0.35 of the
    # step-mate pairs met again next epoch; jittered 0.12 at the same figure, 1.0621 vs 1.0612).
    key = tot * (1.0 + _GROUPED_JITTER * rng.random(len(items))) if rng is not None else tot
    # The window's samples by their share of stage 0, cut into G groups of whole steps, each group split
    # on its own: steps of like samples (text with text) instead of every step holding some of each;
    # the G with the faster split is kept.
    by_share = np.argsort(-(c[:, 0] / np.maximum(tot, 1)), kind="stable")
    best = None
    for G in [g for g in _STAGE_SHARE_GROUPS if g <= W] or [1]:
        step = np.empty(len(items), np.int64)
        rank = np.empty(len(items), np.int64)
        first = 0
        for g in range(G):
            steps = W // G + (g < W % G)
            idx = by_share[first * N:(first + steps) * N]
            idx = idx[descending_order(key[idx])]
            step[idx], rank[idx], _ = grouped_stage_fill(c[idx], steps, R)
            step[idx] += first
            first += steps
        t = _step_times(c, step * R + rank, W, R).sum()
        if best is None or t < best[0]:
            best = (t, step, rank)
    _, step, rank = best
    hmax = min(W, max(1, _STAGE_REFILL_ITEMS // max(N, 1)))
    if short:
        # Short epochs (whose whole plan the caller also makes): the best of several sizes, composed
        # as version 7 does (with its profile-fill candidate).
        tries = [_refill_stage_steps(lens, stages, items, step, rank, W, R, max(1, hmax // d), rng, True)
                 for d in sorted(set(_STAGE_REFILL_FRACTIONS))]
        return max(tries, key=lambda t: t[3])[:3]
    # Long epochs: the heaviest steps once, by sorted orders only (the profile fill doubles the cost;
    # a second refill of the 16k heaviest samples with it: 1M on 512 ranks 1.0606 -> 1.0575 for +1.2 s).
    return _refill_stage_steps(lens, stages, items, step, rank, W, R, hmax, rng, False)[:3]


def _refill_stage_steps(lens: np.ndarray, stages: np.ndarray, items: np.ndarray, step: np.ndarray,
                        rank: np.ndarray, W: int, R: int, h: int, rng: np.random.Generator | None,
                        with_fill: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The ``h`` heaviest of a window's ``W`` steps (by ``Σ_stage max_rank``) planned again by
    :func:`_compose_fill`; returns ``(items, step, rank, time saved)``, unchanged where that is not faster."""
    N = len(items) // W
    loads = _step_times(stages[items], step * R + rank, W, R)
    top = np.argsort(-loads, kind="stable")[:h]
    chosen = np.zeros(W, bool)
    chosen[top] = True
    sel = np.flatnonzero(chosen[step])                  # in permutation order
    p, _, st, rk = _compose_fill(lens, stages, items[sel], np.zeros(len(sel), np.int64),
                                 np.full((1, h), N, np.int64), R, rng, with_fill=with_fill,
                                 refine_rounds=None if with_fill else _STAGE_REFILL_ROUNDS)
    redone = _step_times(stages[p], st * R + rk, h, R).sum()
    gain = float(loads[top].sum() - redone)
    if gain <= 0:
        return items, step, rank, 0.0
    keep = np.flatnonzero(~chosen[step])
    return (np.concatenate([items[keep], p]), np.concatenate([step[keep], top[st]]),
            np.concatenate([rank[keep], rk]), gain)


def _stage_loads(c: np.ndarray, slot: np.ndarray, slots: int) -> np.ndarray:
    """(slots, K) float64 stage loads of items ``c`` (n, K) at ``slot``."""
    return np.stack([np.bincount(slot, weights=c[:, k], minlength=slots) for k in range(c.shape[1])], 1)


def _step_times(c: np.ndarray, slot: np.ndarray, S: int, R: int) -> np.ndarray:
    """(S,) Σ_stages max_rank of each of S steps for items ``c`` (n, K) at ``slot`` = step·R + rank."""
    return _stage_loads(c, slot, S * R).reshape(S, R, -1).max(1).sum(1)


def _split_time(c: np.ndarray, win: np.ndarray, step_w: np.ndarray, rank: np.ndarray, G: int, W: int,
                R: int) -> np.ndarray:
    """(G,) Σ_steps Σ_stages max_rank of each window for items ``c`` at (window, step, rank)."""
    return _step_times(c, (win * W + step_w) * R + rank, G * W, R).reshape(G, W).sum(1)


def _profile_fill(lens: np.ndarray, stages: np.ndarray, perm: np.ndarray, win_of_item: np.ndarray,
                  cap2d: np.ndarray, R: int, group: int, rng: np.random.Generator | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stage mode's fill: steps made of samples with similar stage shares.

    With a couple of samples per rank, no split of a step balances every stage when its samples
    differ in kind: a rank holding one long text waits in the language model for nothing in the
    vision tower, and a rank holding the step's only image the other way round (``Σ_stage max``
    pays both). So inside every window the samples are ordered by their share of stage 0, then of
    stage 1, ... (ties in permutation order), and the window's steps are cut into sub-windows of
    ``group`` steps, filled one after the other along that order: sub-window j gets the next
    ``Σ caps`` samples, and :func:`tokenbal.balance.partition.fill_windows` balances their totals as in the
    plain plan. Which samples share a window is random (the permutation), and so are the small
    ones' steps inside a sub-window; the caller shuffles the steps over the whole window, so the
    sub-windows do not form a curriculum. Returns (perm reordered, steps per window, step in the
    window, rank) aligned with the returned perm.
    """
    G, W = cap2d.shape
    sp = stages[perm]
    tot = np.maximum(sp.sum(1), 1)
    shares = [(sp[:, j] << 20) // tot for j in range(sp.shape[1] - 1)]
    if rng is not None and _STAGE_JITTER > 0:
        jit = int(_STAGE_JITTER * (1 << 20))
        shares = [x + rng.integers(0, jit, len(x)) for x in shares]
    order = _argsort_keys(win_of_item, *shares, np.arange(len(perm)))
    perm = perm[order]
    nsub = -(-W // group)
    cap_sub = np.zeros((G, nsub * group), np.int64)
    cap_sub[:, :W] = cap2d
    cap_sub = cap_sub.reshape(G * nsub, group)
    sub_of_step = np.arange(G * nsub * group).reshape(G, -1)[:, :W] // group
    caps_flat = cap2d.reshape(-1)
    sub = np.repeat(sub_of_step.reshape(-1), caps_flat)
    # Sub-window (g, j) holds steps j·group .. of window g; items fill the steps in caps order.
    _, step_w, rank_w, _ = _fill(lens, perm, sub, cap_sub, R, None, False, rng is not None)
    step_w = (sub % nsub) * group + step_w
    return perm, (cap2d > 0).sum(1), step_w, rank_w


def _token_windows(lens_perm: np.ndarray, window_tokens: int) -> np.ndarray:
    """Window id per item (in permutation order): a new window every ``window_tokens`` tokens."""
    if lens_perm.size == 0:
        return np.zeros(0, np.int64)
    start_tok = np.cumsum(lens_perm) - lens_perm
    win = start_tok // window_tokens
    # A short last window would plan a thin last step: fold it into the one before.
    last = int(win[-1])
    if last > 0 and int(lens_perm[win == last].sum()) * 2 < window_tokens:
        win[win == last] = last - 1
    return win.astype(np.int64)


def _budget_fill(lens: np.ndarray, perm: np.ndarray, R: int, B: int, W: int,
                 rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token-budget mode: pack the epoch into as few rank-steps of ``B`` tokens as first-fit
    decreasing finds, then deal the bins out to steps. Returns (steps, step, rank) per item of
    ``perm`` for one window holding the whole epoch (the caller shuffles its steps and ranks).

    1. *Chunks*: ``perm`` (random) is cut into chunks of ``W`` steps' worth of tokens and each
       chunk is packed on its own (:func:`_pack_chunk`: first-fit decreasing, equal sizes in
       ``perm`` order, then the small samples best-fit in ``perm`` order). Which samples may share
       a bin is thus redrawn every epoch; one sorted epoch would pack the same samples together
       every time.
    2. *Repack*: the bins left under 99 % full (a chunk's last ones) are emptied and packed again,
       ``_REPACK_FAN`` chunks together, then ``_REPACK_FAN`` of those groups, ... up to one group,
       so chunking costs next to no bins.
    3. *Steps*: S = ceil(bins / R). The R·S − bins spare rank-steps go into one *light step* with
       the R lightest-but-spare bins: their samples are re-spread over all R ranks (LPT under the
       budget), so that step is short instead of leaving ranks empty; if its samples are fewer than
       R, the smallest samples of multi-sample bins elsewhere fill its empty ranks. The other bins
       go to the other steps in random order (``rng``; in bin order without it).
    """
    n = len(perm)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    x = lens[perm]
    chunk = _token_windows(x, max(1, W * R * B))
    pos = np.arange(n)
    bins, nb, group = _pack_groups(x, chunk, pos, B)
    load = np.bincount(bins, weights=x, minlength=nb)
    while True:
        partial = load < _REPACK_BELOW * B
        if partial.sum() < 2:
            break
        # Each level pools the partial bins of _REPACK_FAN groups of the level below.
        top = group[partial] // _REPACK_FAN
        again = partial[bins]
        keep = np.cumsum(~partial) - 1
        nk = int((~partial).sum())
        sel = np.flatnonzero(again)
        b, m, g = _pack_groups(x[sel], group[bins[sel]] // _REPACK_FAN, pos[sel], B)
        bins = keep[bins]
        bins[sel] = b + nk
        group = np.concatenate([group[~partial] // _REPACK_FAN, g])
        nb = nk + m
        load = np.bincount(bins, weights=x, minlength=nb)
        if top.min() == top.max():
            break
    S = max(1, -(-nb // R))
    light_n = nb - (S - 1) * R                      # bins of the light step, 1..R
    by_load = np.lexsort((np.arange(nb), load))
    light = np.zeros(nb, bool)
    light[by_load[:light_n]] = True
    full = np.flatnonzero(~light)
    if rng is not None:
        full = full[rng.permutation(len(full))]
    slot_of_bin = np.empty(nb, np.int64)
    slot_of_bin[full] = np.arange(len(full))
    slot = slot_of_bin[bins]
    in_light = light[bins]
    li = np.flatnonzero(in_light)
    light_slot = _spread(x[li], R, B, bins[li])
    slot[li] = (S - 1) * R + light_slot
    slot = _fill_light_step(slot, x, S, R)
    return np.array([S], np.int64), slot // R, slot % R


def _pack_groups(x: np.ndarray, group: np.ndarray, pos: np.ndarray, B: int
                 ) -> tuple[np.ndarray, int, np.ndarray]:
    """First-fit decreasing inside every group of items (``group`` non-decreasing); returns (bin
    per item, number of bins, group per bin)."""
    order = np.argsort(group, kind="stable")
    g = group[order]
    bins = np.empty(len(x), np.int64)
    bin_group = []
    nb = 0
    bounds = np.flatnonzero(np.diff(g)) + 1
    for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(g)].tolist(), strict=True):
        idx = order[lo:hi]
        b, m = _pack_chunk(x[idx], pos[idx], B)
        bins[idx] = b + nb
        bin_group.append(np.full(m, g[lo], np.int64))
        nb += m
    return bins, nb, np.concatenate(bin_group) if bin_group else np.zeros(0, np.int64)


def _pack_chunk(x: np.ndarray, pos: np.ndarray, B: int) -> tuple[np.ndarray, int]:
    """Bins for one chunk: first-fit decreasing for the items above ``B / _SMALL_ITEM``, then the
    small ones best-fit (into the fullest bin they fit) in ``pos`` order, i.e. at random.

    FFD alone ends every chunk with bins of its smallest items in size order, and those bins float
    up the repack levels together, so the same tiny samples would share a step every epoch. Small
    items fill the gaps about as tightly in any order; taken at random they land next to random
    neighbours."""
    from tokenbal.balance.partition import first_fit_decreasing

    small = x <= B // _SMALL_ITEM
    bins = np.empty(len(x), np.int64)
    big = np.flatnonzero(~small)
    b, nb = first_fit_decreasing(x[big], B, tiebreak=pos[big])
    bins[big] = b
    tiny = np.flatnonzero(small)
    if not tiny.size:
        return bins, nb
    tiny = tiny[np.argsort(pos[tiny], kind="stable")]
    M = len(x) + 1
    # key = room * M + bin: the first key >= size * M is the fullest bin with room (lowest id on ties).
    room = B - np.bincount(b, weights=x[big], minlength=nb).astype(np.int64)
    keys = sorted((room * M + np.arange(nb)).tolist())
    out = []
    for v in x[tiny].tolist():
        j = bisect_left(keys, v * M)
        if j < len(keys):
            k = keys.pop(j)
            r, q = divmod(k, M)
        else:
            r, q = B, nb
            nb += 1
        out.append(q)
        insort(keys, (r - v) * M + q)
    bins[tiny] = out
    return bins, nb


def _spread(x: np.ndarray, R: int, B: int, bins: np.ndarray) -> np.ndarray:
    """Rank (0..R-1) for each of the light step's samples: LPT over R ranks within the budget, or
    the bins they came in (renumbered) when LPT cannot keep the budget."""
    from tokenbal.balance.partition import partition

    try:
        return partition(x, R, "lpt", capacity=B)
    except ValueError:
        return np.unique(bins, return_inverse=True)[1].astype(np.int64)


def _fill_light_step(slot: np.ndarray, x: np.ndarray, S: int, R: int) -> np.ndarray:
    """Give each empty rank of the last (light) step the smallest sample of a bin that has more
    than one, never emptying a bin: only samples too few for S·R rank-steps leave a rank empty."""
    counts = np.bincount(slot, minlength=S * R)
    empty = np.flatnonzero(counts[(S - 1) * R:] == 0) + (S - 1) * R
    if not empty.size:
        return slot
    cand = np.flatnonzero(counts[slot] > 1)
    cand = cand[np.lexsort((cand, x[cand]))].tolist()
    spare = {}
    slot = slot.copy()
    it = iter(empty.tolist())
    target = next(it, None)
    for i in cand:
        if target is None:
            break
        s = int(slot[i])
        left = spare.setdefault(s, int(counts[s]) - 1)
        if left == 0:
            continue
        spare[s] = left - 1
        slot[i] = target
        target = next(it, None)
    return slot


def _plan_epoch_padded(lens: np.ndarray, R: int, N: int, *, seed: int, epoch: int, shuffle: bool,
                      drop_last: bool, window: int | None, grad_accum: int) -> EpochPlan:
    """:func:`plan_epoch` for ``cost="padded"`` (same guarantees: exactly N samples per step but a
    merged tail, every sample once, no empty rank when n >= R·k); the steps from
    :func:`tokenbal.balance.partition.padded.plan_padded`."""
    from tokenbal.balance.partition.padded import plan_padded

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
