"""Stage mode (``stages=``, count mode with ``grad_accum=1``): which samples share a step, chosen by
their stage-cost vectors (PLAN_VERSION 7's composition ``_compose_fill``, 9's grouped windows
``_plan_stage_windows``, 10 and 11's leveling and pooling of short epochs ``_level_stage_plan``), and
the stage refinement every mode with stages ends with (``_refine_stages``)."""

from __future__ import annotations

import numpy as np

from tokenbal.balance.partition.stages import _ranked, _row_sums
from tokenbal.balance.plan.common import _argsort_keys, _fill
from tokenbal.balance.plan.counts import _GROUPED_ITEMS, _GROUPED_JITTER

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
# The refinement after a plain fill (grad_accum > 1, token budget; PLAN_VERSION 13): at most
# _REFINE_LEVEL_ROUNDS leveling rounds within _REFINE_LEVEL_WORK samples x rounds (at least
# _STAGE_LEVEL_MIN), and max(_REFINE_SWAPS, samples / _REFINE_ITEMS_PER_SWAP) exact swaps, shared by the
# windows in proportion to their samples (small epochs keep version 12's 4 per micro-step).
_REFINE_LEVEL_ROUNDS = 16
_REFINE_LEVEL_WORK = 1 << 20
_REFINE_ITEMS_PER_SWAP = 512
_REFINE_SWAPS = 512
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
# PLAN_VERSION 12 (issue 49): those rounds within a budget of max(2^20, ranks · 2^14) samples × rounds
# per composition (at least _STAGE_LEVEL_MIN rounds), so the work grows with the epoch, not with
# rounds × steps: 100k samples on 8 ranks level 10 rounds, not 32; 512 ranks and more keep 32.
# PLAN_VERSION 15: max(2^19, ranks · 2^13) (versions 12-14: max(2^20, ranks · 2^14)). At most 32 rounds either
# way, so it only binds where a composition holds more than 2^14 samples and more than 256 per rank (8-64
# ranks from 16,385 samples, 512 from 131,073); none of issue 32's mixture points (plans hash-identical). 30k
# samples, version 14 -> 15 (with _POOL_RACE), median / worst: 8 ranks (16 square draws) 1.0083 -> 1.0084,
# 1.0336 both; 16 ranks 1.0114 -> 1.0121 (+0.07 %), 1.0796 -> 1.0807; 64 ranks 1.0402 -> 1.0393, 1.7763 both;
# CPU 10-20 % less. 100k on 64 ranks (4 draws) 1.0248 -> 1.0254; 60k on 128 1.1002 -> 1.1003.
_COMPOSE_LEVEL_FLOOR = 1 << 19
_COMPOSE_LEVEL_PER_RANK = 1 << 13
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
# Short epochs' refill: the heaviest hmax / d steps for each d here (the best kept), composed with the
# profile-fill candidate from _SHORT_FILL_RANKS ranks on. PLAN_VERSION 11 tried every d with the
# candidate: on 10k samples on 8 ranks the whole window composed three times over (and again whole by the
# caller), each twice. PLAN_VERSION 12: the largest d only, no candidate below _SHORT_FILL_RANKS; the
# smaller d only where they refill at most _STAGE_REFILL_SMALL samples (tiny epochs: with one sample per
# rank the whole window refilled finds the optimum, tests/tokenbal/balance/test_mixture_balance.py).
# Median figure of square draws: (8, 16, 200 steps), 6 draws, 1.0214 -> 1.0215 with the largest d alone,
# -> 1.0194 without the candidate (docs/bench/balance.md, "PLAN_VERSION 12").
_STAGE_REFILL_FRACTIONS = (1, 2, 4)
_STAGE_REFILL_SMALL = 2048
# Short epochs on this many ranks or more keep version 11's refill (every d, with the profile-fill
# candidate): with hundreds of ranks it costs little beside the leveling and it decides some draws (512
# ranks, 40 steps, draw 4: 1.2160 without the candidate, 1.1598 with, version 11 1.1602; 4,096 ranks,
# 24 steps, draw 2: 1.1470 with the largest d only, 1.1121 with every d, as version 11). At 8 ranks, 10k
# samples, the candidate took 0.52 -> 0.82 s for no gain.
_SHORT_FILL_RANKS = 256
# The exact swap search between the steps of a composition (partition.stages._swap_window) stops after
# this many swaps (PLAN_VERSION 11: 4 per step, ~0.1-0.2 ms each: 2 s per composition of 100k samples on
# 8 ranks). It takes the step furthest above its ideal first, so the cap keeps the worst steps' swaps.
_COMPOSE_SWAPS = 256
_STAGE_WHOLE_ITEMS = 1 << 18
# PLAN_VERSION 14 (issue 49): a short epoch of more than _STAGE_WHOLE_STEPS steps of at most 2 samples per
# rank is not also composed whole (_plan_stage_windows): with that many steps the grouped plan (grouped
# fill, its heaviest steps composed again) is the faster one, and the whole composition cost as much again.
# Which plan won (stage time, version 13), square costs, draws 0-5: 8 ranks, 2 per rank: 30k samples
# (1,875 steps) whole 5 / 6; 50k (3,125) whole 5 / 6 by <= 0.26 %; 65,536 (4,096) grouped 5 / 6; 100k
# and 150k grouped 6 / 6; 16 ranks 100k (3,125) grouped 6 / 6; 64 ranks 128k (1,000 steps) whole decides
# 3 / 6 (median 1.0216 -> 1.0238 without it: kept). Epoch figure with / without the whole composition,
# 2 per rank above 4,096 steps: 100k / 8 ranks 8 draws, 200k / 8 6 draws, 150k / 16 6 draws (square),
# 80k and 240k / 8 (FLOPs), 50k / 8 at 1 per rank: every draw the same figure, CPU about halved. 4 per
# rank (144k / 8 ranks, 4,500 steps) lost on 3 / 6 draws (median 1.0029 -> 1.0035): kept there.
# PLAN_VERSION 16: above 1,536 steps (was 4,096). Median / worst figure, the current choice vs the grouped
# plan alone (whole composition skipped), the same run: 30k samples on 8 ranks (1,875 steps) 16 square draws
# 1.0084 -> 1.0090 (+0.06 %) / 1.0336 both, 8 FLOPs draws 1.0082 -> 1.0084 / 1.0193 both, CPU 0.26 -> 0.17 s;
# 50k on 8 (3,125 steps) 1.0092 / 1.0187 both; 60k on 16 FLOPs (1,875 steps) 1.0102 / 1.0125 both. Below,
# at 1,250 steps, the whole composition still pays: 20k on 8 ranks 1.0116 -> 1.0129 (+0.13 %), 40k on 16
# 1.0135 -> 1.0153 (+0.18 %), so those keep it.
_STAGE_WHOLE_STEPS = 1536
_STAGE_WHOLE_PER_RANK = 2
# The final leveling of a short stage epoch (_level_stage_plan): every step trades samples with every
# other, up to _STAGE_LEVEL_ROUNDS rounds and _STAGE_LEVEL_WORK samples x rounds (a round costs
# ~0.2 us per sample: 40k samples ~9 ms, 196k ~40 ms; the budget caps it near 7 s), stopping once the
# epoch's stage time has not fallen for _STAGE_LEVEL_PATIENCE rounds. 512 ranks, 40 steps of 1,024,
# draw 9: 1.1197 unleveled, 1.0996 / 1.0897 / 1.0859 / 1.0829 after 64 / 256 / 512 / 1,024 rounds;
# 20 draws, worst figure over target: 1.0253 unleveled, 1.0033 after 256 rounds, 1.0018 with a budget
# of 2^24, 1.0009 with 1,024 rounds. With 8 ranks the time falls in rare steps (every bin at a
# maximum must drop): patience 64 stopped draw 9 at 1.0186, 256 reached 1.0166 (as 1,024 rounds did).
# See docs/bench/balance.md, "PLAN_VERSION 10".
# PLAN_VERSION 12 (issue 49): the budget is max(_STAGE_LEVEL_FLOOR, ranks · _STAGE_LEVEL_PER_RANK), at most
# _STAGE_LEVEL_WORK, samples × rounds (at least _STAGE_LEVEL_MIN rounds): wide steps, where dozens of
# bins sit near a stage's maximum, keep what version 11 spent (512 ranks and up: 2^25), while 8 ranks,
# where the time falls in rare steps, spend 2^20 (10k samples: 104 rounds, not 1,024; 100k: 10, not
# 335). The leveling (and the pools' leveling) also stops once the last _STAGE_LEVEL_STALL[0] rounds
# gained less than _STAGE_LEVEL_STALL[1] of the epoch's stage time (an anytime stop); each pool of
# _level_stage_plan gets the budget >> _STAGE_POOL_SHIFT (version 11: 2^23 whatever the ranks).
_STAGE_LEVEL_ROUNDS = 1024
_STAGE_LEVEL_WORK = 1 << 25
_STAGE_LEVEL_PATIENCE = 256
_STAGE_LEVEL_MIN = 8
_STAGE_LEVEL_FLOOR = 1 << 20
_STAGE_LEVEL_PER_RANK = 1 << 16
_STAGE_LEVEL_STALL = (64, (1, 20000))
_STAGE_POOL_SHIFT = 2
# Short stage epochs, after the leveling (PLAN_VERSION 11): the heaviest 2 / 4 / 8 / 16 steps
# (up to 2^16 samples) composed again from their pooled samples, the best pool kept where faster;
# 0: off. 4,096 ranks, 24 steps, 20 square draws: 11 faster, none slower, draw 9 1.1812 -> 1.1205
# (target 1.1496), worst over target 2.75 % -> 1.20 %, for ~3 s more CPU per plan. See
# docs/bench/balance.md, "PLAN_VERSION 11".
_STAGE_POOL = 1
# Long stage epochs (more than _STAGE_WHOLE_ITEMS samples; PLAN_VERSION 18, issue 49 part 10): the steps
# furthest above their ideal, up to _LONG_LEVEL_ITEMS samples, leveled among themselves (_level_worst_steps)
# within max(_STAGE_LEVEL_FLOOR, min(_LONG_LEVEL_WORK, ranks · _LONG_LEVEL_PER_RANK)) · _STAGE_WHOLE_ITEMS / n
# samples × rounds (at least _STAGE_LEVEL_MIN rounds, at most _STAGE_LEVEL_ROUNDS): at the line an eighth of
# what the short path's final leveling may spend on 512 ranks and more (2^22 of 2^25), as much on 8-64 ranks
# (2^20), and falling as 1 / n, since the rest of the plan grows with n and the tokens plan the issue's
# target is measured against takes only 0.10 s at 1M samples on 512 ranks (the stage plan 0.8 s before it).
# Versions 9-17 stopped at the grouped plan: 263,168 samples on 512 ranks took 0.36 s against 3.17 s one
# step before (2^18, the short path), and 2.5 % more stage time per draw. The gain is in the worst steps:
# 263,168 / 512 ranks, draw 0, 128 rounds over the 32 worst of 257 steps -1.4 % of stage time in 0.2 s, over
# all 257 -1.8 % in 2.3 s; the 32 heaviest (not the furthest above ideal) -1.2 %. 0 items: off.
_LONG_LEVEL_ITEMS = 1 << 15
_LONG_LEVEL_WORK = 1 << 22
_LONG_LEVEL_PER_RANK = 1 << 13


def _refine_stages(stages: np.ndarray, perm: np.ndarray, window: np.ndarray, step: np.ndarray,
                   vrank: np.ndarray, S: int, R: int, k: int, lens: np.ndarray | None, budget: int | None,
                   cross: bool = True, rounds: int | None = None, level_rounds: int | None = None,
                   max_swaps: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Balance the stages of every micro-step (step s, micro-batch j: virtual ranks r·k + j): first
    swaps between the micro-steps of a window (:func:`tokenbal.balance.partition.swap_stages_across_steps`),
    then moves and swaps inside each (:func:`tokenbal.balance.partition.refine_stages_many`). Returns the new
    (step, virtual rank) of every item."""
    from tokenbal.balance.partition import refine_stages_many, swap_stages_across_steps

    if not len(perm):
        return step, vrank
    c = stages.take(perm, axis=0)
    cap_costs = None if lens is None else lens[perm]
    group, bins = step * k + vrank % k, vrank // k
    if cross:
        more = {}
        if level_rounds is None:
            # The refinement after a plain fill (grad_accum > 1, a token budget), PLAN_VERSION 13: its
            # leveling rounds and swaps within a budget proportional to the epoch (version 12: 16 rounds
            # and 4 swaps per micro-step, 100k samples on 8 ranks with grad_accum 2 in ~4.6 s).
            more = {"level_rounds": min(_REFINE_LEVEL_ROUNDS, max(_STAGE_LEVEL_MIN,
                                                                  _REFINE_LEVEL_WORK // len(perm))),
                    "items_per_swap": len(perm) / max(_REFINE_SWAPS, len(perm) // _REFINE_ITEMS_PER_SWAP)}
        else:
            more = {"level_rounds": level_rounds}
        group, bins = swap_stages_across_steps(c, group, bins, window, R, capacity=budget,
                                               capacity_costs=cap_costs, max_swaps=max_swaps, **more)
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
    costs[group[order], col] = stages.take(perm[order], axis=0)
    cap_costs = None
    if lens is not None:
        cap_costs = np.zeros((S * k, M), np.int64)
        cap_costs[group[order], col] = lens[perm[order]]
    new = refine_stages_many(costs, bins, R, capacity=budget, capacity_costs=cap_costs,
                             max_rounds=rounds)
    out = vrank.copy()
    out[order] = new[group[order], col] * k + group[order] % k
    return step, out


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
    order, step_a, _ = compose_steps(stages.take(perm, axis=0), win_of_item, cap2d, R, rng, _COMPOSE_JITTER)
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
    work = max(_COMPOSE_LEVEL_FLOOR, R * _COMPOSE_LEVEL_PER_RANK)
    level_rounds = min(_COMPOSE_LEVEL_ROUNDS, max(_STAGE_LEVEL_MIN, work // max(len(perm), 1)))
    for p, st, rk in candidates:
        # The stage refinement (swaps across the window's steps, then inside each) depends on which
        # samples share a window and a step, not on the steps' order or the ranks' labels, so it runs
        # here, before the caller shuffles both; each window keeps the candidate that ends faster.
        st, rk = _refine_stages(stages, p, win_of_item, base + st, rk, G * W, R, 1, None, None,
                                cross=True, rounds=refine_rounds or _REFINE_ROUNDS,
                                level_rounds=level_rounds, max_swaps=_COMPOSE_SWAPS)
        st = st - base
        t = _split_time(stages.take(p, axis=0), win_of_item, st, rk, G, W, R)
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
            # (the first len(rest) of the stable order by size, found by a partition: the same set)
            small[_ranked(_row_sums(stages.take(both, axis=0)), 0, len(rest))] = True
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
        # No leveling of every step and no pooling: 1M samples on 512 ranks would pay ~3.5 s for the pooling
        # alone (1.0370 -> 1.0252 on draw 0, nothing on draw 1). Only the steps furthest above their ideal
        # are leveled, within a budget (PLAN_VERSION 18).
        return _level_worst_steps(stages, *grouped, R)
    chosen = grouped
    if S <= _STAGE_WHOLE_STEPS or N > _STAGE_WHOLE_PER_RANK * R:
        # A short epoch is also planned whole by version 7's composition (with its tail step, which
        # then trades samples with the others); the faster of the two plans is kept.
        zero = np.zeros(len(perm), np.int64)
        p, _, st, rk = _compose_fill(lens, stages, perm, zero, caps[None, :], R, rng,
                                     with_fill=R >= _SHORT_FILL_RANKS)
        whole = (p, zero, np.array([S], np.int64), st, rk)
        chosen = whole if _plan_time(stages, *whole, R) <= _plan_time(stages, *grouped, R) else grouped
    work = min(_STAGE_LEVEL_WORK, max(_STAGE_LEVEL_FLOOR, R * _STAGE_LEVEL_PER_RANK))
    rounds = min(_STAGE_LEVEL_ROUNDS, max(_STAGE_LEVEL_MIN, work // max(len(perm), 1)))
    return _level_stage_plan(stages, *chosen, R, rounds, work >> _STAGE_POOL_SHIFT)


def _level_stage_plan(stages: np.ndarray, perm: np.ndarray, win: np.ndarray, steps_in_win: np.ndarray,
                      step_w: np.ndarray, rank: np.ndarray, R: int, rounds: int, pool_work: int | None = None
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
    c = stages.take(perm, axis=0)
    g, rank = level_stage_bins(c, first[win] + step_w, rank, R, rounds=rounds, patience=_STAGE_LEVEL_PATIENCE,
                               stall=_STAGE_LEVEL_STALL)
    if _STAGE_POOL:
        g, rank = pool_heaviest_steps(c, g, rank, R, work=pool_work, stall=_STAGE_LEVEL_STALL)
    win = np.searchsorted(first, g, side="right") - 1
    return perm, win, steps_in_win, g - first[win], rank


def _level_worst_steps(stages: np.ndarray, perm: np.ndarray, win: np.ndarray, steps_in_win: np.ndarray,
                       step_w: np.ndarray, rank: np.ndarray, R: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A long stage epoch's plan (perm, window, steps per window, step, rank) after leveling swaps among its
    steps furthest above their ideal (``Σ_stage max_rank - Σ_stage ⌈sum / R⌉``), up to ``_LONG_LEVEL_ITEMS``
    samples of them, within a budget of samples × rounds that falls as 1 / n (see ``_LONG_LEVEL_ITEMS``)
    (:func:`tokenbal.balance.partition.level_stage_bins`, as :func:`_level_stage_plan` levels every step of a
    short epoch). No step gets slower and every step keeps its sample count; samples may change windows."""
    from tokenbal.balance.partition import level_stage_bins

    n = len(perm)
    first = np.concatenate([[0], np.cumsum(steps_in_win)])
    S = int(first[-1])
    if n < 2 or S < 2 or R < 2 or _LONG_LEVEL_ITEMS <= 0:
        return perm, win, steps_in_win, step_w, rank
    g = first[win] + step_w
    c = stages.take(perm, axis=0)
    K = c.shape[1]
    # Integer loads per (stage, step, rank): float64 sums of int64 costs, exact as in _plan_time.
    slot = g * R + rank
    loads = np.stack([np.bincount(slot, weights=c[:, k], minlength=S * R) for k in range(K)]
                     ).astype(np.int64).reshape(K, S, R)
    excess = loads.max(2).sum(0) - (-(-loads.sum(2) // R)).sum(0)
    worst = np.argsort(-excess, kind="stable")
    held = np.cumsum(np.bincount(g, minlength=S)[worst])
    h = max(2, int((held <= _LONG_LEVEL_ITEMS).sum()))
    chosen = np.zeros(S, bool)
    chosen[worst[:h]] = True
    sel = np.flatnonzero(chosen[g])
    work = max(_STAGE_LEVEL_FLOOR, min(_LONG_LEVEL_WORK, R * _LONG_LEVEL_PER_RANK)) * _STAGE_WHOLE_ITEMS // n
    rounds = min(_STAGE_LEVEL_ROUNDS, max(_STAGE_LEVEL_MIN, work // max(len(sel), 1)))
    new_g, new_rank = level_stage_bins(c[sel], g[sel], rank[sel], R, rounds=rounds,
                                       patience=_STAGE_LEVEL_PATIENCE, stall=_STAGE_LEVEL_STALL)
    new_win = np.searchsorted(first, new_g, side="right") - 1
    win, step_w, rank = win.copy(), step_w.copy(), rank.copy()
    win[sel], step_w[sel], rank[sel] = new_win, new_g - first[new_win], new_rank
    return perm, win, steps_in_win, step_w, rank


def _plan_time(stages: np.ndarray, perm: np.ndarray, win: np.ndarray, steps_in_win: np.ndarray,
               step_w: np.ndarray, rank: np.ndarray, R: int) -> float:
    """``Σ_steps Σ_stages max_rank`` of a fill's (perm, window, steps per window, step, rank)."""
    first = np.concatenate([[0], np.cumsum(steps_in_win)])
    S = int(first[-1])
    return float(_step_times(stages.take(perm, axis=0), (first[win] + step_w) * R + rank, S, R).sum())


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

    c = stages.take(items, axis=0)         # (.take: the rows of stages[items], ~10x faster on 1M rows)
    N = len(items) // W
    tot = _row_sums(c)
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
            step[idx], rank[idx], _ = grouped_stage_fill(c.take(idx, axis=0), steps, R)
            step[idx] += first
            first += steps
        t = _step_times(c, step * R + rank, W, R).sum()
        if best is None or t < best[0]:
            best = (t, step, rank)
    _, step, rank = best
    hmax = min(W, max(1, _STAGE_REFILL_ITEMS // max(N, 1)))
    if short:
        # Short epochs (whose whole plan the caller may also make): the best of several sizes (the smaller
        # ones only where they are cheap), composed as version 7 does.
        tries = [_refill_stage_steps(lens, stages, items, step, rank, W, R, max(1, hmax // d), rng, True)
                 for d in sorted(set(_STAGE_REFILL_FRACTIONS))
                 if d == max(_STAGE_REFILL_FRACTIONS) or hmax // d * N <= _STAGE_REFILL_SMALL
                 or R >= _SHORT_FILL_RANKS]
        return max(tries, key=lambda t: t[3])[:3]
    # Long epochs: the heaviest steps once, by sorted orders only (the profile fill doubles the cost;
    # a second refill of the 16k heaviest samples with it: 1M on 512 ranks 1.0606 -> 1.0575 for +1.2 s).
    return _refill_stage_steps(lens, stages, items, step, rank, W, R, hmax, rng, False)[:3]


def _refill_stage_steps(lens: np.ndarray, stages: np.ndarray, items: np.ndarray, step: np.ndarray,
                        rank: np.ndarray, W: int, R: int, h: int, rng: np.random.Generator | None,
                        short: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The ``h`` heaviest of a window's ``W`` steps (by ``Σ_stage max_rank``) planned again by
    :func:`_compose_fill`; returns ``(items, step, rank, time saved)``, unchanged where that is not faster."""
    N = len(items) // W
    loads = _step_times(stages.take(items, axis=0), step * R + rank, W, R)
    top = np.argsort(-loads, kind="stable")[:h]
    chosen = np.zeros(W, bool)
    chosen[top] = True
    sel = np.flatnonzero(chosen[step])                  # in permutation order
    p, _, st, rk = _compose_fill(lens, stages, items[sel], np.zeros(len(sel), np.int64),
                                 np.full((1, h), N, np.int64), R, rng,
                                 with_fill=short and R >= _SHORT_FILL_RANKS,
                                 refine_rounds=None if short else _STAGE_REFILL_ROUNDS)
    redone = _step_times(stages.take(p, axis=0), st * R + rk, h, R).sum()
    gain = float(loads[top].sum() - redone)
    if gain <= 0:
        return items, step, rank, 0.0
    keep = np.flatnonzero(~chosen[step])
    return (np.concatenate([items[keep], p]), np.concatenate([step[keep], top[st]]),
            np.concatenate([rank[keep], rk]), gain)


def _step_times(c: np.ndarray, slot: np.ndarray, S: int, R: int) -> np.ndarray:
    """(S,) Σ_stages max_rank of each of S steps for items ``c`` (n, K) at ``slot`` = step·R + rank."""
    from tokenbal.balance.partition.grouped import sum_stages

    loads = np.stack([np.bincount(slot, weights=c[:, k], minlength=S * R) for k in range(c.shape[1])])
    return sum_stages(loads.reshape(-1, S, R).max(2))


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
    sp = stages.take(perm, axis=0)
    tot = np.maximum(_row_sums(sp), 1)
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
