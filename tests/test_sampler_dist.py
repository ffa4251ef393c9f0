"""The sampler on real gloo ranks: each process plans on its own, none talks to the others."""

import numpy as np
import torch.distributed as dist

from tests.dist_utils import run_ranks
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


def test_two_gloo_ranks_token_budget():
    results = run_ranks(_gather_epochs, 2, 301, {"max_tokens_per_rank": 20_000}, timeout=120)
    _check(results, 301, 2)
