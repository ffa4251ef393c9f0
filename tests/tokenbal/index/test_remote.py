"""``tokenbal index build`` / ``verify`` / ``IndexedShardDataset`` on remote shards: a real HTTP server
honouring Range (with injected latency and failing requests) and moto's S3 server, both on loopback."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from tests.helpers.corpus import Sample, write_shard  # noqa: E402
from tests.helpers.servers import FAST, serve  # noqa: E402
from tokenbal.cli import main  # noqa: E402
from tokenbal.data.indexed import IndexedShardDataset  # noqa: E402
from tokenbal.index import RemoteOptions, TokenIndex, build_index, verify_index  # noqa: E402


@pytest.fixture(scope="module")
def local(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "index"
    build_index([os.path.join(corpus.root, "data-*.tar")], out, progress=False)
    return TokenIndex.open(out)


def assert_same_index(a: TokenIndex, b: TokenIndex, rename) -> None:
    """``b`` holds what ``a`` holds, with ``rename(path)`` for every shard path."""
    for col in ("lengths", "vision_tokens", "text_tokens", "shard_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(a, col)), np.asarray(getattr(b, col)), err_msg=col)
    assert list(a.keys) == list(b.keys)
    assert [rename(p) for p in a.shard_paths] == b.shard_paths
    for i in range(len(a)):
        assert [(m.name, rename(m.shard), m.offset, m.size) for m in a.members(i)] == \
            [(m.name, m.shard, m.offset, m.size) for m in b.members(i)]
        assert a.image_sizes(i) == b.image_sizes(i)
        # Each member's tar header checksum and mtime (the reader's rewrite check) as a local scan.
        assert a.member_stamps(i) == b.member_stamps(i)
    renamed = [{**e, "shard": rename(e["shard"]),
                "reason": e["reason"].replace(e["shard"], rename(e["shard"]))} for e in a.errors]
    assert renamed == b.errors
    fields = ("size", "fingerprint", "status", "reason", "n_members", "n_samples", "n_errors",
              "end_of_members", "n_full_reads", "headers_digest")
    for ea, eb in zip(a.manifest["shards"], b.manifest["shards"], strict=True):
        ea = {**ea, "reason": ea["reason"] and ea["reason"].replace(ea["path"], rename(ea["path"]))}
        assert {k: ea[k] for k in fields} == {k: eb[k] for k in fields}


def _http_rename(base, corpus):
    return lambda p: f"{base}/{os.path.relpath(p, corpus.root)}"


def test_http_build_equals_local_with_latency_and_retries(corpus, local, tmp_path):
    # Requests 3 and 7 fail with 503: the build retries them and still gives the local index.
    with serve(corpus.root, latency=0.005, fail_at=(3, 7)) as (base, httpd):
        out = tmp_path / "remote"
        n = len(corpus.shards) - 1
        report = build_index([f"{base}/data-{{000..{n:03d}}}.tar"], out, progress=False, remote=FAST)
        assert httpd.failed == 2
        remote = TokenIndex.open(out)
        assert_same_index(local, remote, _http_rename(base, corpus))
        assert report.num_samples == len(local) and report.num_bad_shards == 1
        # Only headers and image heads were fetched, never whole shards.
        ranged = [r for _, r in httpd.requests if r]
        assert ranged and all(r.startswith("bytes=") for r in ranged)
        ok = [e for e in remote.manifest["shards"] if e["status"] == "ok"]
        assert all(e["n_requests"] > 0 for e in ok)
        assert verify_index(out, remote=FAST) == []
        # IndexedShardDataset reads the same bytes from the URLs the index names (its first
        # request fails, and is retried).
        httpd.fail_at, failed = {httpd.n + 1}, httpd.failed
        ds, ref = IndexedShardDataset(remote, decode=None), IndexedShardDataset(local, decode=None)
        for i in range(len(remote)):
            a, b = ds[i], ref[i]
            assert {k: v for k, v in a.items() if not k.startswith("__")} == \
                {k: v for k, v in b.items() if not k.startswith("__")}
        assert httpd.failed == failed + 1


def test_http_without_ranges_streams_whole_objects(tmp_path):
    # Shards over the fingerprint's 1 MiB, so that a ranged read is smaller than the object.
    rng = random.Random(3)
    samples = [Sample(f"k{i}", images=[("jpg", 64, 48)], raw=[("bin", rng.randbytes(700_000))],
                      caption=f"sample {i}", seed=i) for i in range(4)]
    shard = write_shard(tmp_path / "big.tar", samples)
    build_index([shard], tmp_path / "local", progress=False)
    local = TokenIndex.open(tmp_path / "local")
    with serve(str(tmp_path), honour_range=False) as (base, httpd):
        build_index([f"{base}/big.tar"], tmp_path / "remote", progress=False, remote=FAST)
        assert_same_index(local, TokenIndex.open(tmp_path / "remote"), lambda p: f"{base}/big.tar")
        from tokenbal.index.remote import scan_remote_shard

        scan = scan_remote_shard(f"{base}/big.tar", RemoteOptions(mode="ranges", backoff_s=0.01))
        assert scan.status == "unreadable" and "ignores byte ranges" in scan.reason


@pytest.mark.parametrize("ext", ["mp4", "webm"])
def test_http_video_members_are_probed_over_ranged_reads(tmp_path, ext):
    # A video member of a remote shard is probed through the shard's ranged reads (the header only),
    # as a local one is through its file descriptor: the same frames, sizes and tokens.
    pytest.importorskip("av")
    from tests.helpers.videos import write_video

    samples = []
    for i, (n, w, h) in enumerate([(12, 32, 24), (97, 18, 10)]):
        path = write_video(str(tmp_path / f"v{i}.{ext}"), n, w, h, 24)
        samples.append(Sample(f"k{i}", caption=f"clip {i}", raw=[(ext, open(path, "rb").read())]))
    shard = write_shard(tmp_path / "videos.tar", samples)
    build_index([shard], tmp_path / "local", progress=False, model="qwen2-vl")
    local = TokenIndex.open(tmp_path / "local")
    assert len(local) == 2 and (local.video_tokens > 0).all()
    with serve(str(tmp_path)) as (base, _):
        build_index([f"{base}/videos.tar"], tmp_path / "remote", progress=False, remote=FAST,
                    model="qwen2-vl")
        remote = TokenIndex.open(tmp_path / "remote")
        assert_same_index(local, remote, lambda p: f"{base}/videos.tar")
        assert remote.video_frames.tolist() == local.video_frames.tolist()
        assert remote.video_tokens.tolist() == local.video_tokens.tolist()


def test_an_annotation_file_url_is_refused_as_one_not_as_a_corrupt_tar(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    with serve(str(tmp_path)) as (base, _):
        rc = main(["index", "build", f"{base}/train.jsonl", "--out", str(tmp_path / "idx"), "-q"])
    err = capsys.readouterr().err
    assert rc == 1 and "annotation files (.json / .jsonl) are read from local disk" in err
    assert "tarfile" not in err and "corrupt" not in err


def test_http_permanent_errors_name_the_url(corpus, tmp_path):
    with serve(corpus.root) as (base, _):
        # A missing URL fails before any scan, like a missing local file.
        with pytest.raises(FileNotFoundError, match="nope.tar"):
            build_index([f"{base}/data-000.tar", f"{base}/nope.tar"], tmp_path / "a", progress=False,
                        remote=RemoteOptions(retries=0))
    with serve(corpus.root, deny=("data-001.tar",)) as (base, _):
        report = build_index([f"{base}/data-000.tar", f"{base}/data-001.tar"], tmp_path / "b",
                             progress=False, remote=FAST)
        idx = TokenIndex.open(tmp_path / "b")
        (err,) = [e for e in idx.errors if e["key"] is None]
        assert err["shard"] == f"{base}/data-001.tar" and f"{base}/data-001.tar" in err["reason"]
        assert "403" in err["reason"] and report.num_bad_shards == 1
    # Every request failing (503): retried, then one shard error that says how often it was tried.
    with serve(corpus.root, fail_at=range(1, 10_000)) as (base, httpd):
        from tokenbal.index.remote import scan_remote_shard

        scan = scan_remote_shard(f"{base}/data-000.tar", RemoteOptions(retries=2, backoff_s=0.01))
        assert scan.status == "unreadable" and "after 3 attempts" in scan.reason
        assert f"{base}/data-000.tar" in scan.reason and "503" in scan.reason and httpd.failed >= 3


# --- S3 (moto's server) ----------------------------------------------------------------------------

def test_s3_build_verify_and_read_equal_local(s3, corpus, local, tmp_path):
    endpoint, client = s3
    for p in corpus.shards:
        client.upload_file(p, "corpus", f"shards/{os.path.basename(p)}")
    opts = RemoteOptions(storage_options={"endpoint_url": endpoint}, backoff_s=0.01)
    out = tmp_path / "s3index"
    assert main(["index", "build", "s3://corpus/shards/data-*.tar", "--out", str(out), "-q",
                 "--storage-option", f"endpoint_url={endpoint}", "--inflight", "3",
                 "--max-bad-shards", "1"]) == 0   # the corpus's truncated shard
    remote = TokenIndex.open(out)
    assert_same_index(local, remote, lambda p: f"s3://corpus/shards/{os.path.basename(p)}")
    assert all(e["etag"] for e in remote.manifest["shards"])
    assert verify_index(out, remote=opts) == []
    # Rebuilt in place: every unchanged object (same ETag) is reused, none is read again.
    again = build_index(["s3://corpus/shards/data-*.tar"], out, progress=False, remote=opts)
    assert again.num_reused == len(corpus.shards)
    # Two worker processes, each scanning several shards at once: the same index.
    build_index(["s3://corpus/shards/data-*.tar"], tmp_path / "w2", progress=False, remote=opts,
                workers=2, incremental=False)
    assert_same_index(local, TokenIndex.open(tmp_path / "w2"),
                      lambda p: f"s3://corpus/shards/{os.path.basename(p)}")
    ds = IndexedShardDataset(remote, decode=None, storage_options={"endpoint_url": endpoint})
    ref = IndexedShardDataset(local, decode=None)
    for i in (0, len(remote) // 2, len(remote) - 1):
        assert {k: v for k, v in ds[i].items() if not k.startswith("__")} == \
            {k: v for k, v in ref[i].items() if not k.startswith("__")}
    # Rewrite one object (same size, other bytes) and delete another: verify names both.
    data = bytearray(open(corpus.shards[1], "rb").read())
    data[600] ^= 0xFF
    client.put_object(Bucket="corpus", Key="shards/data-001.tar", Body=bytes(data))
    client.delete_object(Bucket="corpus", Key="shards/data-002.tar")
    problems = verify_index(out, remote=opts)
    assert any("shard changed: s3://corpus/shards/data-001.tar" in p for p in problems)
    assert "shard missing: s3://corpus/shards/data-002.tar" in problems
    rc = main(["index", "verify", str(out), "--storage-option", f"endpoint_url={endpoint}"])
    assert rc == 1


def test_s3_verify_and_rebuild_in_the_build_process_see_objects_changed_since_its_listing(s3, tmp_path):
    # A "dir/*.tar" glob fills s3fs's listing cache (a prefix glob "data-*" does not); the filesystem is
    # shared per process, so a verify or a rebuild there must still ask the store, not that cache.
    endpoint, client = s3
    for i in range(2):
        shard = write_shard(tmp_path / f"s{i}.tar", [Sample(f"k{i}{j}", images=[("jpg", 32, 24)],
                                                            caption=f"sample {j}", seed=j) for j in range(3)])
        client.upload_file(shard, "corpus", f"cached/s{i}.tar")
    opts = RemoteOptions(storage_options={"endpoint_url": endpoint}, backoff_s=0.01)
    out = tmp_path / "idx"
    build_index(["s3://corpus/cached/*.tar"], out, progress=False, remote=opts)
    assert verify_index(out, remote=opts) == []
    data = bytearray(open(tmp_path / "s0.tar", "rb").read())
    data[600] ^= 0xFF                                       # the same size, other bytes
    client.put_object(Bucket="corpus", Key="cached/s0.tar", Body=bytes(data))
    client.delete_object(Bucket="corpus", Key="cached/s1.tar")
    problems = verify_index(out, remote=opts)
    assert any(p.startswith("shard changed: s3://corpus/cached/s0.tar") for p in problems)
    assert "shard missing: s3://corpus/cached/s1.tar" in problems
    again = build_index(["s3://corpus/cached/*.tar"], out, progress=False, remote=opts)
    assert again.num_reused == 0 and len(TokenIndex.open(out)) == 3


def test_retry_rules():
    """Which failures are retried: fsspec reports HTTP failures of info() as FileNotFoundError, and
    only the cause tells a 503 (retried) from a 404 (missing at once)."""
    from aiohttp import ClientResponseError, RequestInfo, ServerDisconnectedError
    from yarl import URL

    from tokenbal.io.remote import RemoteReadError, with_retries

    def failing(errors):
        calls = []

        def fn():
            calls.append(1)
            if len(calls) <= len(errors):
                raise errors[len(calls) - 1]
            return "ok"
        return fn, calls

    def not_found(status):
        info = RequestInfo(URL("http://x/y"), "HEAD", {}, URL("http://x/y"))
        try:
            raise FileNotFoundError("http://x/y") from ClientResponseError(info, (), status=status)
        except FileNotFoundError as e:
            return e

    fn, calls = failing([not_found(503), ServerDisconnectedError()])
    assert with_retries(fn, "http://x/y", "info", FAST) == "ok" and len(calls) == 3
    fn, calls = failing([not_found(404)])
    with pytest.raises(FileNotFoundError):
        with_retries(fn, "http://x/y", "info", FAST)
    assert len(calls) == 1
    fn, calls = failing([not_found(403)])
    with pytest.raises(PermissionError, match="403"):
        with_retries(fn, "http://x/y", "info", FAST)
    fn, calls = failing([TimeoutError("slow")] * 10)
    with pytest.raises(RemoteReadError, match=r"http://x/y: cannot read info \(after 5 attempts\)"):
        with_retries(fn, "http://x/y", "info", FAST)


# --- issue 33: transient failures are not permanent; a stalled store is an error, not a hang --------

MIB = 1 << 20


def _middle_shard(root) -> tuple[str, int]:
    """A shard > 2 MiB whose middle samples' headers lie outside the fingerprint's first / last MiB:
    a failure there comes after the fingerprint was taken. Returns (path, number of samples)."""
    from tests.helpers.corpus import good_sample

    rng = random.Random(7)
    samples = [Sample("a", caption="head", raw=[("bin", b"\0" * (3 * MIB // 2))])]
    samples += [good_sample(f"m{i}", rng, "caption") for i in range(6)]
    samples.append(Sample("z", caption="tail", raw=[("bin", b"\0" * (3 * MIB // 2))]))
    return write_shard(os.path.join(root, "big.tar"), samples), len(samples)


def test_a_shard_that_failed_on_a_passing_store_error_is_rescanned_and_reported(tmp_path):
    import threading

    from tokenbal.cli import main as cli

    path, n = _middle_shard(tmp_path)
    size = os.path.getsize(path)
    down = threading.Event()
    down.set()

    def middle(_, rng):   # 503 for every read that starts past the first MiB and before the last
        return down.is_set() and rng is not None and MIB <= int(rng[6:].split("-")[0]) < size - MIB

    with serve(str(tmp_path), fail_if=middle) as (base, httpd):
        url, out = f"{base}/big.tar", tmp_path / "index"
        first = build_index([url], out, progress=False, remote=FAST)
        (entry,) = TokenIndex.open(out).manifest["shards"]
        # What the issue saw: a fingerprint recorded for a shard whose scan ran out of retries.
        assert entry["status"] == "unreadable" and entry["fingerprint"] is not None
        assert first.num_samples == 0 and first.num_bad_shards == 1 and url in entry["reason"]
        problems = verify_index(out, remote=FAST)
        assert problems == [f"shard failed at build time: {url} (unreadable: {entry['reason']}); none of its "
                            "samples are indexed: rebuild the index to retry it"]
        assert cli(["index", "verify", str(out)]) == 1
        assert cli(["index", "verify", str(out), "--allow-failed"]) == 0
        down.clear()                                      # the store is healthy again
        again = build_index([url], out, progress=False, remote=FAST)
        assert (again.num_reused, again.num_samples, again.num_bad_shards) == (0, n, 0)
        assert verify_index(out, remote=FAST) == []


def _bounded(fn, seconds: float):
    """Run ``fn()`` in a thread; fail the test (instead of hanging it) if it has not ended in time."""
    import threading

    box = []
    t = threading.Thread(target=lambda: box.append(_outcome(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a stalled store hangs it"
    return box[0]


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e


def test_a_store_that_accepts_and_never_answers_ends_in_an_error_naming_the_url(tmp_path):
    from tests.helpers.servers import stalled_server
    from tokenbal.io.remote import RemoteReadError

    opts = RemoteOptions(timeout=0.5, total_timeout=3, retries=1, backoff_s=0.01)
    with stalled_server() as (base, _):
        url = f"{base}/data-000.tar"
        got = _bounded(lambda: build_index([url], tmp_path / "i", progress=False, remote=opts), 60)
        assert isinstance(got, RemoteReadError), got
        assert url in str(got) and "no answer within 0.5 s" in str(got)
        # The reader's requests have the same deadlines (RemoteOptions' defaults there).
        from tokenbal.io import remote as rm
        from tokenbal.io.ranged import ShardReaders

        slow = rm.RemoteOptions(timeout=0.5, total_timeout=2, retries=0)
        fs = ShardReaders(1, None)._handle(url)[1]
        call = rm.store_call(fs, "cat_file", url, start=0, end=10)
        got = _bounded(lambda: rm.with_retries(call, url, "bytes 0..10", slow), 30)
        assert isinstance(got, RemoteReadError) and url in str(got)


@pytest.mark.slow   # a CLI process; the in-process test above covers the deadlines in the fast suite
def test_cli_build_against_a_store_that_stalls_reads_ends_naming_the_url(tmp_path):
    import subprocess
    import sys

    from tests.helpers import paths
    from tests.helpers.servers import stalled_server

    env = {**os.environ, "PYTHONPATH": str(paths.REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with stalled_server(answer_head=True) as (base, _):   # HEAD answers (4 MiB), every GET hangs
        url, out = f"{base}/data-000.tar", tmp_path / "i"
        run = subprocess.run([sys.executable, "-m", "tokenbal.cli", "index", "build", url, "--out", str(out),
                              "-q", "--timeout", "0.5", "--total-timeout", "4"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, run.stderr[-2000:]
        assert "0/1 shards" in run.stdout and "1 bad shards" in run.stdout
        (entry,) = TokenIndex.open(out).manifest["shards"]
        assert entry["status"] == "unreadable" and url in entry["reason"]
        assert "no answer within" in entry["reason"]
    with stalled_server() as (base, _):                    # nothing answers: the source check fails
        url = f"{base}/data-000.tar"
        run = subprocess.run([sys.executable, "-m", "tokenbal.cli", "index", "build", url, "--out",
                              str(tmp_path / "j"), "-q", "--timeout", "0.5", "--total-timeout", "4"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and "Traceback" not in run.stderr
        assert f"tokenbal index build: error: {url}: cannot read object info" in run.stderr


@pytest.mark.parametrize("mode", ["ranges", "whole"])
def test_a_remote_tar_shard_reports_what_a_local_scan_of_it_reports(tmp_path, mode):
    """A remote shard was one silent step of the shard bar however large (its header walk a chain of
    requests, then one prefetch of every range): it now makes the local scan's reports of the same
    shard, the header walk then the bytes read, with its ranges fetched a stretch at a time."""
    from tests.tokenbal.index.test_build import big_tar_shard
    from tokenbal.index.remote import DOWNLOAD, scan_remote_shard
    from tokenbal.index.scan import HEADERS, PROGRESS_BYTES, scan_shard

    shard, _, _ = big_tar_shard(tmp_path)
    size = os.path.getsize(shard)
    local = []
    want = scan_shard(shard, progress=lambda *r: local.append(r))
    assert len([r for r in local if r[2] == HEADERS]) == len([r for r in local if r[2] == "B"]) == 3
    opts = RemoteOptions(backoff_s=0.01, mode=mode)
    with serve(str(tmp_path)) as (base, httpd):
        url = f"{base}/big.tar"
        reports = []
        got = scan_remote_shard(url, opts, progress=lambda *r: reports.append(r))
        downloaded = [r for r in reports if r[2] == DOWNLOAD]
        assert [r for r in reports if r[2] != DOWNLOAD] == local
        if mode == "whole":
            # the download first (an 11.5 MB object sat silent until it was whole): each 4 MiB written,
            # whatever sizes the transfer arrived in, then its end; then the local scan's reports
            marks = range(PROGRESS_BYTES, size, PROGRESS_BYTES)
            assert downloaded == [(m, size, DOWNLOAD) for m in marks] + [(size, size, DOWNLOAD)]
            assert reports[:len(downloaded)] == downloaded
        else:
            assert downloaded == []
        assert [(s.key, s.members, s.image_sizes, s.text) for s in got.samples] == \
            [(s.key, s.members, s.image_sizes, s.text) for s in want.samples]
        if mode == "ranges":
            # Ranged reads only; a stretch at a time costs at most a request per stretch more than
            # one prefetch of every range did (2,043 requests at the base commit, on this shard).
            assert all(r.startswith("bytes=") for _, r in httpd.requests)
            assert got.extra["n_requests"] <= 2043 + size // PROGRESS_BYTES + 1
        seen = []
        build_index([url], tmp_path / f"idx-{mode}", remote=opts, progress=lambda *r: seen.append(r))
        assert [r[1:] for r in seen if r[3] in (DOWNLOAD, HEADERS, "B")] == reports


def test_a_remote_sample_pass_reads_from_what_was_prefetched(tmp_path):
    """The ranges prefetched for the sample pass (coalesced, ``inflight`` at once) were found only by
    the 8 segments fetched last before a read: a long prefetched segment hid behind the header walk's
    small ones, so nearly every sample was fetched again, one request at a time (1,000 more sequential
    requests for 2,500 samples). The sample pass now makes only its stretches' prefetch requests."""
    from tests.tokenbal.index.test_build import big_tar_shard
    from tokenbal.index.remote import scan_remote_shard
    from tokenbal.index.scan import HEADERS, PROGRESS_BYTES

    shard, _, _ = big_tar_shard(tmp_path)
    size = os.path.getsize(shard)
    with serve(str(tmp_path)) as (base, httpd):
        listed = []
        scan = scan_remote_shard(f"{base}/big.tar", FAST, progress=lambda done, total, unit: listed.append(
            httpd.n) if (unit, done) == (HEADERS, total) else None)
        assert len(scan.samples) == 2500 and not scan.errors and len(listed) == 1
        stretches = size // PROGRESS_BYTES + 1
        # At most two coalesced requests per stretch (one per prefetch, split where the walk cached).
        assert httpd.n - listed[0] <= 2 * stretches, (httpd.n - listed[0], scan.extra)


def _local_samples(shard):
    from tokenbal.index.scan import scan_shard

    return [(s.key, s.members, s.image_sizes, s.text) for s in scan_shard(shard).samples]


def test_a_remote_header_walk_reads_small_members_through_in_growing_windows(tmp_path, monkeypatch):
    """A tar has no table of contents, so the walk was a chain of one 8 KiB read per header or two:
    1,029 sequential requests (19.9 MB) for an 11.5 MB shard of 2,500 ~4.6 KB samples. Where the
    headers lie close together the walk now reads straight through in windows that double, and the
    sample pass finds the captions and image heads in them. Past the walk's keep budget the windows
    are read and dropped (memory stays bounded), and the sample pass fetches what it needs again."""
    import tokenbal.io.remote as io_remote
    from tests.tokenbal.index.test_build import big_tar_shard
    from tokenbal.index.remote import scan_remote_shard

    shard, _, _ = big_tar_shard(tmp_path)
    size = os.path.getsize(shard)
    want = _local_samples(shard)
    seen = {}
    per_header = RemoteOptions(backoff_s=0.01, read_through=0)
    with serve(str(tmp_path)) as (base, httpd):
        for name, opts, keep in [("through", FAST, io_remote.WALK_KEEP), ("kept 2 MiB", FAST, 2 << 20),
                                 ("per header", per_header, io_remote.WALK_KEEP)]:
            monkeypatch.setattr(io_remote, "WALK_KEEP", keep)
            scan = scan_remote_shard(f"{base}/big.tar", opts)
            assert not scan.errors
            assert [(s.key, s.members, s.image_sizes, s.text) for s in scan.samples] == want
            seen[name] = (scan.extra["n_requests"], scan.extra["bytes_read"])
    requests, read = seen["through"]
    # the fingerprint's 2 spans, ~10 doubling windows (8 KiB .. 4 MiB), a few sample-pass pieces
    assert requests <= 20 and read <= 1.15 * size, seen
    # a 2 MiB keep budget: the walk the same, the sample pass fetches most of the shard's bytes again
    assert seen["kept 2 MiB"][0] <= 30 and seen["kept 2 MiB"][1] > 1.5 * size, seen
    assert seen["per header"][0] > 1000, seen


def test_a_remote_header_walk_skips_the_data_of_large_members(tmp_path):
    """Members far apart (here 600 KB each) keep one ``chunk`` read per header: reading through them
    would cost the shard's bytes."""
    from tokenbal.index.remote import scan_remote_shard

    rng = random.Random(0)
    samples = [Sample(key=f"{i:04d}", caption="a photo of a cat", raw=[("bin", rng.randbytes(600_000))])
               for i in range(24)]
    shard = write_shard(tmp_path / "large.tar", samples)
    size = os.path.getsize(shard)
    with serve(str(tmp_path)) as (base, httpd):
        scan = scan_remote_shard(f"{base}/large.tar", FAST)
    assert not scan.errors and [(s.key, s.members, s.image_sizes, s.text) for s in scan.samples] == \
        _local_samples(shard)
    # the fingerprint's first and last MiB, then 8 KiB reads at the headers past them
    assert scan.extra["bytes_read"] < (2 << 20) + 48 * FAST.chunk < 0.25 * size, scan.extra


def test_cli_read_through_sets_how_the_header_walk_reads(tmp_path):
    """``index build --read-through BYTES`` reaches the walk: 0 keeps one request per header missed."""
    from tests.tokenbal.index.test_build import big_tar_shard

    big_tar_shard(tmp_path, n=600)
    counts = {}
    with serve(str(tmp_path)) as (base, httpd):
        for value in ("0", "262144"):
            n0 = httpd.n
            assert main(["index", "build", f"{base}/big.tar", "--out", str(tmp_path / f"i{value}"), "-q",
                         "--remote-read", "ranges", "--read-through", value]) == 0
            counts[value] = httpd.n - n0
    assert counts["0"] > 5 * counts["262144"], counts
    a, b = TokenIndex.open(tmp_path / "i0"), TokenIndex.open(tmp_path / "i262144")
    assert list(a.keys) == list(b.keys) and np.array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
