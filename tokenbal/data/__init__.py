"""Readers of indexed data other than webdataset tar shards (those are ``tokenbal.wds``):
``IndexedParquetDataset`` returns the row of a Parquet-built index by sample number."""

from __future__ import annotations

from tokenbal.data.parquet import IndexedParquetDataset

__all__ = ["IndexedParquetDataset"]
