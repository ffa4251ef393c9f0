"""FSDP2 training pieces shared by ``scripts/train_fsdp2.py`` and ``tokenbal demo``, one concern a file.

``fsdp`` (sharding and the overlap of its collectives), ``memory`` (allocator settings), ``step``
(optimizer and one training step; the loss is :mod:`collate.loss`), ``profiling`` (a rank's own
compute, timed apart from the collectives), ``report`` (per-step records and their summary) and
``builders`` (the demo corpus, tokenizer, tiny models and loaders that scripts and tests build on).
Every name below is importable from ``collate.train`` as before the split.
"""

from __future__ import annotations

from collate.train.fsdp import (
    AsyncReduceScatter,
    FSDPSettings,
    shard_qwen2_vl,
    use_async_reduce_scatter,
    vision_blocks,
)
from collate.train.memory import keep_freed_memory
from collate.train.profiling import (
    calibration_batches,
    profile_stage_costs,
    solo_compute_time,
    solo_stage_times,
    synchronize,
)
from collate.train.report import StepRecord, median_records, summarise
from collate.train.step import make_optimizer, train_step

__all__ = [
    "AsyncReduceScatter",
    "FSDPSettings",
    "StepRecord",
    "calibration_batches",
    "keep_freed_memory",
    "make_optimizer",
    "median_records",
    "profile_stage_costs",
    "shard_qwen2_vl",
    "solo_compute_time",
    "solo_stage_times",
    "summarise",
    "synchronize",
    "train_step",
    "use_async_reduce_scatter",
    "vision_blocks",
]
