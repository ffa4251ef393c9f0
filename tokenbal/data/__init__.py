"""Reading the samples an index points at, and streaming shards without one.

``indexed`` is :class:`IndexedShardDataset` (webdataset tar shards by
offset), ``parquet`` is :class:`IndexedParquetDataset` (rows of a Parquet-built index), ``processor``
is :class:`ProcessorDataset` (either one's samples tokenized by a transformers processor) and ``stream``
is :func:`balanced_batches` (a webdataset stage for shards without an index). Names load lazily so
that importing the package does not import torch. Tar headers and byte ranges live in ``tokenbal.io``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "IndexedParquetDataset": "tokenbal.data.parquet",
    "IndexedShardDataset": "tokenbal.data.indexed",
    "ProcessorDataset": "tokenbal.data.processor",
    "load_processor": "tokenbal.data.processor",
    "SampleReadError": "tokenbal.data.indexed",
    "BalancedBatches": "tokenbal.data.stream",
    "agree_steps": "tokenbal.data.stream",
    "balanced_batches": "tokenbal.data.stream",
    "parse_tar_header": "tokenbal.io.tar",
}

if TYPE_CHECKING:
    from tokenbal.data.indexed import IndexedShardDataset, SampleReadError
    from tokenbal.data.parquet import IndexedParquetDataset
    from tokenbal.data.processor import ProcessorDataset, load_processor
    from tokenbal.data.stream import BalancedBatches, agree_steps, balanced_batches
    from tokenbal.io.tar import parse_tar_header

__all__ = ["BalancedBatches", "IndexedParquetDataset", "IndexedShardDataset", "ProcessorDataset",
           "SampleReadError", "agree_steps", "balanced_batches", "load_processor", "parse_tar_header"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenbal.data' has no attribute {name!r}")
