"""Index shards where they live: tar shards behind any fsspec URL (``s3://``, ``gs://``, ``https://``, ...).

A remote shard is scanned with the same rules as a local one (``tokenbal.index.scan``) and gives the
same index rows, byte for byte, including the fingerprint. What is read:

* ``ranges`` (the default when the store honours byte ranges): the tar header walk, the first bytes of
  each image and the text members, by ranged reads. Every read fetches at least ``chunk`` bytes
  (8 KiB by default), so one request holds a member's header, its image's first KiB and, for small
  members, the next headers too; where the headers lie close together (``read_through``, 256 KiB
  apart on average) the walk reads straight through in windows growing to 4 MiB
  (``io.remote.HeaderWalkReader``), which the sample pass then reads from. After the walk the ranges
  still missing (large text members) are coalesced and fetched ``inflight`` at a time. The walk itself
  is a chain (each header says where the next one is), so the build runs several shards at once per
  worker (``inflight`` threads) to keep requests in flight. Plus the first and last MiB for the
  fingerprint.
* ``whole``: the object is downloaded to a temporary file and scanned locally. Used when the server
  ignores ``Range`` (it answers a ranged read with more bytes than asked), and on request.

Transient errors (timeouts, connection resets, HTTP 408 / 429 / 5xx) are retried with exponential
backoff (``RETRIES`` times); a permanent one (missing object, access denied, other 4xx) ends the
shard with a shard-level error naming the URL, as for a local shard. Every request has a deadline
(``timeout``, 60 s; on fsspec's async stores the request is cancelled) and every read, retries and
back-off included, another (``total_timeout``, 600 s): a store that accepts connections and never
answers ends in a ``RemoteReadError`` naming the URL, not a hang. A shard that failed this way is
recorded as unreadable; the next build rescans it and ``verify`` reports it until then.

The manifest entry of a remote shard also records what the store says about the object: ``etag``
and ``remote_mtime`` where available. ``verify`` (and an incremental build) trusts an unchanged
ETag, else compares size and fingerprint, as for local files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tarfile
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tokenbal.index.imagesize import FIRST_READ, PREFIX_BYTES, tail_bytes
from tokenbal.index.scan import (
    COMPRESSED_MAGIC,
    FINGERPRINT_SPAN,
    HEADERS,
    PROGRESS_BYTES,
    Progress,
    ProgressMarks,
    ShardScan,
    check_tail,
    group_members,
    headers_digest,
    member_kind,
    read_sample,
    run_end,
    scan_shard,
    shard_error,
)
from tokenbal.io.remote import (
    HeaderWalkReader,
    RangesIgnored,
    RemoteFile,
    RemoteFileObject,
    RemoteOptions,
    RemoteReadError,
    filesystem,
    object_info,
    store_call,
    with_retries,
)
from tokenbal.io.tar import header_stamp, walk_members

# The unit of a whole-object download's progress reports (``--remote-read whole``): bytes of the
# object written to the temporary file, before the local scan's own reports.
DOWNLOAD = "download"

__all__ = ["expand_url", "missing_urls", "remote_fingerprint", "remote_problems", "remote_unchanged",
           "scan_remote_shard"]

# Options, retries, filesystems and ranged reads of remote objects live in tokenbal/io/remote.py.


def scan_remote_shard(url: str, opts: RemoteOptions | None = None, prefix: int = PREFIX_BYTES,
                      exif: str = "ignore", progress: Progress | None = None) -> ShardScan:
    """``scan.scan_shard`` for a remote tar shard (see the module docstring); never raises for bad
    data or an unreachable object: those end up in ``.status`` / ``.reason`` and ``.errors``.
    The same checks as a local shard: member stamps (each member's tar header checksum and mtime, so
    the reader catches a member rewritten in place), image end markers, the ``exif`` policy.
    ``progress(done, total, unit)``: the reports ``scan_shard`` makes of the same shard, the same
    calls (the header walk, unit ``HEADERS``, then the samples read, unit ``"B"``); a shard read
    whole reports its download first (unit ``DOWNLOAD``, each ``PROGRESS_BYTES`` written)."""
    opts = opts or RemoteOptions()
    scan = ShardScan(path=url)
    try:
        info = object_info(url, opts)
        scan.size = info["size"]
        scan.extra = {"etag": info["etag"], "remote_mtime": info["remote_mtime"]}
        if opts.mode != "whole":
            try:
                return _scan_ranges(url, scan, opts, prefix, exif, progress)
            except RangesIgnored:
                if opts.mode == "ranges":
                    raise RemoteReadError(f"{url}: the server ignores byte ranges (it sent more bytes than "
                                          "asked); use the 'whole' or 'auto' read mode") from None
                scan = ShardScan(path=url, size=scan.size, extra=scan.extra)
        return _scan_whole(url, scan, opts, prefix, exif, progress)
    except FileNotFoundError as e:
        shard_error(scan, "missing", f"shard not found: {url}: {e}")
    except PermissionError as e:
        shard_error(scan, "unreadable", f"cannot read shard {url}: access denied: {e}")
    except OSError as e:
        shard_error(scan, "unreadable", f"cannot read shard: {e}")
    scan.samples = []
    scan.errors = [e for e in scan.errors if e["key"] is None]
    return scan


def remote_fingerprint(rf: RemoteFile) -> str:
    """``scan.shard_fingerprint`` of a remote object, from two ranged reads."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{rf.size}:".encode())
    spans = [(0, min(rf.size, FINGERPRINT_SPAN))]
    if rf.size > FINGERPRINT_SPAN:
        spans.append((max(FINGERPRINT_SPAN, rf.size - FINGERPRINT_SPAN), rf.size))
    rf.prefetch(spans)
    for s, e in spans:
        h.update(rf.pread(e - s, s))
    return "blake2b:" + h.hexdigest()


def _scan_whole(url: str, scan: ShardScan, opts: RemoteOptions, prefix: int, exif: str,
                progress: Progress | None = None) -> ShardScan:
    fs, path = filesystem(url, opts.storage_options)
    with tempfile.TemporaryDirectory(prefix="tokenbal-shard-") as tmp:
        local = os.path.join(tmp, "shard.tar")
        # One download: no per-request deadline (a large object takes long); the total one holds.
        whole = dataclasses.replace(opts, timeout=None)
        extra = {} if progress is None else {"callback": _download_callback(progress, scan.size)}
        with_retries(store_call(fs, "get_file", path, local, **extra), url, "the whole object", whole)
        if progress is not None:
            progress(scan.size, scan.size, DOWNLOAD)
        got = scan_shard(local, prefix, exif, progress)
    got.path, got.extra, got.mtime_ns = url, scan.extra, 0
    if got.size != scan.size:
        raise RemoteReadError(f"{url}: downloaded {got.size} bytes, the store says {scan.size}; "
                              "the object changed during the scan")
    for e in got.errors:
        e["shard"] = url
        if e["key"] is None and isinstance(e.get("reason"), str):
            e["reason"] = e["reason"].replace(local, url)
    if got.reason:
        got.reason = got.reason.replace(local, url)
    return got


def _download_callback(progress: Progress, size: int):
    """An fsspec callback reporting ``(k * PROGRESS_BYTES, size, DOWNLOAD)`` for each multiple of
    ``PROGRESS_BYTES`` a ``get_file`` has written past: the same reports whatever sizes the transfer
    arrives in, and none twice when a retried download starts again from 0. fsspec is imported here,
    not with this module: it is the remote extra's."""
    from fsspec.callbacks import Callback

    class Downloaded(Callback):
        mark = PROGRESS_BYTES

        def set_size(self, n):
            super().set_size(n)
            self.value = 0            # a new attempt

        def call(self, hook_name=None, **kwargs):
            while self.mark <= self.value and self.mark < size:
                progress(self.mark, size, DOWNLOAD)
                self.mark += PROGRESS_BYTES

    return Downloaded()


def _scan_ranges(url: str, scan: ShardScan, opts: RemoteOptions, prefix: int, exif: str,
                 progress: Progress | None = None) -> ShardScan:
    rf = RemoteFile(url, scan.size, opts)
    if scan.size == 0:
        shard_error(scan, "empty", "shard is an empty (0-byte) file")
        return _finish(scan)
    scan.fingerprint = remote_fingerprint(rf)
    listing = ProgressMarks(progress, scan.size, HEADERS)
    members = _list_members(rf, scan, listing)
    if scan.status == "ok":
        check_tail(rf.pread, scan)
    if scan.status == "ok":
        listing.end()
        scan.headers_digest = headers_digest(members)
        read = ProgressMarks(progress, scan.size, "B")
        # What the sample pass reads is fetched ahead, a stretch of PROGRESS_BYTES of the shard at a
        # time (image heads and whole text members, ``inflight`` requests at once), then read from
        # the cache and reported as a local scan reports it: a multi-GB shard is not silent until
        # its last range arrives.
        for stretch in _stretches(group_members(members, scan)):
            rf.prefetch(_wanted(stretch, prefix))
            for key, run in stretch:
                sample = read_sample(rf, key, run, scan, prefix, exif)
                if sample is not None:
                    scan.samples.append(sample)
                read.at(run_end(run))
        read.end()
    scan.extra = {**scan.extra, "n_requests": rf.requests, "bytes_read": rf.bytes_read}
    return _finish(scan)


def _stretches(runs: list) -> list[list]:
    """The samples cut where ``ProgressMarks`` reports (after the sample whose end is ``PROGRESS_BYTES``
    or more past the last report), so each stretch is fetched, then read and reported."""
    out: list[list] = [[]]
    last = 0
    for key, run in runs:
        out[-1].append((key, run))
        if run_end(run) - last >= PROGRESS_BYTES:
            last = run_end(run)
            out.append([])
    return [s for s in out if s]


def _wanted(runs: list, prefix: int) -> list[tuple[int, int]]:
    """The byte ranges the sample pass reads of these samples: image heads and tails (the end-marker
    check, ``imagesize.tail_bytes``) and whole text members."""
    want = []
    for _, run in runs:
        for ti in run:
            kind = member_kind(ti.name.rsplit("/", 1)[-1].split(".", 1)[-1]) if ti.isfile() else ""
            if kind == "image":
                want.append((ti.offset_data, ti.offset_data + min(ti.size, FIRST_READ, prefix)))
                tail = min(ti.size, tail_bytes(ti.name))
                want.append((ti.offset_data + ti.size - tail, ti.offset_data + ti.size))
            elif kind == "text":
                want.append((ti.offset_data, ti.offset_data + ti.size))
    return want


def _finish(scan: ShardScan) -> ShardScan:
    if scan.status != "ok":
        scan.samples = []
        scan.errors = [e for e in scan.errors if e["key"] is None]
    return scan


def _list_members(rf: RemoteFile, scan: ShardScan, listing: ProgressMarks) -> list:
    magic = rf.pread(6, 0)
    for sig, name in COMPRESSED_MAGIC.items():
        if magic.startswith(sig):
            shard_error(scan, "corrupt", f"shard is {name}-compressed; only uncompressed tar shards can be "
                                          "indexed for random access (decompress it first)")
            return []
    fast = walk_members(HeaderWalkReader(rf), scan.size, listing.at, PROGRESS_BYTES)
    if fast is not None:
        members, scan.end_of_members = fast
    else:
        members = []
        try:
            with tarfile.open(fileobj=RemoteFileObject(rf), mode="r:") as tf:
                try:
                    for ti in tf:
                        members.append(ti)
                        listing.at(ti.offset)
                finally:
                    scan.end_of_members = tf.offset
        except tarfile.TarError as e:
            where = (f"after member #{len(members)} ({members[-1].name!r})" if members
                     else "at the first header")
            status = "truncated" if "unexpected end of data" in str(e) else "corrupt"
            shard_error(scan, status, f"shard is {status}: tarfile cannot read it {where}: {e}")
            return []
        # tarfile's TarInfo.mtime may come from a PAX record; the stamp is the ustar header's own.
        for ti in members:
            ti.chksum, ti.mtime = header_stamp(rf.pread(512, ti.offset_data - 512))
    scan.n_members = len(members)
    if not members:
        shard_error(scan, "empty", "shard is a valid tar with no members")
    return members


# --- sources, staleness -------------------------------------------------------------------------

def expand_url(pattern: str, opts: RemoteOptions) -> list[str]:
    """URLs for one (brace-expanded) remote pattern: a glob is listed (sorted), a literal URL is
    returned as is (checked by ``missing_urls``)."""
    import glob

    if not glob.has_magic(pattern):
        return [pattern]
    fs, path = filesystem(pattern, opts.storage_options)
    fs.invalidate_cache()      # a listing of this process's shared filesystem may be stale (see object_info)
    # A listing pages through the store inside one call (many requests for a large bucket): only the
    # total deadline applies to it.
    found = with_retries(store_call(fs, "glob", path), pattern, "a listing",
                         dataclasses.replace(opts, timeout=None))
    protocol = pattern.split("://", 1)[0]
    urls = [p if "://" in p else f"{protocol}://{p}" for p in found]
    return sorted(urls)


def missing_urls(urls: Sequence[str], opts: RemoteOptions) -> list[str]:
    """The URLs that do not exist, looked up ``inflight`` at a time (a typo must not become a silently
    smaller dataset)."""
    def gone(url: str) -> bool:
        # info (HEAD), not exists(): a transient 503 must be retried, not taken for "missing".
        try:
            object_info(url, opts)
        except FileNotFoundError:
            return True
        return False

    with ThreadPoolExecutor(max(1, min(opts.inflight * 2, len(urls)))) as pool:
        return [u for u, g in zip(urls, pool.map(gone, urls), strict=True) if g]


def remote_unchanged(entry: dict, opts: RemoteOptions) -> bool:
    """True when the object at ``entry["path"]`` is the one the index was built from."""
    return not remote_problems(entry, opts)


def remote_problems(entry: dict, opts: RemoteOptions) -> list[str]:
    """``verify_index``'s lines for one remote shard: missing, unreadable, or changed."""
    url = entry["path"]
    try:
        info = object_info(url, opts)
    except FileNotFoundError:
        return [f"shard missing: {url}"]
    except OSError as e:
        return [f"shard unreadable: {url}: {e}"]
    if entry.get("fingerprint") is None:
        return []
    if info["size"] != entry["size"]:
        return [f"shard changed: {url} (size {entry['size']} -> {info['size']} bytes)"]
    if entry.get("etag") and info["etag"]:
        return [] if info["etag"] == entry["etag"] else [
            f"shard changed: {url} (ETag {entry['etag']} -> {info['etag']})"]
    try:
        fp = remote_fingerprint(RemoteFile(url, info["size"], opts))
    except (OSError, RangesIgnored) as e:
        return [f"shard unreadable: {url}: {e}"]
    if fp != entry["fingerprint"]:
        return [f"shard changed: {url} (same size {info['size']} bytes, different content)"]
    return []
