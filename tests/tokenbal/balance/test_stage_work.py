"""The stage planner's work grows with the epoch, not faster (issue 49).

Counted, not timed: :data:`tokenbal.balance.partition.stages.work_done` adds up the item visits of
every refinement round (the in-step moves, the swap search between steps, the leveling), which is
where a stage plan's time goes. PLAN_VERSION 11 spent rounds × steps on short epochs (10k samples on
8 ranks: ~4k item visits per sample, 8.5 s CPU against 0.04 s for the tokens plan); version 12 bounds
every refinement by a budget proportional to the epoch, with a floor for small ones.
"""

import pytest

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
    (8, 2, 4000, {}), (8, 8, 8000, {}), (64, 2, 16000, {}), (8, 2, 4000, {"grad_accum": 2})])
def test_stage_plan_work_grows_at_most_linearly_with_the_epoch(R, per_rank, n, kw):
    small, large = _work(n, R, per_rank, **kw), _work(4 * n, R, per_rank, **kw)
    assert large <= 4 * small, (small, large)                   # 4x the samples, at most 4x the work
    assert large <= FLOOR + PER_SAMPLE * 4 * n, large            # and within a budget linear in n
