"""Plan one epoch: which samples every rank reads at every step.

This package's front holds :func:`plan_epoch` (the steps every mode shares: permutation, step sizes,
windows, step order, rank deal) and re-exports :class:`EpochPlan`; each planning mode has its own
module: :mod:`.counts` (``global_batch_size``, no stages), :mod:`.stages` (``stages=``),
:mod:`.budget` (``max_tokens_per_rank``) and :mod:`.padded` (``cost="padded"``); :mod:`.common` holds
the plan, the default window and the window fill they share. Their tunables are module constants of
the mode's own module.

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
   (up to 1,536 steps, or with more than 2 samples per rank: PLAN_VERSIONs 14, 16) is also planned whole by
   version 7 and the faster plan kept, then leveled by swaps among all its
   steps (PLAN_VERSION 10), and its heaviest steps composed again from their pooled samples where
   that is faster (PLAN_VERSION 11, ``_level_stage_plan``); a long epoch (more than 2^18 samples) levels
   only its steps furthest above their ideal, within a budget that falls as 1 / n (PLAN_VERSION 18,
   ``_level_worst_steps``). *With a token budget*:
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
  micro-batch. With ``global_batch_size >= R·k`` no micro-batch is empty once there are R·k samples;
  an epoch of fewer (one step) has its micro-batches dealt to the ranks in turn, so with ``n >= R``
  every rank still gets a sample and no rank runs two more micro-batches than another.
* ``cost=``: the planner balances any integer cost per sample (:mod:`tokenbal.balance.cost`), e.g. FLOPs
  as token-equivalents; the guarantees above hold for it unchanged.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from tokenbal._checks import check_lengths
from tokenbal._checks import nonneg_int as _nonneg_int
from tokenbal.balance.cost import resolve
from tokenbal.balance.plan import stages as stage_mode
from tokenbal.balance.plan.budget import _budget_fill, _insert_alone_steps
from tokenbal.balance.plan.common import EpochPlan, _argsort_keys, _count_steps, _fill, default_window
from tokenbal.balance.plan.counts import _plan_counts
from tokenbal.balance.plan.padded import _plan_epoch_padded
from tokenbal.balance.settings import PlanSettings, plan_settings

logger = logging.getLogger("tokenbal")

__all__ = ["EpochPlan", "plan_epoch", "default_window", "check_lengths", "check_settings", "PLAN_VERSION",
           "pad_steps"]

# Bump when the same inputs would give a different plan (the sampler's resume fingerprint uses it).
# 17: with grad_accum > 1, the one step of an epoch of fewer than R·k samples deals its micro-batches to the
# ranks in turn (_serve_every_rank); every other plan is the same as version 16's.
# 18: a stage epoch of more than 2^18 samples levels its steps furthest above their ideal, within a budget
# that falls as 1 / n (plan.stages._level_worst_steps; issue 49 part 10); shorter epochs: version 17's plans.
PLAN_VERSION = 18


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
        return _serve_every_rank(_plan_epoch_padded(lens, R, N, seed=_nonneg_int("seed", seed),
                                                    epoch=_nonneg_int("epoch", epoch), shuffle=shuffle,
                                                    drop_last=drop_last, window=window, grad_accum=k), lens)
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
        profile = stages is not None and k == 1 and stage_mode._STAGE_GROUP > 0
        W = min(window or default_window(R, N) * (stage_mode._STAGE_WINDOW if profile else 1),
                max(1, len(caps)))
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
            return _serve_every_rank(_plan_counts(lens, perm, caps, R, R_user, k, window,
                                                  rng if shuffle else None, dropped), lens)
        if profile and stage_mode._STAGE_COMPOSE and stage_mode._STAGE_GROUPED:
            perm, win_of_item, steps_in_win, step_w, rank_w = stage_mode._plan_stage_windows(
                lens, stages, perm, caps, R, window, rng if shuffle else None)
        elif profile and stage_mode._STAGE_COMPOSE:
            perm, steps_in_win, step_w, rank_w = stage_mode._compose_fill(
                lens, stages, perm, win_of_item, cap2d, R, rng if shuffle else None)
        elif profile:
            perm, steps_in_win, step_w, rank_w = stage_mode._profile_fill(
                lens, stages, perm, win_of_item, cap2d, R, min(stage_mode._STAGE_GROUP, W),
                rng if shuffle else None)
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

    # (The composition refined its steps already.)
    if stages is not None and not (profile and stage_mode._STAGE_COMPOSE):
        if B is not None:
            # Token mode plans one window; stage swaps stay among W consecutive (shuffled) steps.
            win_of_item = step // W
        # After the profile fill, swaps across steps gain little at many ranks and cost the most
        # there (docs/bench/balance.md); with few ranks they still pay.
        step, rank = stage_mode._refine_stages(stages, perm, win_of_item, step, rank, S, R_user, k,
                                               lens if B is not None else None, B,
                                               cross=not profile or R_user <= stage_mode._CROSS_MAX_RANKS)
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
    plan = EpochPlan(num_replicas=R_user, indices=perm[order].astype(np.int64), offsets=offsets,
                     dropped=dropped.astype(np.int64), grad_accum=k, skipped=skipped.astype(np.int64))
    return plan if B is not None else _serve_every_rank(plan, lens)


def pad_steps(plan: EpochPlan, steps: int, lens: np.ndarray) -> EpochPlan:
    """``plan`` with exactly ``steps`` steps, for loops that fix an epoch's steps from its first epoch
    (the HF Trainer; token-budget plans differ by a step or two from epoch to epoch). The steps added at
    the end are light: each of their micro-batches takes one of the smallest samples of a micro-batch
    holding several (never emptying one, so no rank-step grows and the budget holds); the rest stay
    empty (a dummy batch). Every sample stays once; a plan needing more steps raises."""
    S, R, k = plan.num_steps, plan.num_replicas, plan.grad_accum
    if S == steps:
        return plan
    if S > steps:
        raise ValueError(f"this epoch's plan needs {S} steps, more than the {steps} fixed per epoch "
                         "(epoch_steps)")
    slot = _entry_slots(plan)
    lengths = np.asarray(lens)[plan.indices]
    # Within each micro-batch its entries by length, largest first: all but the first may move.
    order = np.lexsort((plan.indices, -lengths, slot))
    rank_in_slot = np.arange(len(order)) - np.repeat(plan.offsets[:-1], np.diff(plan.offsets))
    movable = order[rank_in_slot >= 1]
    movable = movable[np.lexsort((plan.indices[movable], lengths[movable]))]   # the smallest first
    moved = movable[:(steps - S) * R * k]
    slot[moved] = S * R * k + np.arange(len(moved))
    return _with_slots(plan, slot, steps * R * k)


def _entry_slots(plan: EpochPlan) -> np.ndarray:
    """The micro-batch slot of every entry of ``plan.indices``."""
    sizes = np.diff(plan.offsets)
    return np.repeat(np.arange(len(sizes)), sizes)


def _with_slots(plan: EpochPlan, slot: np.ndarray, num_slots: int) -> EpochPlan:
    """``plan`` with its entries moved to micro-batch slots ``slot`` (each slot's list ascending)."""
    out = np.lexsort((plan.indices, slot))
    offsets = np.zeros(num_slots + 1, np.int64)
    np.cumsum(np.bincount(slot, minlength=num_slots), out=offsets[1:])
    return dataclasses.replace(plan, indices=plan.indices[out].astype(np.int64), offsets=offsets)


def _serve_every_rank(plan: EpochPlan, lens: np.ndarray) -> EpochPlan:
    """``global_batch_size`` mode with ``grad_accum = k > 1``: a step is planned over R·k virtual ranks,
    and a step of fewer than R·k samples (only the one step of an epoch of n < R·k samples: every other
    step has at least R·k) leaves some of them empty, possibly all k of one rank while another rank
    runs two or more. Such a step's non-empty micro-batches are dealt to the ranks in turn, heaviest
    first (micro-batch 0 of every rank, then micro-batch 1, ...; ties in the fill's shuffled order): with
    n >= R every rank gets a sample, as with k = 1, no rank runs more than one micro-batch more than
    another, and micro-batch j holds like samples on every rank. Other plans are returned unchanged."""
    R, k = plan.num_replicas, plan.grad_accum
    if k == 1 or not plan.num_steps:
        return plan
    counts = plan.micro_counts().reshape(plan.num_steps, R * k)     # virtual rank r·k + j
    short = np.flatnonzero((counts == 0).any(1))
    if not short.size:
        return plan
    slots = R * k
    new_slot = np.arange(plan.num_steps * slots).reshape(plan.num_steps, slots)
    entry_slot = _entry_slots(plan)
    load = np.zeros(plan.num_steps * slots, np.int64)
    np.add.at(load, entry_slot, lens[plan.indices])
    load = load.reshape(plan.num_steps, slots)
    for s in short:
        full = np.flatnonzero(counts[s])
        full = full[np.argsort(-load[s, full], kind="stable")]
        order = np.concatenate([full, np.flatnonzero(counts[s] == 0)])
        i = np.arange(slots)
        new_slot[s, order] = s * slots + (i % R) * k + i // R
    return _with_slots(plan, new_slot.reshape(-1)[entry_slot], plan.num_steps * slots)


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
