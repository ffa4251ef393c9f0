"""Deprecated old import path of the reader names (removed in tokenbal 0.3.0); import them from
:mod:`tokenbal.data` instead.

The indexed path (read by byte offset from the token index) is :mod:`tokenbal.data.indexed`; the
streaming path for shards without an index is :mod:`tokenbal.data.stream`; tar header parsing is
:mod:`tokenbal.io.tar`.
"""

from __future__ import annotations

import warnings

from tokenbal.data.indexed import IndexedShardDataset, SampleReadError
from tokenbal.data.stream import BalancedBatches, agree_steps, balanced_batches
from tokenbal.io.tar import parse_tar_header

__all__ = [
    "BalancedBatches",
    "IndexedShardDataset",
    "SampleReadError",
    "agree_steps",
    "balanced_batches",
    "parse_tar_header",
]

# stacklevel=2: the warning names the importing line (the import system's own frames are skipped).
warnings.warn("tokenbal.wds is deprecated and will be removed in tokenbal 0.3.0; import its names from "
              "tokenbal.data", DeprecationWarning, stacklevel=2)
