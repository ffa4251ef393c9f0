"""Each reader names the other when given an index of the other source kind (issue 31):
``IndexedParquetDataset`` over tar / annotation samples, ``IndexedShardDataset`` over Parquet rows
(the latter: ``tests/tokenbal/index/test_parquet.py::test_indexed_parquet_dataset_returns_rows``)."""

from __future__ import annotations

import pytest

from tests.helpers.corpus import make_corpus
from tokenbal.data import IndexedParquetDataset, IndexedShardDataset
from tokenbal.data.indexed import SampleReadError
from tokenbal.index import build_index


def test_parquet_reader_over_a_tar_index_names_the_tar_reader(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_shards=1, samples_per_shard=2, bad=False)
    index = build_index(corpus.shards, tmp_path / "idx", progress=False).out
    ds = IndexedParquetDataset(index)
    with pytest.raises(SampleReadError) as info:
        ds[0]
    assert str(info.value) == (f"sample 0 ('{corpus.good[0].key}') comes from {corpus.shards[0]}, not a "
                               "Parquet file: read it with tokenbal.data.IndexedShardDataset")
    with pytest.raises(SampleReadError, match="IndexedShardDataset"):
        ds.__getitems__([1, 0])
    assert IndexedShardDataset(index, decode=None)[0]["__key__"] == corpus.good[0].key   # the right reader
