"""IndexedShardDataset over HTTP: fsspec ranged reads from a real server on loopback (started here)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from tests.helpers.servers import serve  # noqa: E402
from tests.helpers.shards import as_members, build, first_key_batch, tar_members  # noqa: E402
from tokenbal import TokenBalancedBatchSampler  # noqa: E402
from tokenbal.data.indexed import IndexedShardDataset, SampleReadError  # noqa: E402


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    idx, shards = build(root, n_shards=2, samples_per_shard=6, seed=7)
    return idx, shards


def _urls(base, shards):
    return [f"{base}/shards/{os.path.basename(s)}" for s in shards]


def test_http_ranged_reads_equal_local(remote):
    idx, shards = remote
    root = os.path.dirname(os.path.dirname(shards[0]))
    truth = tar_members(shards)
    with serve(root) as (base, httpd):
        ds = IndexedShardDataset(idx, decode=None, shards=_urls(base, shards))
        got = {}
        for i in range(len(ds)):
            s = ds[i]
            assert s["__shard__"].startswith(base)
            got.update(as_members(s))
        n_members = sum(len(idx.members(i)) for i in range(len(idx)))
        ranged = [r for _, r in httpd.requests if r]
    assert got == truth
    # One ranged request per member (header + payload), never a whole shard.
    assert len(ranged) == n_members and all(r.startswith("bytes=") for r in ranged)
    decoded = IndexedShardDataset(idx, decode="pil", shards=_urls(base, shards))
    assert decoded.decode_spec == "pil"


def test_http_with_dataloader_workers(remote):
    idx, shards = remote
    root = os.path.dirname(os.path.dirname(shards[0]))
    with serve(root) as (base, _):
        ds = IndexedShardDataset(idx, decode=None, shards=_urls(base, shards))
        ds[0]   # the parent has used fsspec before the workers fork
        out = {}
        for workers in (0, 2):
            sampler = TokenBalancedBatchSampler(idx, num_replicas=1, rank=0, global_batch_size=4, seed=1)
            loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers,
                                                 collate_fn=first_key_batch, timeout=60 if workers else 0)
            out[workers] = [[(s["__key__"], as_members(s)) for s in b] for b in loader]
    assert out[0] == out[2]
    assert sorted(k for b in out[0] for k, _ in b) == sorted(idx.keys)


def test_http_server_ignoring_range_is_an_error(remote):
    idx, shards = remote
    root = os.path.dirname(os.path.dirname(shards[0]))
    with serve(root, honour_range=False) as (base, _):
        ds = IndexedShardDataset(idx, decode=None, shards=_urls(base, shards))
        with pytest.raises(SampleReadError, match="ignored the byte range"):
            ds[0]


def test_http_missing_and_truncated_shard(remote, tmp_path):
    idx, shards = remote
    (tmp_path / "shards").mkdir()
    # Serve a copy of shard 0 cut in the middle of its last member, and no shard 1 at all.
    cut = tmp_path / "shards" / os.path.basename(shards[0])
    shutil.copy(shards[0], cut)
    last = max(i for i in range(len(idx)) if idx.shard(i) == shards[0])
    m = idx.members(last)[-1]
    os.truncate(cut, m.offset + m.size // 2)
    with serve(str(tmp_path)) as (base, _):
        ds = IndexedShardDataset(idx, decode=None, shards=_urls(base, shards))
        assert as_members(ds[0]) == as_members(IndexedShardDataset(idx, decode=None)[0])
        with pytest.raises(SampleReadError, match="shard truncated") as e:
            ds[last]
        assert idx.keys[last] in str(e.value) and base in str(e.value)
        first_in_1 = next(i for i in range(len(idx)) if idx.shard(i) == shards[1])
        with pytest.raises(SampleReadError, match="shard missing") as e:
            ds[first_in_1]
        assert idx.keys[first_in_1] in str(e.value)


def test_http_shard_cut_before_a_member_is_a_truncated_shard(remote, tmp_path):
    """A member whose bytes start past the end of the served shard: the server answers 416 (Range Not
    Satisfiable), which is the shard cut short, worded as for a local shard (its size included)."""
    idx, shards = remote
    (tmp_path / "shards").mkdir()
    cut = tmp_path / "shards" / os.path.basename(shards[0])
    shutil.copy(shards[0], cut)
    later = [i for i in range(len(idx)) if idx.shard(i) == shards[0]][2]
    os.truncate(cut, idx.members(later)[0].offset - 512)    # right before its first header
    with serve(str(tmp_path)) as (base, _):
        ds = IndexedShardDataset(idx, decode=None, shards=_urls(base, shards))
        assert as_members(ds[0]) == as_members(IndexedShardDataset(idx, decode=None)[0])
        with pytest.raises(SampleReadError, match=rf"shard truncated: {base}/shards/\S+ ends at "
                                                  rf"{os.path.getsize(cut)} bytes") as e:
            ds[later]
        assert idx.keys[later] in str(e.value)


def test_s3_shard_cut_before_a_member_is_a_truncated_shard(remote, monkeypatch):
    """S3 answers a range past the end with InvalidRange (416), which s3fs raises as a bare OSError:
    a truncated shard too, said at once (not retried: the object will not grow back)."""
    from tests.helpers.servers import moto_s3

    idx, shards = remote
    later = [i for i in range(len(idx)) if idx.shard(i) == shards[0]][2]
    with open(shards[0], "rb") as f:
        cut = f.read()[:idx.members(later)[0].offset - 512]      # right before its first header
    with moto_s3(monkeypatch) as (endpoint, client):
        client.put_object(Bucket="corpus", Key="a.tar", Body=cut)
        with open(shards[1], "rb") as f:
            client.put_object(Bucket="corpus", Key="b.tar", Body=f.read())
        ds = IndexedShardDataset(idx, decode=None, shards=["s3://corpus/a.tar", "s3://corpus/b.tar"],
                                 storage_options={"client_kwargs": {"endpoint_url": endpoint}})
        assert as_members(ds[0]) == as_members(IndexedShardDataset(idx, decode=None)[0])
        with pytest.raises(SampleReadError, match=rf"shard truncated: s3://corpus/a\.tar ends at {len(cut)} "
                                                  "bytes") as e:
            ds[later]
        assert idx.keys[later] in str(e.value)
