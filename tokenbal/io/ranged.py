"""Byte ranges of shards, local or remote: one per-process LRU of open files / fsspec filesystems.

Used by :class:`tokenbal.data.indexed.IndexedShardDataset` (one positional read per member). Local
shards are read with ``os.pread`` on a descriptor opened ``O_NONBLOCK`` (a FIFO in a shard's place
fails instead of blocking); URLs go through ``fsspec``'s ``cat_file`` on the filesystem the index
build uses for that URL (:func:`tokenbal.io.remote.filesystem`: the host, port and user an
``ftp://`` / ``sftp://`` URL names, then ``storage_options``), with the build's retry policy and
deadlines (:func:`tokenbal.io.remote.with_retries`).
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from typing import Any

from tokenbal.io.remote import is_url

__all__ = ["ShardReaders", "is_url"]

# The largest remote read made in one request. A larger one (a video, a big image) is read in pieces
# of this size, ``RemoteOptions.inflight`` at a time, each retried on its own and each within the
# per-request deadline: one request for a GB-sized member would fail whole on any dropped transfer,
# restart from its first byte each retry, and need more than the 60 s deadline under ~20 MB/s.
READ_PIECE = 16 << 20


class ShardReaders:
    """Per-process LRU of open shards: local file descriptors, or fsspec filesystems for URLs.

    Opened lazily, and dropped when the process id changes: descriptors (and fsspec sessions)
    inherited through a DataLoader worker's fork are not shared with the parent.
    """

    def __init__(self, max_open: int, storage_options: dict | None) -> None:
        self.max_open = max(1, int(max_open))
        self.storage_options = dict(storage_options or {})
        self.pid = os.getpid()
        self.open: OrderedDict[str, Any] = OrderedDict()
        self.opened = 0           # shards opened in this process, for tests and debugging

    def _check_pid(self) -> None:
        if os.getpid() != self.pid:
            # Do not close: the descriptors belong to the parent's file table too (after fork the
            # numbers are the child's own copies, but closing buys nothing and the dict is stale).
            self.open.clear()
            self.pid = os.getpid()
            self.opened = 0

    def _handle(self, shard: str) -> Any:
        self._check_pid()
        h = self.open.get(shard)
        if h is not None:
            self.open.move_to_end(shard)
            return h
        if is_url(shard):
            from tokenbal.io.remote import filesystem

            # One filesystem per (process, protocol, options), the URL's own host / port / user
            # included: ftp://a/x.tar and ftp://b/x.tar are two servers, not one.
            fs, inside = filesystem(shard, self.storage_options)
            h = ("url", fs, inside)
        else:
            path = shard[len("file://"):] if shard.startswith("file://") else shard
            # O_NONBLOCK: a FIFO put in a shard's place must fail here, not block the reader forever.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(f"{path} is not a regular file (a FIFO or a device); shards must be files")
            h = ("fd", fd, path)
        self.opened += 1
        self.open[shard] = h
        while len(self.open) > self.max_open:
            _, old = self.open.popitem(last=False)
            if old[0] == "fd":
                os.close(old[1])
        return h

    def read(self, shard: str, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset``; fewer only if the shard ends first."""
        kind, h, path = self._handle(shard)
        if kind == "url":
            # Transient store errors (timeouts, 5xx) are retried with backoff, as in the index build.
            # Each request has the build's deadlines too (RemoteOptions' timeout / total_timeout):
            # a store that stops answering ends in an error naming the URL, not a hung DataLoader.
            from tokenbal.io.remote import RemoteOptions, range_not_satisfiable, store_call, with_retries

            opts = RemoteOptions()
            end = offset + n
            spans = [(pos, min(end, pos + READ_PIECE)) for pos in range(offset, end, READ_PIECE)]

            def piece(span: tuple[int, int]) -> bytes:
                start, stop = span
                try:
                    return with_retries(store_call(h, "cat_file", path, start=start, end=stop), shard,
                                        f"bytes {start}..{stop}", opts)
                except OSError as e:
                    if range_not_satisfiable(e):
                        return b""     # as a local pread there: the caller words it (a truncated shard)
                    raise

            if not spans:
                return b""
            # The first piece alone: a store that ignores ranges (the whole object back) or an object
            # cut short is seen once, not by every piece in flight.
            first = piece(spans[0])
            if len(spans) == 1 or len(first) != spans[0][1] - spans[0][0]:
                return first
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(opts.inflight, len(spans) - 1)) as pool:   # the rest together
                datas = [first, *pool.map(piece, spans[1:])]
            out = []
            for (start, stop), data in zip(spans, datas, strict=True):
                out.append(data)
                if len(data) != stop - start:
                    break      # the object ends here (or the store ignored the range): the caller says
            return b"".join(out)
        data = os.pread(h, n, offset)
        while len(data) < n:          # one pread may return less (e.g. > 2 GiB on Linux)
            more = os.pread(h, n - len(data), offset + len(data))
            if not more:
                break
            data += more
        return data

    def size(self, shard: str) -> int | None:
        try:
            kind, h, path = self._handle(shard)
            return os.fstat(h).st_size if kind == "fd" else int(h.size(path))
        except Exception:  # noqa: BLE001 - only used to word an error message
            return None

    def close(self) -> None:
        if os.getpid() == self.pid:
            for kind, h, _ in self.open.values():
                if kind == "fd":
                    os.close(h)
        self.open.clear()

    def __del__(self) -> None:
        # A dataset dropped without close() (the usual case) must not keep its shards open: one per
        # shard read, so a process that makes datasets in a loop runs out of descriptors.
        try:
            self.close()
        except (OSError, AttributeError):   # already closed elsewhere; or made only half
            pass

