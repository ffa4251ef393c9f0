"""Elastic resume: a checkpoint from one world size (batch size, budget, grad_accum) resumes on
another, and across the change every sample of the epoch is used exactly once."""

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.lengths import lengths_for
from tokenbal import TokenBalancedBatchSampler


def all_ranks(lengths, R, **kw):
    return [TokenBalancedBatchSampler(lengths, R, r, **kw) for r in range(R)]


def take(ss, batches):
    """Run every rank ``batches`` batches (lockstep); returns the samples handed out and rank 0's state,
    through JSON like a real checkpoint."""
    got = []
    for s in ss:
        it = iter(s)
        for _ in range(batches):
            got += next(it)
    return got, json.loads(json.dumps(ss[0].state_dict()))


def resume(state, lengths, R, **kw):
    ss = all_ranks(lengths, R, elastic=True, **kw)
    for s in ss:
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])   # the usual loop calls it again: must not drop the resume
    return ss


def setup(R, mode, per_rank, k=1):
    if mode == "batch":
        return dict(global_batch_size=R * per_rank * k, grad_accum=k)
    return dict(max_tokens_per_rank=20_000 * per_rank, grad_accum=k)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 160), R1=st.integers(1, 5), R2=st.integers(1, 5), R3=st.integers(1, 5),
       per_rank=st.integers(1, 3), k1=st.integers(1, 2), k2=st.integers(1, 2),
       mode=st.sampled_from(["batch", "tokens"]), frac1=st.floats(0, 1), frac2=st.floats(0, 1),
       seed=st.integers(0, 100), epoch=st.integers(0, 3))
def test_every_sample_once_across_two_world_size_changes(n, R1, R2, R3, per_rank, k1, k2, mode, frac1, frac2,
                                                         seed, epoch):
    lengths = lengths_for(n, seed)
    first = all_ranks(lengths, R1, seed=seed, **setup(R1, mode, per_rank, k1))
    for s in first:
        s.set_epoch(epoch)
    used1, state = take(first, int(frac1 * len(first[0])))
    second = resume(state, lengths, R2, **setup(R2, mode, per_rank, k2))
    assert len({len(s) for s in second}) == 1       # every rank runs the same number of batches
    # (an unchanged setup is a plain resume: the epoch's full length, cursor where it stopped)
    used2, state = take(second, int(frac2 * (len(second[0]) - second[0].cursor)))
    third = resume(state, lengths, R3, **setup(R3, mode, per_rank))
    used3 = [i for s in third for b in s for i in b]
    counts = Counter(used1 + used2 + used3)
    assert set(counts.values()) <= {1}
    assert sorted(counts) == list(range(n))          # nothing lost (no drop_last, no skipped)
    # the next epoch is planned for the new setup alone, like a fresh sampler's
    third[0].set_epoch(epoch + 1)
    fresh = TokenBalancedBatchSampler(lengths, R3, 0, seed=seed, **setup(R3, mode, per_rank))
    fresh.set_epoch(epoch + 1)
    assert list(third[0]) == list(fresh)


def test_the_new_world_size_plans_the_rest_balanced_and_deterministically():
    lengths = lengths_for(400, 1)
    old = all_ranks(lengths, 8, global_batch_size=32, seed=5)
    used, state = take(old, 4)
    a = resume(state, lengths, 4, global_batch_size=16, seed=0)
    b = resume(state, lengths, 4, global_batch_size=16, seed=0)
    assert [list(s) for s in a] == [list(s) for s in b]       # no communication, same on every rank
    plan = a[0].plan()
    assert plan.num_replicas == 4 and plan.num_samples == 400 - len(used)
    tokens = plan.micro_tokens(lengths).reshape(plan.num_steps, 4)
    full = tokens[:-1]   # the last step may be partial
    assert (full.max(1) / full.mean(1)).mean() < 1.05


def test_same_setup_resume_after_an_elastic_one_yields_the_exact_suffix():
    lengths = lengths_for(300, 2)
    _, state = take(all_ranks(lengths, 4, global_batch_size=16, seed=3), 3)
    ss = resume(state, lengths, 2, global_batch_size=16, seed=3)
    full = [list(s) for s in resume(state, lengths, 2, global_batch_size=16, seed=3)]
    head, mid = take(ss, 2)
    assert "segments" in mid and mid["cursor"] == 2
    for r in range(2):
        plain = TokenBalancedBatchSampler(lengths, 2, r, global_batch_size=16)   # elastic not needed
        plain.load_state_dict(mid)
        assert list(plain) == full[r][2:]


def test_a_world_size_change_without_elastic_says_how_to_allow_it():
    lengths = lengths_for()
    _, state = take(all_ranks(lengths, 4, global_batch_size=16), 1)
    with pytest.raises(ValueError, match="elastic=True"):
        TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=16).load_state_dict(state)
    other_data = TokenBalancedBatchSampler(lengths + 1, 2, 0, global_batch_size=16, elastic=True)
    with pytest.raises(ValueError, match="lengths_sha256") as e:
        other_data.load_state_dict(state)   # elastic never covers different data
    assert "elastic=True" not in str(e.value)
    fresh = TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=16, elastic=True)
    fresh.set_epoch(3)
    before = list(fresh)
    with pytest.raises(ValueError, match="outside epoch"):
        fresh.load_state_dict(dict(state, cursor=10_000))
    assert (fresh.epoch, fresh.cursor) == (3, len(before)) and list(fresh) == before   # unchanged


def test_a_checkpoint_at_the_end_of_the_epoch_leaves_nothing_to_replan():
    lengths = lengths_for(50)
    ss = all_ranks(lengths, 2, global_batch_size=8)
    _, state = take(ss, len(ss[0]))
    (s,) = resume(state, lengths, 1, global_batch_size=8)
    assert len(s) == 0 and list(s) == []
    s.set_epoch(1)
    assert sorted(i for b in s for i in b) == list(range(50))


def test_stages_and_costs_carry_over():
    lengths = lengths_for(200, 4)
    stages = np.stack([lengths // 3, lengths - lengths // 3], 1)
    old = all_ranks(lengths, 4, global_batch_size=16, stages=stages)
    used, state = take(old, 5)
    new = resume(state, lengths, 3, global_batch_size=12, stages=stages)
    rest = [i for s in new for b in s for i in b]
    assert sorted(used + rest) == list(range(200))
