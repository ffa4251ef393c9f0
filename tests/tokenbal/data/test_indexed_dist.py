"""Real 2-rank gloo groups: the indexed path reads a whole epoch (every sample once, source bytes),
and the streaming path keeps unequal ranks in step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_utils import run_ranks
from tests.helpers.shards import as_members, build, first_key_batch, tar_members


def _read_epoch(rank, world, index_path, epoch):
    from tokenbal import TokenBalancedBatchSampler, TokenIndex
    from tokenbal.data.indexed import IndexedShardDataset

    idx = TokenIndex.open(index_path)
    sampler = TokenBalancedBatchSampler(idx, global_batch_size=6, seed=11)   # rank/world from dist
    sampler.set_epoch(epoch)
    ds = IndexedShardDataset(idx, decode=None, max_open_shards=2)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=1,
                                         collate_fn=first_key_batch, timeout=60,
                                         multiprocessing_context="fork")   # as under torchrun
    batches, tokens = [], []
    for batch in loader:
        batches.append([(s["__index__"], s["__key__"], as_members(s)) for s in batch])
        t = torch.tensor([sum(int(idx.lengths[s["__index__"]]) for s in batch)])
        dist.all_reduce(t)                      # one collective per step, as training does
        tokens.append(int(t))
    return sampler.num_replicas, sampler.rank, batches, tokens


def tokens(sample):
    """A stand-in token count (payload bytes / 64); module level, so DataLoader workers can pickle it."""
    return sum(len(v) for k, v in sample.items() if not k.startswith("__")) // 64 + 1


def _stream(rank, world, shards, budget):
    import webdataset as wds

    from tokenbal.data.stream import agree_steps, balanced_batches

    mine = shards[:2] if rank == 0 else shards[2:]          # unequal: 2 shards vs 1
    # Each rank's own count from a dry pass over its finite stream; one all_reduce(MIN) agrees.
    local = sum(1 for _ in wds.DataPipeline(wds.SimpleShardList(mine), wds.tarfile_to_samples(),
                                            balanced_batches(budget, tokens, rank=rank)))
    steps = agree_steps(local)
    pipe = wds.DataPipeline(wds.ResampledShards(mine, seed=rank, deterministic=True),
                            wds.tarfile_to_samples(),
                            balanced_batches(budget, tokens, steps=steps, bufsize=8, seed=0, rank=rank))
    loader = torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=2, timeout=60,
                                         multiprocessing_context="fork")
    n, biggest = 0, 0
    for batch in loader:
        t = torch.tensor([sum(tokens(s) for s in batch)])
        biggest = max(biggest, int(t))
        dist.all_reduce(t)
        n += 1
    return local, steps, n, biggest


def _both(rank, world, index_path, shards, budget):
    # One pair of ranks for both checks: starting gloo ranks is the slow part of these tests.
    return _read_epoch(rank, world, index_path, 1), _stream(rank, world, shards, budget)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    idx, shards = build(root, n_shards=3, samples_per_shard=8, seed=2)
    results = run_ranks(_both, 2, idx.path, shards, 300, timeout=240)
    return idx, shards, [r[0] for r in results], [r[1] for r in results]


def test_two_ranks_read_one_epoch_by_offset(ranks):
    idx, shards, results, _ = ranks
    truth = tar_members(shards)
    assert [(r[0], r[1]) for r in results] == [(2, 0), (2, 1)]
    steps = [len(r[2]) for r in results]
    assert steps[0] == steps[1] > 0
    assert results[0][3] == results[1][3]          # both ranks ran every step's all_reduce
    seen = [row for r in results for batch in r[2] for row in batch]
    assert sorted(i for i, _, _ in seen) == list(range(len(idx)))    # every sample once
    got = {}
    for i, key, members in seen:
        assert key == idx.keys[i]
        got.update(members)
    assert got == truth                            # every member's bytes equal tarfile's


def test_two_ranks_stream_the_same_number_of_steps(ranks):
    results = ranks[3]
    locals_ = [r[0] for r in results]
    assert locals_[0] > locals_[1] > 0                       # the ranks' own counts differ
    assert [r[1] for r in results] == [locals_[1]] * 2       # agreed on the minimum
    assert [r[2] for r in results] == [locals_[1]] * 2       # and both ran exactly that many steps
    assert all(r[3] <= 300 for r in results)


class _SameSamplesEveryWorker(torch.utils.data.IterableDataset):
    """The same 60 samples, repeated, on every rank and worker: only the stage's seed tells the
    streams apart. Module level, so spawned DataLoader workers can unpickle it."""

    def __init__(self, stage):
        self.stage = stage

    def __iter__(self):
        import itertools

        data = [{"__key__": f"k{j:03d}", "n": 10 + (j * 37) % 90} for j in range(60)]
        return self.stage(itertools.cycle(data))


def _sample_size(sample):
    return sample["n"]


def _keys(batch):
    return [s["__key__"] for s in batch]


def _stream_in_spawned_workers(rank, world):
    from tokenbal.data.stream import balanced_batches

    stage = balanced_batches(200, _sample_size, steps=6, bufsize=16, seed=0, collation_fn=_keys)
    loader = torch.utils.data.DataLoader(_SameSamplesEveryWorker(stage), batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn", timeout=120)
    batches = list(loader)
    dist.barrier()
    return stage.rank, batches


def test_streaming_seed_keeps_the_rank_in_spawned_workers():
    # A spawned worker has no process group: resolved there, every rank's workers would be seeded as
    # rank 0 and cut the same batches from the same stream.
    (rank0, b0), (rank1, b1) = run_ranks(_stream_in_spawned_workers, 2, timeout=240)
    assert len(b0) == len(b1) == 6
    assert b0 != b1
    assert (rank0, rank1) == (0, 1)


def _agree_with_an_empty_rank(rank, world):
    from tokenbal.data.stream import agree_steps

    try:
        return agree_steps([5, 0, 7][rank])
    except ValueError as e:
        return str(e)


def test_a_rank_with_no_samples_is_named_not_an_epoch_of_zero_steps_everywhere():
    """3 shards over 4 ranks, or one rank's shard list empty: its dry pass counts 0 batches, the MIN
    over ranks was 0, and every rank trained 0 steps this epoch, the others' data skipped silently."""
    got = run_ranks(_agree_with_an_empty_rank, 3, timeout=120)
    said = "agree_steps: rank(s) [1] of 3 have 0 steps"
    assert all(isinstance(g, str) and said in g and "up to 7" in g for g in got), got
