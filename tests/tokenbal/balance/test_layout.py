"""tokenbal/balance/ layout: the old import paths (the contract's ``tokenbal.partition`` without a warning,
the deprecated ones with one naming the removal version), and a sampler (whose class lives in
tokenbal.balance.sampler) still crosses into spawned DataLoader workers."""

import json
import pickle
import subprocess
import sys

import numpy as np
import torch.utils.data

import tokenbal
import tokenbal.balance.sampler

# A fresh interpreter per check: a module warns once, when it is first imported.
_OLD_PATHS = r"""
import json, sys, warnings
warnings.simplefilter("always")
out = {}
for stmt in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(stmt, {})
    out[stmt] = [(w.category.__name__, str(w.message), w.filename) for w in caught]
print(json.dumps(out))
"""


def _import_warnings(*statements: str) -> dict[str, list]:
    done = subprocess.run([sys.executable, "-c", _OLD_PATHS, *statements], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout)


def test_contract_partition_path_imports_without_a_warning():
    got = _import_warnings(
        "from tokenbal.partition import partition; import tokenbal.balance.partition as p; "
        "assert partition is p.partition",
        "import tokenbal.partition, tokenbal.balance.partition as p; assert tokenbal.partition is p")
    assert got == {k: [] for k in got}


def test_deprecated_old_paths_warn_with_a_removal_version_and_keep_working():
    got = _import_warnings(
        "import tokenbal.cost, tokenbal.balance.cost as m; assert tokenbal.cost is m; "
        "from tokenbal.cost import FlopsModel, resolve_costs, resolve_stage_costs",
        "import tokenbal.sampler, tokenbal.balance.sampler as m; assert tokenbal.sampler is m; "
        "from tokenbal.sampler import TokenBalancedBatchSampler",
        "from tokenbal.plan import EpochPlan, plan_epoch, simulate, step_balance, balance_summary; "
        "import tokenbal.balance.plan as p, tokenbal.balance.simulate as s; "
        "assert plan_epoch is p.plan_epoch and simulate is s.simulate",
        "from tokenbal.wds import IndexedShardDataset, balanced_batches, parse_tar_header; "
        "import tokenbal.data as d; assert IndexedShardDataset is d.IndexedShardDataset")
    for stmt, caught in got.items():
        old = stmt.split()[1].rstrip(",")
        assert [c for c, _, _ in caught] == ["DeprecationWarning"], (stmt, caught)
        category, message, filename = caught[0]
        assert old in message and "0.3.0" in message, message
        assert filename == "<string>", f"the warning should name the importing code, not {filename}"


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
