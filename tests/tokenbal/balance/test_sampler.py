import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from tests.helpers.lengths import lengths_for
from tokenbal import TokenBalancedBatchSampler
from tokenbal.balance.plan import plan_epoch


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


def _first_pass(batches, stop_after):
    """The indices of the first ``stop_after`` batches of ``batches``, then a ``break`` (an eval, an
    OOM retry) that abandons the iterator with what its workers had prefetched."""
    seen = []
    for n, batch in enumerate(batches):
        seen += batch["idx"].tolist()
        if n + 1 == stop_after:
            break
    return seen


@pytest.mark.parametrize("second_pass", ["track", "plain"])
def test_a_new_iteration_after_a_break_under_track_continues_at_the_first_batch_not_received(second_pass):
    # The reproduction: 200 samples, a real 2-worker DataLoader, break after 10 batches, iterate
    # the same loader again. The workers had asked for 4 batches more than the loop received.
    lengths = lengths_for(200)
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
    loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=2)
    seen = _first_pass(s.track(loader), 10)
    assert s.cursor > 10, "the DataLoader ran ahead of the loop"
    assert s.state_dict()["cursor"] == 10
    rest = s.track(loader) if second_pass == "track" else loader
    seen += [i for batch in rest for i in batch["idx"].tolist()]
    assert sorted(seen) == list(range(200)), "every sample once, none skipped, none twice"
    # The epoch is complete: the next iteration (no set_epoch) replays it from the start.
    assert [b["idx"].tolist() for b in s.track(loader)][0] == list(s)[0]


def test_set_epoch_inside_the_last_step_ends_the_epoch_instead_of_replaying_it():
    # A loop that prepares the next epoch at the last step of this one: with num_workers=0 the
    # DataLoader asks the sampler for the batch after it only then, and the old iteration used to hand
    # out epoch e's plan again at epoch e+1's cursor (each epoch trained twice, len(loader) steps
    # promised). It must end there, and epoch e+1 must then be its own plan from its first step.
    lengths = lengths_for(40)
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=8, seed=1)
    want = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=8, seed=1)
    loader = DataLoader(list(range(40)), batch_sampler=s, collate_fn=list)
    s.set_epoch(0)
    for epoch in range(3):
        got = []
        for n, batch in enumerate(loader):
            got.append(batch)
            if n == len(loader) - 1:
                s.set_epoch(epoch + 1)
        want.set_epoch(epoch)
        assert got == list(want)
    # load_state_dict of another epoch while an iteration is live ends it as well; of the same epoch
    # (the same plan), the live iteration continues from the loaded batch.
    it = iter(want)
    first = next(it)
    state = want.state_dict()                 # epoch 2, after batch 0
    s.set_epoch(5)
    live = iter(s)
    next(live)
    s.load_state_dict(state)
    assert next(live, None) is None
    live = iter(s)
    assert next(live) == next(it)
    s.load_state_dict(state)
    assert next(live) == want.plan(2).slot(1, 0).tolist() and first == want.plan(2).slot(0, 0).tolist()


def test_epoch_steps_changed_after_a_mid_epoch_load_is_refused_instead_of_re_cutting_the_epoch():
    # pad_steps moves samples out of earlier steps: fix_epoch_steps after a mid-epoch load used to
    # continue the loaded cursor on a plan whose first steps were not the ones trained (2 samples
    # twice, 2 never, here).
    lengths = np.random.default_rng(0).integers(1, 900, 300)
    kw = {"max_tokens_per_rank": 2000, "seed": 4}
    runs = [TokenBalancedBatchSampler(lengths, 2, r, **kw) for r in range(2)]
    natural = runs[0].natural_steps(1)
    for s in runs:
        s.set_epoch(1)
    head = [b for s in runs for _, b in zip(range(10), s, strict=False)]
    state = runs[0].state_dict()
    resumed = [TokenBalancedBatchSampler(lengths, 2, r, **kw) for r in range(2)]
    for s in resumed:
        s.load_state_dict(state)
        with pytest.raises(ValueError, match="epoch_steps cannot change from None to .* batch 10 of epoch 1"):
            s.fix_epoch_steps(3, at_least=natural + 2)
        assert s.fix_epoch_steps(1, at_least=natural) == natural   # the same cut: allowed
    trained = [i for b in head + [b for s in resumed for b in s] for i in b]
    assert sorted(trained) == list(range(300))
    # A finished epoch stays finished under a new cut; the next epoch is planned into it.
    done = TokenBalancedBatchSampler(lengths, 2, 0, epoch_steps=natural, **kw)
    done.load_state_dict(resumed[0].state_dict())   # at the end of epoch 1
    done.fix_epoch_steps(1, at_least=natural + 2)
    assert list(done) == [] and done.state_dict()["cursor"] == len(done) == natural + 2
    done.set_epoch(2)
    assert len(list(done)) == natural + 2


def test_a_break_after_the_sampler_handed_out_its_last_batch_still_continues_under_track():
    # The sampler has finished handing out the epoch, the loop has not received all of it.
    lengths = lengths_for(40)
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=2, prefetch_factor=4)
    seen = _first_pass(s.track(loader), len(s) - 2)
    assert s.cursor == len(s)
    seen += [i for batch in s.track(loader) for i in batch["idx"].tolist()]
    assert sorted(seen) == list(range(40))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_break_at_the_last_batch_under_track_leaves_nothing_to_continue_whatever_the_workers(workers):
    # An eval (a break) at the epoch's last step, then the same loader again without set_epoch: the loop
    # received every batch, so nothing is left. With workers the sampler had already reached its end
    # before the loop received the last batches, and that used to replay the whole epoch.
    lengths = lengths_for(40)
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=8)
    loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=workers)
    seen = _first_pass(s.track(loader), len(s))
    assert sorted(seen) == list(range(40))
    assert [b for b in s.track(loader)] == []
    assert s.state_dict()["cursor"] == len(s)
    # A pass the loop saw to its end is a finished epoch: iterated again, it is replayed (as before).
    replay = [i for batch in s.track(loader) for i in batch["idx"].tolist()]
    assert sorted(replay) == list(range(40))


def test_plain_dataloader_re_iteration_continues_after_what_was_handed_out_and_warns():
    # Without track the sampler cannot know what the loop received: it continues at the cursor
    # (batches handed out) and says so. With workers the prefetched batches are skipped this epoch;
    # with num_workers=0 nothing is prefetched, so nothing is skipped.
    lengths = lengths_for(200)
    for workers in (2, 0):
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
        loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=workers)
        seen = _first_pass(loader, 10)
        handed_out = s.cursor
        with pytest.warns(RuntimeWarning, match=f"continues at batch {handed_out} of 50.*sampler.track"):
            rest = [i for batch in loader for i in batch["idx"].tolist()]
        plan = list(TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2))
        skipped = sorted(i for batch in plan[10:handed_out] for i in batch)
        assert sorted(seen + rest + skipped) == list(range(200))
        assert handed_out == (10 if workers == 0 else 14)   # 2 workers x prefetch_factor 2 ahead
    # A complete pass, a set_epoch or a load_state_dict in between: no warning.
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=2)
    _first_pass(loader, 10)
    state = s.state_dict()
    s.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(loader)) == len(s) - state["cursor"]
        _first_pass(loader, 3)
        s.set_epoch(1)
        assert len(list(loader)) == len(s)


@pytest.mark.slow   # ~20 DataLoader worker start-ups
@settings(max_examples=20, deadline=None)
@given(n=st.integers(20, 160), gbs=st.sampled_from([2, 4, 8]), grad_accum=st.integers(1, 2),
       workers=st.integers(0, 3), prefetch=st.sampled_from([1, 2, 4]),
       breaks=st.lists(st.integers(1, 80), max_size=3), seed=st.integers(0, 99))
def test_breaks_anywhere_under_track_see_every_sample_once(n, gbs, grad_accum, workers, prefetch, breaks,
                                                           seed):
    lengths = lengths_for(n)
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=gbs, grad_accum=grad_accum, seed=seed)
    kw = {"prefetch_factor": prefetch} if workers else {}
    loader = DataLoader(IndexDataset(n), batch_sampler=s, num_workers=workers, **kw)
    seen, done = [], 0
    for stop in sorted({b for b in breaks if b < len(s)}) + [None]:
        for batch in s.track(loader):
            seen += batch["idx"].tolist()
            done += 1
            if done == stop:
                break
    assert sorted(seen) == list(range(n))


def test_a_second_live_iteration_retires_the_first_instead_of_sharing_its_cursor():
    # One sampler has one cursor. Before, an older iteration advanced after a newer one had started went
    # on at the newer one's cursor: it skipped the batches the newer one had handed out (or, after
    # list(s) inside a loop over s, ended the loop's epoch early), without a word.
    lengths = lengths_for(40)
    full = list(TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4))
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    it1 = iter(s)
    assert next(it1) == full[0]
    it2 = iter(s)
    assert next(it1) == full[1], "an iteration that has not started yet retires nothing"
    with pytest.warns(RuntimeWarning, match="continues at batch 2"):
        assert next(it2) == full[2]
    with pytest.raises(RuntimeError, match="newer iteration of the same sampler"):
        next(it1)
    assert list(it2) == full[3:] and s.state_dict()["cursor"] == len(s)
    # list(s) inside a loop over s: the loop's next batch is an error, not a silent end of its epoch
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    with pytest.raises(RuntimeError, match="newer iteration"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step, _ in enumerate(s):
            if step == 2:
                assert list(s) == full[3:]
    # two DataLoaders over one sampler, iterated together: each would have seen half the epoch
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    a, b = (DataLoader(IndexDataset(40), batch_sampler=s) for _ in range(2))
    with pytest.raises(RuntimeError, match="newer iteration"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in zip(a, b, strict=True):
            pass


def test_a_dataloader_re_iterated_with_persistent_workers_keeps_one_live_iteration():
    # DataLoader(persistent_workers=True) replaces its sampler iterator at each iter(), before the old one
    # is exhausted (a break): the old one is never asked again, so nothing is refused.
    lengths = lengths_for(60)
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(60), batch_sampler=s, num_workers=1, persistent_workers=True)
    seen = _first_pass(s.track(loader), 5)
    seen += [i for batch in s.track(loader) for i in batch["idx"].tolist()]
    assert sorted(seen) == list(range(60))
    s.set_epoch(1)
    assert sorted(i for batch in loader for i in batch["idx"].tolist()) == list(range(60))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), gbs=st.sampled_from([1, 2, 4]), grad_accum=st.integers(1, 3),
       first=st.integers(1, 3), ops=st.lists(st.integers(0, 11), min_size=4, max_size=40))
def test_interleaved_iterations_hand_out_each_batch_once_or_refuse(n, gbs, grad_accum, first, ops):
    """Any interleaving of iter() / next() on several iterators / len() / state_dict() (``ops``: 0 a new
    iterator, 1 a state_dict and a resume from it, 2 len(), k > 2 next() on iterator k): the batches
    handed out are the epoch's plan in order (each sample once per pass), an iteration advanced after a
    newer one started raises, and a resume from any state_dict() yields exactly the rest."""
    lengths = lengths_for(n)
    kw = dict(global_batch_size=gbs * grad_accum, grad_accum=grad_accum, seed=n)
    full = list(TokenBalancedBatchSampler(lengths, 1, 0, **kw))
    s = TokenBalancedBatchSampler(lengths, 1, 0, **kw)
    its, started, dead = [], [], []   # iterators; which have started; which have ended
    latest = None                     # the iterator that started last: the only one that may hand out
    handed = []                       # batches handed out in the current pass
    finished = False                  # the live iteration saw the end of the epoch (a new one replays)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the re-iteration warning (its own test)
        for op in [0] * first + ops:
            if op == 0:
                its.append(iter(s))
                started.append(False)
                dead.append(False)
            elif op == 2:
                assert len(s) == len(full)
            elif op == 1:
                fresh = TokenBalancedBatchSampler(lengths, 1, 0, **kw)
                fresh.load_state_dict(json.loads(json.dumps(s.state_dict())))
                assert handed + list(fresh) == full, "a resume continues exactly where the loop is"
            else:
                i = op % len(its)
                if dead[i]:
                    assert next(its[i], None) is None
                    continue
                if started[i] and i != latest:
                    with pytest.raises(RuntimeError, match="newer iteration"):
                        next(its[i])
                    dead[i] = True
                    continue
                if not started[i]:
                    started[i], latest = True, i
                    if finished:
                        handed, finished = [], False   # a finished epoch iterated again is replayed
                batch = next(its[i], None)
                if batch is None:
                    dead[i], finished = True, True
                    assert len(handed) == len(full)
                else:
                    handed.append(batch)
                    assert handed == full[:len(handed)]
    assert sorted(i for b in handed for i in b) == sorted(i for b in full[:len(handed)] for i in b)


def test_load_state_dict_inside_a_tracked_loop_counts_from_the_loaded_batch():
    # The live iteration continues from the loaded batch (above); track() used to go on counting from
    # the iteration's start, so state_dict() claimed batches the loop never trained after the rollback
    # (trained 0 1 2 3 4 2, saved cursor 6: a resume skipped batches 3 to 5).
    lengths = lengths_for(40)
    full = list(TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4))
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(list(range(40)), batch_sampler=s, collate_fn=list)
    trained = []
    for n, batch in enumerate(s.track(loader)):
        trained.append(batch)
        if n == 1:
            ckpt = s.state_dict()
        if n == 4:
            s.load_state_dict(ckpt)          # roll back (a loss spike) and keep looping
        if n == 6:
            state = s.state_dict()
            break
    assert trained == full[:5] + full[2:4] and state["cursor"] == 4
    fresh = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    fresh.load_state_dict(state)
    assert list(fresh) == full[4:]
    # the same loop, not stopped: after the rollback it runs to the epoch's end, and the next pass of the
    # loader is the epoch replayed (a finished epoch), not a continuation
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(list(range(40)), batch_sampler=s, collate_fn=list)
    trained = []
    for n, batch in enumerate(s.track(loader)):
        trained.append(batch)
        if n == 3:
            s.load_state_dict(ckpt)
    assert trained == full[:4] + full[2:] and s.state_dict()["cursor"] == len(s)


def test_load_state_dict_inside_a_tracked_loop_with_workers_drops_the_batches_in_flight():
    # 2 workers x prefetch 2: at the load, 4 batches handed out before it are still on their way. They
    # used to reach the loop first (trained 0-5, 6-9, then 2, 3: four batches trained after the rollback
    # that the run from the checkpoint never trains there); track() drops them, so the next batch after
    # the load is the loaded one, as with num_workers=0.
    lengths = lengths_for(80)
    full = list(TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4))
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(80), batch_sampler=s, num_workers=2, prefetch_factor=2)
    trained = []
    for n, batch in enumerate(s.track(loader)):
        trained.append(sorted(batch["idx"].tolist()))
        if n == 1:
            ckpt = s.state_dict()
        if n == 5:
            assert s.cursor == 10
            s.load_state_dict(ckpt)
            assert s.state_dict()["cursor"] == 2
        if n == 6:
            assert s.state_dict()["cursor"] == 3
        if n == 9:
            state = s.state_dict()
            break
    assert trained == [sorted(b) for b in full[:6] + full[2:6]] and state["cursor"] == 6
    fresh = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    fresh.load_state_dict(state)
    assert list(fresh) == full[6:]
    # twice in one loop, the second load before any loaded batch arrived: both loads' stale batches go
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(80), batch_sampler=s, num_workers=2, prefetch_factor=2)
    trained = []
    for n, batch in enumerate(s.track(loader)):
        trained.append(sorted(batch["idx"].tolist()))
        if n == 5:
            s.load_state_dict(ckpt | {"cursor": 9})
            s.load_state_dict(ckpt)
        if n == 8:
            break
    assert trained == [sorted(b) for b in full[:6] + full[2:5]]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 50), R=st.integers(1, 3), k=st.integers(1, 3),
       mode=st.sampled_from(["batch", "tokens"]), drop_last=st.booleans(), ops=st.lists(st.sampled_from(
           ["next", "next", "next", "next", "break", "set_same", "set_next", "set_back", "state", "load",
            "load_live", "len"]), max_size=50))
def test_lifecycles_hand_out_the_plan_in_order_and_resume_exactly(n, R, k, mode, drop_last, ops):
    """Random lifecycles of R samplers in lockstep (``grad_accum``, ``drop_last``, token budgets): next /
    break and iterate again / set_epoch (same, next, back) / state_dict / load_state_dict (with the live
    iteration kept: same epoch goes on from the loaded batch, another epoch ends it) / len. Every batch
    handed out is the current epoch's plan at the model's position, and a resume from any state_dict
    yields exactly the rest of the epoch."""
    lengths = lengths_for(n, n)
    kw = (dict(global_batch_size=R * k * 2, drop_last=drop_last) if mode == "batch"
          else dict(max_tokens_per_rank=int(lengths.max(initial=1)) * 2))
    kw.update(grad_accum=k, seed=n % 3)

    def plan(epoch):
        out = []
        for r in range(R):
            x = TokenBalancedBatchSampler(lengths, R, r, **kw)
            x.set_epoch(epoch)
            out.append(list(x))
        return out

    ss = [TokenBalancedBatchSampler(lengths, R, r, **kw) for r in range(R)]
    its, epoch, pos, finished, snaps, plans = None, 0, 0, False, [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # re-iteration mid-epoch (its own test)
        for op in ops:
            full = plans.setdefault(epoch, plan(epoch))
            if op == "next":
                if its is None:
                    its = [iter(s) for s in ss]
                    if finished:                          # a finished epoch iterated again: replayed
                        pos, finished = 0, False
                got = [next(it, None) for it in its]
                if pos < len(full[0]):
                    assert got == [full[r][pos] for r in range(R)]
                    pos += 1
                else:
                    assert got == [None] * R
                    its, finished = None, True
            elif op == "break":
                its = None
            elif op.startswith("set_"):
                e = {"set_same": epoch, "set_next": epoch + 1, "set_back": max(epoch - 1, 0)}[op]
                for s in ss:
                    s.set_epoch(e)
                if e != epoch:
                    if its is not None:
                        assert [next(it, None) for it in its] == [None] * R, "set_epoch ends it"
                    its, epoch, pos, finished = None, e, 0, False
            elif op == "state":
                states = [json.loads(json.dumps(s.state_dict())) for s in ss]
                fresh = [TokenBalancedBatchSampler(lengths, R, r, **kw) for r in range(R)]
                for f, state in zip(fresh, states, strict=True):
                    f.load_state_dict(state)
                assert [list(f) for f in fresh] == [full[r][pos:] for r in range(R)]
                snaps.append((states, epoch, pos))
            elif op.startswith("load") and snaps:
                states, e, p = snaps[len(ops) % len(snaps)]
                for s, state in zip(ss, states, strict=True):
                    s.load_state_dict(state)
                if op == "load_live" and its is not None and e != epoch:
                    assert [next(it, None) for it in its] == [None] * R, "a load of another epoch ends it"
                    its = None
                elif op == "load":
                    its = None
                epoch, pos, finished = e, p, False
            elif op == "len":
                assert {len(s) for s in ss} == {len(full[0])}


def _rollback_loop(loader, s, load_at, stop_at):
    """Train through ``loader``, save a checkpoint after batch 1, load it back after batch ``load_at``
    (a rollback inside the loop) and stop after batch ``stop_at``; the sorted indices per batch."""
    trained = []
    for n, batch in enumerate(loader):
        trained.append(sorted(batch["idx"].tolist()))
        if n == 1:
            ckpt = s.state_dict()
        if n == load_at:
            s.load_state_dict(ckpt)
        if n == stop_at:
            break
    return trained


@pytest.mark.parametrize("persistent", [False, True])
def test_load_state_dict_inside_a_plain_loop_with_workers_refuses_instead_of_training_prefetched_batches(
        persistent):
    # A plain DataLoader with 2 workers x prefetch 2: at a load after batch 5 the sampler had handed out
    # 10 batches, and batches 6-9 were already in the workers' queues. The loop used to receive them
    # first (trained 0-5, 6-9, then 2, 3, ...: the rollback trained four batches it should not have,
    # silently). The sampler cannot take them back from a plain DataLoader: it refuses, saying how.
    lengths = lengths_for(80)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(80), batch_sampler=s, num_workers=2, prefetch_factor=2,
                        persistent_workers=persistent)
    with pytest.raises(RuntimeError, match=r"4 batches.*(break|track)"):
        _rollback_loop(loader, s, load_at=5, stop_at=11)
    if not persistent:
        assert s.state_dict()["cursor"] == 10, "a refused load changes nothing"
        # a reload of where the sampler is: the batches in flight come before it in any run
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
        loader = DataLoader(IndexDataset(80), batch_sampler=s, num_workers=2, prefetch_factor=2)
        trained = []
        for n, batch in enumerate(loader):
            trained.append(sorted(batch["idx"].tolist()))
            if n == 5:
                s.load_state_dict(s.state_dict())
        assert trained == full
    # The remedy: stop the loop, load, iterate the loader again: the loaded batch comes next.
    ckpt = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4).state_dict() | {"cursor": 2}
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(80), batch_sampler=s, num_workers=2, prefetch_factor=2,
                        persistent_workers=persistent)
    _first_pass(loader, 6)
    s.load_state_dict(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [sorted(b["idx"].tolist()) for b in loader] == full[2:]


def test_load_state_dict_inside_a_plain_loop_without_workers_goes_on_from_the_loaded_batch():
    # num_workers=0 fetches nothing ahead: the load in the loop is exact, and allowed.
    lengths = lengths_for(80)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(80), batch_sampler=s, num_workers=0)
    assert _rollback_loop(loader, s, load_at=5, stop_at=9) == full[:6] + full[2:6]


def test_a_sampler_wrapped_by_another_batch_sampler_is_not_taken_for_the_dataloaders_own():
    # The VeOmni integration's batch sampler groups grad_accum micro-batches of the tokenbal sampler into
    # one step: the DataLoader counts steps, the sampler hands out micro-batches. Taking that DataLoader
    # for the sampler's own counted 1 micro-batch per step as still in flight and refused a rollback
    # in the loop that num_workers=0 makes exact.
    from tokenbal.integrations.veomni import _Steps

    lengths = lengths_for(80)
    full = list(TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, grad_accum=2))
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, grad_accum=2)
    micro_batches = _Identity()   # dataset[micro-batch] is the micro-batch's indices
    loader = DataLoader(micro_batches, batch_sampler=_Steps(s, 2), collate_fn=lambda b: b)
    trained = []
    for n, step in enumerate(loader):
        trained.append(step)
        if n == 0:
            ckpt = s.state_dict()
        if n == 2:
            s.load_state_dict(ckpt)
        if n == 4:
            break
    assert trained == [full[0:2], full[2:4], full[4:6], full[2:4], full[4:6]]


class _Identity(Dataset):
    def __len__(self):
        return 80

    def __getitem__(self, i):
        return i
