"""Stage balance on mixtures the planner was not tuned on (issue 32).

Random draws of :mod:`tokenbal.balance.mixtures` (blends of photos, documents, screenshots, text,
multi-image posts and videos; vision = patches + patches², language = tokens + tokens²). On every
draw the plan's epoch figure (Σ_steps Σ_stages max_rank over the ideal) must be no worse than
max(goal, floor of a length-grouped composition of the same samples), and the plan keeps the
sampler's contract: every sample once, the plain plan's step sizes, a pure function of its inputs.
The fast tests use a few dozen steps per draw; the full scales are in the slow test and in
``scripts/bench_balance.py --mixtures``.

Not met exactly on every draw: with two samples per rank the split of the composed steps stays a
little above max(goal, length-grouped floor) on some draws (PLAN_VERSION 11, 20 draws per scale in
docs/BENCHMARKS.md, issue 32 part 7: 2 of 20 at (8, 16), worst 0.46 % over; 1 of 20 at 512 ranks,
0.10 %; 2 of 20 at 4,096 ranks, 1.2 %). Shorter epochs leave less to trade: one of the fast tests'
60-step draws at 8 ranks is 1.45 % over. So these tests allow ``SLACK`` on top of it.

That floor is a bound no split reaches with two samples per rank, and on most draws no plan at all:
searched exhaustively on 12-16-sample epochs (:func:`tokenbal.balance.simulate.best_plan_figure`,
issue 32 part 8) the best of every plan is above max(1.06, length-grouped floor) on 4-11 of 20 draws.
What a length-grouped sampler can
reach with the same number of samples on every rank is bounded by
:func:`tokenbal.balance.simulate.equal_count_floor` of its steps, and against max(goal, that bound) the
plan holds with no slack, on square costs and on Qwen2-VL-7B FLOPs (issue 32 part 5 in
docs/BENCHMARKS.md: every draw of 20 at 8, 64, 512 and 4,096 ranks, both costs). The same tests compare
the compositions under one split: length-grouped steps split the way the planner splits its own
(:func:`tokenbal.balance.simulate.split_figure`, any count per rank) end no faster than the plan, or
both are under the goal (part 6).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.balance.cost import FlopsModel
from tokenbal.balance.mixtures import KINDS, draw_samples, random_mixture, random_stage_costs, stage_costs
from tokenbal.balance.plan import plan_epoch
from tokenbal.balance.simulate import (
    best_plan_figure,
    composition_floor,
    epoch_stage_figure,
    equal_count_floor,
    length_grouped_steps,
    split_figure,
)

GOALS = {8: 1.01, 64: 1.02, 512: 1.04, 4096: 1.06}
SLACK = 0.02


def _step_of(plan, n: int) -> np.ndarray:
    per = plan.num_replicas * plan.grad_accum
    out = np.full(n, -1, np.int64)
    out[plan.indices] = np.repeat(np.arange(len(plan.offsets) - 1) // per, np.diff(plan.offsets))
    return out


def _check(R: int, N: int, steps: int, draw: int, slack: float = SLACK) -> None:
    s = draw_samples(random_mixture(draw), steps * N, draw)
    c = stage_costs(s)
    plan = plan_epoch(s.lengths, R, global_batch_size=N, seed=draw, cost=c.sum(1), stages=c)
    assert np.array_equal(np.sort(plan.indices), np.arange(len(c)))             # every sample once
    assert plan.num_steps == steps and (plan.counts().sum(1) == N).all()        # equal steps
    assert (plan.counts() > 0).all()                                            # no empty rank-step
    figure = epoch_stage_figure(plan, c)
    lg = composition_floor(length_grouped_steps(c, N, draw), c, R)
    assert figure <= max(GOALS[R], lg) * (1 + slack), (draw, figure, lg)


def test_mixture_draws_are_reproducible_and_varied():
    a = random_stage_costs(5000, 3)
    assert np.array_equal(a, random_stage_costs(5000, 3))
    assert not np.array_equal(a, random_stage_costs(5000, 4))
    kinds = [np.bincount(draw_samples(random_mixture(d), 5000, d).kind, minlength=len(KINDS))
             for d in range(6)]
    assert len({tuple(np.argsort(k)[-2:]) for k in kinds}) > 1                 # blends differ
    s = draw_samples(random_mixture(1), 5000, 1)
    assert (s.lengths <= random_mixture(1).max_length + s.vision_tokens).all()
    assert np.array_equal(np.diff(s.image_offsets) > 0, s.vision_tokens > 0)
    text = s.kind == KINDS.index("text")
    assert (stage_costs(s)[text, 0] == 0).all() and (stage_costs(s)[:, 1] > 0).all()


# derandomize: the same draws on every run (CI must not find a new worst draw by chance); the benchmark
# is where new draws are explored.
@settings(max_examples=6, deadline=None, derandomize=True)
@given(draw=st.integers(0, 10**6))
def test_plan_beats_length_grouping_or_meets_the_goal_8_ranks(draw):
    _check(8, 16, 60, draw)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(draw=st.integers(0, 10**6))
def test_plan_beats_length_grouping_or_meets_the_goal_64_ranks(draw):
    _check(64, 128, 40, draw)



def _check_reachable(R: int, N: int, steps: int, draws, cost: str) -> None:
    # The reachable side of the comparison: a length-grouped sampler with per_device_train_batch_size
    # samples per rank cannot go below equal_count_floor of its steps, and the plan (any counts) is
    # under that or under the goal, with no slack: on the stage costs the planner was built against
    # (square) and on Qwen2-VL-7B's FLOPs, which it was not tuned on.
    model = "square" if cost == "square" else FlopsModel.qwen2_vl_7b()
    for draw in draws:
        s = draw_samples(random_mixture(draw), steps * N, draw)
        c = stage_costs(s, model)
        plan = plan_epoch(s.lengths, R, global_batch_size=N, seed=draw, cost=c.sum(1), stages=c)
        lg_steps = length_grouped_steps(c, N, draw)
        lg = composition_floor(lg_steps, c, R)
        reachable = equal_count_floor(lg_steps, c, R)
        assert lg <= reachable
        figure = epoch_stage_figure(plan, c)
        assert figure <= max(GOALS[R], reachable), (draw, cost)
        # The compositions under one split: length-grouped steps split the way the planner splits its
        # own composed steps (any counts) end no faster than the plan, or both are under the goal.
        assert figure <= max(GOALS[R], split_figure(lg_steps, c, R)), (draw, cost)


@pytest.mark.parametrize("cost", ["square", "flops"])
@pytest.mark.parametrize("R, N, steps, draws", [(8, 16, 60, range(6)), (64, 128, 40, range(3))])
def test_plan_beats_every_equal_split_of_length_grouped_steps_or_meets_the_goal(R, N, steps, draws, cost):
    _check_reachable(R, N, steps, draws, cost)


@pytest.mark.slow
@pytest.mark.parametrize("cost", ["square", "flops"])
@pytest.mark.parametrize("R, N, steps", [(512, 1024, 40), (4096, 8192, 24)])
def test_many_ranks_beat_every_equal_split_of_length_grouped_steps_or_meet_the_goal(R, N, steps, cost):
    # The benchmark's scales and step counts (every one of 20 draws holds there, both costs).
    _check_reachable(R, N, steps, range(4), cost)


def test_stage_plan_is_a_pure_function_of_its_inputs():
    s = draw_samples(random_mixture(5), 64 * 20 + 7, 5)
    c = stage_costs(s)
    a = plan_epoch(s.lengths, 32, global_batch_size=64, seed=1, cost=c.sum(1), stages=c)
    b = plan_epoch(s.lengths, 32, global_batch_size=64, seed=1, cost=c.sum(1), stages=c)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.offsets, b.offsets)
    assert a.counts().sum(1)[-1] == 64 + 7 and (a.counts() > 0).all()
    other = plan_epoch(s.lengths, 32, global_batch_size=64, seed=1, epoch=1, cost=c.sum(1), stages=c)
    assert not np.array_equal(other.indices, a.indices)


@pytest.mark.slow
@pytest.mark.parametrize("R, N, steps", [(8, 16, 200), (64, 128, 100)])
def test_plan_beats_length_grouping_or_meets_the_goal_bench_sizes(R, N, steps):
    for draw in range(20):
        _check(R, N, steps, draw)


@pytest.mark.slow
@pytest.mark.parametrize("R, N, steps, slack", [(512, 1024, 40, 0.005), (4096, 8192, 24, 0.015)])
def test_many_ranks_stay_within_the_measured_shortfall(R, N, steps, slack):
    # Not the property: at 512 / 4,096 ranks the plan misses max(goal, LG floor) on one draw
    # of 20 each, by 0.11 % / 1.2 % (PLAN_VERSION 11, docs/BENCHMARKS.md); this guards that shortfall
    # from growing (draw 4 at 4,096 ranks is the 1.2 %).
    for draw in range(4):
        _check(R, N, steps, draw, slack)


@pytest.mark.slow
def test_pooling_the_heaviest_steps_brings_a_4096_rank_draw_onto_the_target():
    # Draw 9 at 4,096 ranks: PLAN_VERSION 10 ended 2.7 % over max(goal, LG floor) (1.1812 against
    # 1.1496): its heaviest step's samples do not pair off and swaps could not fix it. Pooled with the
    # next heavy steps and dealt again (partition.pool_heaviest_steps) it meets the target, no slack.
    _check(4096, 8192, 24, 9, slack=0.0)


# ---------------------------------------------------------------------------------------------
# Tiny epochs, searched exhaustively (simulate.best_plan_figure): the best of every plan


def _tiny(R: int, N: int, steps: int, draw: int, cost: str = "square"):
    model = "square" if cost == "square" else FlopsModel.qwen2_vl_7b()
    s = draw_samples(random_mixture(draw), steps * N, draw)
    c = stage_costs(s, model)
    plan = plan_epoch(s.lengths, R, global_batch_size=N, seed=draw, cost=c.sum(1), stages=c)
    best, best_steps = best_plan_figure(c, R, N)
    lg = composition_floor(length_grouped_steps(c, N, draw), c, R)
    return c, epoch_stage_figure(plan, c), best, best_steps, lg


@pytest.mark.parametrize("draw", [1, 3, 10, 19])
def test_no_plan_meets_the_length_grouped_floor_on_these_draws(draw):
    # Why the property above carries SLACK: with two samples per rank, max(goal, length-grouped floor)
    # can be below the best figure of every plan. On 12-sample epochs of these draws (2 ranks, 4 per
    # step) the exhaustive optimum is over the target even with the loosest goal, 1.06 (20 draws:
    # the optimum is over max(1.01, LG floor) on 15, docs/BENCHMARKS.md issue 32 part 8).
    _, figure, best, _, lg = _tiny(2, 4, 3, draw)
    assert best > max(1.06, lg) * 1.03, (best, lg)
    assert figure >= best * (1 - 1e-9)                       # the plan is one of the plans searched


@pytest.mark.parametrize("cost", ["square", "flops"])
def test_plan_is_near_the_best_plan_on_tiny_epochs(cost):
    # Two per rank: the plan within 6 % of the optimum on every draw (measured worst 4.9 % square, 5.0 %
    # FLOPs, median 0.06 % / 0.10 %), and tokenbal's split of the optimum's steps is the optimum (to
    # 0.1 %): what the plan gives up on these epochs is its composition, not its split.
    for draw in range(20):
        c, figure, best, best_steps, _ = _tiny(2, 4, 3, draw, cost)
        assert best * (1 - 1e-9) <= figure <= best * 1.06, (draw, figure, best)
        assert split_figure(best_steps, c, 2) <= best * 1.001, draw


def test_one_sample_per_rank_the_plan_composes_the_best_steps():
    # With one sample per rank the split is fixed, the floor is reached, and the target holds for any
    # plan whose composition is as good as length grouping: here the plan finds the optimum itself.
    for draw in range(6):
        _, figure, best, _, lg = _tiny(4, 4, 4, draw)
        assert np.isclose(figure, best, rtol=1e-6) and best <= lg * (1 + 1e-9), draw


# ---------------------------------------------------------------------------------------------
# Tokens mode (no stages): the grouped fill of PLAN_VERSION 8 on whole-epoch windows


def _token_step_ratios(R: int, N: int, steps: int, draw: int) -> np.ndarray:
    lengths = draw_samples(random_mixture(draw), steps * N, draw).lengths
    plan = plan_epoch(lengths, R, global_batch_size=N, seed=draw)
    assert np.array_equal(np.sort(plan.indices), np.arange(len(lengths)))
    assert (plan.counts().sum(1) == N).all() and plan.num_empty == 0
    t = plan.step_rank_tokens(lengths).astype(np.float64)
    return t.max(1) / t.mean(1)


@pytest.mark.parametrize("draw", [0, 1, 2])
def test_tokens_mode_levels_512_ranks_on_random_mixtures(draw):
    # 1M samples on 512 ranks, 2 per rank per step: per-step max/mean mean <= 1.005, p95 <= 1.01
    # (docs/BENCHMARKS.md, issue 32: worst of 20 draws in scripts/bench_balance.py --token-mixtures).
    r = _token_step_ratios(512, 1024, 976, draw)
    assert r.mean() <= 1.005 and np.quantile(r, 0.95) <= 1.01


@pytest.mark.parametrize("R, N, steps", [(8, 16, 2000), (64, 128, 400)])
def test_tokens_mode_levels_fewer_ranks_on_random_mixtures(R, N, steps):
    for draw in range(3):
        r = _token_step_ratios(R, N, steps, draw)
        assert r.mean() <= 1.005 and np.quantile(r, 0.95) <= 1.02
