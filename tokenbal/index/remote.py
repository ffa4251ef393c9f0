"""Index shards where they live: tar shards behind any fsspec URL (``s3://``, ``gs://``, ``https://``, ...).

A remote shard is scanned with the same rules as a local one (``tokenbal.index.scan``) and gives the
same index rows, byte for byte, including the fingerprint. What is read:

* ``ranges`` (the default when the store honours byte ranges): the tar header walk, the first bytes of
  each image and the text members, by ranged reads. Every read fetches at least ``chunk`` bytes
  (8 KiB by default), so one request holds a member's header, its image's first KiB and, for small
  members, the next headers too; after the walk the ranges still missing (large text members) are
  coalesced and fetched ``inflight`` at a time. The walk itself is a chain (each header says where
  the next one is), so the build runs several shards at once per worker (``inflight`` threads) to
  keep requests in flight. Plus the first and last MiB for the fingerprint.
* ``whole``: the object is downloaded to a temporary file and scanned locally. Used when the server
  ignores ``Range`` (it answers a ranged read with more bytes than asked), and on request; better for
  small members on a high-bandwidth link, where the ranged walk costs one round trip per member.

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

import bisect
import dataclasses
import hashlib
import inspect
import os
import random
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tokenbal._extras import MissingExtraError
from tokenbal.data.tar import header_stamp, walk_members
from tokenbal.index.imagesize import FIRST_READ, PREFIX_BYTES, tail_bytes
from tokenbal.index.scan import (
    _COMPRESSED_MAGIC,
    FINGERPRINT_SPAN,
    ShardScan,
    _group,
    _read_sample,
    _shard_error,
    check_tail,
    headers_digest,
    member_kind,
    scan_shard,
)

CHUNK = 8 * 1024
INFLIGHT = 8
RETRIES = 4
BACKOFF_S = 0.2
TIMEOUT_S = 60.0         # one request
TOTAL_TIMEOUT_S = 600.0  # one read, retries and back-off included
READ_MODES = ("auto", "ranges", "whole")


def is_url(path: str) -> bool:
    """A remote source: ``scheme://...`` other than ``file://``."""
    return "://" in path and not path.startswith("file://")


@dataclass
class RemoteOptions:
    """How remote sources are read; the build passes one to every worker."""
    storage_options: dict = field(default_factory=dict)   # fsspec.filesystem(...) keyword arguments
    mode: str = "auto"           # auto | ranges | whole
    chunk: int = CHUNK
    inflight: int = INFLIGHT
    retries: int = RETRIES
    backoff_s: float = BACKOFF_S
    timeout: float | None = TIMEOUT_S               # seconds per request; None: no limit
    total_timeout: float | None = TOTAL_TIMEOUT_S   # seconds per read, retries included; None: no limit

    def __post_init__(self) -> None:
        if self.mode not in READ_MODES:
            raise ValueError(f"remote read mode must be one of {READ_MODES}, got {self.mode!r}")
        if self.chunk < 1024 or self.inflight < 1 or self.retries < 0:
            raise ValueError(f"bad remote options: chunk={self.chunk} (>= 1024), inflight={self.inflight} "
                             f"(>= 1), retries={self.retries} (>= 0)")
        for name in ("timeout", "total_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"bad remote options: {name}={value} (> 0 seconds, or None for no limit)")


class RemoteReadError(OSError):
    """A read of a remote object failed for good; the message names the URL."""


class _NoRanges(Exception):
    """The server answered a ranged read with the whole object."""


_FS_LOCK = threading.Lock()
_FS: dict[tuple, Any] = {}


def filesystem(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``url``; filesystems are shared per process."""
    from tokenbal._extras import fsspec_filesystem

    protocol = url.split("://", 1)[0]
    opts = dict(storage_options or {})
    key = (os.getpid(), protocol, repr(sorted(opts.items())))
    with _FS_LOCK:
        fs = _FS.get(key)
        if fs is None:
            fs = _FS[key] = fsspec_filesystem(protocol, **opts)
    return fs, fs._strip_protocol(url) if protocol not in ("http", "https") else url


def _permanent(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotImplementedError,
                      ValueError, TypeError, _NoRanges)):
        return True
    status = getattr(e, "status", None) or getattr(e, "code", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return True
    return False


def _transient_cause(cause: BaseException | None) -> bool:
    """Whether the error behind a FileNotFoundError was a passing one (a 5xx, a timeout, a reset):
    only then is the object retried rather than reported missing."""
    if cause is None:
        return False
    status = getattr(cause, "status", None)
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    if isinstance(cause, OSError):   # aiohttp's connection errors are OSErrors too
        return not isinstance(cause, (FileNotFoundError, PermissionError, IsADirectoryError))
    return type(cause).__name__ in ("ClientConnectionError", "ClientOSError", "ServerDisconnectedError",
                                 "ClientPayloadError", "ServerTimeoutError")


class store_call:   # noqa: N801 - used like a function: store_call(fs, "cat_file", path, start=0, end=9)
    """``fs.<method>(*args, **kwargs)`` as ``with_retries`` runs it: given each attempt's deadline.
    On fsspec's async filesystems (HTTP, S3, GCS, ...) the deadline goes to fsspec's ``sync``, which
    cancels the request when it passes; on others the call runs in a thread that is abandoned."""

    def __init__(self, fs: Any, method: str, *args: Any, **kwargs: Any) -> None:
        self.fs, self.method, self.args, self.kwargs = fs, method, args, kwargs

    def __call__(self, timeout: float | None = None) -> Any:
        fn = getattr(self.fs, self.method)
        if timeout is None:
            return fn(*self.args, **self.kwargs)
        # fsspec mirrors an async store's coroutine ``_<method>`` as a sync wrapper whose ``timeout``
        # keyword is fsspec.asyn.sync's (a cancelling wait_for); only then is it passed down.
        if inspect.iscoroutinefunction(getattr(fn, "__wrapped__", None)):
            try:
                return fn(*self.args, timeout=timeout, **self.kwargs)
            except TimeoutError as e:   # fsspec's FSTimeoutError: say how long was waited
                raise TimeoutError(f"no answer within {timeout:g} s") from e
        return _call_with_deadline(lambda: fn(*self.args, **self.kwargs), timeout)


def _call_with_deadline(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread; ``TimeoutError`` if it has not returned after ``timeout`` seconds
    (the thread is left to finish on its own: a blocking call cannot be interrupted from outside)."""
    box: list = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))
        done.set()

    threading.Thread(target=run, daemon=True, name="tokenbal-remote-call").start()
    if not done.wait(timeout):
        raise TimeoutError(f"no answer within {timeout:g} s")
    ok, value = box[0]
    if ok:
        return value
    raise value


def with_retries(fn: Callable[..., Any], url: str, what: str, opts: RemoteOptions) -> Any:
    """``fn()``, retried on transient errors with exponential backoff (jittered). A missing object
    stays a ``FileNotFoundError`` and a denied one a ``PermissionError``; every other final failure
    is a ``RemoteReadError`` naming ``url``, what was read and how many attempts were made.

    Deadlines: each attempt gets ``opts.timeout`` seconds (a ``store_call`` is handed it; any other
    ``fn`` runs in a thread that is waited for that long), and all attempts together, back-off
    included, ``opts.total_timeout``; an attempt past its deadline is a transient error."""
    deadline = None if opts.total_timeout is None else time.monotonic() + opts.total_timeout
    for attempt in range(opts.retries + 1):
        limit = opts.timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteReadError(f"{url}: cannot read {what}: no answer within the total timeout of "
                                      f"{opts.total_timeout:g} s ({attempt} attempts)")
            limit = left if limit is None else min(limit, left)
        try:
            if isinstance(fn, store_call):
                return fn(limit)
            return fn() if limit is None else _call_with_deadline(fn, limit)
        except (_NoRanges, MissingExtraError):
            raise
        except Exception as e:
            # fsspec's HTTP info() reports any failure as FileNotFoundError; its cause says which.
            cause = e.__cause__ if isinstance(e, FileNotFoundError) and e.__cause__ is not None else None
            status = getattr(cause, "status", None)
            if status in (401, 403):
                raise PermissionError(f"{url}: access denied (HTTP {status})") from e
            if isinstance(e, (FileNotFoundError, PermissionError)) and not _transient_cause(cause):
                raise
            if (cause is None and _permanent(e)) or attempt == opts.retries:
                tries = f" (after {attempt + 1} attempts)" if attempt else ""
                shown = cause if cause is not None else e
                raise RemoteReadError(f"{url}: cannot read {what}{tries}: {type(shown).__name__}: "
                                      f"{shown}") from e
            pause = opts.backoff_s * (2 ** attempt) * (1 + 0.25 * random.random())
            if deadline is not None:
                pause = max(0.0, min(pause, deadline - time.monotonic()))
            time.sleep(pause)
    raise AssertionError("unreachable")


def object_info(url: str, opts: RemoteOptions) -> dict:
    """Size and identity of a remote object: ``{"size", "etag", "remote_mtime"}`` (None when the store
    does not say)."""
    fs, path = filesystem(url, opts.storage_options)
    info = with_retries(store_call(fs, "info", path), url, "object info", opts)
    if info.get("size") is None:
        raise RemoteReadError(f"{url}: the server does not report the object's size")
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    mtime = info.get("LastModified") or info.get("Last-Modified") or info.get("mtime") or info.get("updated")
    return {"size": int(info["size"]), "etag": None if etag is None else str(etag).strip('"'),
            "remote_mtime": None if mtime is None else str(mtime)}


class RemoteFile:
    """Ranged reads of one object with a cache of the fetched segments (kept for one shard scan).

    ``pread(n, offset)`` serves from the cache, else fetches ``[offset, offset + max(n, chunk))``;
    ``prefetch(ranges)`` fetches many ranges at once, coalesced, ``inflight`` requests at a time.
    """

    def __init__(self, url: str, size: int, opts: RemoteOptions) -> None:
        self.url, self.size, self.opts = url, size, opts
        self.fs, self.path = filesystem(url, opts.storage_options)
        self._starts: list[int] = []
        self._segs: list[bytes] = []
        self.requests = 0
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _fetch(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if end <= start:
            return b""
        data = with_retries(store_call(self.fs, "cat_file", self.path, start=start, end=end), self.url,
                            f"bytes {start}..{end}", self.opts)
        with self._lock:
            self.requests += 1
            self.bytes_read += len(data)
        if len(data) > end - start:
            raise _NoRanges
        if len(data) < end - start:
            raise RemoteReadError(f"{self.url}: asked for bytes {start}..{end} of a {self.size}-byte object "
                                  f"and got {len(data)}; the object changed or was cut short during the scan")
        return data

    def _add(self, start: int, data: bytes) -> None:
        with self._lock:
            j = bisect.bisect_left(self._starts, start)
            self._starts.insert(j, start)
            self._segs.insert(j, data)

    def _cached(self, n: int, offset: int) -> bytes | None:
        # Segments are few per shard; look at those starting at or before offset, latest first.
        j = bisect.bisect_right(self._starts, offset)
        for k in range(j - 1, max(-1, j - 9), -1):
            s, seg = self._starts[k], self._segs[k]
            if offset + n <= s + len(seg):
                return seg[offset - s:offset - s + n]
        return None

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the object)."""
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        got = self._cached(n, offset)
        if got is not None:
            return got
        data = self._fetch(offset, offset + max(n, self.opts.chunk))
        self._add(offset, data)
        return data[:n]

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Fetch every ``(start, end)`` not already cached: adjacent ones (gaps under ``chunk``) in one
        request, ``inflight`` requests at a time."""
        todo = sorted((s, min(e, self.size)) for s, e in ranges
                      if e > s and self._cached(min(e, self.size) - s, s) is None)
        merged: list[list[int]] = []
        for s, e in todo:
            if merged and s <= merged[-1][1] + self.opts.chunk:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        if not merged:
            return
        if len(merged) == 1 or self.opts.inflight == 1:
            for s, e in merged:
                self._add(s, self._fetch(s, e))
            return
        with ThreadPoolExecutor(min(self.opts.inflight, len(merged))) as pool:
            for (s, _), data in zip(merged, pool.map(lambda r: self._fetch(*r), merged), strict=True):
                self._add(s, data)

    def fingerprint(self) -> str:
        """``scan.shard_fingerprint`` of the object, from two ranged reads."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.size}:".encode())
        spans = [(0, min(self.size, FINGERPRINT_SPAN))]
        if self.size > FINGERPRINT_SPAN:
            spans.append((max(FINGERPRINT_SPAN, self.size - FINGERPRINT_SPAN), self.size))
        self.prefetch(spans)
        for s, e in spans:
            h.update(self.pread(e - s, s))
        return "blake2b:" + h.hexdigest()


class RetryingFile:
    """A read-only, seekable file over ranged reads of one remote object, every read retried with
    the deadlines of ``with_retries`` (fsspec's own file object retries nothing: a passing 503 in
    the middle of a Parquet row group failed the file). It keeps only the last block it fetched
    (at least ``opts.chunk`` bytes), not the object: pyarrow reads Parquet footers and column
    chunks through it (``tokenbal.index.parquet``, ``tokenbal.data.parquet``)."""

    def __init__(self, url: str, size: int, opts: RemoteOptions) -> None:
        self.url, self.size, self.opts = url, size, opts
        self.fs, self.path = filesystem(url, opts.storage_options)
        self.pos, self.closed = 0, False
        self._start, self._block = 0, b""

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        if n == 0:
            return b""
        rel = self.pos - self._start
        if not (0 <= rel and rel + n <= len(self._block)):
            end = min(self.size, self.pos + max(n, self.opts.chunk))
            data = with_retries(store_call(self.fs, "cat_file", self.path, start=self.pos, end=end), self.url,
                                f"bytes {self.pos}..{end}", self.opts)
            if len(data) != end - self.pos:
                raise RemoteReadError(f"{self.url}: asked for bytes {self.pos}..{end} of a {self.size}-byte "
                                      f"object and got {len(data)}; the object changed or the server ignores "
                                      "byte ranges")
            self._start, self._block, rel = self.pos, data, 0
        out = self._block[rel:rel + n]
        self.pos += len(out)
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.size + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed, self._block = True, b""


class _RemoteFileObj:
    """A seekable file object over ``RemoteFile`` for ``tarfile`` (the fallback listing)."""

    def __init__(self, rf: RemoteFile) -> None:
        self.rf, self.pos = rf, 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.rf.size - self.pos
        data = self.rf.pread(n, self.pos)
        self.pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.rf.size + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def scan_remote_shard(url: str, opts: RemoteOptions | None = None, prefix: int = PREFIX_BYTES,
                      exif: str = "ignore") -> ShardScan:
    """``scan.scan_shard`` for a remote tar shard (see the module docstring); never raises for bad
    data or an unreachable object: those end up in ``.status`` / ``.reason`` and ``.errors``.
    The same checks as a local shard: member stamps (each member's tar header checksum and mtime, so
    the reader catches a member rewritten in place), image end markers, the ``exif`` policy."""
    opts = opts or RemoteOptions()
    scan = ShardScan(path=url)
    try:
        info = object_info(url, opts)
        scan.size = info["size"]
        scan.extra = {"etag": info["etag"], "remote_mtime": info["remote_mtime"]}
        if opts.mode != "whole":
            try:
                return _scan_ranges(url, scan, opts, prefix, exif)
            except _NoRanges:
                if opts.mode == "ranges":
                    raise RemoteReadError(f"{url}: the server ignores byte ranges (it sent more bytes than "
                                          "asked); use the 'whole' or 'auto' read mode") from None
                scan = ShardScan(path=url, size=scan.size, extra=scan.extra)
        return _scan_whole(url, scan, opts, prefix, exif)
    except FileNotFoundError as e:
        _shard_error(scan, "missing", f"shard not found: {url}: {e}")
    except PermissionError as e:
        _shard_error(scan, "unreadable", f"cannot read shard {url}: access denied: {e}")
    except OSError as e:
        _shard_error(scan, "unreadable", f"cannot read shard: {e}")
    scan.samples = []
    scan.errors = [e for e in scan.errors if e["key"] is None]
    return scan


def _scan_whole(url: str, scan: ShardScan, opts: RemoteOptions, prefix: int, exif: str) -> ShardScan:
    fs, path = filesystem(url, opts.storage_options)
    with tempfile.TemporaryDirectory(prefix="tokenbal-shard-") as tmp:
        local = os.path.join(tmp, "shard.tar")
        # One download: no per-request deadline (a large object takes long); the total one holds.
        whole = dataclasses.replace(opts, timeout=None)
        with_retries(store_call(fs, "get_file", path, local), url, "the whole object", whole)
        got = scan_shard(local, prefix, exif)
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


def _scan_ranges(url: str, scan: ShardScan, opts: RemoteOptions, prefix: int, exif: str) -> ShardScan:
    rf = RemoteFile(url, scan.size, opts)
    if scan.size == 0:
        _shard_error(scan, "empty", "shard is an empty (0-byte) file")
        return _finish(scan)
    scan.fingerprint = rf.fingerprint()
    members = _list_members(rf, scan)
    if scan.status == "ok":
        check_tail(rf.pread, scan)
    if scan.status == "ok":
        scan.headers_digest = headers_digest(members)
        runs = _group(members, scan)
        # What the sample pass will read, fetched together: image heads and whole text members.
        want = []
        for _, run in runs:
            for ti in run:
                kind = member_kind(ti.name.rsplit("/", 1)[-1].split(".", 1)[-1]) if ti.isfile() else ""
                if kind == "image":
                    want.append((ti.offset_data, ti.offset_data + min(ti.size, FIRST_READ, prefix)))
                    # the end-marker check reads the last bytes (imagesize.tail_bytes says how many)
                    tail = min(ti.size, tail_bytes(ti.name))
                    want.append((ti.offset_data + ti.size - tail, ti.offset_data + ti.size))
                elif kind == "text":
                    want.append((ti.offset_data, ti.offset_data + ti.size))
        rf.prefetch(want)
        for key, run in runs:
            sample = _read_sample(rf, key, run, scan, prefix, exif)
            if sample is not None:
                scan.samples.append(sample)
    scan.extra = {**scan.extra, "n_requests": rf.requests, "bytes_read": rf.bytes_read}
    return _finish(scan)


def _finish(scan: ShardScan) -> ShardScan:
    if scan.status != "ok":
        scan.samples = []
        scan.errors = [e for e in scan.errors if e["key"] is None]
    return scan


def _list_members(rf: RemoteFile, scan: ShardScan) -> list:
    magic = rf.pread(6, 0)
    for sig, name in _COMPRESSED_MAGIC.items():
        if magic.startswith(sig):
            _shard_error(scan, "corrupt", f"shard is {name}-compressed; only uncompressed tar shards can be "
                                          "indexed for random access (decompress it first)")
            return []
    fast = walk_members(rf, scan.size)
    if fast is not None:
        members, scan.end_of_members = fast
    else:
        members = []
        try:
            with tarfile.open(fileobj=_RemoteFileObj(rf), mode="r:") as tf:
                try:
                    for ti in tf:
                        members.append(ti)
                finally:
                    scan.end_of_members = tf.offset
        except tarfile.TarError as e:
            where = (f"after member #{len(members)} ({members[-1].name!r})" if members
                     else "at the first header")
            status = "truncated" if "unexpected end of data" in str(e) else "corrupt"
            _shard_error(scan, status, f"shard is {status}: tarfile cannot read it {where}: {e}")
            return []
        # tarfile's TarInfo.mtime may come from a PAX record; the stamp is the ustar header's own.
        for ti in members:
            ti.chksum, ti.mtime = header_stamp(rf.pread(512, ti.offset_data - 512))
    scan.n_members = len(members)
    if not members:
        _shard_error(scan, "empty", "shard is a valid tar with no members")
    return members


# --- sources, staleness -------------------------------------------------------------------------

def expand_url(pattern: str, opts: RemoteOptions) -> list[str]:
    """URLs for one (brace-expanded) remote pattern: a glob is listed (sorted), a literal URL is
    returned as is (checked by ``missing_urls``)."""
    import glob

    if not glob.has_magic(pattern):
        return [pattern]
    fs, path = filesystem(pattern, opts.storage_options)
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
        fp = RemoteFile(url, info["size"], opts).fingerprint()
    except (OSError, _NoRanges) as e:
        return [f"shard unreadable: {url}: {e}"]
    if fp != entry["fingerprint"]:
        return [f"shard changed: {url} (same size {info['size']} bytes, different content)"]
    return []


def threaded_map(fn: Callable[[str], Any], items: Sequence[str], inflight: int) -> Iterator[Any]:
    """``map(fn, items)`` in order, ``inflight`` calls at a time (remote scans wait on the network)."""
    if inflight <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    from collections import deque

    # A bounded window of futures: results are taken in order, at most 2 * inflight held at once.
    with ThreadPoolExecutor(min(inflight, len(items))) as pool:
        window: deque = deque()
        for item in items:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * inflight:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
