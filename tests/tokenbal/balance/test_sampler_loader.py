"""The sampler seen from the loader side: real DataLoaders with worker processes (persistent or not),
``DevicePrefetcher`` read-ahead, and loads made inside a running loop. The rule everywhere: after a
``load_state_dict`` the next batch the loop receives is the loaded one, or the loop gets a clear error —
never a batch fetched before the load trained as if it were the loaded position's."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from collate import DevicePrefetcher
from collate.prefetch import StreamOps
from tests.helpers.lengths import lengths_for
from tests.tokenbal.balance.test_sampler import IndexDataset
from tokenbal import TokenBalancedBatchSampler


def _ids(batch):
    return sorted(batch["idx"].tolist())


def _train_loading_at(batches, sampler, load_at: int, ckpt: dict) -> tuple[list, str | None]:
    """The batches a loop over ``batches`` receives (as sorted sample ids) when it loads ``ckpt`` into
    ``sampler`` after its batch ``load_at``, and the RuntimeError that ended it, if one did."""
    trained: list = []
    try:
        for n, batch in enumerate(batches):
            trained.append(_ids(batch))
            if n == load_at:
                sampler.load_state_dict(ckpt)
    except RuntimeError as e:
        return trained, str(e)
    return trained, None


@pytest.mark.parametrize("persistent", [True, False])
def test_a_load_in_the_loop_after_the_epochs_last_batch_was_handed_out_never_trains_a_stale_batch(persistent):
    # 10 batches, 2 workers x prefetch 2: from the loop's 6th batch on the sampler has handed out the
    # epoch's last one and its iteration is over. With persistent workers a load there was not caught: the
    # deferred check ran only when the sampler's generator was asked for a batch, and a finished generator
    # runs no code, so the batches fetched before the load reached the loop (load at 7: trained 0-9, the
    # rollback's batches 8 and 9 stale). Every load position: the loop receives exactly what it would with
    # num_workers=0 (the loaded batch next, here or at the next pass), or an error before any stale batch.
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    assert len(full) == 10
    for load_at in range(3, 10):
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
        ckpt = s.state_dict() | {"cursor": 2}
        loader = DataLoader(IndexDataset(40), batch_sampler=s, num_workers=2, prefetch_factor=2,
                            persistent_workers=persistent)
        trained, error = _train_loading_at(loader, s, load_at, ckpt)
        expected = full[:load_at + 1] + full[2:]
        assert trained == expected[:len(trained)], f"load at {load_at}: a stale batch reached the loop"
        if error is not None:
            assert len(trained) == load_at + 1 and "track" in error
            if not persistent:
                continue   # refused at the load itself, which changed nothing (its own test)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            trained += [_ids(b) for b in loader]   # the next pass: the rest of the loaded position
        assert trained == expected, f"load at {load_at}"


class _CpuSideStream(StreamOps):
    """``DevicePrefetcher``'s real read-ahead on CPU: ``depth`` batches copied (cloned) ahead of the loop,
    through the same code path as a CUDA / NPU side stream (a CPU device is otherwise a passthrough)."""

    def __init__(self):
        super().__init__(torch.device("cpu"))

    def new_stream(self):
        return None

    def use_stream(self, stream):
        return contextlib.nullcontext()

    def copy(self, tensor):
        return tensor.clone()

    def record_event(self, stream):
        return None

    def consumer_stream(self):
        return None

    def wait_event(self, stream, event):
        pass

    def record_stream(self, tensor, stream):
        pass


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("tracked", [False, True])
def test_a_load_in_a_loop_over_a_device_prefetcher_delivers_the_loaded_batch_next(depth, workers, tracked):
    # DevicePrefetcher holds depth - 1 batches beyond the one the loop has; without track, after a load
    # inside the loop they reached it before the loaded ones (depth 2, num_workers=0, load after batch 4:
    # trained 0-4, 5, then 2-9: batch 5 stale). The prefetcher now drops the batches it fetched before
    # the load; with workers the DataLoader's own read-ahead is refused as without a prefetcher (here
    # persistent workers: an error at the next batch), under track nothing changes.
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    for load_at in range(2, 10):
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
        ckpt = s.state_dict() | {"cursor": 2}
        loader = DataLoader(IndexDataset(40), batch_sampler=s, num_workers=workers,
                            persistent_workers=workers > 0)

        def batches(s=s, loader=loader):
            prefetcher = DevicePrefetcher(loader, depth=depth, ops=_CpuSideStream())
            return s.track(prefetcher) if tracked else prefetcher

        trained, error = _train_loading_at(batches(), s, load_at, ckpt)
        expected = full[:load_at + 1] + full[2:]
        assert trained == expected[:len(trained)], f"load at {load_at}: a stale batch reached the loop"
        assert error is None or (workers and not tracked and len(trained) == load_at + 1), error
        if len(trained) < len(expected):   # the pass ended early (or raised): the next one goes on
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                trained += [_ids(b) for b in batches()]
        assert trained == expected, f"load at {load_at}"


def test_a_prefetcher_outside_what_counts_the_received_batches_is_refused_naming_the_order():
    # DevicePrefetcher(sampler.track(loader)) (track inside, the order the README warns against): track
    # counted the batches the prefetcher fetched, depth - 1 ahead of the loop. Depth 2, 4 batches trained:
    # state_dict() said cursor 5, and a resume started at batch 5 (batch 4 never trained). The same around
    # prepare_loader's loader, which counts what it yields. Refused, naming the order that works.
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(40), batch_sampler=s)
    with pytest.raises(ValueError, match=r"track must be outermost, sampler\.track\(DevicePrefetcher"):
        DevicePrefetcher(s.track(loader), depth=2, ops=_CpuSideStream())
    # the order that works: track outermost counts what the loop received, whatever the prefetcher holds
    for n, _ in enumerate(s.track(DevicePrefetcher(loader, depth=3, ops=_CpuSideStream()))):
        if n == 3:
            state = s.state_dict()
            break
    fresh = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    fresh.load_state_dict(state)
    assert state["cursor"] == 4 and [sorted(b) for b in fresh] == full[4:]

    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from tokenbal.integrations.accelerate import prepare_loader

    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    prepared = prepare_loader(Accelerator(cpu=True), DataLoader(IndexDataset(40), batch_sampler=s),
                              register=False)
    with pytest.raises(ValueError, match=r"DevicePrefetcher\(TokenBalancedLoader\).*iterate the prepared"):
        DevicePrefetcher(prepared, depth=2, ops=_CpuSideStream())


def _epoch_plan(lengths, epoch: int, **options) -> list:
    s = TokenBalancedBatchSampler(lengths, 1, 0, **options)
    s.set_epoch(epoch)
    return [sorted(b) for b in s]


@pytest.mark.parametrize("batches", [10, 3])
@pytest.mark.parametrize("persistent", [False, True])
def test_set_epoch_after_the_dataloader_iterator_was_made_is_refused_instead_of_cutting_the_pass(persistent,
                                                                                                batches):
    # it = iter(loader); sampler.set_epoch(e); for batch in it: with workers, iter() already asked the sampler
    # for prefetch_factor x num_workers batches of the epoch before (a replay of the finished one), and the
    # move to epoch e ended the iteration after them: every pass after the first had 4 of its 10 batches, all
    # of the old epoch, silently (num_workers=0 asks nothing before the first next(), and trained every
    # epoch).
    # Refused when that iterator is read, before the first old batch reaches the loop (also when the old
    # iteration had handed out its whole epoch already: 3 batches, 4 prefetched).
    lengths = lengths_for(4 * batches)
    options = dict(global_batch_size=4)
    s = TokenBalancedBatchSampler(lengths, 1, 0, **options)
    loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=s, num_workers=2, prefetch_factor=2,
                        persistent_workers=persistent)
    it = iter(loader)
    s.set_epoch(0)                        # the same epoch: nothing fetched is of another one
    assert sum(1 for _ in it) == batches
    it = iter(loader)
    s.set_epoch(1)
    trained = []
    refusal = (r"set_epoch\(1\) was called after the DataLoader's iterator was made"
               rf".*{min(batches, 4)} batches of epoch 0.*before iterating the loader")
    with pytest.raises(RuntimeError, match=refusal):
        trained += [_ids(b) for b in it]
    assert trained == [], "no batch of the old epoch reached the loop"
    del it
    # the order that works: set_epoch, then iterate (the refused pass left epoch 1 untouched)
    for epoch in (1, 2):
        s.set_epoch(epoch)
        assert [_ids(b) for b in loader] == _epoch_plan(lengths, epoch, **options)
    # inside a running loop (set_epoch at the epoch's last step, a documented pattern) it is allowed
    for n, _ in enumerate(loader):
        if n == len(s) - 1:
            s.set_epoch(3)
    assert s.epoch == 3 and [_ids(b) for b in loader] == _epoch_plan(lengths, 3, **options)


@pytest.mark.parametrize("persistent", [False, True])
def test_set_epoch_after_an_iterator_that_is_never_read_is_allowed(persistent):
    # iter(loader) made and left unread (a peek that never happened, a tool that takes the iterator), then
    # set_epoch(1) and the usual for loop over the loader: set_epoch raised "after the DataLoader's iterator
    # was made: its workers have already fetched 4 batches of epoch 0", though the for loop makes its own
    # iterator (persistent workers: resets the shared one, dropping what it had fetched) and trains epoch 1
    # exactly. Only reading the old iterator is refused (the test above).
    lengths = lengths_for(40)
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(40), batch_sampler=s, num_workers=2, prefetch_factor=2,
                        persistent_workers=persistent)
    assert [_ids(b) for b in loader] == _epoch_plan(lengths, 0, global_batch_size=4)
    unread = iter(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.set_epoch(1)
        assert [_ids(b) for b in loader] == _epoch_plan(lengths, 1, global_batch_size=4)
        s.set_epoch(2)
        assert [_ids(b) for b in loader] == _epoch_plan(lengths, 2, global_batch_size=4)
    assert unread is not None


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("prefetcher", [False, True])
def test_a_load_in_a_tracked_loop_after_the_last_batch_was_handed_out_goes_on_in_the_same_pass(persistent,
                                                                                              prefetcher):
    # With workers the sampler hands out an epoch's last batch before the loop receives the last few. A
    # rollback there (load of batch 2 after the loop received batch 9, the epoch's last) ended the pass:
    # the DataLoader had nothing more to ask for, the loop took it for the epoch's end, and its
    # set_epoch(e + 1) dropped the rollback (with num_workers=0 the same pass goes on at batch 2). track
    # now starts a new pass of the loader at the loaded batch, so the loop sees what num_workers=0 gives.
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    for load_at in (6, 9):
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
        ckpt = s.state_dict() | {"cursor": 2}
        loader = DataLoader(IndexDataset(40), batch_sampler=s, num_workers=2, prefetch_factor=2,
                            persistent_workers=persistent)
        source = DevicePrefetcher(loader, depth=2, ops=_CpuSideStream()) if prefetcher else loader
        trained = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for n, batch in enumerate(s.track(source)):
                trained.append(_ids(batch))
                if n == load_at:
                    s.load_state_dict(ckpt)
            assert trained == full[:load_at + 1] + full[2:], f"load at {load_at}"
            assert s.state_dict()["cursor"] == len(s)
            s.set_epoch(1)   # the epoch is done: no rollback is dropped (that warned)


@pytest.mark.parametrize("tracked", [False, True])
def test_a_rollback_trained_to_the_epochs_end_does_not_warn_that_set_epoch_drops_it(tracked):
    # num_workers=0, load of batch 2 after batch 5 inside the loop, the loop trains 2-9, then
    # set_epoch(1): it warned "set_epoch(1) drops the position load_state_dict restored (epoch 0, batch 2
    # of 10) before any batch of it was handed out", though all of it had been (the warning is for a loop
    # that leaves a restored position untrained). The live iteration handing out a batch now clears it.
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = DataLoader(IndexDataset(40), batch_sampler=s)
    ckpt = s.state_dict() | {"cursor": 2}
    trained = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n, batch in enumerate(s.track(loader) if tracked else loader):
            trained.append(_ids(batch))
            if n == 5:
                s.load_state_dict(ckpt)
        s.set_epoch(1)
    assert trained == full[:6] + full[2:]
    # still said where it is true: a mid-epoch load, and set_epoch to another epoch before any of it
    s.load_state_dict(ckpt)
    with pytest.warns(RuntimeWarning, match=r"set_epoch\(2\) drops the position"):
        s.set_epoch(2)


def _gloo_rank_loop(rank, world_size, n, resume_state):
    """On a gloo rank: a sampler over the process group (cross-rank verify on), a DataLoader with persistent
    workers read through a DevicePrefetcher under track. Epoch 0 rolls back after its last batch was handed
    out; epoch 1 stops after 3 batches with a checkpoint. Or, with ``resume_state``, a fresh process that
    resumes from it and trains the rest of that epoch."""
    s = TokenBalancedBatchSampler(lengths_for(n, 7), global_batch_size=4 * world_size, seed=3)
    loader = DataLoader(IndexDataset(n), batch_sampler=s, num_workers=2, prefetch_factor=2,
                        persistent_workers=True)

    def batches():
        return s.track(DevicePrefetcher(loader, depth=2, ops=_CpuSideStream()))

    if resume_state is not None:
        s.load_state_dict(resume_state)
        s.set_epoch(resume_state["epoch"])
        return {"rest": [_ids(b) for b in batches()]}
    out = {"epoch0": [], "epoch1": []}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n_, batch in enumerate(batches()):
            out["epoch0"].append(_ids(batch))
            if n_ == 1:
                ckpt = s.state_dict()
            if n_ == len(s) - 1:
                s.load_state_dict(ckpt)       # every batch of the epoch was handed out long ago
        s.set_epoch(1)
        for n_, batch in enumerate(batches()):
            out["epoch1"].append(_ids(batch))
            if n_ == 2:
                out["state"] = s.state_dict()
                break
    return out


def test_gloo_ranks_roll_back_and_resume_through_workers_prefetcher_and_track():
    from tokenbal.launch import run_ranks

    n, world = 64, 2
    results = run_ranks(_gloo_rank_loop, world, n, None, timeout=180)
    plans = {}
    for epoch in (0, 1):
        ranks = [TokenBalancedBatchSampler(lengths_for(n, 7), world, r, global_batch_size=4 * world, seed=3)
                 for r in range(world)]
        for r in ranks:
            r.set_epoch(epoch)
        plans[epoch] = [[sorted(b) for b in r] for r in ranks]
    for rank, res in enumerate(results):
        full = plans[0][rank]
        assert res["epoch0"] == full + full[2:], f"rank {rank}: the rollback goes on in the same pass"
        assert res["epoch1"] == plans[1][rank][:3] and res["state"]["cursor"] == 3
    assert results[0]["state"] == results[1]["state"]
    resumed = run_ranks(_gloo_rank_loop, world, n, results[0]["state"], timeout=180)
    epoch1 = [i for rank in range(world) for b in results[rank]["epoch1"] + resumed[rank]["rest"] for i in b]
    assert sorted(epoch1) == list(range(n)), "every sample of epoch 1 once across the resume, on all ranks"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_behind_a_prefetcher_resumes_from_the_prefetchers_state(workers):
    # DevicePrefetcher(StatefulDataLoader(...)), checkpointed with loader.state_dict() after 4 trained
    # batches (depth 2): the loader counted 5, the one the prefetcher held, and the resume started at batch
    # 5 (batch 4 never trained). prefetcher.state_dict() is the loader's state as of the batch the loop
    # last received: every stop position resumes exactly.
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]

    def prefetcher():
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
        loader = stateful.StatefulDataLoader(IndexDataset(40), batch_sampler=s, num_workers=workers)
        return DevicePrefetcher(loader, depth=3, ops=_CpuSideStream())

    for stop in (0, 3, 8, 9):
        first, trained = prefetcher(), []
        for n, batch in enumerate(first):
            trained.append(_ids(batch))
            if n == stop:
                state = first.state_dict()
                break
        resumed = prefetcher()
        resumed.load_state_dict(state)
        assert trained + [_ids(b) for b in resumed] == full, f"stop after batch {stop}"
    with pytest.raises(TypeError, match="has no state_dict"):
        DevicePrefetcher([1, 2], depth=2, ops=_CpuSideStream()).state_dict()


def test_a_load_after_a_break_from_a_stateful_dataloader_with_workers_is_not_taken_for_one_inside_the_loop():
    # torchdata's StatefulDataLoader keeps its iterator after a loop over it ends (for its state_dict),
    # also without persistent workers. sampler.load_state_dict after a break was refused as "inside a loop
    # over a DataLoader that has read ahead: 4 batches ...", though the loop was over and the next pass
    # starts at the loaded batch. It is now checked as for persistent workers: at the next batch, and only
    # a live loop gets the error (before any batch fetched before the load reaches it).
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
    loader = stateful.StatefulDataLoader(IndexDataset(40), batch_sampler=s, num_workers=2)
    ckpt = s.state_dict() | {"cursor": 2}
    for n, _ in enumerate(loader):
        if n == 3:
            break
    s.load_state_dict(ckpt)
    assert [_ids(b) for b in loader] == full[2:]
    s.set_epoch(0)   # the finished epoch, replayed
    trained = []
    with pytest.raises(RuntimeError, match=r"batches it fetched before the load.*track"):
        for n, batch in enumerate(loader):
            trained.append(_ids(batch))
            if n == 3:
                s.load_state_dict(ckpt)
    assert trained == full[:4]


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_break_out_of_a_prefetcher_loop_continues_at_the_first_batch_not_received(workers, persistent):
    # for batch in DevicePrefetcher(loader): ... break (an eval), then iterate again, no track: the batch the
    # prefetcher held (depth 2) and the workers' prefetch were skipped for the rest of the epoch, with a
    # warning that said "with num_workers=0 nothing is skipped" (num_workers=0, break after batch 2: trained
    # 0, 1, 2, 4, ..., 9). The abandoned prefetcher tells the sampler what the loop received (what the
    # DataLoader gave it, less what it held): the new pass continues there, and state_dict() after the
    # break is that position.
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    for stop in (0, 2, 8):
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
        loader = DataLoader(IndexDataset(40), batch_sampler=s, num_workers=workers,
                            persistent_workers=persistent)
        prefetcher = DevicePrefetcher(loader, depth=2, ops=_CpuSideStream())
        trained = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for n, batch in enumerate(prefetcher):
                trained.append(_ids(batch))
                if n == stop:
                    break
            assert s.state_dict()["cursor"] == stop + 1
            trained += [_ids(b) for b in prefetcher]
        assert trained == full, f"break after batch {stop}"


@pytest.mark.parametrize("skip", [0, 3])
def test_a_prefetcher_around_accelerates_own_prepared_loader_of_the_sampler_is_refused(skip):
    # DevicePrefetcher(neutralise(accelerator, loader)) (accelerate's DataLoaderShard over the sampler, the
    # loader the HF Trainer integration builds; or accelerate's skip_first_batches of it, a resumed epoch's):
    # on a device it crashed at the first batch (AttributeError: 'DataLoader' object has no attribute
    # 'dl_state_dict'), and with that fixed, the shard fetches each batch one step before it yields it: a
    # load of batch 2 after batch 3 trained batch 5 (fetched before the load) first, a break after batch 2
    # skipped batches 3 and 4 — neither detected, where prepare_loader's loader and track are refused with
    # the order that works. Refused too, naming prepare_loader.
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.data_loader import skip_first_batches

    from tokenbal.integrations.accelerate import neutralise

    s = TokenBalancedBatchSampler(lengths_for(40), 1, 0, global_batch_size=4)
    prepared = neutralise(Accelerator(cpu=True), DataLoader(IndexDataset(40), batch_sampler=s))
    if skip:
        prepared = skip_first_batches(prepared, skip)
    with pytest.raises(ValueError, match=r"DevicePrefetcher\(DataLoaderShard\) over a TokenBalancedBatch"
                                         r"Sampler:.*one step before it yields it.*prepare_loader"):
        DevicePrefetcher(prepared, depth=2, ops=_CpuSideStream())


_PATHS = [(0, False, False), (2, False, False), (2, True, False), (0, False, True), (2, False, True),
          (2, True, True)]


@pytest.mark.parametrize(("workers", "persistent", "prefetcher"), _PATHS)
def test_a_rollback_after_the_epochs_last_batch_was_handed_out_is_trained_or_refused(workers, persistent,
                                                                                    prefetcher):
    # for epoch in (0, 1): set_epoch(epoch); for batch in loader: ... a load of batch 2 of the same epoch (a
    # rollback) after the loop received the epoch's last batch. num_workers=0 goes on at batch 2 in the same
    # pass, and so do track and prepare_loader. Without them, a DataLoader with workers (every batch already
    # handed out) and a DevicePrefetcher (its source already exhausted) ended the pass, and set_epoch(1)
    # dropped the rollback with a warning: batches 2-9 of the rolled-back epoch never trained (2 workers,
    # persistent or not, and a prefetcher over 0 or 2 workers, load after batch 9 or 8). Now the pass goes on
    # where it can (the prefetcher starts a new pass of the loader), or the loop gets an error before anything
    # is lost: at the load (workers, not persistent: its loop is live) or at set_epoch(1) (persistent workers,
    # whose iterator outlives the loop); following what it says trains what num_workers=0 trains.
    lengths = lengths_for(40)
    full = [sorted(b) for b in TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)]
    for load_at in (8, 9):
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4)
        ckpt = s.state_dict() | {"cursor": 2}
        loader = DataLoader(IndexDataset(40), batch_sampler=s, num_workers=workers,
                            persistent_workers=persistent)

        def batches(loader=loader):
            return DevicePrefetcher(loader, depth=2, ops=_CpuSideStream()) if prefetcher else loader

        trained, errors = {0: [], 1: []}, []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for epoch in (0, 1):
                s.set_epoch(epoch)
                try:
                    for n, batch in enumerate(batches()):
                        trained[epoch].append(_ids(batch))
                        if epoch == 0 and n == load_at:
                            try:
                                s.load_state_dict(ckpt)
                            except RuntimeError as e:   # refused: break out, load, iterate again
                                errors.append(str(e))
                                break
                    if errors and epoch == 0:
                        s.load_state_dict(ckpt)
                        trained[0] += [_ids(b) for b in batches()]
                    if epoch == 0:
                        s.set_epoch(1)
                except RuntimeError as e:   # set_epoch(1) refused: iterate the loader again first
                    errors.append(str(e))
                    trained[0] += [_ids(b) for b in batches()]
        expected = full[:load_at + 1] + full[2:]
        if load_at == 8 and (workers == 0 or not prefetcher):
            # the sampler had not handed out its last batch at the load (single process) or the DataLoader
            # still held batch 9 (its read-ahead): the load is refused or goes on as before (other tests)
            continue
        assert trained[0] == expected, f"load after batch {load_at}: {errors}"
        assert trained[1] == _epoch_plan(lengths, 1, global_batch_size=4)
        # refused: workers without a prefetcher; with one, only where the DataLoader's own iterator still
        # lives in the loop (not persistent, the prefetcher not yet past its end), as any load there with
        # workers is
        assert len(errors) == (workers > 0 and (not prefetcher or (not persistent and load_at == 8))), errors
        assert all("track" in e and "batch 2 of 10" in e for e in errors)


def _neutralised_rollback(workers: int, persistent: bool, load_at: int, rank: int = 0,
                          world: int = 1) -> dict:
    """A loop over ``neutralise(accelerator, loader)`` iterated directly (no prepare_loader), loading batch
    2 after batch ``load_at`` of epoch 0; on a refusal, what it says: out of the loop, load, iterate again."""
    import warnings

    from accelerate import Accelerator

    from tokenbal.integrations.accelerate import neutralise

    n = 40 * world
    s = TokenBalancedBatchSampler(lengths_for(n), global_batch_size=4 * world)
    loader = DataLoader(IndexDataset(n), batch_sampler=s, num_workers=workers, persistent_workers=persistent)
    prepared = neutralise(Accelerator(cpu=True), loader)
    ranks_plan = TokenBalancedBatchSampler(lengths_for(n), world, rank, global_batch_size=4 * world)
    plan = [sorted(b) for b in ranks_plan]
    ckpt = s.state_dict() | {"cursor": 2}
    trained, errors = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            for k, batch in enumerate(prepared):
                trained.append(plan.index(_ids(batch)))
                if k == load_at:
                    s.load_state_dict(ckpt)
        except RuntimeError as e:
            errors.append(str(e))
        if errors:   # out of the loop (its iterators are gone with the error): load, iterate again
            s.load_state_dict(ckpt)
            trained += [plan.index(_ids(b)) for b in prepared]
        else:
            # persistent workers, load at the last batch: the load stands, and accelerate's next pass (which
            # it counts as epoch 1) refuses to leave the loaded position; its set_epoch(0), then iterate
            try:
                trained += [plan.index(_ids(b)) for b in prepared]
            except RuntimeError as e:
                errors.append(str(e))
            prepared.set_epoch(0)
            trained += [plan.index(_ids(b)) for b in prepared]
    return {"trained": trained, "errors": errors, "shard": type(prepared.batch_sampler).__name__}


def _neutralised_rollback_rank(rank: int, world: int, workers: int, load_at: int) -> dict:
    return _neutralised_rollback(workers, False, load_at, rank, world)


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_rollback_in_a_loop_over_neutralises_loader_never_trains_a_stale_batch(workers, persistent):
    # neutralise(accelerator, loader) iterated directly (the loader the HF Trainer integration builds; the
    # lower-level path under prepare_loader): accelerate's DataLoaderShard fetches each batch one step before
    # it yields it. A load of batch 2 after batch 3 trained batch 4 (fetched before the load) first, silently,
    # with num_workers=0; on 2 gloo ranks, where accelerate wraps the sampler in its BatchSamplerShard, the
    # sampler did not see the DataLoader at all, and with 2 workers batches 4-8 were trained before the
    # loaded ones, silently. Now refused as for a plain DataLoader that read ahead (no stale batch reaches the
    # loop), naming prepare_loader; doing what it says trains the loaded position.
    pytest.importorskip("accelerate")
    for load_at in (3, 9):
        out = _neutralised_rollback(workers, persistent, load_at)
        assert out["trained"] == list(range(load_at + 1)) + list(range(2, 10)), (load_at, out["errors"])
        assert len(out["errors"]) == 1 and "prepare_loader" in out["errors"][0], out["errors"]


def test_a_rollback_over_neutralises_loader_on_gloo_ranks_is_refused_before_a_stale_batch():
    pytest.importorskip("accelerate")
    from tokenbal.launch import run_ranks

    for workers in (0, 2):
        for rank, out in enumerate(run_ranks(_neutralised_rollback_rank, 2, workers, 3, timeout=180)):
            assert out["shard"] == "BatchSamplerShard"
            assert out["trained"] == [0, 1, 2, 3] + list(range(2, 10)), (workers, rank, out["errors"])
            assert len(out["errors"]) == 1 and "prepare_loader" in out["errors"][0], out["errors"]
