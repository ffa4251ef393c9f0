"""tokenbal/balance/ layout: the old import paths are the same modules, and a sampler (whose class now
lives in tokenbal.balance.sampler) still crosses into spawned DataLoader workers."""

import pickle

import numpy as np
import torch.utils.data

import tokenbal
import tokenbal.balance.cost
import tokenbal.balance.partition
import tokenbal.balance.plan
import tokenbal.balance.sampler
import tokenbal.cost
import tokenbal.partition
import tokenbal.plan
import tokenbal.sampler


def test_old_paths_are_the_new_modules():
    assert tokenbal.plan is tokenbal.balance.plan
    assert tokenbal.cost is tokenbal.balance.cost
    assert tokenbal.sampler is tokenbal.balance.sampler
    assert tokenbal.partition is tokenbal.balance.partition
    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.cost import FlopsModel, resolve_costs, resolve_stage_costs
    from tokenbal.partition import fill_windows, partition, refine_stages, swap_stages_across_steps
    from tokenbal.plan import EpochPlan, plan_epoch, simulate, step_balance

    assert TokenBalancedBatchSampler is tokenbal.balance.sampler.TokenBalancedBatchSampler
    assert partition is tokenbal.balance.partition.partition
    assert all(callable(f) for f in (FlopsModel, resolve_costs, resolve_stage_costs, fill_windows,
                                     refine_stages, swap_stages_across_steps, EpochPlan, plan_epoch,
                                     simulate, step_balance))


class _SamplerDataset(torch.utils.data.Dataset):
    """Holds a sampler, so every worker unpickles one; returns each rank's first step."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __len__(self) -> int:
        return 2

    def __getitem__(self, rank: int):
        return self.sampler.plan().slot(0, rank).tolist()


def test_sampler_crosses_into_spawned_workers_and_pickles_under_its_new_name():
    lens = np.arange(1, 65)
    sampler = tokenbal.TokenBalancedBatchSampler(lens, 2, 0, global_batch_size=8, seed=3)
    data = pickle.dumps(sampler)
    assert b"tokenbal.balance.sampler" in data
    loader = torch.utils.data.DataLoader(_SamplerDataset(sampler), batch_size=None, num_workers=1,
                                         multiprocessing_context="spawn")
    got = list(loader)
    assert got == [sampler.plan().slot(0, r).tolist() for r in range(2)]
    assert list(pickle.loads(data)) == list(sampler)
