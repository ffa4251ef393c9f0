"""torchtitan (0.3.0): a ``BaseDataLoader`` that plans every step over the data-parallel ranks.

torchtitan's multimodal loader (``MMDataLoader``) streams its dataset and splits it by node
(``split_dataset_by_node``): each DP rank gets the same number of samples but not of tokens.
:func:`build_dataloader` returns a ``ParallelAwareDataloader`` (torchtitan's ``BaseDataLoader`` on a
torchdata ``StatefulDataLoader``) over a map-style dataset of raw samples, with:

* a :class:`~tokenbal.TokenBalancedBatchSampler` over the DP ranks (``dp_rank`` /
  ``dp_world_size``, as torchtitan passes them), lengths from a tokenbal index of the same samples
  (``tokenbal index build SHARDS --model ... --tokenizer ...``; for webdataset shards the dataset is
  ``tokenbal.data.IndexedShardDataset(index)``, one positional read per member);
* torchtitan's own sample processor (e.g. its cc12m ``_process_cc12_wd_sample``, with the keyword
  arguments ``MMDataLoader`` gives it) run on each sample as it is read, and a collate function of
  your choice: torchtitan's ``MultiModalCollator`` (it pads every batch to ``batch_size`` rows of
  ``seq_len`` tokens: balance then evens the real tokens, not the compute) or tokenbal's packed
  collator (:func:`packed_collate`: one row, ``cu_seqlens``, no padding, so balance is compute);
* torchtitan's state layout (``{"dp_rank_<r>": ..., "world_size": ...}``: per DP rank, a DP-degree
  change refused as torchtitan refuses it), holding the plan's epoch and step; and, as torchtitan's
  training loop never calls ``set_epoch``, ``infinite=True`` (its loaders' default) steps to the
  next epoch's plan when one ends.

Importing this module imports nothing of torchtitan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["build_dataloader", "packed_collate"]


class _Processed:
    """``dataset[i]`` through torchtitan's sample processor; a sample it drops (``None``) raises,
    naming it, since the plan counted it."""

    def __init__(self, dataset: Any, sample_processor: Callable, processor_kwargs: dict) -> None:
        self.dataset, self.sample_processor, self.kwargs = dataset, sample_processor, processor_kwargs

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        out = self.sample_processor(sample=self.dataset[i], **self.kwargs)
        if out is None:
            raise ValueError(f"torchtitan's sample processor dropped sample {i} (it returns None for a "
                             "sample it cannot process); remove it from the index and the dataset")
        return out


def build_dataloader(dataset: Any, lengths: Any, *, dp_rank: int, dp_world_size: int,
                     sample_processor: Callable, processor_kwargs: dict, collate_fn: Callable,
                     global_batch_size: int, seed: int = 0, infinite: bool = True, num_workers: int = 0,
                     **sampler_options: Any) -> Any:
    """torchtitan's ``ParallelAwareDataloader`` over ``dataset`` (map-style, raw samples) with
    tokenbal's plan; ``global_batch_size`` samples per step over the DP ranks (torchtitan's
    ``local_batch_size × dp`` for the same data per step). ``sampler_options`` go to the sampler
    (``cost=``, ``stages=``, ...)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from tokenbal.integrations._resume import EpochFollowingSampler

    sampler = EpochFollowingSampler(lengths, num_replicas=dp_world_size, rank=dp_rank,
                                    global_batch_size=global_batch_size, seed=seed, verify=False,
                                    **sampler_options)
    sampler.framework = "torchtitan"

    class TokenBalancedDataLoader(ParallelAwareDataloader):
        """Epochs of tokenbal's plan; ``state_dict`` per DP rank as torchtitan's loaders."""

        def __iter__(self):
            while True:
                yield from super().__iter__()
                if not infinite:
                    return
                self.batch_sampler.set_epoch(self.batch_sampler.epoch + 1)

        def set_epoch(self, epoch: int) -> None:
            self.batch_sampler.set_epoch(epoch)

    return TokenBalancedDataLoader(_Processed(dataset, sample_processor, processor_kwargs), dp_rank=dp_rank,
                                   dp_world_size=dp_world_size, batch_sampler=sampler, collate_fn=collate_fn,
                                   num_workers=num_workers)


def packed_collate(**collator_options: Any) -> Callable:
    """The alternative to torchtitan's fixed-size padding: a collate function packing a rank's
    processed samples (``input_ids``, ``labels``) into one row with ``cu_seqlens`` (tokenbal's
    ``collate.PackedCollator(rope="1d")``; ``collator_options`` replace its fields), so the balanced
    tokens are the compute. Returns ``(inputs, labels)`` as torchtitan's training step takes them:
    ``inputs`` holds the packed ``input`` row, ``positions``, ``cu_seqlens``, ``max_seqlen`` and the
    samples' images (``pixel_values``, a list, in sample order)."""
    from collate import PackedCollator

    coll = PackedCollator(**{"rope": "1d", **collator_options})

    def collate(samples: list[dict]) -> tuple[dict, Any]:
        batch = coll([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples])
        inputs = {"input": batch["input_ids"], "positions": batch["position_ids"],
                  "cu_seqlens": batch["cu_seqlens"], "max_seqlen": batch["max_seqlen"],
                  "pixel_values": [img for s in samples for img in s.get("pixel_values", [])]}
        return inputs, batch["labels"]

    return collate
