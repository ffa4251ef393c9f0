"""The on-disk token index: build it offline from webdataset shards and JSON/JSONL annotation files,
open it (memory-mapped) on every rank, verify it against the shards.

``build_index(sources, out, model=...)`` scans tar shards (headers only: member offsets, image sizes,
text) and annotation files, and writes one folder, reusing the unchanged shards of an earlier build;
``TokenIndex.open(out, expect_model=...)`` reads it (and checks its token rules);
``verify_index(out)`` names stale or missing shards; ``index_stats(out, plot=...)`` summarises it.
Remote sources (fsspec URLs): ``tokenbal.index.remote``; Parquet: ``tokenbal.index.parquet``; builds
in parts and their merge: ``tokenbal.index.merge``; export and joins by key: ``tokenbal.index.export``.
Layout: ``tokenbal.index.store``; sample and damage rules: ``tokenbal.index.scan`` (tar listing fast
path: ``tokenbal.io.tar``); annotations: ``tokenbal.index.annotations``; text rules:
``tokenbal.index.text``; histogram: ``tokenbal.index.plot``.
"""

from __future__ import annotations

from tokenbal.index.annotations import scan_annotations
from tokenbal.index.build import (
    BuildReport,
    IndexBuildError,
    ShardResult,
    build_index,
    index_shard,
    write_index,
)
from tokenbal.index.export import export_index, lengths_for_keys
from tokenbal.index.merge import merge_indexes
from tokenbal.index.parquet import ParquetOptions
from tokenbal.index.plot import plot_token_histogram, token_histogram
from tokenbal.index.scan import ShardScan, scan_shard, shard_fingerprint, split_name
from tokenbal.index.sources import expand_sources
from tokenbal.index.store import (
    IndexDamagedError,
    Member,
    TokenIndex,
    check_index_rules,
    index_stats,
    verify_index,
)
from tokenbal.io.remote import RemoteOptions

__all__ = [
    "BuildReport",
    "IndexBuildError",
    "IndexDamagedError",
    "Member",
    "ParquetOptions",
    "RemoteOptions",
    "ShardResult",
    "ShardScan",
    "TokenIndex",
    "build_index",
    "check_index_rules",
    "expand_sources",
    "export_index",
    "index_shard",
    "index_stats",
    "lengths_for_keys",
    "merge_indexes",
    "plot_token_histogram",
    "scan_annotations",
    "scan_shard",
    "shard_fingerprint",
    "split_name",
    "token_histogram",
    "verify_index",
    "write_index",
]
