"""balanced_batches: the streaming stage for shards without an index (single process)."""

from __future__ import annotations

import itertools
import json
import re
import tarfile

import pytest
import torch
import webdataset as wds

from tests.helpers.corpus import make_corpus
from tokenbal.data.stream import agree_steps, balanced_batches


def _samples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = (torch.rand(n, generator=g) ** 3 * 900 + 10).long().tolist()   # heavy-tailed, 10..910
    return [{"__key__": f"k{i:05d}", "n": n_} for i, n_ in enumerate(lens)]


def _n(s):
    return s["n"]


def test_every_sample_once_within_budget():
    data = _samples(500)
    batches = list(balanced_batches(1000, _n, bufsize=64, seed=1)(iter(data)))
    keys = [s["__key__"] for b in batches for s in b]
    assert sorted(keys) == [s["__key__"] for s in data]          # each sample exactly once
    sums = [sum(s["n"] for s in b) for b in batches]
    assert max(sums) <= 1000
    # Best fit from the buffer fills the budget: every batch but the last few (the drained buffer)
    # is close to full.
    assert sum(sums[:-5]) / (1000 * len(sums[:-5])) > 0.95
    assert keys != [s["__key__"] for s in data]                  # shuffled, not arrival order


def test_deterministic_per_seed_epoch_rank():
    data = _samples(200)

    def run(**kw):
        return [[s["__key__"] for s in b] for b in balanced_batches(1000, _n, bufsize=32, **kw)(iter(data))]

    assert run(seed=3, epoch=1, rank=0) == run(seed=3, epoch=1, rank=0)
    assert run(seed=3, epoch=1, rank=0) != run(seed=3, epoch=2, rank=0)
    assert run(seed=3, epoch=1, rank=0) != run(seed=3, epoch=1, rank=1)


def test_over_budget_sample_names_its_key():
    data = _samples(20) + [{"__key__": "huge", "__url__": "shard-7.tar", "n": 5000}]
    with pytest.raises(ValueError, match=r"'huge' from 'shard-7.tar' has 5000 tokens"):
        list(balanced_batches(1000, _n)(iter(data)))


@pytest.mark.parametrize("sample, tokens, says", [
    # a tuple (after wds.to_tuple) has no key: its place in the stream is named, not an AttributeError
    (("img", "caption"), 5000,
     r"sample #20 of this stream \(a tuple: \('img', 'caption'\)\) has 5000 tokens"),
    ({"__key__": "neg", "__url__": "s.tar"}, -3, r"'neg' from 's.tar': length_fn returned -3 tokens"),
    # floored to 10 it would fit a budget of 10 that 10.9 exceeds
    ({"__key__": "frac", "__url__": "s.tar"}, 10.9, r"'frac' from 's.tar': length_fn returned 10.9, not"),
    ({"__key__": "text", "__url__": "s.tar"}, "12", r"'text' from 's.tar': length_fn returned '12', not"),
])
def test_a_bad_token_count_names_the_sample(sample, tokens, says):
    data = [("x", 1)] * 20 + [sample]

    def length(s):
        return tokens if s is sample else 1

    with pytest.raises(ValueError, match=says):
        list(balanced_batches(10, length, bufsize=4)(iter(data)))


def test_whole_numbers_of_any_integer_type_are_token_counts():
    import numpy as np

    counts = [np.int64(3), torch.tensor(4), 5.0, True + 1, torch.tensor(6.0), np.float32(2.0)]
    data = [{"__key__": str(j), "n": n} for j, n in enumerate(counts)]
    batches = list(balanced_batches(20, _n, seed=0, rank=0)(iter(data)))
    assert sorted(s["__key__"] for b in batches for s in b) == ["0", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("kwargs, says", [
    ({"steps": -3}, "steps must be an integer >= 0, got -3"),
    ({"steps": 2.5}, "steps must be an integer >= 0, got 2.5"),
    ({"steps": True}, "steps must be an integer >= 0, got True"),
    ({"max_tokens": "50"}, "max_tokens must be a positive integer, got '50'"),
    ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ({"bufsize": 0}, "bufsize must be a positive integer, got 0"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"rank": 1.0}, "rank must be an integer >= 0, got 1.0"),
    ({"length_fn": "n"}, "length_fn must be callable"),
    ({"collation_fn": "stack"}, "collation_fn must be callable (list of samples -> batch) or None, got str"),
])
def test_bad_settings_are_refused_when_the_stage_is_built(kwargs, says):
    # Not at the first batch, often inside a DataLoader worker; never a silent 0 or 3 batches.
    args = {"max_tokens": 50, "length_fn": _n, "steps": 2, **kwargs}
    with pytest.raises(ValueError, match=re.escape(says)):
        balanced_batches(**args)


def test_fixed_steps_stop_exactly_and_dry_source_is_an_error():
    data = _samples(300)
    stage = balanced_batches(1000, _n, steps=10, bufsize=16, rank=0)
    assert len(list(stage(itertools.cycle(data)))) == 10
    with pytest.raises(RuntimeError, match=r"rank 0 worker 0/1 ran out of samples after \d+ of its 10000"):
        list(balanced_batches(1000, _n, steps=10_000, rank=0)(iter(data)))
    assert agree_steps(17) == 17      # no process group: the local count


class _Repeating(torch.utils.data.IterableDataset):
    def __init__(self, data, stage):
        self.data, self.stage = data, stage

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = 0 if info is None else info.id
        data = self.data[wid::2]               # each worker its own part, repeated
        return self.stage(itertools.cycle(data))


@pytest.mark.parametrize("workers", [0, 2])
def test_steps_split_over_dataloader_workers(workers):
    stage = balanced_batches(1000, _n, steps=7, bufsize=16, rank=0, collation_fn=len)
    loader = torch.utils.data.DataLoader(_Repeating(_samples(100), stage), batch_size=None,
                                         num_workers=workers, timeout=60 if workers else 0)
    assert len(list(loader)) == 7          # 4 + 3 with two workers, still 7 for the rank


def test_in_a_webdataset_pipeline_over_real_shards(tmp_path):
    corpus = make_corpus(tmp_path, n_shards=3, samples_per_shard=6, bad=False)
    truth = []
    for path in corpus.shards:
        with tarfile.open(path) as tf:
            truth += sorted({ti.name.split(".", 1)[0] for ti in tf})

    def tokens(sample):   # a stand-in token count: payload bytes / 64
        return sum(len(v) for k, v in sample.items() if not k.startswith("__")) // 64 + 1

    budget = 4 * max(tokens(s) for s in wds.DataPipeline(wds.SimpleShardList(corpus.shards),
                                                         wds.tarfile_to_samples()))
    pipe = wds.DataPipeline(wds.SimpleShardList(corpus.shards), wds.tarfile_to_samples(),
                            balanced_batches(budget, tokens, bufsize=8, seed=0, rank=0))
    batches = list(pipe)
    assert sorted(s["__key__"] for b in batches for s in b) == sorted(truth)
    assert all(sum(tokens(s) for s in b) <= budget for b in batches)
    assert all(isinstance(s["txt"], bytes) for b in batches for s in b if "txt" in s)


def caption_tokens(sample):
    """Tokens from the sample's caption field (module level: DataLoader workers may pickle it)."""
    return len(json.loads(sample["json"])["caption"].split())


def test_a_sample_missing_the_field_length_fn_reads_is_named(tmp_path):
    """A sample without the member ``length_fn`` reads (a shard written with one field missing) ended a
    DataLoader worker with a bare ``KeyError: 'json'``, no sample or shard named."""
    from tests.helpers.corpus import Sample, write_shard

    samples = [Sample(f"k{i}", caption="alt", raw=[("json", json.dumps({"caption": f"number {i}"}).encode())])
               for i in range(6)]
    shard = write_shard(tmp_path / "d.tar", samples)
    with tarfile.open(shard) as src, tarfile.open(tmp_path / "holed.tar", "w") as dst:
        for ti in src:           # k3 keeps its .txt and loses its .json
            if ti.name != "k3.json":
                dst.addfile(ti, src.extractfile(ti))
    pipe = wds.DataPipeline(wds.SimpleShardList([str(tmp_path / "holed.tar")]), wds.tarfile_to_samples(),
                            balanced_batches(100, caption_tokens, bufsize=2, rank=0))
    loader = torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=1, timeout=60)
    says = r"sample 'k3' from '.*holed.tar': length_fn raised KeyError: 'json'"
    with pytest.raises(ValueError, match=says):
        list(loader)
