"""cost="padded": steps composed for collators that pad each micro-batch to its longest sample,
against transformers' own BatchRebalanceSampler (train_sampling_strategy="batch_rebalance") on the
same lengths. The split of one step is checked against brute force; plans keep every guarantee of
global_batch_size mode (every sample once, N per step but the merged tail, no empty rank)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.balance.baselines import batch_rebalance_plan, distributed_sampler_plan, padded_summary
from tokenbal.balance.partition.padded import min_max_padded_split
from tokenbal.balance.plan import plan_epoch
from tokenbal.balance.sampler import TokenBalancedBatchSampler


def _brute(lens: list[int], K: int) -> int:
    n, best = len(lens), None
    for cuts in itertools.combinations(range(1, n), K - 1):
        b = [0, *cuts, n]
        cost = max((b[i + 1] - b[i]) * max(lens[b[i]], 1) for i in range(K))
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=9), st.data())
def test_split_is_the_optimal_contiguous_split(lens, data):
    lens = sorted(lens, reverse=True)
    K = data.draw(st.integers(1, len(lens)))
    counts = min_max_padded_split(np.array(lens), K)
    assert counts.sum() == len(lens) and (counts >= 1).all()
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    assert max(counts * np.maximum(np.array(lens)[start], 1)) == _brute(lens, K)


def _mixture(kind: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == 0:
        return rng.integers(1, 2000, n)
    if kind == 1:
        return rng.lognormal(5, 1.2, n).astype(np.int64) + 1
    if kind == 2:   # mostly short text, a tail of long image / video samples
        return np.where(rng.random(n) < 0.1, rng.integers(2000, 8000, n), rng.integers(10, 300, n))
    return rng.choice([5, 50, 500, 5000], n)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.sampled_from([1, 1, 2, 3]), st.integers(0, 3),
       st.integers(0, 2**31 - 1), st.booleans())
def test_plan_guarantees(R, per_device, k, kind, seed, drop_last):
    rng = np.random.default_rng(seed)
    N = R * per_device * k
    n = int(rng.integers(1, min(2000, 12 * N)))
    lens = _mixture(kind, n, rng)
    opts = dict(global_batch_size=N, grad_accum=k, cost="padded", seed=seed, drop_last=drop_last)
    plan = plan_epoch(lens, R, **opts)
    assert sorted(plan.indices.tolist() + plan.dropped.tolist()) == list(range(n))   # every sample once
    counts = plan.counts().sum(1)
    if plan.num_steps:
        assert (counts[:-1] == N).all() and (counts[-1] == N if drop_last else counts[-1] >= min(n, R * k))
    if n >= R * k:
        assert plan.num_empty == 0
    again = plan_epoch(lens, R, **opts)
    assert np.array_equal(plan.indices, again.indices) and np.array_equal(plan.offsets, again.offsets)


def _needs_batch_rebalance() -> None:
    """transformers' BatchRebalanceSampler is the oracle; releases before it (e.g. 4.57) skip."""
    trainer_pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    if not hasattr(trainer_pt_utils, "BatchRebalanceSampler"):
        pytest.skip("the installed transformers has no BatchRebalanceSampler")


def test_beats_batch_rebalance_on_random_mixtures():
    """40 random draws (ranks 1-8, per-device batch 1-6, grad accum 1-3, four length families, 8-24
    steps), each planned by tokenbal and by batch_rebalance on the same lengths. Not a pointwise
    theorem: over 300 such draws (seeded, measured when this was written) tokenbal's Σ per-step max
    padded tokens was higher in 1 and its padded ÷ real (per-device batch >= 2: with one sample per
    micro-batch batch_rebalance pads nothing, and tokenbal's merged tail must) in 3 (docs/BENCHMARKS.md,
    issue 30). So:
    at most 2 of these 40 draws may lose on either, and the totals must win clearly."""
    _needs_batch_rebalance()
    draws = np.random.default_rng(2026)
    lose_max = lose_ratio = 0
    ours_total = theirs_total = 0
    for _ in range(40):
        R, per_device = int(draws.integers(1, 9)), int(draws.integers(1, 7))
        k, kind, seed = int(draws.choice([1, 1, 2, 3])), int(draws.integers(0, 4)), int(draws.integers(2**31))
        rng = np.random.default_rng(seed)
        N = R * per_device * k
        n = int(rng.integers(8 * N, max(8 * N + 1, min(600, 24 * N))))
        lens = _mixture(kind, n, rng)
        plan = plan_epoch(lens, R, global_batch_size=N, grad_accum=k, cost="padded", seed=seed)
        assert sorted(plan.indices.tolist()) == list(range(n))
        ours = padded_summary(plan, lens)
        theirs = padded_summary(batch_rebalance_plan(lens, R, per_device, k, seed=seed), lens)
        lose_max += ours["sum_max_padded"] > theirs["sum_max_padded"]
        lose_ratio += per_device >= 2 and ours["padded_over_real"] > theirs["padded_over_real"]
        ours_total += ours["sum_max_padded"]
        theirs_total += theirs["sum_max_padded"]
    assert lose_max <= 2 and lose_ratio <= 2
    assert ours_total < 0.8 * theirs_total


def test_padded_cost_in_the_sampler_and_its_errors():
    rng = np.random.default_rng(0)
    lens = _mixture(2, 300, rng)
    samplers = [TokenBalancedBatchSampler(lens, num_replicas=2, rank=r, global_batch_size=8, cost="padded",
                                          seed=3) for r in range(2)]
    steps = [list(s) for s in samplers]
    assert len(steps[0]) == len(steps[1]) == len(samplers[0])
    assert sorted(i for rank in steps for b in rank for i in b) == list(range(300))
    assert samplers[0].fingerprint()["cost"] == "padded"
    # the sampler's steps are plan_epoch's
    plan = plan_epoch(lens, 2, global_batch_size=8, cost="padded", seed=3)
    assert steps[0] == plan.rank_steps(0)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        plan_epoch(lens, 2, max_tokens_per_rank=10_000, cost="padded")
    reports = []
    ds = padded_summary(distributed_sampler_plan(lens, 2, 4, progress=lambda *r: reports.append(r)), lens)
    assert reports == [(2, 2, "ranks")]
    assert padded_summary(plan, lens)["sum_max_padded"] < ds["sum_max_padded"]


def test_plan_simulate_padded_shows_batch_rebalance(tmp_path, capsys):
    _needs_batch_rebalance()
    from tokenbal.cli import main
    from tokenbal.index import build_index
    from tokenbal.synthetic import make_samples, write_shards

    samples = [s for s in make_samples(160, seed=5) if s.kind in ("text_short", "text_long", "icon")]
    shards = write_shards(samples, str(tmp_path / "shards"), samples_per_shard=128)
    index = str(build_index(shards, tmp_path / "idx", progress=False).out)
    assert main(["plan", "simulate", "--index", index, "--world-size", "2", "--global-batch-size", "8",
                 "--padded"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("method") and "Σ max padded" in line)
    rows = {line[:34].strip(): line[34:].split() for line in lines[start + 1:start + 5]}
    assert set(rows) == {"DistributedSampler", "batch_rebalance (transformers)", "tokenbal (cost tokens)",
                         "tokenbal (cost padded)"}
    ours, theirs = rows["tokenbal (cost padded)"], rows["batch_rebalance (transformers)"]
    assert int(ours[0]) <= int(theirs[0]) and float(ours[1]) <= float(theirs[1])
    with pytest.raises(ValueError, match="divisible"):
        from tokenbal.balance.baselines import padded_comparison

        padded_comparison(np.arange(1, 50), 2, 7)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1), st.booleans(),
       st.integers(0, 2))
def test_batch_rebalance_plan_is_every_ranks_own_sampler(R, per_device, k, seed, drop_last, epoch):
    # The baseline runs one BatchRebalanceSampler and hands out every rank's part of each step (R
    # samplers would each compute every rank's part: hours at 1M samples on 512 ranks); what each rank
    # gets must be what that rank's own sampler yields, tails (padded or dropped) included.
    _needs_batch_rebalance()
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    rng = np.random.default_rng(seed)
    N = R * per_device * k
    lens = rng.integers(1, 3000, int(rng.integers(N, 6 * N + 3)))
    reports = []
    plan = batch_rebalance_plan(lens, R, per_device, k, seed=seed, drop_last=drop_last, epoch=epoch,
                                progress=lambda done, total, unit: reports.append((done, total, unit)))
    for r in range(R):
        own = BatchRebalanceSampler(lengths=lens.tolist(), effective_batch_size=N, dp_size=R, grad_accum=k,
                                    seed=seed, rank=r, drop_last=drop_last)
        own.set_epoch(epoch)
        assert [plan.micro(step, r, j).tolist() for step in range(plan.num_steps) for j in range(k)] \
            == [list(mb) for mb in own]
    # counted in steps, ending at the total
    assert reports[-1] == (plan.num_steps, plan.num_steps, "steps")
    assert all(done < total for done, total, _ in reports[:-1])


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 300), st.integers(1, 40), st.booleans(), st.booleans(), st.integers(0, 3),
       st.integers(0, 2**31 - 1))
def test_distributed_sampler_indices_are_every_ranks_own_sampler(n, R, drop_last, shuffle, epoch, seed):
    # One permutation, sliced for every rank, must be what each rank's own torch DistributedSampler
    # yields: the padding (cyclic when the epoch is shorter than the ranks), drop_last, the seed+epoch
    # generator, and no shuffle.
    from torch.utils.data import DistributedSampler

    from tokenbal.balance.baselines import distributed_sampler_indices

    rows = distributed_sampler_indices(n, R, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
    assert rows.dtype == np.int64 and rows.shape[0] == R
    for r in range(R):
        own = DistributedSampler(range(n), num_replicas=R, rank=r, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
        own.set_epoch(epoch)
        assert rows[r].tolist() == list(own)
        assert rows.shape[1] == len(own)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 400), st.integers(1, 12), st.integers(1, 6), st.integers(1, 3), st.integers(0, 2),
       st.integers(0, 2**31 - 1))
def test_distributed_sampler_plan_is_every_ranks_own_loader(n, R, b, k, epoch, seed):
    # The plan from one permutation holds, for every rank, the batches its own DistributedSampler +
    # BatchSampler(drop_last=False) gives, whole optimizer steps only (the last short batch kept when
    # it completes a step).
    from torch.utils.data import BatchSampler, DistributedSampler

    lens = np.random.default_rng(seed).integers(1, 3000, n)
    reports = []
    plan = distributed_sampler_plan(lens, R, b, k, seed=seed, epoch=epoch,
                                    progress=lambda *report: reports.append(report))
    own_batches = []
    for r in range(R):
        own = DistributedSampler(range(n), num_replicas=R, rank=r, shuffle=True, seed=seed, drop_last=False)
        own.set_epoch(epoch)
        own_batches.append([list(x) for x in BatchSampler(own, b, drop_last=False)])
    whole = len(own_batches[0]) - len(own_batches[0]) % k
    assert plan.num_steps == whole // k
    for r in range(R):
        assert [plan.micro(s, r, j).tolist() for s in range(plan.num_steps) for j in range(k)] \
            == own_batches[r][:whole]
    assert reports == [(R, R, "ranks")]


def test_balance_groups_on_arrays_is_the_class_own():
    # The baseline's array port of BatchRebalanceSampler._balance_groups gives the very groups the
    # class's own gives, on skewed lengths (short text, images, a few huge samples) where the largest
    # groups run down to one sample: the slot freezing, whose groups are visited in a Python set's
    # order (told from sorted order only at ~17+ ranks x 3 micro-batches: 5 of these 400 draws), and
    # ties (equal lengths, equal costs). Seeded draws, not hypothesis: its draws rarely reach those.
    _needs_batch_rebalance()
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    from tokenbal.balance.baselines import _balance_groups_on_arrays, _balance_is_ported

    assert _balance_is_ported(BatchRebalanceSampler)
    froze = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        R, k, fill = int(rng.integers(1, 25)), int(rng.integers(1, 4)), int(rng.integers(0, 3))
        n = int(rng.integers(R * k, (fill + 1) * R * k + 1))
        kinds = rng.integers(0, 3, n)
        lens = np.where(kinds == 0, rng.integers(1, 60, n), np.where(kinds == 1, rng.integers(1, 3000, n),
                                                                   rng.integers(20_000, 200_000, n))).tolist()
        pairs = sorted(zip(range(n), lens, strict=True), key=lambda x: x[1], reverse=True)
        sampler = BatchRebalanceSampler(lengths=lens, effective_batch_size=n, dp_size=R, grad_accum=k)
        ours = _balance_groups_on_arrays(sampler, pairs)
        assert ours == sampler._balance_groups(pairs), (seed, R, k, n)
        froze += min(len(g) for g in ours) == 1
    assert froze > 100    # the freezing path ran (a group down to one sample)
