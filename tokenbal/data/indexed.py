"""webdataset shards read by byte offset from the token index: the indexed path.

:class:`IndexedShardDataset` (the one to use when an index exists) is a map-style
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

The streaming path for shards without an index is :mod:`tokenbal.data.stream`; tar header parsing
is :mod:`tokenbal.io.tar`, ranged reads :mod:`tokenbal.io.ranged`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tokenbal.io.ranged import ShardReaders
from tokenbal.io.tar import BLOCK, PLAIN_TYPES, header_names, header_stamp, name_matches, parse_tar_header

__all__ = ["IndexedShardDataset", "SampleReadError"]


class SampleReadError(RuntimeError):
    """A sample could not be read or decoded; the message names the shard, the key and the member.

    One string argument only, so that a DataLoader worker can re-raise it in the main process.
    """


class _ImageHandler:
    """webdataset's ``imagehandler(spec)`` for every image extension the index counts
    (``tokenbal.index.imagesize.IMAGE_EXTS``: AVIF, JPEG 2000, TIFF, GIF ..., not only webdataset's
    JPEG / PNG / PNM), with ``PIL.ImageOps.exif_transpose`` applied after opening when ``transpose``
    (as transformers' ``load_image`` does); the same outputs (PIL / numpy / torch, modes, dtypes)."""

    def __init__(self, spec: str, transpose: bool = True) -> None:
        from webdataset import autodecode

        if spec not in autodecode.imagespecs:
            raise ValueError(f"unknown image spec {spec!r}; known: {', '.join(autodecode.imagespecs)}")
        self.spec, self.transpose = spec, transpose
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
        if self.transpose:
            img = ImageOps.exif_transpose(img)
        img = img.convert(self.mode.upper())
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
    those (as in ``wds.decode(*args)``), or a ready ``webdataset.autodecode.Decoder``. The image
    spec strings decode through ``_ImageHandler``, with the EXIF transpose when ``exif="transpose"``."""
    if decode is None:
        return None
    from webdataset import autodecode

    if isinstance(decode, autodecode.Decoder):
        return decode
    specs = list(decode) if isinstance(decode, list | tuple) else [decode]
    handlers = []
    for s in specs:
        if isinstance(s, str):
            handlers.append(_ImageHandler(s, transpose=exif == "transpose"))
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
        self._readers = ShardReaders(max_open_shards, storage_options)

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
        self._readers = ShardReaders(self.max_open_shards, self.storage_options)

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
        if offset < BLOCK:
            raise SampleReadError(f"{where}: index payload offset {offset} leaves no room for a tar "
                                  f"header; the index is corrupt (rebuild it)")
        start = offset - BLOCK
        try:
            data = self._readers.read(shard, start, BLOCK + size)
        except FileNotFoundError as e:
            raise SampleReadError(f"shard missing: {shard} (needed for {where}): {e}") from e
        except Exception as e:
            raise SampleReadError(f"cannot read {where} (bytes {start}..{offset + size}): "
                                  f"{type(e).__name__}: {e}") from e
        if len(data) != BLOCK + size:
            if len(data) > BLOCK + size:
                raise SampleReadError(f"{where}: asked for {BLOCK + size} bytes at {start} and got "
                                      f"{len(data)}; the server ignored the byte range")
            end = self._readers.size(shard)
            raise SampleReadError(f"shard truncated: {shard} ends at {end if end is not None else '?'} "
                                  f"bytes but {where} needs bytes {start}..{offset + size} "
                                  f"(read {len(data)}); the shard is cut short or the index is stale")
        try:
            stored, hsize, typeflag = parse_tar_header(data[:BLOCK])
        except ValueError as e:
            raise SampleReadError(f"stale index or corrupt shard: no valid tar header before {where} "
                                  f"(at byte {start}): {e}") from None
        if typeflag not in PLAIN_TYPES:
            raise SampleReadError(f"stale index: the header before {where} is of type {typeflag!r}, "
                                  f"not a regular file (name {stored!r}); rebuild the index")
        if hsize != size or not any(name_matches(n, name) for n in header_names(data[:BLOCK])):
            raise SampleReadError(f"stale index: {where} expected {name!r} with {size} bytes at {offset}, "
                                  f"the shard has {stored.decode('utf-8', 'replace')!r} with {hsize} "
                                  f"bytes there; the shard changed since the index was built "
                                  f"(run `tokenbal index verify`, then rebuild)")
        if stamp is not None and stamp[0] != -1:
            have = header_stamp(data[:BLOCK])
            if have != tuple(stamp):
                raise SampleReadError(f"stale index: {where} was rewritten since the index was built (same "
                                      "name "
                                      f"and size, but header checksum/mtime {have[0]}/{have[1]}, the index "
                                      f"recorded {stamp[0]}/{stamp[1]}); run `tokenbal index verify`, "
                                      "then rebuild")
        return data[BLOCK:]

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

