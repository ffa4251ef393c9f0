"""``prepare_loader``: a tokenbal loader through ``accelerator.prepare`` without losing steps.

accelerate (1.x) wraps every batch sampler of a multi-process job in ``BatchSamplerShard``, which
hands rank ``r`` only batches ``i % world == r`` of what it wraps. tokenbal's sampler already yields
this rank's batches, so that second shard silently drops half of them (at 2 ranks) and gives the
ranks different plan rows at each step; accelerate has no "already sharded" flag. The Trainer makes
the wrapper a pass-through for its own per-rank ``BatchRebalanceSampler`` (``num_processes = 1``);
:func:`neutralise` does the same and also links the wrapper's ``sampler`` attribute to the tokenbal
sampler, which is the attribute accelerate's ``DataLoaderShard.set_epoch`` (and a
``skip_first_batches`` loader) forwards the epoch through.

Usage (every rank)::

    sampler = TokenBalancedBatchSampler(index, global_batch_size=64)
    loader = prepare_loader(accelerator, DataLoader(ds, batch_sampler=sampler, collate_fn=...))
    for epoch in range(start_epoch, num_epochs):
        loader.set_epoch(epoch)
        for batch in loader: ...
        # accelerator.save_state(dir) stores the loader position; accelerator.load_state(dir)
        # restores it: the next iteration continues at the first batch the loop had not received.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenbal.balance.sampler import TokenBalancedBatchSampler

__all__ = ["TokenBalancedLoader", "neutralise", "prepare_loader"]


def _tokenbal_sampler(loader: Any) -> TokenBalancedBatchSampler:
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, TokenBalancedBatchSampler):
        raise TypeError("expected a DataLoader built with batch_sampler=TokenBalancedBatchSampler(...), got "
                        f"batch_sampler={type(sampler).__name__}")
    return sampler


def neutralise(accelerator: Any, loader: Any) -> Any:
    """``accelerator.prepare(loader)`` with accelerate's re-sharding turned off; returns accelerate's
    own ``DataLoaderShard`` (device placement, gradient-accumulation end-of-loader tracking kept).

    It fetches each batch one step before it yields it, so iterated directly the loop is a batch behind
    the DataLoader: a ``load_state_dict`` inside the loop is refused as for a DataLoader that read ahead
    (the sampler sees the held batch), a ``break`` then a new pass skips it (with the sampler's warning), and
    a ``collate.DevicePrefetcher`` around it is refused. :func:`prepare_loader` counts what the loop
    received and does all three exactly."""
    sampler = _tokenbal_sampler(loader)
    config = getattr(accelerator, "dataloader_config", None)
    if getattr(config, "dispatch_batches", None):
        # rank 0 would iterate its own plan and scatter it: the other ranks' samples are never used.
        raise ValueError("dispatch_batches=True is not supported with a TokenBalancedBatchSampler (rank 0's "
                         "plan would be split across ranks); use the default dispatch_batches=None/False")
    if getattr(config, "use_stateful_dataloader", False):
        # accelerate would restore its own loader position on top of tokenbal's (one batch trained twice).
        raise ValueError("use_stateful_dataloader=True is not supported with a TokenBalancedBatchSampler: "
                         "prepare_loader saves and restores the position itself (accelerator.save_state / "
                         "load_state); leave use_stateful_dataloader off")
    if getattr(config, "split_batches", False):
        raise ValueError("split_batches=True is not supported with a TokenBalancedBatchSampler: its batches "
                         "are already per rank and have no fixed batch_size")
    from accelerate.data_loader import BatchSamplerShard

    # accelerate 1.10 and 1.11 refuse a batch sampler without a batch_size in BatchSamplerShard unless
    # even_batches is off; the shard becomes a pass-through below and tokenbal's plan already gives
    # every rank the same number of batches, so "evening" has nothing to do: off while preparing.
    even = getattr(accelerator, "even_batches", None)
    if even:
        accelerator.even_batches = False
    try:
        prepared = accelerator.prepare(loader)
    finally:
        if even:
            accelerator.even_batches = even
    shard = getattr(prepared, "batch_sampler", None)
    world = (int(accelerator.num_processes), int(accelerator.process_index))
    if isinstance(shard, BatchSamplerShard):
        if shard.batch_sampler is not sampler:
            raise RuntimeError("accelerate wrapped an unexpected batch sampler; cannot neutralise its "
                               "sharding")
        _check_data_parallel(sampler, (int(shard.num_processes), int(shard.process_index)), world)
        shard.num_processes, shard.process_index, shard.even_batches = 1, 0, False
        shard.sampler = sampler     # DataLoaderShard.set_epoch forwards through `.sampler`
    elif shard is not sampler:
        raise RuntimeError(f"accelerate replaced the batch sampler with {type(shard).__name__}; tokenbal "
                           "cannot check that it yields this rank's batches")
    elif world[0] > 1:
        # Several processes and no shard: accelerate's device mesh left one data-parallel rank
        # (every process a tensor / context parallel peer of the others), all on the same batches.
        _check_data_parallel(sampler, (1, 0), world)
    return prepared


def _check_data_parallel(sampler: TokenBalancedBatchSampler, split: tuple[int, int],
                         world: tuple[int, int]) -> None:
    """Refuse a sampler planned over other ranks than accelerate's device mesh shards data over.

    accelerate's ``prepare_data_loader`` shards by ``(num_processes, process_index)`` of the whole
    world unless the accelerator has a device mesh with tensor / context parallel dimensions
    (``ParallelismConfig``, a ``tp_plan`` model, DeepSpeed AutoTP): then over its data-parallel ranks
    only, the peers of one TP / CP group on the same batches (accelerate 1.16 ``data_loader.py``:
    1117-1153). Where accelerate's ``split`` differs from the plain ``world`` it knows the layout,
    and a tokenbal plan over other ranks would hand TP / CP peers different samples. Where it does
    not, the sampler's own ranks stand (a ``dp_group`` of a layout accelerate is not told about)."""
    if split == world or split == (sampler.num_replicas, sampler.rank):
        return
    raise ValueError(f"accelerate shards this loader over {split[0]} data-parallel rank(s), this process "
                     f"being data-parallel rank {split[1]} (its device mesh puts tensor / context parallel "
                     "peers on one batch), but the TokenBalancedBatchSampler was planned for "
                     f"num_replicas={sampler.num_replicas}, rank={sampler.rank}: peers of one TP / CP group "
                     "would train on different samples. Build the sampler over the data-parallel ranks: "
                     f"num_replicas={split[0]}, rank={split[1]}")


class TokenBalancedLoader:
    """The prepared loader plus an exact position: it counts the batches the loop *received* (the
    sampler itself runs ahead by accelerate's one-batch look-ahead and DataLoader prefetching; a new
    iteration after a ``break`` continues at the first batch not received), and saves / restores
    ``(epoch, batches received)`` through ``accelerator.save_state`` / ``load_state`` (it is
    registered with ``register_for_checkpointing``). Everything else is delegated to the wrapped
    ``DataLoaderShard``."""

    # Its count is what the loop received only when the loop iterates it directly: collate.DevicePrefetcher
    # refuses to read ahead of it.
    counts_received_batches = True

    def __init__(self, prepared: Any, sampler: TokenBalancedBatchSampler) -> None:
        self.loader = prepared
        self.sampler = sampler
        self._received = 0
        self._epoch = int(getattr(prepared, "iteration", sampler.epoch))
        # A pass is running; batches it had fetched before a load_state_dict made inside it (accelerate's
        # look-ahead, the workers' prefetch), still to come and not of the loaded position; whether a load
        # happened inside the pass (its end is then the epoch's end only if every batch was received).
        self._passing = False
        self._in_flight = 0
        self._loaded_in_pass = False

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def _finished(self) -> bool:
        """Every batch of the current epoch received: its last one too (the pass may not have ended, a
        loop can break or save a checkpoint at the last batch), so the next pass is the next epoch."""
        return self._received > 0 and self._received >= len(self.sampler)

    @property
    def epoch(self) -> int:
        """The epoch the next pass iterates (a loop can start at it after ``load_state``)."""
        return self._epoch + 1 if self._finished() else self._epoch

    @property
    def batches_received(self) -> int:
        """Batches of that epoch the loop has received (restored by ``load_state``)."""
        return 0 if self._finished() else self._received

    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        if epoch != self._epoch or self._finished():
            self._received = 0      # another epoch, or the finished one asked for again: from its start
        self._epoch = epoch
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        while True:
            # DataLoaderShard.__iter__ re-applies set_epoch(its iteration): keep it on our epoch.
            if self._finished():
                self._epoch, self._received = self._epoch + 1, 0
            self.loader.set_epoch(self._epoch)
            pass_epoch = self._epoch
            # Tell the sampler where the loop is: after an early stop (a break for an eval), it had run
            # ahead by accelerate's look-ahead batch and the workers' prefetch; it continues from here.
            self.sampler.mark_received(self._epoch, self._received)
            self._passing, self._in_flight, self._loaded_in_pass = True, 0, False
            try:
                for batch in self.loader:
                    if self._in_flight:
                        # fetched before a load_state_dict inside this pass: not the loaded position's, so the
                        # loop never sees it (the next batch after a load is the loaded one, as under track)
                        self._in_flight -= 1
                        continue
                    self._received += 1
                    self.sampler.mark_received(self._epoch, self._received)
                    yield batch
            finally:
                self._passing = False
            if self._loaded_in_pass and not self._finished():
                if self._epoch == pass_epoch:
                    # A rollback within this epoch after the sampler had handed out its last batch (workers
                    # fetch ahead): the DataLoader had nothing more to ask for and ended its pass, where with
                    # num_workers=0 the loop goes on at the loaded batch. Go on the same way, in this pass.
                    continue
                # a load of another epoch ended the pass before that epoch's end: the next pass continues it
                return
            # A complete pass: the next one is the next epoch, as accelerate's own iteration counter has it.
            self._epoch += 1
            self._received = 0
            return

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        state["epoch"], state["cursor"] = self.epoch, self.batches_received
        if state["epoch"] != self.sampler.epoch:
            state.pop("segments", None)   # a finished epoch: nothing of the next one is consumed yet
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Inside a pass (a rollback in the loop), the batches handed out but not yet received will still
        # arrive first: they are not the loaded position's, so the pass drops them.
        in_flight = max(self.sampler.cursor - self._received, 0) if self._passing else 0
        self.sampler.load_state_dict(state)
        self._epoch, self._received = int(state["epoch"]), int(self.sampler.cursor)
        self._in_flight, self._loaded_in_pass = in_flight, self._passing
        self.loader.set_epoch(self._epoch)


def prepare_loader(accelerator: Any, loader: Any, *, register: bool = True) -> TokenBalancedLoader:
    """Prepare a ``DataLoader(batch_sampler=TokenBalancedBatchSampler(...))`` for a raw accelerate
    loop: no re-sharding (every rank gets all of its own steps), ``set_epoch`` reaches the sampler
    (and a plain loop advances one epoch per complete pass), and with ``register=True`` the position
    is part of ``accelerator.save_state`` / ``load_state``. Raises for ``dispatch_batches`` /
    ``split_batches``, which cannot work with per-rank batches, and ``use_stateful_dataloader``, whose
    restored position would stack on tokenbal's."""
    sampler = _tokenbal_sampler(loader)
    wrapped = TokenBalancedLoader(neutralise(accelerator, loader), sampler)
    if register:
        accelerator.register_for_checkpointing(wrapped)
    return wrapped
