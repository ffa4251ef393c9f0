"""Resume across changed inputs: another index, changed settings, serialised states."""
import dataclasses
import io
import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from tokenbal import TokenBalancedBatchSampler, TokenIndex


@pytest.fixture(scope="module")
def twin_indexes(tmp_path_factory):
    """Two real indexes whose samples have the same token counts in the same order but are other
    samples (other keys, other shards): a fixed-length corpus and its successor look like this."""
    from tokenbal.index import build_index
    from tokenbal.synthetic import make_samples, write_shards

    root = tmp_path_factory.mktemp("twins")
    samples = [s for s in make_samples(60, seed=3) if s.kind in ("text_short", "text_long", "icon")]
    other = [dataclasses.replace(s, key=str(int(s.key) + 50_000)) for s in samples]
    a = build_index(write_shards(samples, str(root / "a"), 16), root / "idx-a", progress=False).out
    b = build_index(write_shards(other, str(root / "b"), 16, prefix="next"), root / "idx-b",
                    progress=False).out
    return TokenIndex(str(a)), TokenIndex(str(b))


def test_a_state_from_another_index_with_the_same_lengths_is_refused_by_name(twin_indexes):
    # The fingerprint held only the lengths' digest: a checkpoint of index A loaded into a sampler over
    # index B with the same token counts resumed silently, on other samples.
    a, b = twin_indexes
    assert np.array_equal(a.lengths, b.lengths) and list(a.keys) != list(b.keys)
    s = TokenBalancedBatchSampler(a, 2, 0, global_batch_size=4)
    it = iter(s)
    next(it)
    state = s.state_dict()
    other = TokenBalancedBatchSampler(b, 2, 0, global_batch_size=4)
    with pytest.raises(ValueError, match="samples_sha256.*other samples"):
        other.load_state_dict(state)
    assert other.cursor == 0
    # the same index (reopened), or its lengths as an array (no keys to compare), resume as before
    same = TokenBalancedBatchSampler(TokenIndex(a.path), 2, 0, global_batch_size=4)
    same.load_state_dict(state)
    assert same.cursor == 1
    plain = TokenBalancedBatchSampler(np.asarray(a.lengths), 2, 0, global_batch_size=4)
    plain.load_state_dict(state)
    s.load_state_dict(plain.state_dict())
    # a checkpoint from before the key existed still loads
    old = {**state, "fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "samples_sha256"}}
    other.load_state_dict(old)


def _state_after(batches=1, lengths=None, **kw):
    lengths = np.arange(1, 101) if lengths is None else lengths
    s = TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=8, **kw)
    it = iter(s)
    for _ in range(batches):
        next(it)
    return s.state_dict()


def test_a_state_of_a_newer_format_is_refused_instead_of_read_as_this_one():
    # version 99 (or "x") loaded as version 1: a newer tokenbal's state, whose fields may mean something
    # else, resumed silently.
    state = _state_after()
    for version in (99, "x", 1.5):
        fresh = TokenBalancedBatchSampler(np.arange(1, 101), 2, 0, global_batch_size=8)
        with pytest.raises(ValueError, match=rf"state\['version'\] is {version!r}.*version 1"):
            fresh.load_state_dict({**state, "version": version})
        assert fresh.cursor == 0
    fresh.load_state_dict({k: v for k, v in state.items() if k != "version"})   # before versions: 1
    assert fresh.cursor == 1


def test_a_damaged_elastic_history_names_the_missing_setting_instead_of_a_key_error():
    # segments[0]['fingerprint'] without num_replicas: a bare KeyError('num_replicas') from the replan.
    state = _state_after()
    seg = {"fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "num_replicas"}, "cursor": 0}
    for elastic in (False, True):
        fresh = TokenBalancedBatchSampler(np.arange(1, 101), 2, 0, global_batch_size=8, elastic=elastic)
        with pytest.raises(ValueError, match=r"\['segments'\]\[0\]\['fingerprint'\] has no num_replicas"):
            fresh.load_state_dict({**state, "segments": [seg]})
        assert fresh.cursor == 0 and fresh._segments == []


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _round_trip(state, how):
    """A checkpoint as it is stored: JSON, or torch.save / torch.load (weights_only, the default)."""
    if how == "json":
        return json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def _training_run(n, R, k, mode, drop_last, seed, workers, ops):
    """A training loop through ``sampler.track(DataLoader)``: next batch, save a checkpoint (JSON or
    torch.save), roll back to one inside the running loop, restart a fresh process from one (another
    rank's state will do), break and iterate again, move to the next epoch. Every batch the loop receives
    must be the batch an uninterrupted run from the last load would receive there: the epoch's plan at
    the model's position. So from any resume point on, every sample is used exactly once per epoch."""
    lengths = np.random.default_rng(n).integers(1, 3000, n)
    kw = (dict(global_batch_size=R * k * 2 + (n % 2), drop_last=drop_last) if mode == "batch"
          else dict(max_tokens_per_rank=int(lengths.max(initial=1)) * 2, drop_last=drop_last))
    kw.update(grad_accum=k, seed=seed)
    rank = n % R

    def plan(epoch):
        s = TokenBalancedBatchSampler(lengths, R, rank, **kw)
        s.set_epoch(epoch)
        return list(s)

    def start(state=None):
        s = TokenBalancedBatchSampler(lengths, R, rank, **{**kw, "seed": 0 if state else seed})
        if state is not None:
            s.load_state_dict(state)
        extra = dict(num_workers=workers, prefetch_factor=2) if workers else {}
        return s, DataLoader(_Rows(n), batch_sampler=s, collate_fn=list, **extra)

    s, loader = start()
    plans, snaps = {}, []
    it, epoch, pos, finished, start_pos, seen = None, 0, 0, False, 0, []
    for op, arg in ops:
        full = plans.setdefault(epoch, plan(epoch))
        if op == "next":
            if it is None:
                it = s.track(loader)
                if finished:                                  # a finished epoch again: replayed
                    pos, finished, start_pos, seen = 0, False, 0, []
            batch = next(it, None)
            if pos < len(full):
                assert batch == full[pos], f"epoch {epoch} batch {pos}"
                seen += batch
                pos += 1
            else:
                assert batch is None
                it, finished = None, True
                # since the last load (or the epoch's start): the rest of the epoch, each sample once
                assert sorted(seen) == sorted(i for b in full[start_pos:] for i in b)
                assert len(set(seen)) == len(seen)
        elif op == "save":
            snaps.append((_round_trip(s.state_dict(), ["json", "torch"][arg % 2]), epoch, pos))
        elif op in ("rollback", "restart") and snaps:
            state, e, p = snaps[arg % len(snaps)]
            if op == "restart":
                s, loader = start(_round_trip(state, "json"))
                it = None
            else:
                s.load_state_dict(state)
                if it is not None and e != epoch:
                    assert next(it, None) is None, "a load of another epoch ends the live loop"
                    it = None
            epoch, pos, finished, start_pos, seen = e, p, False, p, []
        elif op == "break":
            it = None
        elif op == "next_epoch":
            epoch, pos, finished, it, start_pos, seen = epoch + 1, 0, False, None, 0, []
            s.set_epoch(epoch)


_OP_NAMES = ["next"] * 5 + ["save", "rollback", "restart", "break", "next_epoch"]
_OPS = st.lists(st.tuples(st.sampled_from(_OP_NAMES), st.integers(0, 5)), max_size=40)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), R=st.integers(1, 3), k=st.integers(1, 2),
       mode=st.sampled_from(["batch", "tokens"]), drop_last=st.booleans(), seed=st.integers(0, 2**32),
       ops=_OPS)
def test_any_resume_point_in_a_tracked_loop_gives_the_uninterrupted_runs_batches(
        n, R, k, mode, drop_last, seed, ops):
    _training_run(n, R, k, mode, drop_last, seed, 0, ops)


@pytest.mark.slow   # DataLoader worker start-ups
@settings(max_examples=10, deadline=None)
@given(n=st.integers(8, 60), k=st.integers(1, 2), workers=st.integers(1, 2), seed=st.integers(0, 100),
       ops=_OPS)
# a rollback while 4 batches are in flight: they reached the loop first before track dropped them
@example(n=40, k=1, workers=2, seed=0,
         ops=[("next", 0), ("save", 0)] + [("next", 0)] * 6 + [("rollback", 0)] + [("next", 0)] * 3)
def test_any_resume_point_in_a_tracked_loop_with_workers_gives_the_uninterrupted_runs_batches(
        n, k, workers, seed, ops):
    _training_run(n, 1, k, "batch", False, seed, workers, ops)


def test_the_same_user_costs_given_as_another_array_type_resume():
    # The fingerprint's "cost" is the type name of a user's cost (ndarray, Tensor, list, a function): the
    # same costs as a torch tensor after a numpy array were refused ("cost: checkpoint has 'ndarray',
    # this sampler has 'Tensor'"), though the costs' digest is the same. Different values still refuse.
    lengths = np.arange(1, 61)
    costs = lengths * 3 + 7
    state = _state_after(batches=2, lengths=lengths, cost=costs)
    for same in (torch.tensor(costs), costs.tolist(), lambda x: x * 3 + 7):
        fresh = TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=8, cost=same)
        fresh.load_state_dict(state)
        assert fresh.cursor == 2
    other = TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=8, cost=torch.tensor(costs + 1))
    with pytest.raises(ValueError, match="lengths_sha256"):
        other.load_state_dict(state)
    # a named cost against user costs that happen to equal it is still another setup
    with pytest.raises(ValueError, match="cost: checkpoint has 'ndarray', this sampler has 'tokens'"):
        TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=8).load_state_dict(
            _state_after(lengths=lengths, cost=lengths.copy()))


def test_set_epoch_to_another_epoch_right_after_a_mid_epoch_load_warns_that_the_resume_is_dropped():
    # A loop that restarts its epoch counter at 0 (for epoch in range(num_epochs): set_epoch(epoch))
    # after load_state_dict of epoch 2, batch 3: set_epoch(0) silently threw the resume away and trained
    # epochs 0 and 1 again.
    lengths = np.arange(1, 101)
    s = TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=8)
    s.set_epoch(2)
    it = iter(s)
    for _ in range(3):
        next(it)
    state = s.state_dict()
    fresh = TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=8)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)   # the same epoch keeps the position (and the warning to come)
    with pytest.warns(RuntimeWarning, match=r"set_epoch\(0\) drops the position load_state_dict restored "
                                            r"\(epoch 2, batch 3 of 13\).*range\(state\['epoch'\]"):
        fresh.set_epoch(0)
    assert (fresh.epoch, fresh.cursor) == (0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the usual loop: from the checkpoint's epoch on
        fresh.load_state_dict(state)
        for epoch in range(state["epoch"], 4):
            fresh.set_epoch(epoch)
            list(fresh)
        # a checkpoint at an epoch's end, then the next epoch; a load at cursor 0; a set_epoch after
        # batches of the loaded epoch were handed out (the loop moved on by itself)
        for cursor in (13, 0):
            fresh.load_state_dict({**state, "cursor": cursor})
            fresh.set_epoch(3)
        fresh.load_state_dict(state)
        next(iter(fresh))
        fresh.set_epoch(3)
    # an elastic resume (another world size) restores the middle of the epoch as well
    elastic = TokenBalancedBatchSampler(lengths, 4, 0, global_batch_size=8, elastic=True)
    elastic.load_state_dict(state)
    with pytest.warns(RuntimeWarning, match=r"epoch 2, batch 0 of \d+, after 1 earlier setup"):
        elastic.set_epoch(3)


@pytest.mark.parametrize("persistent", [False, True])
def test_stateful_dataloader_with_workers_resumes_in_a_fresh_loader_and_in_the_same_one(persistent):
    # torchdata's StatefulDataLoader restores the sampler itself (load_state_dict at iter()), with its
    # workers' prefetch in flight in the same process: none of it may be taken for a load inside a loop.
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    lengths = np.random.default_rng(2).integers(1, 3000, 120)

    def loader():
        s = TokenBalancedBatchSampler(lengths, 2, 1, global_batch_size=8, seed=3)
        return sdl.StatefulDataLoader(list(range(120)), batch_sampler=s, collate_fn=list, num_workers=2,
                                      prefetch_factor=2, persistent_workers=persistent)

    full = list(TokenBalancedBatchSampler(lengths, 2, 1, global_batch_size=8, seed=3))
    dl = loader()
    got = []
    for n, batch in enumerate(dl):
        got.append(batch)
        if n == 2:
            state = dl.state_dict()
        if n == 6:
            dl.load_state_dict(state)      # a rollback: takes effect at the next iter()
            break
    assert got[:3] + list(dl) == full
    fresh = loader()
    fresh.load_state_dict(state)
    assert got[:3] + list(fresh) == full


def test_a_state_of_other_token_counts_says_what_the_digest_stands_for():
    # lengths that changed between save and load (an index rebuilt with another max_pixels): the message
    # named only "lengths_sha256: checkpoint has '32d5...', this sampler has '27e6...'"
    lengths = np.arange(1, 51, dtype=np.int64) * 10
    state = TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=8).state_dict() | {"cursor": 2}
    rebuilt = lengths.copy()
    rebuilt[3] += 1
    with pytest.raises(ValueError, match=r"lengths_sha256: checkpoint has '[0-9a-f]+', this sampler has "
                                         r"'[0-9a-f]+' \(the samples' token counts or costs"):
        TokenBalancedBatchSampler(rebuilt, 2, 0, global_batch_size=8).load_state_dict(state)
