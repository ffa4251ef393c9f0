"""Properties of the sampler behind real DataLoaders (worker processes, persistent or not), DevicePrefetcher
read-ahead, ``track`` and accelerate's ``prepare_loader``, on positions hypothesis picks:

- a resume at any batch of any epoch (in the same process, or a fresh sampler and loader from the state)
  trains every sample exactly once per epoch;
- a rollback inside the loop (``load_state_dict`` of an earlier batch of the epoch) trains what
  ``num_workers=0`` trains — the epoch up to the load, then the epoch from the loaded batch — or raises
  ``RuntimeError`` before a wrong batch reaches the loop, and doing what the error says (leave the loop, load,
  iterate the loader again) trains exactly that.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from collate import DevicePrefetcher
from tests.helpers.lengths import lengths_for
from tests.tokenbal.balance.test_sampler import IndexDataset
from tests.tokenbal.balance.test_sampler_loader import _CpuSideStream
from tokenbal import TokenBalancedBatchSampler

N, EPOCHS, OPTIONS = 40, 2, dict(global_batch_size=4)   # 10 batches an epoch
LENGTHS = lengths_for(N)


@dataclass(frozen=True)
class Path:
    """How the loop reads the loader: ``track``-ed or not, through a DevicePrefetcher or not, or through
    accelerate's ``prepare_loader``."""

    workers: int
    persistent: bool = False
    tracked: bool = False
    prefetcher: bool = False
    accelerate: bool = False

    def __str__(self) -> str:
        parts = [f"{self.workers} workers" + (" persistent" if self.persistent else "")]
        parts += [name for name in ("tracked", "prefetcher", "accelerate") if getattr(self, name)]
        return ", ".join(parts)


# The paths whose state_dict is the loop's position (without track, a DataLoader with workers reads ahead:
# its state counts the batches handed out, by design; a prefetcher abandoned by a break reports what it held).
RESUMABLE = [Path(0), Path(0, prefetcher=True), Path(2, prefetcher=True), Path(2, True, prefetcher=True),
             Path(0, tracked=True), Path(2, tracked=True), Path(2, True, tracked=True),
             Path(2, True, tracked=True, prefetcher=True), Path(0, accelerate=True), Path(2, accelerate=True)]
# Every way of reading the loader, for rollbacks (an error is an allowed answer there).
ALL = RESUMABLE + [Path(2), Path(2, True), Path(2, tracked=True, prefetcher=True)]


class Run:
    """A sampler, its DataLoader, and the loop's view of it along ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sampler = TokenBalancedBatchSampler(LENGTHS, 1, 0, **OPTIONS)
        self.loader = DataLoader(IndexDataset(N), batch_sampler=self.sampler, num_workers=path.workers,
                                 persistent_workers=path.persistent)
        self.prepared = None
        if path.accelerate:
            pytest.importorskip("accelerate")
            from accelerate import Accelerator

            from tokenbal.integrations.accelerate import prepare_loader

            self.prepared = prepare_loader(Accelerator(cpu=True), self.loader, register=False)

    def batches(self):
        if self.prepared is not None:
            return self.prepared
        source = DevicePrefetcher(self.loader, depth=2, ops=_CpuSideStream()) if self.path.prefetcher \
            else self.loader
        return self.sampler.track(source) if self.path.tracked else source

    def set_epoch(self, epoch: int) -> None:
        (self.prepared or self.sampler).set_epoch(epoch)

    def state_dict(self) -> dict:
        return (self.prepared or self.sampler).state_dict()

    def load_state_dict(self, state: dict) -> None:
        (self.prepared or self.sampler).load_state_dict(state)


def _plan(epoch: int) -> list[list[int]]:
    s = TokenBalancedBatchSampler(LENGTHS, 1, 0, **OPTIONS)
    s.set_epoch(epoch)
    return [sorted(b) for b in s]


def _ids(batch) -> list[int]:
    return sorted(batch["idx"].tolist())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(RESUMABLE), stop_epoch=st.integers(0, EPOCHS - 1), stop=st.integers(0, 9),
       fresh=st.booleans())
def test_every_sample_once_per_epoch_across_a_resume_at_any_batch(path, stop_epoch, stop, fresh):
    run, seen = Run(path), {epoch: [] for epoch in range(EPOCHS)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "skipped" warning either: nothing may be skipped
        state = None
        for epoch in range(EPOCHS):
            run.set_epoch(epoch)
            for n, batch in enumerate(run.batches()):
                seen[epoch] += _ids(batch)
                if (epoch, n) == (stop_epoch, stop):
                    break
            else:
                continue
            state = run.state_dict()   # after the break: the loop's position
            break
        if fresh:   # a new process: a new sampler and loader restored from the state
            run = Run(path)
        run.load_state_dict(state)
        for epoch in range(state["epoch"], EPOCHS):
            run.set_epoch(epoch)
            seen[epoch] += [i for batch in run.batches() for i in _ids(batch)]
    for epoch in range(EPOCHS):
        where = f"{path}: epoch {epoch}, resumed after batch {stop} of epoch {stop_epoch} (fresh={fresh})"
        assert sorted(seen[epoch]) == list(range(N)), where


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(ALL), load_at=st.integers(0, 9), data=st.data())
def test_a_rollback_at_any_batch_trains_what_one_process_loading_trains_or_raises_first(path, load_at, data):
    cursor = data.draw(st.integers(0, load_at), label="cursor")
    full = _plan(0)
    run = Run(path)
    ckpt = {**run.sampler.state_dict(), "cursor": cursor}
    trained, errors = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.set_epoch(0)
        loaded = False
        try:
            for n, batch in enumerate(run.batches()):
                trained.append(_ids(batch))
                if n == load_at and not loaded:
                    loaded = True
                    run.load_state_dict(ckpt)
        except RuntimeError as e:
            errors.append(str(e))
        if errors:
            # what the error says: out of the loop, load, iterate the loader again (a load that was refused
            # changed nothing, one that was not is loaded again: the same position)
            assert "track" in errors[0], errors[0]
            run.load_state_dict(ckpt)
            trained += [_ids(b) for b in run.batches()]
        try:
            run.set_epoch(1)
        except RuntimeError as e:   # persistent workers: the rollback is not trained yet
            errors.append(str(e))
            assert "Iterate the loader again first" in str(e)
            trained += [_ids(b) for b in run.batches()]
            run.set_epoch(1)
        epoch1 = [_ids(b) for b in run.batches()]
    assert trained == full[:load_at + 1] + full[cursor:], f"{path}: load of batch {cursor} after batch " \
                                                          f"{load_at}: {errors}"
    assert epoch1 == _plan(1), f"{path}: epoch 1 after the rollback"
    if path.workers == 0 or path.tracked or path.accelerate:
        assert not errors, f"{path}: {errors}"
