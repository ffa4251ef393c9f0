import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from tests.helpers.lengths import lengths_for
from tokenbal import TokenBalancedBatchSampler
from tokenbal.plan import plan_epoch


def samplers(lengths, R, **kw):
    return [TokenBalancedBatchSampler(lengths, num_replicas=R, rank=r, **kw) for r in range(R)]


def run_epoch(ss):
    return [list(s) for s in ss]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 200), R=st.integers(1, 6), per_rank=st.integers(1, 4),
       mode=st.sampled_from(["batch", "tokens"]), seed=st.integers(0, 1000), epoch=st.integers(0, 5))
def test_all_ranks_together_use_every_sample_once(n, R, per_rank, mode, seed, epoch):
    lengths = lengths_for(n, seed)
    kw = (dict(global_batch_size=R * per_rank + seed % 2) if mode == "batch"
          else dict(max_tokens_per_rank=int(max(lengths.max(initial=1), 1) * (1 + per_rank))))
    ss = samplers(lengths, R, seed=seed, **kw)
    for s in ss:
        s.set_epoch(epoch)
    steps = run_epoch(ss)
    assert len({len(x) for x in steps}) == 1 and all(len(x) == len(ss[0]) for x in steps)
    flat = sorted(i for rank_steps in steps for step in rank_steps for i in step)
    assert flat == list(range(n))
    if n >= R and mode == "batch":
        assert all(len(step) >= 1 for rank_steps in steps for step in rank_steps)
    # exactly the plan, sliced per rank
    plan = plan_epoch(lengths, R, seed=seed, epoch=epoch, **kw)
    assert steps == [plan.rank_steps(r) for r in range(R)]


def test_accepts_an_object_with_lengths_and_defaults():
    class Index:
        def __init__(self, lengths):
            self.lengths = lengths

    lengths = lengths_for()
    a = TokenBalancedBatchSampler(Index(lengths), num_replicas=4, rank=1, global_batch_size=16)
    b = TokenBalancedBatchSampler(lengths, 4, 1, global_batch_size=16)
    assert list(a) == list(b) and len(a) == len(b) == -(-len(lengths) // 16)


def test_epochs_differ_and_the_same_epoch_repeats():
    s = TokenBalancedBatchSampler(lengths_for(), 4, 0, global_batch_size=16)
    e0 = list(s)
    assert list(s) == e0, "iterating a finished epoch again replays it"
    s.set_epoch(1)
    e1 = list(s)
    assert e1 != e0
    s.set_epoch(0)
    assert list(s) == e0


def test_one_process_defaults_when_torch_distributed_is_not_initialised():
    # Neither given: one process owns the whole epoch, exactly as num_replicas=1, rank=0 would.
    s = TokenBalancedBatchSampler(lengths_for(), global_batch_size=8)
    assert (s.num_replicas, s.rank) == (1, 0)
    assert list(s) == list(TokenBalancedBatchSampler(lengths_for(), 1, 0, global_batch_size=8))
    assert sorted(i for step in s for i in step) == list(range(len(lengths_for())))
    # Half a pair is ambiguous (rank 0 of 4 would silently train a quarter of the data).
    with pytest.raises(ValueError, match="num_replicas given without rank and torch.distributed is not"):
        TokenBalancedBatchSampler(lengths_for(), 4, global_batch_size=8)
    with pytest.raises(ValueError, match="rank given without num_replicas"):
        TokenBalancedBatchSampler(lengths_for(), rank=1, global_batch_size=8)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\)"):
        TokenBalancedBatchSampler(lengths_for(), 4, 4, global_batch_size=8)
    with pytest.raises(ValueError, match="exactly one of"):
        TokenBalancedBatchSampler(lengths_for(), 4, 0)
    with pytest.raises(ValueError, match="smaller than num_replicas"):
        TokenBalancedBatchSampler(lengths_for(), 4, 0, global_batch_size=2)


class IndexDataset(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"idx": i, "x": torch.full((2,), float(i))}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_works_as_dataloader_batch_sampler(num_workers):
    lengths = lengths_for(120)
    s = TokenBalancedBatchSampler(lengths, 3, 2, global_batch_size=12)
    loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=num_workers)
    assert len(loader) == len(s)
    got = [b["idx"].tolist() for b in loader]
    assert got == plan_epoch(lengths, 3, global_batch_size=12).rank_steps(2)
    assert all(b.shape == (len(i), 2) for b, i in zip((b["x"] for b in loader), got, strict=True))


@pytest.mark.parametrize("mode", [dict(global_batch_size=16), dict(max_tokens_per_rank=16_000)])
def test_resume_mid_epoch_yields_exactly_the_suffix(mode):
    lengths = lengths_for(300)
    R = 4
    for stop in [0, 1, "half", "end"]:
        plan = plan_epoch(lengths, R, seed=7, epoch=3, **mode)
        full = [plan.rank_steps(r) for r in range(R)]
        stop_at = {"half": len(full[0]) // 2, "end": len(full[0])}.get(stop, stop)
        assert len(full[0]) >= 4
        states = []
        for r in range(R):
            s = TokenBalancedBatchSampler(lengths, R, r, seed=7, **mode)
            s.set_epoch(3)
            it = iter(s)
            for _ in range(stop_at):
                next(it)
            states.append(json.loads(json.dumps(s.state_dict())))  # plain, serialisable values
            assert states[-1]["cursor"] == stop_at and states[-1]["epoch"] == 3
        for r in range(R):
            fresh = TokenBalancedBatchSampler(lengths, R, r, seed=0, **mode)   # seed comes from the state
            fresh.load_state_dict(states[r])
            fresh.set_epoch(3)                      # the usual loop calls this again: must not reset
            rest = list(fresh)
            assert rest == full[r][stop_at:]     # empty when the checkpoint ended the epoch
            if r == 0:
                fresh.set_epoch(4)
                assert list(fresh) == plan_epoch(lengths, R, seed=7, epoch=4, **mode).rank_steps(0)


def test_fingerprint_mismatch_names_what_differs():
    lengths = lengths_for()
    s = TokenBalancedBatchSampler(lengths, 4, 0, global_batch_size=16)
    next(iter(s))
    sd = s.state_dict()
    cases = [
        (TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=16), ["num_replicas: checkpoint has 4"]),
        (TokenBalancedBatchSampler(lengths, 4, 0, global_batch_size=32), ["global_batch_size"]),
        (TokenBalancedBatchSampler(lengths[:-1], 4, 0, global_batch_size=16),
         ["num_samples", "lengths_sha256"]),
        (TokenBalancedBatchSampler(lengths + 1, 4, 0, global_batch_size=16), ["lengths_sha256"]),
        (TokenBalancedBatchSampler(lengths, 4, 0, global_batch_size=16, shuffle=False), ["shuffle"]),
        (TokenBalancedBatchSampler(lengths, 4, 0, max_tokens_per_rank=20_000),
         ["global_batch_size", "max_tokens_per_rank"]),
    ]
    for other, needles in cases:
        with pytest.raises(ValueError, match="cannot resume") as e:
            other.load_state_dict(sd)
        for needle in needles:
            assert needle in str(e.value)
        assert other.cursor == 0
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"seed": 0})
    bad = dict(sd, cursor=10_000)
    with pytest.raises(ValueError, match="outside epoch"):
        s.load_state_dict(bad)


def test_plan_is_cached_per_epoch():
    s = TokenBalancedBatchSampler(lengths_for(), 4, 0, global_batch_size=16)
    p0 = s.plan()
    assert s.plan() is p0
    s.set_epoch(1)
    assert s.plan() is not p0 and s.plan(epoch=0) is p0


def test_grad_accum_yields_k_micro_batches_per_step_and_resumes_mid_step():
    lengths = lengths_for()
    R, k = 4, 3
    samplers = [TokenBalancedBatchSampler(lengths, R, r, global_batch_size=48, grad_accum=k, seed=2)
                for r in range(R)]
    plan = samplers[0].plan()
    runs = [list(s) for s in samplers]
    assert {len(x) for x in runs} == {plan.num_steps * k} == {len(samplers[0])}
    for r, batches in enumerate(runs):
        for i, b in enumerate(batches):
            assert b == plan.micro(i // k, r, i % k).tolist() and len(b) >= 1
    assert sorted(i for x in runs for b in x for i in b) == list(range(len(lengths)))
    # a checkpoint between two micro-batches of one step resumes at the next micro-batch
    s = TokenBalancedBatchSampler(lengths, R, 1, global_batch_size=48, grad_accum=k, seed=2)
    it = iter(s)
    head = [next(it) for _ in range(k + 1)]
    fresh = TokenBalancedBatchSampler(lengths, R, 1, global_batch_size=48, grad_accum=k, seed=2)
    fresh.load_state_dict(s.state_dict())
    assert head + list(fresh) == runs[1]
    with pytest.raises(ValueError, match="grad_accum"):
        TokenBalancedBatchSampler(lengths, R, 1, global_batch_size=48, grad_accum=1).load_state_dict(
            s.state_dict())


def test_stateful_dataloader_resumes_exactly():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    lengths = lengths_for()
    data = list(range(len(lengths)))

    def loader():
        sampler = TokenBalancedBatchSampler(lengths, 2, 1, global_batch_size=8, seed=3)
        return sdl.StatefulDataLoader(data, batch_sampler=sampler, collate_fn=list)

    full = list(loader())
    dl = loader()
    it = iter(dl)
    head = [next(it) for _ in range(5)]
    state = dl.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    assert full == [b for b in TokenBalancedBatchSampler(lengths, 2, 1, global_batch_size=8, seed=3)]


def test_verify_needs_a_process_group():
    s = TokenBalancedBatchSampler(lengths_for(), 2, 0, global_batch_size=8, verify=True)
    with pytest.raises(RuntimeError, match="process group"):
        next(iter(s))


def test_track_resumes_a_dataloader_with_workers_without_skipping_what_it_prefetched():
    # Workers fetch ahead of the loop (here 2 workers x prefetch_factor 2), so the sampler has
    # handed out more batches than the loop trained on when the checkpoint is taken.
    lengths = lengths_for(200)
    R, k = 2, 3
    trained = []
    for r in range(R):
        s = TokenBalancedBatchSampler(lengths, R, r, global_batch_size=8, seed=4)
        s.set_epoch(1)
        loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=2)
        for step, batch in enumerate(s.track(loader)):
            trained += batch["idx"].tolist()
            if step + 1 == k:
                break
        assert s.cursor > k, "the DataLoader ran ahead of the loop"
        state = json.loads(json.dumps(s.state_dict()))
        assert state["cursor"] == k
        fresh = TokenBalancedBatchSampler(lengths, R, r, global_batch_size=8, seed=4)
        fresh.load_state_dict(state)
        fresh.set_epoch(1)
        resumed = DataLoader(IndexDataset(len(lengths)), batch_sampler=fresh, num_workers=2)
        trained += [i for batch in fresh.track(resumed) for i in batch["idx"].tolist()]
        assert fresh.state_dict()["cursor"] == len(fresh)
    assert sorted(trained) == list(range(len(lengths))), "every sample once, none twice, none skipped"


def test_track_needs_its_own_loader_in_order():
    s = TokenBalancedBatchSampler(lengths_for(40), 2, 0, global_batch_size=8)
    other = TokenBalancedBatchSampler(lengths_for(40), 2, 0, global_batch_size=8)
    with pytest.raises(ValueError, match="batch_sampler=this sampler"):
        next(s.track(DataLoader(IndexDataset(40), batch_sampler=other)))
    unordered = DataLoader(IndexDataset(40), batch_sampler=s, num_workers=1, in_order=False)
    with pytest.raises(ValueError, match="in_order=True"):
        next(s.track(unordered))
