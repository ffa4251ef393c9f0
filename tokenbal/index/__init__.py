"""The on-disk token index: build it offline from webdataset shards, open it (memory-mapped) on
every rank, verify it against the shards.

``build_index(sources, out, model=...)`` scans tar shards (headers only: member offsets, image sizes,
text) and writes one folder; ``TokenIndex.open(out)`` reads it; ``verify_index(out)`` names stale or
missing shards; ``index_stats(out)`` summarises it. Layout: ``tokenbal.index.store``; sample and
damage rules: ``tokenbal.index.scan``; text rules: ``tokenbal.index.text``.
"""

from __future__ import annotations

from tokenbal.index.build import BuildReport, build_index, index_shard
from tokenbal.index.scan import ShardScan, scan_shard, shard_fingerprint, split_name
from tokenbal.index.sources import expand_sources
from tokenbal.index.store import Member, TokenIndex, index_stats, verify_index

__all__ = [
    "BuildReport",
    "Member",
    "ShardScan",
    "TokenIndex",
    "build_index",
    "expand_sources",
    "index_shard",
    "index_stats",
    "scan_shard",
    "shard_fingerprint",
    "split_name",
    "verify_index",
]
