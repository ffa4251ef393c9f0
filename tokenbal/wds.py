"""webdataset shards, read two ways: the names of :mod:`tokenbal.data`, at their documented path.

The indexed path (read by byte offset from the token index) is :mod:`tokenbal.data.indexed`; the
streaming path for shards without an index is :mod:`tokenbal.data.stream`; tar header parsing is
:mod:`tokenbal.data.tar`.
"""

from __future__ import annotations

from tokenbal.data.indexed import IndexedShardDataset, SampleReadError
from tokenbal.data.stream import BalancedBatches, agree_steps, balanced_batches
from tokenbal.data.tar import parse_tar_header

__all__ = [
    "BalancedBatches",
    "IndexedShardDataset",
    "SampleReadError",
    "agree_steps",
    "balanced_batches",
    "parse_tar_header",
]
