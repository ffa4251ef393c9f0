"""The stage planner's work grows with the epoch, not faster (issue 49).

Counted, not timed: :data:`tokenbal.balance.partition.stages.work_done` adds up the item visits of
every refinement round (the in-step moves, the swap search between steps, the leveling), which is
where a stage plan's time goes. PLAN_VERSION 11 spent rounds × steps on short epochs (10k samples on
8 ranks: ~4k item visits per sample, 8.5 s CPU against 0.04 s for the tokens plan); version 12 bounds
every refinement by a budget proportional to the epoch, with a floor for small ones; version 13 does the
same for the refinement after a plain fill (``grad_accum > 1``, a token budget), where a token budget
that holds hundreds of samples per rank made a round quadratic in the step (20k samples on 8 ranks:
~800M item visits, 36 s). Version 14 stops composing a short epoch of more than 4,096 steps (2 per rank)
a second time as a whole (40k -> 160k samples on 8 ranks crosses that line). Version 15 levels every pool
of the heaviest steps for a few rounds and only the one ahead for the rest (counted below). Version 18 levels
a long epoch's (more than 2^18 samples) steps furthest above their ideal within a budget that falls as 1 / n.
"""

import numpy as np
import pytest

from tokenbal.balance.cost import resolve
from tokenbal.balance.mixtures import draw_samples, random_mixture, stage_costs
from tokenbal.balance.partition import stages as stage_ops
from tokenbal.balance.plan import plan_epoch

# What a plan may spend: a floor (small epochs) plus a constant per sample.
FLOOR = 1 << 24
PER_SAMPLE = 1024


def _work(n: int, R: int, per_rank: int, draw: int = 1, **kw) -> int:
    s = draw_samples(random_mixture(draw), n, draw)
    c = stage_costs(s)
    for k in stage_ops.work_done:
        stage_ops.work_done[k] = 0
    plan_epoch(s.lengths, R, global_batch_size=per_rank * R * kw.get("grad_accum", 1), seed=draw,
               cost=c.sum(1), stages=c, **kw)
    return sum(stage_ops.work_done.values())


@pytest.mark.parametrize("R, per_rank, n, kw", [
    (8, 2, 4000, {}), (8, 8, 8000, {}), (64, 2, 16000, {}), (8, 2, 40000, {}),
    (8, 2, 4000, {"grad_accum": 2}), (8, 2, 8000, {"grad_accum": 2}), (16, 4, 8000, {"grad_accum": 4})])
def test_stage_plan_work_grows_at_most_linearly_with_the_epoch(R, per_rank, n, kw):
    small, large = _work(n, R, per_rank, **kw), _work(4 * n, R, per_rank, **kw)
    assert large <= 4 * small, (small, large)                   # 4x the samples, at most 4x the work
    assert large <= FLOOR + PER_SAMPLE * 4 * n, large            # and within a budget linear in n


def _budget_work(n: int, R: int, per_sample: float, draw: int = 0, grad_accum: int = 1) -> tuple[int, int]:
    """Work of a token-budget stage plan whose budget holds ``per_sample`` mean samples per rank-step
    (at least the largest sample: no sample is over it); returns (work, rank-steps planned)."""
    s = draw_samples(random_mixture(draw), n, draw)
    c = stage_costs(s)
    units = resolve(s.lengths, c.sum(1), c).costs               # the budget is in these units
    budget = int(max(units.max(), per_sample * units.mean()))
    for k in stage_ops.work_done:
        stage_ops.work_done[k] = 0
    plan = plan_epoch(s.lengths, R, max_tokens_per_rank=budget, grad_accum=grad_accum, seed=draw,
                      cost=c.sum(1), stages=c)
    slots = np.diff(plan.offsets)
    assert slots.sum() == n
    return sum(stage_ops.work_done.values()), len(slots)


@pytest.mark.parametrize("per_sample, grad_accum", [(4, 1), (16, 1), (4, 2)])
def test_budget_stage_plan_work_grows_at_most_linearly_with_the_epoch(per_sample, grad_accum):
    # per_sample 4: the budget is the largest sample, ~150 mean samples per rank-step (crowded bins).
    (small, _), (large, _) = (_budget_work(n, 8, per_sample, grad_accum=grad_accum) for n in (4000, 16000))
    assert large <= 4 * small + FLOOR // 16, (small, large)
    assert large <= FLOOR + PER_SAMPLE * 16000, large


def test_pools_level_one_pool_past_the_race():
    # PLAN_VERSION 15: every pool of pool_heaviest_steps levels its first _POOL_RACE rounds, then only the
    # one ahead levels on; version 14 (race 0) leveled every pool all its rounds. 64 ranks, 40 steps of
    # 2 samples per rank, random bins: pools of 2 / 4 / 8 / 16 steps.
    from tokenbal.balance.mixtures import random_stage_costs
    from tokenbal.balance.partition.stages import _POOL_RACE, _POOL_ROUNDS, _POOL_STEPS, pool_heaviest_steps

    R, steps, N = 64, 40, 128
    c = random_stage_costs(steps * N, 3)
    group = np.repeat(np.arange(steps), N)
    bins = np.concatenate([np.random.default_rng(s).permutation(np.arange(N) % R) for s in range(steps)])

    def level_work(race: int) -> tuple[int, np.ndarray, np.ndarray]:
        old = stage_ops._POOL_RACE
        stage_ops._POOL_RACE = race
        stage_ops.work_done["level"] = 0
        try:
            g, b = pool_heaviest_steps(c, group, bins, R)
        finally:
            stage_ops._POOL_RACE = old
        return stage_ops.work_done["level"], g, b

    work, g, b = level_work(_POOL_RACE)
    full, _, _ = level_work(0)
    largest = max(_POOL_STEPS) * N
    assert work <= (len(_POOL_STEPS) * _POOL_RACE + _POOL_ROUNDS) * largest, work
    assert work < full, (work, full)
    # Still never slower, every step its count.
    def total(gg, bb):
        loads = np.zeros((steps, R, c.shape[1]), np.int64)
        np.add.at(loads, (gg, bb), c)
        return int(loads.max(1).sum())
    assert total(g, b) <= total(group, bins)
    assert np.array_equal(np.bincount(g, minlength=steps), np.bincount(group, minlength=steps))


def _long_level_work(n: int, R: int, draw: int, monkeypatch, whole_items: int | None = None,
                     items: int | None = None) -> tuple[int, float]:
    """Item visits of a long stage epoch's leveling of its worst steps (plan.stages._level_worst_steps),
    and the plan's stage figure. ``whole_items``: the short / long line, lowered so small epochs are long."""
    from tokenbal.balance.plan import stages as stage_mode
    from tokenbal.balance.simulate import epoch_stage_figure

    if whole_items is not None:
        monkeypatch.setattr(stage_mode, "_STAGE_WHOLE_ITEMS", whole_items)
    if items is not None:
        monkeypatch.setattr(stage_mode, "_LONG_LEVEL_ITEMS", items)
    spent = []
    inner = stage_mode._level_worst_steps

    def counted(*args):
        before = stage_ops.work_done["level"]
        out = inner(*args)
        spent.append(stage_ops.work_done["level"] - before)
        return out

    monkeypatch.setattr(stage_mode, "_level_worst_steps", counted)
    s = draw_samples(random_mixture(draw), n, draw)
    c = stage_costs(s)
    plan = plan_epoch(s.lengths, R, global_batch_size=2 * R, seed=draw, cost=c.sum(1), stages=c)
    monkeypatch.undo()
    assert len(spent) == 1                                      # a long epoch: leveled once
    return spent[0], epoch_stage_figure(plan, c)


@pytest.mark.parametrize("R, n", [(8, 6000), (64, 8192), (512, 20480)])
def test_long_stage_epoch_leveling_work_is_linear_in_the_epoch(R, n, monkeypatch):
    # PLAN_VERSION 18: a stage epoch of more than _STAGE_WHOLE_ITEMS samples levels its worst steps within
    # a budget that falls as 1 / n (so its work is bounded by a constant, at most linear in n). The line is
    # lowered to 4,096 samples so that small epochs take the long path.
    small, _ = _long_level_work(n, R, 1, monkeypatch, whole_items=4096, items=2048)
    large, _ = _long_level_work(4 * n, R, 1, monkeypatch, whole_items=4096, items=2048)
    assert 0 < small and 0 < large
    assert large <= 4 * small, (small, large)
    assert large <= FLOOR + PER_SAMPLE * 4 * n, large


def test_long_stage_epoch_leveling_at_scale_is_bounded_and_never_slower(monkeypatch):
    # The real line (2^18 samples): 64 ranks, 2 per rank. Its work is at most its budget (rounds x the worst
    # steps' samples, at least _STAGE_LEVEL_MIN rounds), and the epoch is no slower than without it.
    from tokenbal.balance.plan import stages as stage_mode

    n, R = (1 << 18) + 2 * 64 * 5, 64
    work, figure = _long_level_work(n, R, 0, monkeypatch)
    _, without = _long_level_work(n, R, 0, monkeypatch, items=0)
    budget = max(stage_mode._STAGE_LEVEL_FLOOR,
                 min(stage_mode._LONG_LEVEL_WORK, R * stage_mode._LONG_LEVEL_PER_RANK))
    assert 0 < work <= max(budget * stage_mode._STAGE_WHOLE_ITEMS // n,
                           stage_mode._STAGE_LEVEL_MIN * stage_mode._LONG_LEVEL_ITEMS), work
    assert work <= PER_SAMPLE * n
    assert figure <= without, (figure, without)
