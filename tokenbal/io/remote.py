"""Remote objects behind any fsspec URL (``s3://``, ``gs://``, ``https://``, ...): how they are read
(``RemoteOptions``), transient errors retried with backoff (``with_retries``), one filesystem per
process and protocol (``filesystem``), object size and identity (``object_info``), and ranged reads
with a segment cache (``RemoteFile``); a seekable, retried file over one object (``RetryingFile``), and
per-request and total deadlines (``RemoteOptions.timeout`` / ``total_timeout``), so a store that
accepts connections and never answers ends in an error naming the URL.

Shared by the index build (:mod:`tokenbal.index.remote` scans remote shards) and the readers
(:mod:`tokenbal.io.ranged`, :mod:`tokenbal.data.parquet`), so both retry the same errors the same way.
Transient errors (timeouts, connection resets, HTTP 408 / 429 / 5xx) are retried with exponential
backoff (``RETRIES`` times); a permanent one (missing object, access denied, other 4xx) is raised
at once, naming the URL.
"""

from __future__ import annotations

import bisect
import inspect
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tokenbal._extras import MissingExtraError

CHUNK = 8 * 1024
# The tar header walk reads straight through stretches whose headers lie at most READ_THROUGH bytes
# apart on average (small members), in windows that double up to READ_AHEAD_MAX, and keeps up to
# WALK_KEEP bytes of them for the sample pass (see ``HeaderWalkReader``).
READ_THROUGH = 256 * 1024
READ_AHEAD_MAX = 4 << 20
WALK_KEEP = 64 << 20
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
    read_through: int = READ_THROUGH   # see HeaderWalkReader; 0: one request per header missed
    inflight: int = INFLIGHT
    retries: int = RETRIES
    backoff_s: float = BACKOFF_S
    timeout: float | None = TIMEOUT_S               # seconds per request; None: no limit
    total_timeout: float | None = TOTAL_TIMEOUT_S   # seconds per read, retries included; None: no limit

    def __post_init__(self) -> None:
        if self.mode not in READ_MODES:
            raise ValueError(f"remote read mode must be one of {READ_MODES}, got {self.mode!r}")
        if self.chunk < 1024 or self.inflight < 1 or self.retries < 0 or self.read_through < 0:
            raise ValueError(f"bad remote options: chunk={self.chunk} (>= 1024), inflight={self.inflight} "
                             f"(>= 1), retries={self.retries} (>= 0), "
                             f"read_through={self.read_through} (>= 0)")
        for name in ("timeout", "total_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"bad remote options: {name}={value} (> 0 seconds, or None for no limit)")


class RemoteReadError(OSError):
    """A read of a remote object failed for good; the message names the URL."""


class RangesIgnored(Exception):  # noqa: N818 - a signal to fall back to a whole download, not a failure
    """The server answered a ranged read with the whole object."""


_FS_LOCK = threading.Lock()
_FS: dict[tuple, Any] = {}


def filesystem(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``url``; filesystems are shared per process."""
    from tokenbal._extras import fsspec_filesystem

    protocol = url.split("://", 1)[0]
    # What the URL itself says (an ftp:// or sftp:// host, port, user), then the caller's options.
    opts = {**_options_in_url(protocol, url), **(storage_options or {})}
    key = (os.getpid(), protocol, repr(sorted(opts.items())))
    with _FS_LOCK:
        fs = _FS.get(key)
        if fs is None:
            try:
                fs = _FS[key] = fsspec_filesystem(protocol, **opts)
            except OSError as e:       # filesystems that connect when made (ftp, sftp): name the URL
                raise RemoteReadError(f"{url}: cannot connect to its store ({type(e).__name__}: {e})") from e
    return fs, fs._strip_protocol(url) if protocol not in ("http", "https") else url


def _options_in_url(protocol: str, url: str) -> dict:
    """The filesystem options fsspec reads from a URL of ``protocol`` (``fsspec.core.url_to_fs`` does
    the same): a host-based protocol (ftp, sftp, smb) cannot be made without them."""
    from tokenbal._extras import require

    fsspec = require("fsspec", "remote (URL) sources")
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return {}       # fsspec_filesystem says what is missing
    return dict(cls._get_kwargs_from_urls(url))


def range_not_satisfiable(e: BaseException) -> bool:
    """Whether a store refused a ranged read because it starts at or past the end of the object (HTTP
    416: ``status`` on aiohttp's error, ``InvalidRange`` in the botocore response behind s3fs's
    ``OSError``), in ``e`` or the errors behind it. Retrying cannot help: the object is shorter."""
    seen: BaseException | None = e
    for _ in range(8):        # a cause chain is short; a cycle must not loop forever
        if seen is None:
            return False
        if getattr(seen, "status", None) == 416 or getattr(seen, "code", None) == 416:
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and (response.get("Error", {}).get("Code") == "InvalidRange" or
                                           response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _permanent(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotImplementedError,
                      ValueError, TypeError, RangesIgnored)):
        return True
    if range_not_satisfiable(e):
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
        except (RangesIgnored, MissingExtraError):
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
    # The filesystem is shared per process, and s3fs / gcsfs answer info from the listing a glob left in
    # their cache: an object deleted or rewritten since (a verify or a rebuild later in the same process)
    # would look unchanged. Ask the store.
    fs.invalidate_cache(path)
    info = with_retries(store_call(fs, "info", path), url, "object info", opts)
    if info.get("size") is None:
        raise RemoteReadError(f"{url}: the server does not report the object's size")
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    mtime = info.get("LastModified") or info.get("Last-Modified") or info.get("mtime") or info.get("updated")
    return {"size": int(info["size"]), "etag": None if etag is None else str(etag).strip('"'),
            "remote_mtime": None if mtime is None else str(mtime)}


class _Segments:
    """Fetched byte ranges of one object, sorted by start; ``get`` looks at the 8 starting last at or
    before the offset (segments of one kind are few there), joining segments that touch."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.segs: list[bytes] = []

    def add(self, start: int, data: bytes) -> None:
        j = bisect.bisect_left(self.starts, start)
        self.starts.insert(j, start)
        self.segs.insert(j, data)

    def get(self, n: int, offset: int) -> bytes | None:
        j = bisect.bisect_right(self.starts, offset)
        for k in range(j - 1, max(-1, j - 9), -1):
            s, seg = self.starts[k], self.segs[k]
            if offset + n <= s + len(seg):
                return seg[offset - s:offset - s + n]
            if offset < s + len(seg):
                got = self._stitched(n, offset, k)
                if got is not None:
                    return got
        return None

    def _stitched(self, n: int, offset: int, k: int) -> bytes | None:
        """The bytes across segment ``k``'s end and the ones after it that leave no gap (the header
        walk's windows touch or overlap), or None where a gap remains."""
        s = self.starts[k]
        parts, end = [self.segs[k][offset - s:]], s + len(self.segs[k])
        for m in range(k + 1, len(self.starts)):
            if end >= offset + n or self.starts[m] > end:
                break
            tail_start = end - self.starts[m]
            if tail_start < len(self.segs[m]):
                parts.append(self.segs[m][tail_start:])
                end = self.starts[m] + len(self.segs[m])
        return b"".join(parts)[:n] if end >= offset + n else None


class RemoteFile:
    """Ranged reads of one object with a cache of the fetched segments (kept for one shard scan).

    ``pread(n, offset)`` serves from the cache, else fetches ``[offset, offset + max(n, chunk))``;
    ``prefetch(ranges)`` fetches many ranges at once, coalesced, ``inflight`` requests at a time.
    The two are cached apart: a coalesced range is long (a stretch of a shard), and among the
    ``chunk``-sized segments the header walk leaves every few members it would start too far back
    to be found, so the sample pass would fetch again, one request at a time, what was prefetched.
    """

    def __init__(self, url: str, size: int, opts: RemoteOptions) -> None:
        self.url, self.size, self.opts = url, size, opts
        self.fs, self.path = filesystem(url, opts.storage_options)
        self._read = _Segments()       # pread's misses: chunk-sized
        self._ahead = _Segments()      # prefetch's coalesced ranges
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
            raise RangesIgnored
        if len(data) < end - start:
            raise RemoteReadError(f"{self.url}: asked for bytes {start}..{end} of a {self.size}-byte object "
                                  f"and got {len(data)}; the object changed or was cut short during the scan")
        return data

    def _add(self, start: int, data: bytes, ahead: bool = False) -> None:
        with self._lock:
            (self._ahead if ahead else self._read).add(start, data)

    def _cached(self, n: int, offset: int) -> bytes | None:
        got = self._ahead.get(n, offset)
        return got if got is not None else self._read.get(n, offset)

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
                self._add(s, self._fetch(s, e), ahead=True)
            return
        with ThreadPoolExecutor(min(self.opts.inflight, len(merged))) as pool:
            for (s, _), data in zip(merged, pool.map(lambda r: self._fetch(*r), merged), strict=True):
                self._add(s, data, ahead=True)


class HeaderWalkReader:
    """``pread`` for the tar header walk (``tokenbal.io.tar.walk_members``) over a ``RemoteFile``.

    A tar has no table of contents: each header says where the next one is, so the walk is a chain of
    reads. Reading ``chunk`` bytes per miss costs one round trip per member or two when members are
    small (a shard of 2,500 ~4 KB samples: ~1,000 sequential requests). Here the headers' spacing is
    tracked (a moving average of the forward distance between reads); while it stays at most
    ``opts.read_through``, each miss fetches a window twice the last one's, up to ``READ_AHEAD_MAX``,
    so a stretch of small members costs a request per window and its bytes (on a remote link a member
    under ~1 MB takes less time to transfer than a round trip). Larger members (photos of MBs, videos)
    keep ``chunk``-sized reads at each header and skip the data between. The windows go
    into the ``RemoteFile``'s cache, up to ``WALK_KEEP`` bytes, so the sample pass finds the image
    heads and captions of those members there instead of fetching them again."""

    def __init__(self, rf: RemoteFile, keep: int | None = None) -> None:
        self.rf, self.keep = rf, WALK_KEEP if keep is None else keep
        self._start, self._window = 0, b""
        self._last = 0
        self._spacing = float(rf.opts.read_through)   # the first small steps start reading through
        self._size = rf.opts.chunk
        self.kept = 0

    def pread(self, n: int, offset: int) -> bytes:
        if offset > self._last:
            self._spacing += (offset - self._last - self._spacing) / 8
        self._last = offset
        n = max(0, min(n, self.rf.size - offset))
        rel = offset - self._start
        if 0 <= rel and rel + n <= len(self._window):
            return self._window[rel:rel + n]
        got = self.rf._cached(n, offset)
        if got is not None:
            return got
        small = self.rf.opts.read_through and self._spacing <= self.rf.opts.read_through
        self._size = min(READ_AHEAD_MAX, 2 * self._size) if small else self.rf.opts.chunk
        # Reading through, a window starts where the last one ended (not at the header missed), so
        # the member data between them is cached for the sample pass too.
        end = self._start + len(self._window)
        start = end if small and self._window and end <= offset < end + self._size else offset
        data = self.rf._fetch(start, max(offset + n, start + self._size))
        self._start, self._window = start, data
        if self.kept + len(data) <= self.keep:
            self.kept += len(data)
            self.rf._add(start, data)
        return data[offset - start:offset - start + n]


class _ReadOnlyFile:
    """The file protocol around ``read``: a position in ``size`` bytes, seekable, never writable."""

    size: int
    pos: int

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


class RetryingFile(_ReadOnlyFile):
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

    def close(self) -> None:
        self.closed, self._block = True, b""


class RemoteFileObject(_ReadOnlyFile):
    """A seekable file object over ``RemoteFile`` for ``tarfile`` (the fallback listing)."""

    def __init__(self, rf: RemoteFile) -> None:
        self.rf, self.size, self.pos = rf, rf.size, 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.pos
        data = self.rf.pread(n, self.pos)
        self.pos += len(data)
        return data


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
