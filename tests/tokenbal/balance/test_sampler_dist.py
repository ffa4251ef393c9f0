"""The sampler on real gloo ranks: each process plans on its own, none talks to the others."""

import numpy as np
import pytest
import torch.distributed as dist

from tests.helpers.dist_utils import run_ranks
from tokenbal import TokenBalancedBatchSampler


def _lengths(n: int) -> np.ndarray:
    rng = np.random.default_rng(123)
    x = np.exp(rng.normal(6.0, 1.0, n)).astype(np.int64) + 1
    x[rng.random(n) < 0.02] = 15_000
    return x


def _gather_epochs(rank, world_size, n, kwargs):
    # num_replicas / rank come from the initialised process group.
    sampler = TokenBalancedBatchSampler(_lengths(n), seed=5, **kwargs)
    assert (sampler.num_replicas, sampler.rank) == (world_size, rank)
    out = {}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        mine = list(sampler)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        out[epoch] = gathered
    # resume on every rank from the same mid-epoch state equals the rest of the epoch
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(3)]
    state = sampler.state_dict()
    fresh = TokenBalancedBatchSampler(_lengths(n), **kwargs)
    fresh.load_state_dict(state)
    tail = list(fresh)
    sampler.set_epoch(3)
    sampler.set_epoch(2)
    return {"epochs": out, "resume_ok": head + tail == list(sampler), "len": len(sampler)}


def _check(results, n, world_size):
    for epoch in (0, 1):
        views = [res["epochs"][epoch] for res in results]
        assert all(v == views[0] for v in views), "every rank gathered the same per-rank steps"
        per_rank = views[0]
        assert len({len(steps) for steps in per_rank}) == 1, "equal step counts on every rank"
        flat = sorted(i for steps in per_rank for step in steps for i in step)
        assert flat == list(range(n)), "the union over ranks is every sample exactly once"
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
    assert all(res["resume_ok"] for res in results)


def test_two_gloo_ranks_global_batch():
    results = run_ranks(_gather_epochs, 2, 301, {"global_batch_size": 8}, timeout=120)
    _check(results, 301, 2)
    assert all(all(len(step) >= 1 for steps in res["epochs"][0] for step in steps) for res in results)


def _budget_then_verify(rank, world_size, n, kwargs):
    # One spawn for two checks (process start-up dominates these tests): the token-budget epoch,
    # then verify=True with deliberately different lengths on rank 1.
    out = _gather_epochs(rank, world_size, n, kwargs)
    out["verify"] = _verify_with(rank, world_size, 1)
    return out


def test_two_gloo_ranks_token_budget_and_verify_mismatch():
    results = run_ranks(_budget_then_verify, 2, 301, {"max_tokens_per_rank": 20_000}, timeout=120)
    _check(results, 301, 2)
    for res in results:
        err = res["verify"].get("error", "")
        assert err, "both ranks raise instead of one hanging in a collective"
        assert "rank 1 differs from rank 0 in: lengths_sha256" in err


def _verify_with(rank, world_size, tamper_rank):
    lengths = _lengths(200)
    if rank == tamper_rank:
        lengths = lengths.copy()
        lengths[7] += 1          # e.g. a stale index on one node
    sampler = TokenBalancedBatchSampler(lengths, global_batch_size=8, seed=1, verify=True)
    try:
        steps = list(sampler)
    except RuntimeError as e:
        return {"error": str(e)}
    sampler.set_epoch(1)
    steps1 = list(sampler)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (steps, steps1))
    return {"steps": gathered, "hash": sampler.plan_hash()}


@pytest.mark.slow   # four processes importing torch: ~30 s on a shared 2-core machine
def test_four_processes_build_their_own_samplers_and_agree():
    results = run_ranks(_verify_with, 4, -1, timeout=180)
    assert all("error" not in res for res in results)
    assert len({res["hash"] for res in results}) == 1
    for epoch in (0, 1):
        views = [[g[epoch] for g in res["steps"]] for res in results]
        assert all(v == views[0] for v in views)
        per_rank = views[0]
        assert len({len(s) for s in per_rank}) == 1
        assert sorted(i for steps in per_rank for step in steps for i in step) == list(range(200))


def _elastic_leg(rank, world_size, n, path, batches):
    """One leg of an elastic run on real ranks: load the checkpoint at ``path`` if there is one,
    run ``batches`` batches (all when None), checkpoint; verify=True all-gathers the plan hash, so
    the ranks must agree on the re-planned remainder without having talked about it."""
    import json
    import os

    sampler = TokenBalancedBatchSampler(_lengths(n), global_batch_size=4 * world_size, elastic=True,
                                        verify=True)
    if os.path.exists(path):
        with open(path) as f:
            sampler.load_state_dict(json.load(f))
    it = iter(sampler)
    mine = [next(it) for _ in range(len(sampler) if batches is None else batches)]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(sampler.state_dict(), f)
    dist.barrier()
    return [i for steps in gathered for step in steps for i in step]


def test_elastic_resume_from_two_ranks_onto_three(tmp_path):
    path = str(tmp_path / "sampler.json")
    head = run_ranks(_elastic_leg, 2, 301, path, 5, timeout=120)[0]
    tail = run_ranks(_elastic_leg, 3, 301, path, None, timeout=120)[0]
    assert len(head) == 5 * 8
    assert sorted(head + tail) == list(range(301))


def _mismatches_with_default_settings(rank, world_size):
    """Default settings on real ranks: different lengths on one rank, then ranks restored at
    different cursors; each must raise on every rank instead of training on (or hanging)."""
    out = {}
    lengths = _lengths(400)
    stale = lengths.copy()
    stale[100:] = stale[100:][::-1]            # one node's index lists the samples in another order
    mine = stale if rank == 1 else lengths
    try:
        out["lengths"] = {"steps": len(list(TokenBalancedBatchSampler(mine, global_batch_size=8)))}
    except RuntimeError as e:
        out["lengths"] = {"error": str(e)}
    # The documented off-switch: no collective, each rank runs its own (wrong) plan to the end.
    off = TokenBalancedBatchSampler(mine, global_batch_size=8, verify=False)
    out["off_steps"] = len(list(off))
    # Same lengths, but rank 1 restores a state saved two steps later than rank 0's.
    sampler = TokenBalancedBatchSampler(lengths, global_batch_size=8, seed=3)
    it = iter(sampler)
    for _ in range(3 + 2 * rank):
        next(it)
    state = sampler.state_dict()
    fresh = TokenBalancedBatchSampler(lengths, global_batch_size=8, seed=3)
    fresh.load_state_dict(state)
    try:
        out["cursor"] = {"steps": len(list(fresh))}
    except RuntimeError as e:
        out["cursor"] = {"error": str(e)}
    # The same checkpoint on every rank resumes (the check runs again after the load, and passes).
    agreed = TokenBalancedBatchSampler(lengths, global_batch_size=8, seed=3)
    agreed.load_state_dict(dict(state, cursor=3))
    out["agreed_steps"] = len(list(agreed))
    return out


def test_default_settings_catch_different_lengths_and_different_resume_cursors():
    results = run_ranks(_mismatches_with_default_settings, 2, timeout=120, collective_timeout=30)
    steps = len(TokenBalancedBatchSampler(_lengths(400), 2, 0, global_batch_size=8))
    for res in results:
        assert "rank 1 differs from rank 0 in: lengths_sha256" in res["lengths"].get("error", ""), res
        assert res["off_steps"] == steps
        want = "rank 1 differs from rank 0 in: cursor (rank 0: 3, rank 1: 5)"
        assert want in res["cursor"].get("error", ""), res
        assert res["agreed_steps"] == steps - 3
