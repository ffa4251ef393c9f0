"""IndexedShardDataset over HTTP: fsspec ranged reads from a real server on loopback (started here)."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from tests.helpers.servers import RangeHandler, serve  # noqa: E402
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


class _DropsLongTransfers(RangeHandler):
    """A store (or proxy) that drops any response after ``server.cut_after`` bytes of body: the
    connection closes mid-transfer, as a long transfer over a flaky link ends."""

    def do_GET(self):
        m = re.match(r"bytes=(\d+)-(\d+)$", self.headers.get("Range") or "")
        if m is None or int(m.group(2)) + 1 - int(m.group(1)) <= self.server.cut_after:
            return super().do_GET()
        self.server.requests.append((self.path, self.headers.get("Range")))
        start, end = int(m.group(1)), int(m.group(2)) + 1
        with open(self.translate_path(self.path), "rb") as f:
            f.seek(start)
            body = f.read(end - start)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{os.path.getsize(f.name)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:self.server.cut_after])
        self.close_connection = True


def test_a_large_remote_member_is_read_in_pieces_each_retried_on_its_own(tmp_path, monkeypatch):
    """A member read in one request failed whole when that request did (a dropped transfer, or a member
    too large to arrive within the per-request deadline), retried from its first byte every time: a
    link that drops transfers after 1 MiB never delivered a 3 MB member. Reads over ``READ_PIECE``
    bytes are now ranged requests of that size, each retried on its own."""
    import random

    from tests.helpers.corpus import Sample, write_shard
    from tokenbal import TokenIndex
    from tokenbal.index import build_index
    from tokenbal.io import ranged

    rng = random.Random(5)
    big = rng.randbytes(3_000_000)
    shard = write_shard(tmp_path / "big.tar", [Sample("a", caption="small", raw=[("bin", big)]),
                                               Sample("b", caption="next")])
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", progress=False).out)
    assert ranged.READ_PIECE >= 8 << 20      # production: pieces of at least 8 MiB
    monkeypatch.setattr(ranged, "READ_PIECE", 1 << 20)
    with serve(str(tmp_path), handler=_DropsLongTransfers) as (base, httpd):
        httpd.cut_after = 1 << 20
        ds = IndexedShardDataset(idx, decode=None, shards=[f"{base}/big.tar"])
        assert ds[0]["bin"] == big and ds[1]["txt"] == b"next"
        pieces = [r for p, r in httpd.requests if r]
        assert len(pieces) == 3 + 2 and httpd.failed == 0     # 3 pieces of the big member, then 2 small
        # each attempt gets the reader's deadlines; a failed piece is retried, not the member
        httpd.fail_at = {httpd.n + 2}
        assert ds[0]["bin"] == big and httpd.failed == 1


def test_a_store_ignoring_ranges_sends_a_large_member_once_not_once_per_piece(tmp_path, monkeypatch):
    """The pieces of a large member go out together; a store that answers a ranged read with the whole
    object is seen on the first piece alone, not downloaded whole by every piece in flight."""
    from tests.helpers.corpus import Sample, write_shard
    from tokenbal import TokenIndex
    from tokenbal.index import build_index
    from tokenbal.io import ranged

    # the large member first, so that it is the first read
    big = Sample("a", raw=[("bin", bytes(3_000_000)), ("txt", b"small")])
    shard = write_shard(tmp_path / "big.tar", [big])
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", progress=False).out)
    monkeypatch.setattr(ranged, "READ_PIECE", 1 << 20)
    with serve(str(tmp_path), honour_range=False) as (base, httpd):
        ds = IndexedShardDataset(idx, decode=None, shards=[f"{base}/big.tar"])
        with pytest.raises(SampleReadError, match="the server ignored the byte range"):
            ds[0]
        assert len(httpd.requests) == 1, httpd.requests
