"""MindSpeed-MM (FSDP2 trainer, ``mindspeed_mm/fsdp``): a ``dataloader_provider`` with tokenbal's plan.

Read against MindSpeed-MM's source at commit ``57069cd55a8ab16d5affe379a2e2c5f0a4d962b9``
(github.com/Ascend/MindSpeed-MM, 2026-08-08; not on PyPI). Its ``Trainer(args, dataloader_provider=...)``
(``mindspeed_mm/fsdp/train/trainer.py``) takes the loader a provider returns for ``args`` and relies on:

* ``len(loader)`` counting **samples**: ``iters_per_epoch = len(loader) // global_batch_size`` and
  ``train_iters = train_epochs × iters_per_epoch`` (``_validate_and_set_train_iters``, drop_last);
* a cyclic iterator (``build_iterations``: ``for x in loader`` again and again, never ``set_epoch``)
  from which each iteration takes ``gradient_accumulation_steps`` micro-batches
  (``global_batch_size = micro_batch_size × dp × gradient_accumulation_steps``);
* ``loader.state_dict()`` saved in its checkpoint's ``extra_state["train_dataloader"]`` and
  ``loader.load_state_dict(...)`` called once at start-up, before the first iteration.

:func:`build_dataloader` returns a loader that keeps that contract: every step is
``gradient_accumulation_steps`` micro-batches on every DP rank (tokenbal's ``grad_accum``, each
micro-batch balanced across the ranks), ``len`` = planned steps × ``global_batch_size`` (so the
trainer's formula gives exactly the planned steps, every sample once per epoch, no tail dropped),
each new iteration after a finished epoch moves to the next epoch's plan, and its state is the
position the training loop has *received* (``sampler.track``), restored exactly, an epoch's end
included. :func:`dataloader_provider` wraps it as MindSpeed-MM's hook::

    from mindspeed_mm.fsdp.train.trainer import Trainer
    from tokenbal.integrations.mindspeed_mm import dataloader_provider

    def build(args):   # MindSpeed-MM's own dataset and collator, as its get_dataloader builds them
        return dataset, collate_fn

    trainer = Trainer(args=args, dataloader_provider=dataloader_provider(build, index="train-index"))
    trainer.train()

Its NPU attention reads ``cu_seqlens`` back to the host (``.cpu()`` / ``.tolist()``); tokenbal's
``collate.PackedCollator`` hands them over as pinned host tensors and a Python list (``seq_lens``)
computed on the host, so no device-to-host copy is needed there. Importing this module imports
nothing of MindSpeed-MM (nor torch_npu).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from tokenbal.balance.sampler import TokenBalancedBatchSampler

__all__ = ["TokenBalancedMMLoader", "build_dataloader", "dataloader_provider"]


class TokenBalancedMMLoader(DataLoader):
    """A ``DataLoader`` over tokenbal's plan with the contract MindSpeed-MM's FSDP2 trainer uses
    (``len`` in samples, cyclic re-iteration, ``state_dict`` / ``load_state_dict``)."""

    def __init__(self, dataset: Any, sampler: TokenBalancedBatchSampler, global_batch_size: int,
                 **loader_options: Any) -> None:
        super().__init__(dataset, batch_sampler=sampler, **loader_options)
        self.sampler_plan = sampler
        self.global_batch_size = global_batch_size

    def __len__(self) -> int:
        # MindSpeed-MM: iters_per_epoch = len(loader) // global_batch_size
        return len(self.sampler_plan) // self.sampler_plan.grad_accum * self.global_batch_size

    def __iter__(self):
        s = self.sampler_plan
        # Where the loop is: the batches it received (track), not the sampler's cursor, which a DataLoader
        # with workers has run to the epoch's end before the loop receives its last batches; a new
        # iter() after a stop there continues the epoch rather than skipping them.
        if s.state_dict()["cursor"] >= len(s):
            # the cyclic iterator came back for more: the next epoch (MindSpeed-MM never calls set_epoch)
            s.set_epoch(s.epoch + 1)
        return iter(s.track(_Plain(self)))

    def set_epoch(self, epoch: int) -> None:
        self.sampler_plan.set_epoch(epoch)

    def state_dict(self) -> dict:
        return {"tokenbal": self.sampler_plan.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler_plan.load_state_dict(state["tokenbal"])


class _Plain:
    """The loader's own ``DataLoader.__iter__`` (not the overridden one), for ``sampler.track``."""

    def __init__(self, loader: TokenBalancedMMLoader) -> None:
        self.loader = loader
        self.batch_sampler = loader.batch_sampler

    def __iter__(self):
        return DataLoader.__iter__(self.loader)


def build_dataloader(dataset: Any, lengths: Any, *, global_batch_size: int, micro_batch_size: int,
                     dp_size: int, dp_rank: int, collate_fn: Callable | None = None, seed: int = 0,
                     num_workers: int = 0, pin_memory: bool = False, **sampler_options: Any
                     ) -> TokenBalancedMMLoader:
    """The loader for one DP rank: ``global_batch_size`` samples per step over ``dp_size`` ranks, in
    ``global_batch_size // (micro_batch_size × dp_size)`` micro-batches per rank (MindSpeed-MM's
    ``gradient_accumulation_steps``). ``lengths``: a ``TokenIndex``, its folder (``str`` or
    ``pathlib.Path``) or token counts, one per item of ``dataset``, in order. ``sampler_options`` go
    to the sampler (``cost=``, ``stages=``, ...)."""
    lengths = _open_index(lengths)
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(f"global_batch_size {global_batch_size} is not micro_batch_size {micro_batch_size} "
                         f"x dp {dp_size} x gradient_accumulation_steps")
    k = global_batch_size // (micro_batch_size * dp_size)
    sampler = TokenBalancedBatchSampler(lengths, num_replicas=dp_size, rank=dp_rank,
                                        global_batch_size=global_batch_size, grad_accum=k, seed=seed,
                                        verify=False, **sampler_options)
    if len(getattr(lengths, "lengths", lengths)) != len(dataset):
        raise ValueError(f"{len(getattr(lengths, 'lengths', lengths))} lengths for a dataset of "
                         f"{len(dataset)} items: index the same samples, in the same order")
    return TokenBalancedMMLoader(dataset, sampler, global_batch_size, collate_fn=collate_fn,
                                 num_workers=num_workers, pin_memory=pin_memory)


def _open_index(lengths: Any) -> Any:
    # A folder may come as a pathlib.Path too; read as token counts it would be a 0-d array
    # ("lengths must be 1-D"), an error that names neither the index nor the option.
    if isinstance(lengths, (str, os.PathLike)):
        from tokenbal.index.store import TokenIndex

        return TokenIndex.open(lengths)
    return lengths


def dataloader_provider(build: Callable[[Any], tuple[Any, Callable | None]], index: Any,
                        **options: Any) -> Callable[[Any], TokenBalancedMMLoader]:
    """MindSpeed-MM's ``Trainer(dataloader_provider=...)`` hook: ``build(args)`` returns
    ``(dataset, collate_fn)``; the DP group, batch sizes and seed come from ``args`` and MindSpeed's
    parallel state, as its own ``get_dataloader`` takes them. ``index``: a ``TokenIndex``, its
    folder, or token counts."""

    def provide(args: Any) -> TokenBalancedMMLoader:
        from mindspeed_mm.fsdp.distributed.parallel_state import get_parallel_state

        dataset, collate_fn = build(args)
        group = get_parallel_state().get_dp_group()
        return build_dataloader(dataset, index, global_batch_size=args.training.global_batch_size,
                                micro_batch_size=args.training.micro_batch_size, dp_size=group.size(),
                                dp_rank=group.rank(), collate_fn=collate_fn, seed=args.training.seed,
                                **options)

    return provide
