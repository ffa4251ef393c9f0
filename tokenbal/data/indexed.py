"""webdataset shards, read two ways: by byte offset from the token index, or streamed without one.

**Indexed path** — :class:`IndexedShardDataset` (the one to use when an index exists). A map-style
dataset: ``ds[i]`` reads sample ``i``'s members straight from its shard with one positional read
per member (the 512-byte tar header right before the payload, plus the payload), checks that the
header is the member the index says it is, and returns a webdataset-style dict::

    ds = IndexedShardDataset(index, decode="pil")                # webdataset's own decoders
    sampler = TokenBalancedBatchSampler(index, global_batch_size=256)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=..., num_workers=8)

Each rank reads exactly the samples the sampler gave it (1/R of the bytes), and the order is the
sampler's, whatever the worker count: the batch sampler runs in the main process and the
DataLoader returns batches in order. Shards may be local paths or any fsspec URL (``shards=`` maps
the index's local paths to URLs); remote members are read with ranged requests.

Why the header check: an index that no longer matches its shard (the shard was rewritten, re-tarred,
or one sample was inserted) would otherwise hand out *another sample's bytes* without any error.
For every tar member, even one with a PAX or GNU long-name header in front, the 512 bytes right
before the payload are that member's own ustar header, so checking its checksum, type, size and
name costs nothing extra. A name longer than the ustar fields (or not ASCII) is stored in a PAX /
GNU record further back; the ustar field then holds a truncated (or ASCII-replaced) copy, and that
copy is what is compared, together with the exact size. When the index has member stamps, the
header's checksum and mtime fields must also be the ones the index recorded: a member rewritten in
place at the same size (a new mtime, so a new checksum) is a stale index, not another sample's bytes.
After decoding, every image's size must be the size the index counted (``idx.image_sizes(i)``): the
last guard, for a rewrite that kept even the header. Images are decoded with the index's EXIF policy
(``manifest["exif"]``): with ``"transpose"`` (the default of ``tokenbal index build``) the built-in
image specs (``"pil"``, ``"rgb8"``, ...) apply ``PIL.ImageOps.exif_transpose`` like transformers'
``load_image``, so what is read is what was counted.

**Streaming path** — :func:`balanced_batches`, a webdataset pipeline stage for shards *without* an
index. Each rank streams its own subset of shards; the stage keeps a shuffle buffer and cuts batches
that fill a per-rank token budget (``length_fn(sample)`` gives a sample's tokens), best-fit from the
buffer. Equal step counts — the thing plain webdataset gets wrong (ranks with more samples keep going
while the others wait in a collective forever) — come from a fixed ``steps``: every rank yields
exactly ``steps`` batches per epoch from a source that does not run dry (a resampled / repeated
shard stream), and ranks agree on ``steps`` with one ``all_reduce(MIN)`` per epoch
(:func:`agree_steps`) or from a number fixed in the config. Each rank's own figure can come from a
dry pass over its shards (``steps=None`` counts the batches the stage makes) or from its shards'
sample counts × mean tokens ÷ budget. Every rank therefore runs the same number of training steps
and so the same number of collectives.

Trade-offs of the streaming path against the indexed one:

* Balance is per rank, not across ranks: each rank fills *its own* budget, so ranks differ by the
  budget's unfilled tail (small with a large buffer) instead of being planned jointly.
* An "epoch" is ``steps`` batches of a resampled stream, not each sample exactly once: some samples
  repeat and some are not seen in a given epoch. The indexed path uses every sample exactly once.
* Resume is approximate (webdataset's shard RNG state), where the indexed sampler resumes exactly.
* Shuffling is limited to the buffer and the shard order; the indexed plan shuffles globally.
* In exchange it needs no offline index and reads whole shards sequentially, which is what object
  stores serve best; the indexed path issues one small ranged read per member.
"""

from __future__ import annotations

import bisect
import os
import random
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "BalancedBatches",
    "IndexedShardDataset",
    "SampleReadError",
    "agree_steps",
    "balanced_batches",
    "parse_tar_header",
]

_BLOCK = 512
_REGULAR = (b"0", b"\0")


class SampleReadError(RuntimeError):
    """A sample could not be read or decoded; the message names the shard, the key and the member.

    One string argument only, so that a DataLoader worker can re-raise it in the main process.
    """


# ---------------------------------------------------------------------------------------------
# tar headers


def _octal(field: bytes) -> int:
    """A numeric ustar field: octal text, or GNU base-256 (first byte 0x80 / 0xff) for big values."""
    if field[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field[1:], "big")
        return n - (1 << (8 * (len(field) - 1))) if field[:1] == b"\xff" else n
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _cstr(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def parse_tar_header(block: bytes) -> tuple[bytes, int, bytes]:
    """(name as stored, size, typeflag) of a 512-byte ustar header; ``ValueError`` if it is not one.

    The name is ``prefix/name`` for POSIX ustar headers with a prefix; for a member with a long
    name (PAX or GNU records before this header) it is the truncated copy the writer stored.
    """
    if len(block) != _BLOCK:
        raise ValueError(f"header is {len(block)} bytes, not {_BLOCK}")
    if not block.strip(b"\0"):
        raise ValueError("an all-zero block (end of archive), not a member header")
    try:
        stored = _octal(block[148:156])
        size = _octal(block[124:136])
    except ValueError as e:
        raise ValueError(f"not a tar header: bad numeric field ({e})") from None
    # The checksum field counts as 8 spaces. tarfile accepts the unsigned and the (historic) signed
    # byte sum; the signed one is only worked out when the unsigned one fails (it is rare and slow).
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32
    if stored != unsigned:
        rest = block[:148] + b" " * 8 + block[156:]
        if stored != unsigned - 256 * sum(1 for b in rest if b > 127):
            raise ValueError(f"tar header checksum mismatch (stored {stored}, computed {unsigned})")
    name = _cstr(block[0:100])
    if block[257:263] == b"ustar\0":           # POSIX ustar: a long path may be split into prefix/name
        prefix = _cstr(block[345:500])
        if prefix:
            name = prefix + b"/" + name
    return name, size, block[156:157]


def _name_matches(stored: bytes, expected: str) -> bool:
    enc = expected.encode("utf-8")
    if stored == enc:
        return True
    # A name that does not fit ustar (too long, or not ASCII) lives in a PAX / GNU record; the
    # ustar field keeps a copy truncated to 100 bytes (UTF-8 for GNU, ASCII with '?' for PAX).
    long_or_unicode = len(enc) > 100 or not expected.isascii()
    return long_or_unicode and stored in (enc[:100], expected.encode("ascii", "replace")[:100])


# ---------------------------------------------------------------------------------------------
# reading byte ranges, local or remote


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class _Readers:
    """Per-process LRU of open shards: local file descriptors, or fsspec filesystems for URLs.

    Opened lazily, and dropped when the process id changes: descriptors (and fsspec sessions)
    inherited through a DataLoader worker's fork are not shared with the parent.
    """

    def __init__(self, max_open: int, storage_options: dict | None) -> None:
        self.max_open = max(1, int(max_open))
        self.storage_options = dict(storage_options or {})
        self.pid = os.getpid()
        self.open: OrderedDict[str, Any] = OrderedDict()
        self.filesystems: dict[str, Any] = {}
        self.opened = 0           # shards opened in this process, for tests and debugging

    def _check_pid(self) -> None:
        if os.getpid() != self.pid:
            # Do not close: the descriptors belong to the parent's file table too (after fork the
            # numbers are the child's own copies, but closing buys nothing and the dict is stale).
            self.open.clear()
            self.filesystems.clear()
            self.pid = os.getpid()
            self.opened = 0

    def _handle(self, shard: str) -> Any:
        self._check_pid()
        h = self.open.get(shard)
        if h is not None:
            self.open.move_to_end(shard)
            return h
        if _is_url(shard):
            import fsspec

            protocol = shard.split("://", 1)[0]
            fs = self.filesystems.get(protocol)
            if fs is None:
                fs = fsspec.filesystem(protocol, **self.storage_options)
                self.filesystems[protocol] = fs
            h = ("url", fs, shard)
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
            from tokenbal.index.remote import RemoteOptions, with_retries

            return with_retries(lambda: h.cat_file(shard, start=offset, end=offset + n), shard,
                                f"bytes {offset}..{offset + n}", RemoteOptions())
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
            return os.fstat(h).st_size if kind == "fd" else int(h.size(shard))
        except Exception:  # noqa: BLE001 - only used to word an error message
            return None

    def close(self) -> None:
        if os.getpid() == self.pid:
            for kind, h, _ in self.open.values():
                if kind == "fd":
                    os.close(h)
        self.open.clear()
        self.filesystems.clear()


# ---------------------------------------------------------------------------------------------
# the indexed dataset


class _ExifImageHandler:
    """webdataset's ``imagehandler(spec)`` with ``PIL.ImageOps.exif_transpose`` applied after opening,
    as transformers' ``load_image`` does; the same outputs (PIL / numpy / torch, modes, dtypes)."""

    def __init__(self, spec: str) -> None:
        from webdataset import autodecode

        if spec not in autodecode.imagespecs:
            raise ValueError(f"unknown image spec {spec!r}; known: {', '.join(autodecode.imagespecs)}")
        self.spec = spec
        self.atype, self.etype, self.mode = autodecode.imagespecs[spec]

    def __call__(self, key: str, data: bytes) -> Any:
        import io

        from PIL import Image, ImageOps

        from tokenbal.index.imagesize import IMAGE_EXTS

        if key.rsplit(".", 1)[-1].lower() not in IMAGE_EXTS:
            return None
        with io.BytesIO(data) as stream:
            img = Image.open(stream)
            img.load()
        img = ImageOps.exif_transpose(img).convert(self.mode.upper())
        if self.atype == "pil":
            return img
        arr = np.asarray(img)
        if self.etype == "float":
            arr = arr.astype(np.float32) / 255.0
        if self.atype == "numpy":
            return arr
        t = torch.from_numpy(arr.transpose(2, 0, 1).copy() if arr.ndim == 3 else arr.copy())
        return t


def _decoded_size(value: Any) -> tuple[int, int] | None:
    """(width, height) of a decoded image (PIL, numpy HWC / HW, torch CHW / HW); None otherwise."""
    size = getattr(value, "size", None)
    if isinstance(size, tuple) and len(size) == 2 and hasattr(value, "mode"):
        return int(size[0]), int(size[1])
    if isinstance(value, np.ndarray) and value.ndim in (2, 3):
        return int(value.shape[1]), int(value.shape[0])
    if isinstance(value, torch.Tensor) and value.ndim in (2, 3):
        return int(value.shape[-1]), int(value.shape[-2])
    return None


def _make_decoder(decode: Any, exif: str = "ignore") -> Callable[[dict], dict] | None:
    """``None`` (raw bytes), an image spec string ("pil", "rgb8", ...), a handler, a list of
    those (as in ``wds.decode(*args)``), or a ready ``webdataset.autodecode.Decoder``. With
    ``exif="transpose"`` the image spec strings decode through ``_ExifImageHandler``."""
    if decode is None:
        return None
    from webdataset import autodecode

    if isinstance(decode, autodecode.Decoder):
        return decode
    specs = list(decode) if isinstance(decode, list | tuple) else [decode]
    handlers = []
    for s in specs:
        if isinstance(s, str):
            handlers.append(_ExifImageHandler(s) if exif == "transpose" else autodecode.imagehandler(s))
        elif callable(s):
            handlers.append(s)
        else:
            raise TypeError(f"decode: expected None, an image spec string, a handler or a Decoder, got {s!r}")
    return autodecode.Decoder(handlers)


class IndexedShardDataset(Dataset):
    """Map-style dataset over a :class:`tokenbal.TokenIndex`: ``ds[i]`` reads sample ``i`` by offset.

    ``index``: a ``TokenIndex`` or its folder. ``decode``: ``None`` for raw bytes, else what
    ``webdataset.decode(...)`` takes — image spec strings (``"pil"``, ``"rgb8"``, ...), handler
    functions, a list of those, or a ``webdataset.autodecode.Decoder``. ``shards``: where to read
    the shards instead of the index's recorded paths — a list parallel to ``index.shard_paths`` or a
    function ``path -> path or URL`` (any fsspec URL, e.g. ``https://host/data-000.tar`` or
    ``s3://bucket/data-000.tar``); ``storage_options`` go to ``fsspec.filesystem``.
    ``max_open_shards``: size of each process's LRU of open shards. ``on_error``: what a member that
    is read correctly but fails to *decode* does — ``"raise"`` (default) or ``"mark"``: the sample
    comes back as ``{"__key__", "__shard__", "__index__", "__error__": reason}`` with no members, so
    the collate function can count and drop it without the batch shifting. A stale index, a
    missing or truncated shard always raise :class:`SampleReadError`.

    Returned dict: ``__key__``, ``__shard__`` and ``__url__`` (the shard read), ``__index__`` (``i``),
    and one entry per member, keyed by its extension lower-cased as webdataset does (``jpg``,
    ``0.png``, ``txt``). With a ``decode``, a video member becomes the uint8 array (T, H, W, 3) of
    exactly the frames the index's model family samples (``tokenbal.index.videoindex``), and
    ``__videos__`` lists, per video, its member key, ``fps``, ``frames_indices`` and
    ``total_num_frames`` (the processor's video metadata).
    """

    def __init__(self, index: Any, decode: Any = "pil", *,
                 shards: Sequence[str] | Callable[[str], str] | None = None,
                 storage_options: dict | None = None, max_open_shards: int = 16,
                 on_error: str = "raise") -> None:
        from tokenbal.index import TokenIndex

        self.index = index if isinstance(index, TokenIndex) else TokenIndex.open(index)
        if on_error not in ("raise", "mark"):
            raise ValueError(f"on_error must be 'raise' or 'mark', got {on_error!r}")
        self.decode_spec = decode
        self.exif = self.index.manifest.get("exif", "ignore")
        self.decoder = _make_decoder(decode, self.exif)
        self.on_error = on_error
        self.storage_options = storage_options
        self.max_open_shards = max_open_shards
        self.shard_map = self._shard_map(shards)
        self._readers = _Readers(max_open_shards, storage_options)

    def _shard_map(self, shards: Any) -> dict[str, str]:
        paths = self.index.shard_paths
        if shards is None:
            return {p: p for p in paths}
        if callable(shards):
            return {p: shards(p) for p in paths}
        shards = list(shards)
        if len(shards) != len(paths):
            raise ValueError(f"shards: got {len(shards)} paths for an index of {len(paths)} shards "
                             f"({self.index.path}); give one per index.shard_paths entry, in order")
        return dict(zip(paths, shards, strict=True))

    def __len__(self) -> int:
        return len(self.index)

    # Pickling (spawn workers): the TokenIndex pickles as (path, build id) and reopens that same
    # version, memory-mapped, even if the index was rebuilt since; no open handle crosses processes.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_readers"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        from tokenbal.index import TokenIndex

        self.__dict__.update(state)
        if isinstance(self.index, str):
            self.index = TokenIndex.open(self.index)
        self._readers = _Readers(self.max_open_shards, self.storage_options)

    def close(self) -> None:
        """Close this process's open shards (they reopen on the next read)."""
        self._readers.close()

    @property
    def shards_opened(self) -> int:
        """How many times this process opened a shard (LRU misses)."""
        return self._readers.opened

    def read_raw(self, i: int) -> dict:
        """Sample ``i`` with every member as verified raw bytes (no decoding)."""
        i = int(i)
        key = self.index.keys[i]
        members = self.index.members(i)
        shard = self.shard_map[self.index.shard(i)]
        sample: dict[str, Any] = {"__key__": key, "__shard__": shard, "__url__": shard, "__index__": i}
        local = self.index.shard(i)
        if local.lower().endswith((".parquet", ".pq")):
            raise SampleReadError(f"sample {i} ({key!r}) is a row of the Parquet file {local}; read it with "
                                  "tokenbal.data.IndexedParquetDataset")

        def plain(m: Any) -> bool:
            # Not a tar member (tar payloads start at byte 512 or later, inside the sample's shard):
            # a file named by a JSON/JSONL annotation record.
            return m.offset == 0 or m.shard != local

        n_files = sum(1 for m in members if plain(m))
        stamps = self.index.member_stamps(i)
        for j, m in enumerate(members):
            if plain(m):
                # Keyed by its extension, numbered when the record has several ("0.jpg", "1.png")
                # as webdataset names a sample's images.
                ext = m.name.rsplit("/", 1)[-1].rsplit(".", 1)[-1].lower()
                ext = f"{j}.{ext}" if n_files > 1 else ext
                data = self._read_file(i, key, m.name, self.shard_map.get(m.shard, m.shard), m.offset, m.size)
            else:
                ext = m.name[len(key) + 1:].lower()
                data = self._read_member(i, key, m.name, shard, m.offset, m.size,
                                         stamps[j] if stamps is not None else None)
            if ext in sample:
                raise SampleReadError(f"sample {i} key {key!r} in shard {shard}: two members map to "
                                      f"extension {ext!r} (webdataset lower-cases extensions)")
            sample[ext] = data
        return sample

    def _read_file(self, i: int, key: str, name: str, path: str, offset: int, size: int) -> bytes:
        where = f"file {path} ({name!r} of sample {i}, key {key!r})"
        # A whole file (offset 0) is read one byte long, so that a file that grew is caught too.
        want = size + 1 if offset == 0 else size
        try:
            data = self._readers.read(path, offset, want)
        except FileNotFoundError as e:
            raise SampleReadError(f"file missing: {where}: {e}") from e
        except Exception as e:
            raise SampleReadError(f"cannot read {where}: {type(e).__name__}: {e}") from e
        if len(data) != size:
            got = f"{len(data)} bytes" if len(data) < size else "more bytes"
            raise SampleReadError(f"stale index: {where} has {got} at offset {offset}, the index says "
                                  f"{size}; rebuild the index")
        return data

    def _read_member(self, i: int, key: str, name: str, shard: str, offset: int, size: int,
                     stamp: tuple[int, int] | None = None) -> bytes:
        where = f"member {name!r} of sample {i} (key {key!r}) in shard {shard}"
        if offset < _BLOCK:
            raise SampleReadError(f"{where}: index payload offset {offset} leaves no room for a tar "
                                  f"header; the index is corrupt (rebuild it)")
        start = offset - _BLOCK
        try:
            data = self._readers.read(shard, start, _BLOCK + size)
        except FileNotFoundError as e:
            raise SampleReadError(f"shard missing: {shard} (needed for {where}): {e}") from e
        except Exception as e:
            raise SampleReadError(f"cannot read {where} (bytes {start}..{offset + size}): "
                                  f"{type(e).__name__}: {e}") from e
        if len(data) != _BLOCK + size:
            if len(data) > _BLOCK + size:
                raise SampleReadError(f"{where}: asked for {_BLOCK + size} bytes at {start} and got "
                                      f"{len(data)}; the server ignored the byte range")
            end = self._readers.size(shard)
            raise SampleReadError(f"shard truncated: {shard} ends at {end if end is not None else '?'} "
                                  f"bytes but {where} needs bytes {start}..{offset + size} "
                                  f"(read {len(data)}); the shard is cut short or the index is stale")
        try:
            stored, hsize, typeflag = parse_tar_header(data[:_BLOCK])
        except ValueError as e:
            raise SampleReadError(f"stale index or corrupt shard: no valid tar header before {where} "
                                  f"(at byte {start}): {e}") from None
        if typeflag not in _REGULAR:
            raise SampleReadError(f"stale index: the header before {where} is of type {typeflag!r}, "
                                  f"not a regular file (name {stored!r}); rebuild the index")
        if hsize != size or not _name_matches(stored, name):
            raise SampleReadError(f"stale index: {where} expected {name!r} with {size} bytes at {offset}, "
                                  f"the shard has {stored.decode('utf-8', 'replace')!r} with {hsize} "
                                  f"bytes there; the shard changed since the index was built "
                                  f"(run `tokenbal index verify`, then rebuild)")
        if stamp is not None and stamp[0] != -1:
            from tokenbal.index.tarwalk import header_stamp

            have = header_stamp(data[:_BLOCK])
            if have != tuple(stamp):
                raise SampleReadError(f"stale index: {where} was rewritten since the index was built (same "
                                      "name "
                                      f"and size, but header checksum/mtime {have[0]}/{have[1]}, the index "
                                      f"recorded {stamp[0]}/{stamp[1]}); run `tokenbal index verify`, "
                                      "then rebuild")
        return data[_BLOCK:]

    def _check_image_sizes(self, raw: dict, decoded: dict) -> None:
        """Each decoded image must have the size the index counted (after its EXIF policy)."""
        from tokenbal.index.imagesize import IMAGE_EXTS

        want = self.index.image_sizes(raw["__index__"])
        keys = [k for k in raw if not k.startswith("__") and k.rsplit(".", 1)[-1] in IMAGE_EXTS]
        for k, (w, h) in zip(keys, want, strict=False):
            got = _decoded_size(decoded.get(k))
            if got is not None and got != (w, h):
                hint = (" (the index counts images after EXIF orientation: decode with an image spec string "
                        "such as 'pil', or apply PIL.ImageOps.exif_transpose in your handler)"
                        if self.exif == "transpose" and got == (h, w) else "")
                raise SampleReadError(f"stale index: image {raw['__key__']}.{k} of sample {raw['__index__']} "
                                      f"in shard {raw['__shard__']} decodes to {got[0]}x{got[1]}, the index "
                                      f"counted {w}x{h}{hint}; run `tokenbal index verify`, then rebuild")

    def _decode(self, sample: dict) -> dict:
        if self.decoder is None:
            return sample
        try:
            decoded = self.decoder(sample)
            from tokenbal.index.videoindex import decode_sample_videos

            decoded = decode_sample_videos(self.index, decoded)
        except Exception as e:
            # webdataset's DecodingError names the field; the cause says why.
            cause = e.__cause__ if e.__cause__ is not None else e
            field = getattr(e, "k", None)
            reason = (f"cannot decode member {sample['__key__']}.{field} " if field else "cannot decode ") + \
                f"of sample {sample['__index__']} in shard {sample['__shard__']}: " \
                f"{type(cause).__name__}: {cause}"
            if self.on_error == "mark":
                return {k: sample[k] for k in ("__key__", "__shard__", "__url__", "__index__")} | \
                    {"__error__": reason}
            raise SampleReadError(reason) from e
        self._check_image_sizes(sample, decoded)
        return decoded

    def __getitem__(self, i: int) -> dict:
        return self._decode(self.read_raw(i))

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """A whole batch (the DataLoader calls this with a batch sampler's list): members are read in
        (shard, offset) order for locality, and returned in the order asked."""
        shard_ids = np.asarray(self.index.shard_ids)   # a plain view: memmap indexing is slow
        order = sorted(range(len(indices)), key=lambda j: (int(shard_ids[int(indices[j])]), int(indices[j])))
        raw: list[dict | None] = [None] * len(indices)
        for j in order:
            raw[j] = self.read_raw(indices[j])
        return [self._decode(s) for s in raw]   # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# streaming: token-budget batches from a shuffle buffer, a fixed number of steps per rank


def agree_steps(local_steps: int, group: Any = None) -> int:
    """The smallest ``local_steps`` over all ranks: one ``all_reduce(MIN)``; call it once per epoch on
    every rank (it is a collective). Without an initialised process group, ``local_steps``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(local_steps)
    t = torch.tensor([int(local_steps)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _worker_share(steps: int) -> tuple[int, int, int]:
    """(steps for this DataLoader worker, worker id, worker count): the rank's ``steps`` split so that
    the workers' batches add up to exactly ``steps``."""
    info = torch.utils.data.get_worker_info()
    wid, n = (0, 1) if info is None else (info.id, info.num_workers)
    return steps // n + (1 if wid < steps % n else 0), wid, n


def _balanced_batches(data: Iterable[dict], max_tokens: int, length_fn: Callable[[dict], int],
                      steps: int | None = None, bufsize: int = 1000, seed: int = 0, epoch: int = 0,
                      rank: int | None = None, collation_fn: Callable[[list[dict]], Any] | None = None
                      ) -> Iterator[Any]:
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if bufsize < 1:
        raise ValueError(f"bufsize must be >= 1, got {bufsize}")
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    want, wid, nworkers = _worker_share(steps) if steps is not None else (None, 0, 1)
    # Seeded from (seed, epoch, rank, worker): reproducible, and different for every stream.
    rng = random.Random(f"tokenbal.balanced_batches:{seed}:{epoch}:{rank}:{wid}")
    lens: list[tuple[int, int]] = []     # sorted (tokens, arrival number), parallel to items
    items: list[dict] = []
    arrival = 0
    made = 0

    def take(j: int) -> tuple[int, dict]:
        return lens.pop(j)[0], items.pop(j)

    def cut() -> list[dict]:
        # A random first sample keeps the order shuffled; then best fit: the largest buffered
        # sample that still fits, until none does. Largest-first fills the budget tightly.
        n, first = take(rng.randrange(len(lens)))
        batch, room = [first], max_tokens - n
        while lens and room > 0:
            j = bisect.bisect_right(lens, (room, float("inf"))) - 1
            if j < 0:
                break
            n, s = take(j)
            batch.append(s)
            room -= n
        return batch

    def emit(batch: list[dict]) -> Any:
        return collation_fn(batch) if collation_fn is not None else batch

    source = iter(data)
    exhausted = False
    while want is None or made < want:
        while not exhausted and len(lens) < bufsize:
            try:
                sample = next(source)
            except StopIteration:
                exhausted = True
                break
            n = int(length_fn(sample))
            if n > max_tokens or n < 0:
                raise ValueError(f"sample {sample.get('__key__')!r} from {sample.get('__url__')!r} has "
                                 f"{n} tokens; the budget is max_tokens={max_tokens}")
            bisect.insort(lens, (n, arrival))
            items.insert(bisect.bisect_left(lens, (n, arrival)), sample)
            arrival += 1
        if not lens:
            break
        yield emit(cut())
        made += 1
    if want is not None and made < want:
        raise RuntimeError(f"balanced_batches: rank {rank} worker {wid}/{nworkers} ran out of samples "
                           f"after {made} of its {want} batches (steps={steps}); feed it a source that does "
                           f"not run dry (webdataset ResampledShards / .repeat()) or agree on fewer steps")


@dataclass(frozen=True)
class BalancedBatches:
    """The stage :func:`balanced_batches` returns: a picklable callable ``samples -> batches`` (spawned
    DataLoader workers pickle the pipeline, so ``length_fn`` must be picklable too)."""
    max_tokens: int
    length_fn: Callable[[dict], int]
    steps: int | None = None
    bufsize: int = 1000
    seed: int = 0
    epoch: int = 0
    rank: int | None = None
    collation_fn: Callable[[list[dict]], Any] | None = None

    def __call__(self, src: Iterable[dict]) -> Iterator[Any]:
        return _balanced_batches(src, self.max_tokens, self.length_fn, steps=self.steps,
                                 bufsize=self.bufsize, seed=self.seed, epoch=self.epoch, rank=self.rank,
                                 collation_fn=self.collation_fn)


def balanced_batches(max_tokens: int, length_fn: Callable[[dict], int], steps: int | None = None,
                     bufsize: int = 1000, seed: int = 0, epoch: int = 0, rank: int | None = None,
                     collation_fn: Callable[[list[dict]], Any] | None = None, *, dp_group: Any = None,
                     device_mesh: Any = None) -> BalancedBatches:
    """A webdataset pipeline stage: samples in, batches (lists of samples, or ``collation_fn`` of
    them) out, each batch's ``length_fn`` sum at most ``max_tokens``.

    ``steps``: the number of batches this rank yields (split over DataLoader workers so that the
    workers' batches add up to exactly ``steps``; use ``batch_size=None`` in the DataLoader). Give
    every rank the same ``steps`` — fixed in the config or from :func:`agree_steps` — and a source
    that does not run dry; a source that does anyway raises a clear error rather than letting ranks
    fall out of step. ``steps=None`` batches until the source ends (one process, or ranks that are
    kept in step some other way). ``bufsize``: samples held for shuffling and fitting. Randomness is
    seeded from ``(seed, epoch, rank, worker)``; ``rank`` defaults to ``torch.distributed``'s (pass it
    explicitly when DataLoader workers are spawned, where no process group exists). Each DataLoader
    worker batches what its own source yields, so give workers disjoint or resampled shard streams
    (``wds.ResampledShards(..., deterministic=True)`` seeds per rank and worker). A sample over the
    budget raises, naming its key and shard. Under tensor / sequence parallelism pass ``dp_group=`` or
    ``device_mesh=`` (:mod:`tokenbal.parallel`): the seed then uses the data-parallel rank, so the peers
    of one SP/TP group cut the same batches; give them the same shard stream too (seed it with the DP
    rank).

    Recipe (every rank)::

        steps = agree_steps(my_estimate)          # one all_reduce(MIN) per epoch, or a config value
        pipe = wds.DataPipeline(wds.ResampledShards(my_shards, seed=rank, deterministic=True),
                                wds.tarfile_to_samples(), wds.decode("pil"),
                                balanced_batches(max_tokens, length_fn, steps=steps, epoch=epoch))
        loader = DataLoader(pipe, batch_size=None, num_workers=4)   # exactly `steps` batches
    """
    if dp_group is not None or device_mesh is not None:
        from tokenbal.parallel import resolve_dp

        _, rank = resolve_dp(None, rank, dp_group, device_mesh)
    return BalancedBatches(max_tokens, length_fn, steps, bufsize, seed, epoch, rank, collation_fn)
