"""Stage mode's profile fill (tokenbal.balance.plan._profile_fill): steps are built from samples of similar
stage shares, out of windows of a random permutation. These tests pin its contracts: every sample
once, the plain plan's step sizes, determinism, steps in random order (no curriculum by kind) and
step composition redrawn every epoch."""

import numpy as np

from tokenbal.balance.plan import plan_epoch
from tokenbal.balance.simulate import plan_stage_costs, step_stage_balance

R, N, STEPS = 4, 8, 300


def _kinds(n: int, seed: int) -> np.ndarray:
    """(n, 2) vision / language costs: text-only, image and video-like samples of similar totals."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, n, p=[0.5, 0.4, 0.1])
    tot = rng.integers(200, 2000, n)
    share = np.choose(kind, [np.zeros(n), rng.uniform(0.2, 0.4, n), rng.uniform(0.6, 0.8, n)])
    vision = np.round(tot * share).astype(np.int64)
    return np.stack([vision, tot - vision], 1)


def _step_of_sample(plan) -> np.ndarray:
    per = plan.num_replicas * plan.grad_accum
    step = np.repeat(np.arange(len(plan.offsets) - 1) // per, np.diff(plan.offsets))
    out = np.empty(len(plan.indices), np.int64)
    out[plan.indices] = step
    return out


def test_profile_fill_keeps_the_plain_plans_guarantees_and_is_deterministic():
    c = _kinds(STEPS * N + 5, 0)            # a last step of 5 samples
    plain = plan_epoch(c.sum(1), R, global_batch_size=N, seed=1)
    staged = plan_epoch(c.sum(1), R, global_batch_size=N, seed=1, stages=c)
    assert np.array_equal(np.sort(staged.indices), np.arange(len(c)))
    assert staged.num_steps == plain.num_steps
    assert np.array_equal(staged.counts().sum(1), plain.counts().sum(1))
    assert staged.counts().sum(1)[-1] == 5                      # the short step stays the last one
    assert (staged.counts() > 0).all()
    again = plan_epoch(c.sum(1), R, global_batch_size=N, seed=1, stages=c)
    assert np.array_equal(again.indices, staged.indices) and np.array_equal(again.offsets, staged.offsets)
    other = plan_epoch(c.sum(1), R, global_batch_size=N, seed=2, stages=c)
    assert not np.array_equal(other.indices, staged.indices)


def test_profile_fill_groups_kinds_within_steps_and_balances_both_stages():
    c = _kinds(STEPS * N, 3)
    plain = plan_epoch(c.sum(1), R, global_batch_size=N, seed=0)
    staged = plan_epoch(c.sum(1), R, global_batch_size=N, seed=0, stages=c)
    share = c[:, 0] / c.sum(1)

    def spread(plan) -> float:      # mean over steps of the std of the samples' vision share
        step = _step_of_sample(plan)
        return float(np.mean([share[step == s].std() for s in range(plan.num_steps)]))

    assert spread(staged) < 0.5 * spread(plain)
    before = step_stage_balance(plan_stage_costs(plain, c))
    after = step_stage_balance(plan_stage_costs(staged, c))
    assert after.mean() < before.mean()


def test_profile_fill_steps_come_in_random_order_and_change_every_epoch():
    c = _kinds(STEPS * N, 4)
    share = c[:, 0] / c.sum(1)
    a = plan_epoch(c.sum(1), R, global_batch_size=N, seed=0, epoch=0, stages=c)
    b = plan_epoch(c.sum(1), R, global_batch_size=N, seed=0, epoch=1, stages=c)
    sa = _step_of_sample(a)
    per_step = np.bincount(sa, weights=share) / np.bincount(sa)
    # Sub-windows are cut along the vision share; the step shuffle spans the whole window, so the
    # epoch is no curriculum from text-only to video-like steps.
    rank = np.argsort(np.argsort(per_step))
    rho = np.corrcoef(rank, np.arange(len(rank)))[0, 1]
    assert abs(rho) < 0.3
    # Which samples share a step is redrawn: most pairs of epoch 0 are apart in epoch 1.
    sb = _step_of_sample(b)
    pairs = [(i, j) for s in range(a.num_steps) for i, j in [tuple(np.flatnonzero(sa == s)[:2])]]
    again = np.mean([sb[i] == sb[j] for i, j in pairs])
    assert again < 0.2
