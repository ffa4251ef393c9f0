"""``plan_ahead=True`` (issue 49): the next epoch is planned in a background thread when an epoch starts.
The plan is the foreground plan (same hash), a resume mid-epoch is exact, and the sampler still copies."""

import copy
import pickle

import numpy as np
import pytest

from tokenbal import TokenBalancedBatchSampler
from tokenbal.balance.mixtures import draw_samples, random_mixture, stage_costs


def _data(n=600, draw=3):
    s = draw_samples(random_mixture(draw), n, draw)
    c = stage_costs(s)
    return s.lengths, {"cost": c.sum(1), "stages": c}


def _epoch(sampler, epoch):
    sampler.set_epoch(epoch)
    return [list(b) for b in sampler]


@pytest.mark.parametrize("kw", [{"global_batch_size": 16}, {"global_batch_size": 32, "grad_accum": 2}])
def test_background_plan_is_the_foreground_plan(kw):
    lengths, costs = _data()
    ahead = TokenBalancedBatchSampler(lengths, num_replicas=4, rank=1, seed=7, plan_ahead=True, **costs, **kw)
    plain = TokenBalancedBatchSampler(lengths, num_replicas=4, rank=1, seed=7, **costs, **kw)
    for epoch in range(3):
        got = _epoch(ahead, epoch)
        assert ahead._ahead and next(iter(ahead._ahead))[1] == epoch + 1   # the next one is under way
        assert got == _epoch(plain, epoch)
        assert ahead.plan_hash() == plain.plan_hash()
    # Epoch 3 was planned in the background: taken from the thread, not planned again.
    thread, out = next(iter(ahead._ahead.values()))
    ahead.set_epoch(3)
    assert ahead.plan() is out[0] and not ahead._ahead and not thread.is_alive()
    assert ahead.plan_hash() == plain.plan_hash(3)


def test_resume_mid_epoch_with_plan_ahead_is_exact():
    lengths, costs = _data()
    kw = {"num_replicas": 2, "rank": 0, "global_batch_size": 8, "seed": 3, **costs}
    plain = TokenBalancedBatchSampler(lengths, **kw)
    want = [_epoch(plain, 0), _epoch(plain, 1), _epoch(plain, 2)]

    first = TokenBalancedBatchSampler(lengths, plan_ahead=True, **kw)
    assert _epoch(first, 0) == want[0]
    first.set_epoch(1)
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()                       # mid-epoch 1, epoch 2 being planned behind it
    resumed = TokenBalancedBatchSampler(lengths, plan_ahead=True, **kw)
    resumed.load_state_dict(state)
    rest = [list(b) for b in resumed]
    assert head + rest == want[1]
    assert _epoch(resumed, 2) == want[2]
    # A copy (threads and locks are not copied) plans in the foreground, to the same plan.
    for other in (copy.deepcopy(first), pickle.loads(pickle.dumps(first))):
        assert other._ahead == {}
        assert _epoch(other, 2) == want[2]


def test_a_failed_background_plan_is_planned_again_in_the_foreground(monkeypatch):
    lengths, costs = _data(200)
    s = TokenBalancedBatchSampler(lengths, num_replicas=2, rank=0, global_batch_size=8, plan_ahead=True,
                                  **costs)
    import tokenbal.balance.sampler as mod

    s.plan()                                         # epoch 0 planned in the foreground, then
    real = mod.plan_epoch
    monkeypatch.setattr(mod, "plan_epoch", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no")))
    list(s)                                          # the thread planning epoch 1 fails
    thread, out = next(iter(s._ahead.values()))
    thread.join()
    assert isinstance(out[0], MemoryError)
    monkeypatch.setattr(mod, "plan_epoch", real)
    want = TokenBalancedBatchSampler(lengths, num_replicas=2, rank=0, global_batch_size=8, **costs)
    with pytest.warns(RuntimeWarning, match="planning epoch 1 in the background failed .MemoryError: no."):
        assert _epoch(s, 1) == _epoch(want, 1)
    assert np.array_equal(s.plan().indices, want.plan().indices)


def test_a_plan_that_cannot_be_made_names_its_epoch():
    # epoch_steps too small for the epoch's plan: pad_steps said "this epoch's plan needs ..." without
    # saying which, while the loop, a look-ahead or a resume may be at another one.
    lengths = np.random.default_rng(0).integers(1, 900, 300)
    kw = {"num_replicas": 2, "rank": 0, "max_tokens_per_rank": 2000, "plan_ahead": True}
    steps = TokenBalancedBatchSampler(lengths, **kw).natural_steps(3)
    s = TokenBalancedBatchSampler(lengths, epoch_steps=steps - 1, **kw)
    s.set_epoch(3)
    with pytest.raises(ValueError, match=f"epoch 3 .seed 0.: this epoch's plan needs {steps} steps"):
        len(s)
