"""IndexedShardDataset over HTTP: fsspec ranged reads from a real server on loopback (started here)."""

from __future__ import annotations

import os
import re
import shutil
import threading
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from tests.test_wds import as_members, build, first_key_batch, tar_members  # noqa: E402
from tokenbal import TokenBalancedBatchSampler  # noqa: E402
from tokenbal.wds import IndexedShardDataset, SampleReadError  # noqa: E402

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single byte-range support (RFC 9110 206 / 416), and a request log."""

    honour_range = True

    def log_message(self, *args):   # keep the test output quiet
        pass

    def do_GET(self):
        self.server.requests.append((self.path, self.headers.get("Range")))
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404, "not found")
            return
        size = os.path.getsize(path)
        rng = self.headers.get("Range")
        m = _RANGE.match(rng) if rng and self.server.honour_range else None
        with open(path, "rb") as f:
            if m is None:
                self.send_response(200)
                start, end = 0, size
            else:
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            f.seek(start)
            body = f.read(end - start)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def serve(root: str, honour_range: bool = True):
    """An HTTP server for ``root`` on 127.0.0.1 (a free port), in a thread; yields its base URL."""
    handler = lambda *a, **kw: RangeHandler(*a, directory=root, **kw)  # noqa: E731
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    httpd.requests = []
    httpd.honour_range = honour_range
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(10)


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
