"""VeOmni (0.1.12): a ``"tokenbal"`` entry in VeOmni's ``DATALOADER_REGISTRY``.

VeOmni's trainers build their loader with ``build_dataloader(args.data.dataloader.type, ...)``; the
``"native"`` entry gives each data-parallel rank a ``StatefulDistributedSampler`` slice and either
fixed-size micro-batches (``--train.dyn_bsz false``) or a per-rank token budget (``dyn_bsz``,
counted from text tokens as they are loaded). The ``"tokenbal"`` entry plans every step over the
DP ranks from a tokenbal index (image tokens from image headers, never running the processor):

* each optimizer step is ``num_micro_batch = global_batch_size // (micro_batch_size · dp)``
  micro-batches on every rank (``grad_accum`` in tokenbal's plan: each micro-batch balanced across
  ranks), packed by VeOmni's own collator (``MainCollator``) as the native loader's are;
* exactly VeOmni's ``train_steps`` steps per epoch (its trainer and its resume arithmetic count
  them), with every sample once per epoch: the samples per step are the fewest whose plan fits in
  that many steps (about ``dataloader_batch_size`` per rank, the native loader's, which instead
  drops the tail), and a plan a step or two short gets light steps at the epoch's end; a smaller
  ``--train.max_steps`` only stops each epoch early, as with the native loader (the plan keeps the
  uncapped step count and batch size);
* ``set_epoch`` on the loader reaches the plan (VeOmni's native loader forwards it to a
  ``sampler``, which a batch sampler is not), and the loader's ``state_dict`` (torchdata's
  ``StatefulDataLoader``, saved in VeOmni's checkpoint ``extra_state``) holds the plan's position,
  so a resume continues at the next step, an epoch's end included.

Select it with ``--data.dataloader.type tokenbal --train.dyn_bsz false`` and point it at the index
with ``TOKENBAL_INDEX=DIR`` (built from the same ``--data.train_path`` files in the same order:
``tokenbal index build train.parquet --model MODEL_DIR --tokenizer MODEL_DIR --out DIR``).
VeOmni's dataclass arguments do not take extra keys, hence the environment variable. Run::

    TOKENBAL_INDEX=IDX torchrun --nproc-per-node 8 -m tokenbal.integrations.veomni config.yaml \\
        --data.dataloader.type tokenbal --train.dyn_bsz false

which registers the entry and runs VeOmni 0.1.12's ``VLMTrainer(parse_args(VeOmniVLMArguments)).train()``; in
a script of your own, call :func:`register` before the trainer is built. Importing this module
imports nothing of VeOmni.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["build_tokenbal_dataloader", "fitting_batch_size", "main", "register", "steps_batch_size"]

ENV_INDEX = "TOKENBAL_INDEX"


def register() -> None:
    """Add ``"tokenbal"`` to VeOmni's ``DATALOADER_REGISTRY`` (once; later calls do nothing)."""
    from veomni.data.data_loader import DATALOADER_REGISTRY

    if "tokenbal" not in DATALOADER_REGISTRY.valid_keys():
        DATALOADER_REGISTRY.register("tokenbal")(build_tokenbal_dataloader)


def steps_batch_size(lengths: Any, steps: int, num_replicas: int, grad_accum: int = 1, seed: int = 0
                     ) -> int:
    """The samples per step (all ranks) for which tokenbal's plan of ``lengths`` has exactly ``steps``
    steps, every sample used once; the smallest such, near ``len / steps``. Raises if none."""
    size, planned = fitting_batch_size(lengths, steps, num_replicas, grad_accum, seed)
    if planned != steps:
        raise ValueError(f"no batch size gives tokenbal's plan of {len(lengths)} samples exactly {steps} "
                         "steps")
    return size


def fitting_batch_size(lengths: Any, steps: int, num_replicas: int, grad_accum: int = 1, seed: int = 0
                       ) -> tuple[int, int]:
    """``(size, planned)``: the smallest samples per step (all ranks) whose plan of ``lengths`` has at
    most ``steps`` steps, and that plan's steps. Often no size gives exactly ``steps`` (42 samples in
    10 steps: 4 per step plans 11, 5 plans 9); the loader then pads the plan to ``steps`` with light
    steps at the epoch's end (``epoch_steps``), every sample still once."""
    from tokenbal.balance.sampler import TokenBalancedBatchSampler

    n = len(lengths)
    if steps < 1 or n < steps * num_replicas * grad_accum:
        raise ValueError(f"{n} samples cannot fill {steps} steps of {num_replicas} ranks x {grad_accum} "
                         "micro-batches with at least one sample each")
    for size in range(max(num_replicas * grad_accum, n // steps), n + 1):
        s = TokenBalancedBatchSampler(lengths, num_replicas=num_replicas, rank=0, global_batch_size=size,
                                      grad_accum=grad_accum, seed=seed, verify=False)
        planned = len(s) // grad_accum
        if planned <= steps:
            return size, planned
    raise ValueError(f"no batch size fits tokenbal's plan of {n} samples into {steps} steps")


class _Steps:
    """A batch sampler yielding, per optimizer step, this rank's micro-batches (lists of indices)
    from a tokenbal sampler with ``grad_accum = k``, whose batches are the micro-batches."""

    def __init__(self, sampler: Any, k: int) -> None:
        self.sampler, self.k = sampler, k

    def __iter__(self):
        step: list[list[int]] = []
        for micro in self.sampler:
            step.append(micro)
            if len(step) == self.k:
                yield step
                step = []

    def __len__(self) -> int:
        return len(self.sampler) // self.k

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class _MicroBatchItems:
    """The dataset, read one step at a time: ``__getitems__`` takes the step's micro-batches."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, micro_batches: list[list[int]]) -> list[list[Any]]:
        return [[self.dataset[i] for i in micro] for micro in micro_batches]


class _CollateMicroBatches:
    """VeOmni's per-micro-batch collator over each micro-batch (its datasets return a list per
    sample, of which the trainer uses the first, as ``MakeMicroBatchCollator`` does)."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, micro_batches: list[list[Any]]) -> list[Any]:
        out = []
        for j, micro in enumerate(micro_batches):
            if not micro:
                raise ValueError(f"micro-batch {j} of this rank's step is empty (fewer samples than ranks x "
                                 "micro-batches in the step); lower micro_batch_size or global_batch_size")
            out.append(self.collate([item[0] if isinstance(item, list) else item for item in micro]))
        return out


def build_tokenbal_dataloader(dataset: Any, micro_batch_size: int, global_batch_size: int,
                              dataloader_batch_size: int, train_steps: int, dyn_bsz: bool = False,
                              num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2,
                              seed: int = 0, collate_fn: Any = None, build_collate_fn: bool = True,
                              collate_fn_kwargs: dict | None = None, **ignored: Any) -> Any:
    """VeOmni's dataloader-builder signature (``build_native_dataloader``'s keywords; the dynamic
    batching and sampler ones do not apply and are ignored). Returns a ``StatefulDataLoader``
    with ``set_epoch``."""
    if dyn_bsz:
        raise ValueError("data.dataloader.type=tokenbal plans the steps itself: pass --train.dyn_bsz false")
    from torchdata.stateful_dataloader import StatefulDataLoader
    from veomni.data.data_collator import MainCollator, NoopDataCollator
    from veomni.distributed.parallel_state import get_parallel_state

    from tokenbal.integrations._resume import EpochFollowingSampler
    from tokenbal.integrations.verl import index_lengths

    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        # VeOmni's iterable datasets stream their rows: there is no epoch of indexed rows to plan.
        raise ValueError("data.dataloader.type=tokenbal plans whole epochs of a mapping dataset (indexed "
                         f"rows); this one is a {type(dataset).__name__} (a stream): pass "
                         "--data.datasets_type mapping")
    path = os.environ.get(ENV_INDEX)
    if not path:
        raise ValueError(f"data.dataloader.type=tokenbal: set {ENV_INDEX}=DIR, a `tokenbal index build` of "
                         "data.train_path (same files, same order)")
    lengths = np.asarray(index_lengths(path, len(dataset)).lengths)
    ps = get_parallel_state()
    k = max(1, global_batch_size // (micro_batch_size * ps.dp_size))
    # VeOmni's train_steps is --train.max_steps when that is smaller than its own count of an epoch
    # (floor(n / dp / dataloader_batch_size), compute_train_steps): a cap on the steps it trains, not
    # a request for bigger batches. Plan the uncapped count, so each step keeps about
    # dataloader_batch_size samples per rank, and let VeOmni stop each epoch early as it does with
    # its native loader (cramming the epoch into max_steps steps would multiply the batch size).
    steps = max(train_steps, len(dataset) // ps.dp_size // dataloader_batch_size)
    size, planned = fitting_batch_size(lengths, steps, ps.dp_size, k, seed)
    # VeOmni's loop and resume arithmetic count exactly `steps` per epoch: a plan one or two steps
    # short gets light steps at its end (epoch_steps; set only then, so a checkpoint of an exact plan
    # keeps its fingerprint)
    sampler = EpochFollowingSampler(lengths, num_replicas=ps.dp_size, rank=ps.dp_rank, global_batch_size=size,
                                    grad_accum=k, seed=seed, verify=False,
                                    epoch_steps=steps if planned < steps else None)
    sampler.framework = "VeOmni"
    if collate_fn is None:
        collate_fn = MainCollator(**(collate_fn_kwargs or {})) if build_collate_fn else NoopDataCollator()

    class TokenBalancedDataLoader(StatefulDataLoader):
        def set_epoch(self, epoch: int) -> None:
            self.batch_sampler.set_epoch(epoch)

    return TokenBalancedDataLoader(
        _MicroBatchItems(dataset), batch_sampler=_Steps(sampler, k),
        collate_fn=_CollateMicroBatches(collate_fn), num_workers=num_workers, pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None)


def main() -> None:
    """``python -m tokenbal.integrations.veomni CONFIG [--key value ...]``: VeOmni 0.1.12's VLM
    trainer (``VLMTrainer(parse_args(VeOmniVLMArguments)).train()``) with the ``"tokenbal"`` entry
    registered."""
    register()
    from veomni.arguments import parse_args
    from veomni.trainer.vlm_trainer import VeOmniVLMArguments, VLMTrainer

    VLMTrainer(parse_args(VeOmniVLMArguments)).train()


if __name__ == "__main__":
    main()
