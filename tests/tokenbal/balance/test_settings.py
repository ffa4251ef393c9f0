"""PlanSettings: frozen, checked once on creation with the messages plan_epoch and the sampler gave
before it existed; its fingerprint is the sampler's (old checkpoints still resume); a plan made from
resolved arrays + settings equals the keyword form; and the lengths are checked once per sampler,
not once per epoch."""

from __future__ import annotations

import dataclasses
import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

import tokenbal._checks
from tests.helpers.lengths import lengths_for
from tokenbal.balance.cost import Resolved, resolve
from tokenbal.balance.plan import PLAN_VERSION, check_settings, plan_epoch
from tokenbal.balance.sampler import TokenBalancedBatchSampler
from tokenbal.balance.settings import PlanSettings, plan_settings
from tokenbal.parallel import ParallelLayout

BAD = [
    # settings, the message's start (as plan_epoch, the sampler and check_settings have said it)
    (dict(num_replicas=0, global_batch_size=8), "num_replicas must be a positive integer, got 0"),
    (dict(num_replicas=2), "give exactly one of global_batch_size and max_tokens_per_rank"),
    (dict(num_replicas=2, global_batch_size=8, max_tokens_per_rank=100),
     "give exactly one of global_batch_size and max_tokens_per_rank"),
    (dict(num_replicas=4, global_batch_size=3), "global_batch_size=3 is smaller than num_replicas=4"),
    (dict(num_replicas=4, global_batch_size=6, grad_accum=2),
     "global_batch_size=6 is smaller than num_replicas × grad_accum = 8"),
    (dict(num_replicas=2, global_batch_size=8, grad_accum=0), "grad_accum must be a positive integer, got 0"),
    (dict(num_replicas=2, global_batch_size=8, window=0), "window must be a positive integer, got 0"),
    (dict(num_replicas=2, max_tokens_per_rank=-5), "max_tokens_per_rank must be a positive integer, got -5"),
    (dict(num_replicas=2, max_tokens_per_rank=100, oversize="drop"),
     "oversize must be 'error', 'skip' or 'alone', got 'drop'"),
    (dict(num_replicas=2, global_batch_size=True), "global_batch_size must be a positive integer, got True"),
]


@pytest.mark.parametrize("kw, says", BAD)
def test_a_bad_value_fails_at_creation_with_the_message_every_entry_point_gives(kw, says):
    with pytest.raises(ValueError) as made:
        PlanSettings(**kw)
    assert str(made.value).startswith(says)
    lengths = lengths_for(60)
    R = kw.pop("num_replicas")
    for call in (lambda: plan_epoch(lengths, R, **kw),
                 lambda: TokenBalancedBatchSampler(lengths, R, 0, **kw)):
        with pytest.raises(ValueError) as other:
            call()
        assert str(other.value) == str(made.value)


def test_frozen_and_normalised():
    s = PlanSettings(np.int64(4), global_batch_size=np.int32(16), shuffle=np.bool_(False), drop_last=1)
    assert s == PlanSettings(4, 16, shuffle=False, drop_last=True)
    assert type(s.num_replicas) is int and type(s.global_batch_size) is int and s.shuffle is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_replicas = 8   # type: ignore[misc]
    with pytest.raises(ValueError, match="shuffle must be True or False, got 'no'"):
        PlanSettings(4, 16, shuffle="no")   # type: ignore[arg-type]


def test_the_budget_check_needs_the_data_and_lists_the_samples():
    s = PlanSettings(2, max_tokens_per_rank=1000)
    costs = np.array([10, 1500, 20, 2000])
    with pytest.raises(ValueError, match=r"2 sample\(s\) exceed max_tokens_per_rank=1000 on their own: "
                                         r"1 \(1500 tokens\), 3 \(2000 tokens\)"):
        s.check_against(costs)
    PlanSettings(2, max_tokens_per_rank=1000, oversize="skip").check_against(costs)   # left out, no error
    with pytest.raises(ValueError, match="exceed max_tokens_per_rank=1000"):
        check_settings(costs, 2, None, 1000)
    assert check_settings(costs, np.int64(2), 8, None, 3) == (2, 8, None, 3)


def test_fingerprint_round_trip_and_the_sampler_stores_the_same_keys_as_before():
    s = PlanSettings(4, max_tokens_per_rank=5000, window=3, grad_accum=2, shuffle=False, oversize="alone")
    assert PlanSettings.from_fingerprint(s.fingerprint()) == s
    with pytest.raises(ValueError, match="fingerprint has no grad_accum"):
        PlanSettings.from_fingerprint({k: v for k, v in s.fingerprint().items() if k != "grad_accum"})
    lengths = lengths_for()
    sampler = TokenBalancedBatchSampler(lengths, 4, 1, max_tokens_per_rank=20_000, grad_accum=2)
    fp = sampler.fingerprint()
    # The keys checkpoints have stored since before the settings were an object.
    assert set(fp) == {"plan_version", "num_samples", "lengths_sha256", "num_replicas", "global_batch_size",
                       "max_tokens_per_rank", "shuffle", "drop_last", "window", "grad_accum", "oversize",
                       "cost", "stages"}
    assert PlanSettings.from_fingerprint(fp) == sampler.settings


def test_a_checkpoint_written_by_the_old_sampler_resumes():
    """The fingerprint as the sampler wrote it before PlanSettings (its digest computed the old way,
    and from before ``stages`` was a key): the new sampler accepts it and resumes at its cursor."""
    lengths = lengths_for()
    s = TokenBalancedBatchSampler(lengths, 4, 2, global_batch_size=16, seed=5)
    s.set_epoch(1)
    full = list(s)
    old_fp = {"plan_version": PLAN_VERSION, "num_samples": len(lengths),
              "lengths_sha256": hashlib.sha256(lengths.astype("<i8").tobytes()).hexdigest()[:16],
              "num_replicas": 4, "global_batch_size": 16, "max_tokens_per_rank": None, "shuffle": True,
              "drop_last": False, "window": None, "grad_accum": 1, "oversize": "error", "cost": "tokens"}
    fresh = TokenBalancedBatchSampler(lengths, 4, 2, global_batch_size=16)
    fresh.load_state_dict({"version": 1, "seed": 5, "epoch": 1, "cursor": 3, "fingerprint": old_fp})
    assert list(fresh) == full[3:]


def _index_like(n: int, seed: int) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    vision = np.where(rng.random(n) < 0.5, rng.integers(50, 1500, n), 0)
    return SimpleNamespace(lengths=vision + rng.integers(10, 800, n), vision_tokens=vision)


def _same_plan(a, b) -> bool:
    return (a.num_replicas, a.grad_accum) == (b.num_replicas, b.grad_accum) and all(
        np.array_equal(x, y) for x, y in ((a.indices, b.indices), (a.offsets, b.offsets),
                                          (a.dropped, b.dropped), (a.skipped, b.skipped)))


CASES = [
    dict(num_replicas=4, global_batch_size=32),
    dict(num_replicas=3, global_batch_size=24, grad_accum=2, drop_last=True),
    dict(num_replicas=4, max_tokens_per_rank=20_000, window=2),
    dict(num_replicas=2, max_tokens_per_rank=3000, oversize="skip", grad_accum=2),
    dict(num_replicas=4, global_batch_size=16, cost="flops", stages=True),
    dict(num_replicas=2, global_batch_size=16, cost="padded", grad_accum=2),
    dict(num_replicas=4, global_batch_size=32, shuffle=False, cost="flops"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_from_resolved_and_settings_equals_the_keyword_form(case, seed):
    case = dict(case)
    cost, stages = case.pop("cost", None), case.pop("stages", None)
    data = _index_like(400, seed)
    settings = PlanSettings(**case)
    R = case.pop("num_replicas")
    for epoch in (0, 3):
        by_keywords = plan_epoch(data, R, seed=seed, epoch=epoch, cost=cost, stages=stages, **case)
        by_settings = plan_epoch(resolve(data, cost, stages), settings=settings, seed=seed, epoch=epoch)
        assert _same_plan(by_keywords, by_settings)
        # Keywords that agree with settings= are fine next to it.
        assert _same_plan(by_settings, plan_epoch(data, R, settings=settings, seed=seed, epoch=epoch,
                                                  cost=cost, stages=stages))


def test_the_sampler_takes_settings_and_plans_as_with_keywords():
    lengths = lengths_for()
    settings = PlanSettings(4, global_batch_size=32, grad_accum=2, drop_last=True)
    a = TokenBalancedBatchSampler(lengths, rank=3, seed=1, settings=settings)
    b = TokenBalancedBatchSampler(lengths, 4, 3, global_batch_size=32, grad_accum=2, drop_last=True, seed=1)
    assert a.settings == b.settings and a.fingerprint() == b.fingerprint() and list(a) == list(b)
    assert (a.num_replicas, a.grad_accum, a.drop_last) == (4, 2, True)
    with pytest.raises(ValueError, match=r"disagrees with global_batch_size=64 \(settings has 32\)"):
        TokenBalancedBatchSampler(lengths, rank=0, global_batch_size=64, settings=settings)
    with pytest.raises(ValueError, match="num_replicas=2 .settings has 4"):
        TokenBalancedBatchSampler(lengths, 2, 0, settings=settings)


def test_plan_settings_merges_keywords_at_their_defaults_and_refuses_clashes():
    s = PlanSettings(2, max_tokens_per_rank=100, shuffle=False)
    assert plan_settings(s, num_replicas=None, window=None, shuffle=True, grad_accum=1) is s  # defaults
    assert plan_settings(s, num_replicas=np.int64(2), shuffle=False) is s                      # agreeing
    with pytest.raises(ValueError, match=r"grad_accum=3 \(settings has 1\)"):
        plan_settings(s, grad_accum=3)
    with pytest.raises(TypeError, match="settings must be a PlanSettings"):
        plan_settings({"num_replicas": 2})   # type: ignore[arg-type]
    assert plan_settings(None, num_replicas=2, global_batch_size=4) == PlanSettings(2, 4)


def test_from_layout_plans_over_the_data_parallel_ranks():
    layout = ParallelLayout.from_world(8, sp_size=2, rank=5)
    assert PlanSettings.from_layout(layout, global_batch_size=8) == PlanSettings(4, 8)
    with pytest.raises(ValueError, match="from_layout takes num_replicas from the layout"):
        PlanSettings.from_layout(layout, num_replicas=8, global_batch_size=8)


def test_resolved_subset_and_resolve_of_a_resolved():
    data = _index_like(50, 3)
    r = resolve(data, "flops", True)
    sub = r.subset(np.array([4, 9, 17]))
    assert sub.cost_name == "flops" and len(sub) == 3
    assert np.array_equal(sub.costs, r.costs[[4, 9, 17]]) and np.array_equal(sub.stages, r.stages[[4, 9, 17]])
    assert resolve(r) is r
    with pytest.raises(ValueError, match="already resolved"):
        resolve(r, "flops")
    with pytest.raises(ValueError, match="one value per sample"):
        Resolved(lengths=r.lengths, costs=r.costs[:-1], stages=None, cost_name="tokens")


@pytest.mark.parametrize("mode", [dict(global_batch_size=32), dict(max_tokens_per_rank=20_000, grad_accum=2),
                                  dict(global_batch_size=16, cost="flops", stages=True),
                                  dict(global_batch_size=16, cost="padded")])
def test_lengths_are_checked_once_per_sampler_not_per_epoch(mode, monkeypatch):
    calls = []
    real = tokenbal._checks.check_lengths

    def counting(lengths):
        calls.append(1)
        return real(lengths)

    # Every module that checks lengths imported the one function by name: count it in each.
    for module in ("tokenbal.balance.cost", "tokenbal.balance.plan", "tokenbal.balance.simulate"):
        monkeypatch.setattr(f"{module}.check_lengths", counting)
    data = _index_like(300, 0)
    s = TokenBalancedBatchSampler(data, 4, 1, **mode)
    for epoch in range(3):
        s.set_epoch(epoch)
        assert sum(len(b) for b in s) > 0
    assert len(calls) == 1
