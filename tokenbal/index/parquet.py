"""Scan one Parquet file (the Hugging Face datasets layout of most VLM SFT sets) like a shard.

Columns (``ParquetOptions``; each default is the first that the file has):

* images: ``--image-column`` (default ``images``, else ``image``): a list of ``{bytes, path}``
  structs (HF ``Sequence(Image())``), one such struct (HF ``Image()``), or a list of / plain binary.
* text: ``--messages-column`` (default ``messages``, else ``conversations``): chat turns, counted by
  the rules of ``tokenbal.index.text`` (``{"role", "content"}`` turns as ``messages``, ``{"from",
  "value"}`` turns as ``conversations``); or ``--text-column`` (default ``text``, else ``caption``),
  a string. A file with none of the named / default columns is one file-level error.
* videos: ``--video-column`` (``ParquetOptions.video_column``), else a ``videos`` column when the file
  has one (per row a list of / one path, bytes or ``{bytes, path}`` struct, datasets'
  ``Video(decode=False)``), else the file each ``{"type": "video"}`` part
  names under ``video`` / ``path`` / ``url``; each read from its container header
  (``tokenbal.index.video``: from the bytes in the row, or the file, a path used as given) and
  counted like an annotation record's videos. The video table's member of each is the row (0).
* audio: an ``audios`` column, when present, is read only to refuse the rows that have audio.

Only those columns are read (Parquet is columnar: the others are never fetched), one row group at a
time. An image's bytes sit inside a compressed column page, so a page is decompressed whole, but only
each image's first 4 KiB are copied out of Arrow and parsed (``imagesize.read_image_size``, as for a
tar member: size, orientation, end check); further ranges (its last bytes, a header past the first
4 KiB) are copied out of the column's buffer as needed. A remote file (any fsspec URL) is read
through fsspec, which fetches the footer and the needed column chunks by ranged reads.

Samples: a sample's key is ``<file name>:<row group>:<row in group>`` and its one member is
``(ext "row", offset = row group, size = row in group)``, which is how
``tokenbal.data.IndexedParquetDataset`` finds the row again. Errors, one per row, naming the file,
row group and row: an image without bytes, an image whose header cannot be read, malformed chat
turns, a row with neither images nor text nor a video, video parts and videos that disagree, a video
that cannot be read (missing file, URL, bytes that are not a video), a row whose image placeholders
(``<image>``, ``{"type": "image"}`` parts) are not one per image
(``tokenbal.index.text.placeholder_mismatch``), a row with audio (a non-empty ``audios`` column value
or audio message parts: audio is not counted).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenbal._extras import MissingExtraError
from tokenbal.estimate.conversation import content_parts
from tokenbal.index.imagesize import FIRST_READ, ImageSizeError, read_image_size
from tokenbal.index.scan import Progress, ScannedSample, ShardScan, shard_fingerprint
from tokenbal.index.text import (
    AUDIO_FIELDS,
    SampleTextError,
    audio_reason,
    chat_messages,
    image_parts,
    join_text,
    json_text,
    part_file_key,
    placeholder_mismatch,
)
from tokenbal.io.remote import RemoteReadError

PARQUET_SUFFIXES = (".parquet", ".pq")
VIDEO_COLUMN = "videos"   # read when the file has it: a row's video files (as dataset_lengths' videos column)
ROW_EXT = "row"


def is_parquet(path: str) -> bool:
    return path.lower().endswith(PARQUET_SUFFIXES)


@dataclass(frozen=True)
class ParquetOptions:
    """Which columns hold a row's images, text and videos (``None``: the defaults in the module
    docstring; videos: a ``videos`` column where the file has one)."""
    image_column: str | None = None
    text_column: str | None = None
    messages_column: str | None = None
    video_column: str | None = None

    def as_meta(self) -> dict:
        meta = {"image_column": self.image_column, "text_column": self.text_column,
                "messages_column": self.messages_column}
        if self.video_column is not None:   # only when named: indexes built before it stay comparable
            meta["video_column"] = self.video_column
        return meta


def resolve_video_column(names: list[str], opts: ParquetOptions) -> str | None:
    """The column of a row's videos in a file with columns ``names``: the one named (``ValueError``
    when absent), else ``videos`` where the file has it, else None (videos only from the parts)."""
    if opts.video_column is not None:
        if opts.video_column not in names:
            raise ValueError(f"column {opts.video_column!r} not in the file (columns: {', '.join(names)})")
        return opts.video_column
    return VIDEO_COLUMN if VIDEO_COLUMN in names else None


def resolve_columns(names: list[str], opts: ParquetOptions) -> tuple[str | None, str | None, str | None]:
    """``(image, messages, text)`` column names in a file with columns ``names``; raises
    ``ValueError`` for a named column that is absent, or when no column gives images or text."""
    have = set(names)
    for given in (opts.image_column, opts.text_column, opts.messages_column):
        if given is not None and given not in have:
            raise ValueError(f"column {given!r} not in the file (columns: {', '.join(names)})")

    def pick(given: str | None, defaults: tuple[str, ...]) -> str | None:
        return given if given is not None else next((d for d in defaults if d in have), None)

    image = pick(opts.image_column, ("images", "image"))
    if opts.text_column is not None:
        messages, text = opts.messages_column, opts.text_column
    else:
        messages = pick(opts.messages_column, ("messages", "conversations"))
        text = None if messages is not None else pick(None, ("text", "caption"))
    if image is None and messages is None and text is None:
        raise ValueError(f"no image or text column (looked for images / image, messages / conversations, "
                         f"text / caption; columns: {', '.join(names)}); name them with --image-column and "
                         "--messages-column / --text-column")
    return image, messages, text


def open_parquet(path: str, remote=None):
    """``(pyarrow.parquet.ParquetFile, size, fingerprint, extra manifest fields)`` for a local path or
    a URL (``remote``: ``tokenbal.io.remote.RemoteOptions``)."""
    from tokenbal._extras import require

    pq = require("pyarrow.parquet", "Parquet sources")

    from tokenbal.index.remote import remote_fingerprint
    from tokenbal.io import remote as rm

    if rm.is_url(path):
        opts = remote or rm.RemoteOptions()
        info = rm.object_info(path, opts)
        fp = remote_fingerprint(rm.RemoteFile(path, info["size"], opts))
        # Every ranged read of the footer and column chunks retried (fsspec's file retries none).
        f = rm.RetryingFile(path, info["size"], opts)
        extra = {"etag": info["etag"], "remote_mtime": info["remote_mtime"]}
        return pq.ParquetFile(f, page_checksum_verification=True), info["size"], fp, extra
    size = os.path.getsize(path)
    # Page CRCs, where the writer stored them (pyarrow's write_page_checksum=True), are checked: a
    # flipped bit in a text page is an error, not a silently different row length. Files written
    # without them are read unchecked (docs/remote-and-parquet.md).
    return pq.ParquetFile(path, page_checksum_verification=True), size, shard_fingerprint(path, size), {}


def scan_parquet(path: str, opts: ParquetOptions | None = None, remote=None,
                 exif: str = "ignore", progress: Progress | None = None) -> ShardScan:
    """Scan the Parquet file at ``path`` (see the module docstring); never raises for bad data.
    ``exif``: the orientation policy for image sizes, as for tar shards (``imagesize``). A row's
    image has no tar header and sits inside a column page: no member stamps, but the end check of a
    tar member's image (a value Parquet stored whole may hold an image cut short before it was
    written). ``progress(done, total, "rows")``
    after each row group scanned (a file of millions of rows takes minutes)."""
    opts = opts or ParquetOptions()
    scan = ShardScan(path=path)
    try:
        pf, scan.size, scan.fingerprint, scan.extra = open_parquet(path, remote)
        if "://" not in path:
            scan.mtime_ns = os.stat(path).st_mtime_ns
        image_col, messages_col, text_col = resolve_columns(pf.schema_arrow.names, opts)
        # an ``audios`` column (LLaMA-Factory's layout) is read to refuse its rows: audio is not counted
        audio_col = AUDIO_FIELDS[0] if AUDIO_FIELDS[0] in pf.schema_arrow.names else None
        video_col = resolve_video_column(pf.schema_arrow.names, opts)
        cols = [c for c in (image_col, messages_col, text_col, audio_col, video_col) if c is not None]
        video_files: dict[str, tuple[int, int]] = {}
        base = os.path.basename(path.rstrip("/"))
        for rg in range(pf.num_row_groups):
            table = pf.read_row_group(rg, columns=cols)
            heads, full = _image_heads(table, image_col)
            msgs = table.column(messages_col).to_pylist() if messages_col else None
            texts = table.column(text_col).to_pylist() if text_col else None
            audios = table.column(audio_col).to_pylist() if audio_col else None
            videos = table.column(video_col).to_pylist() if video_col else None
            for row in range(table.num_rows):
                scan.n_members += 1
                key = f"{base}:{rg}:{row}"
                sample = _row(scan, key, f"{path} row group {rg} row {row}", rg, row,
                              heads[row] if heads is not None else None, full, messages_col,
                              msgs[row] if msgs is not None else None,
                              texts[row] if texts is not None else None, exif,
                              audios[row] if audios is not None else None,
                              videos[row] if videos is not None else None, video_files, video_col,
                              text_col)
                if sample is not None:
                    scan.samples.append(sample)
            if progress is not None:
                progress(scan.n_members, max(pf.metadata.num_rows, scan.n_members), "rows")
        if video_files:   # a rebuild rescans the file when a video it names changed (build.py)
            scan.extra["video_files"] = [[p, size, mtime] for p, (size, mtime) in video_files.items()]
        if scan.n_members == 0:
            _file_error(scan, "empty", f"Parquet file {path} holds no rows")
    except MissingExtraError:
        raise   # no pyarrow: not this file's fault, and every other file would fail the same way
    except FileNotFoundError as e:
        _file_error(scan, "missing", f"Parquet file not found: {path}: {e}")
    except (RemoteReadError, TimeoutError, PermissionError) as e:
        # A read that failed, not the file's bytes: a read failure (rescanned by the next build).
        _file_error(scan, "unreadable", f"cannot read Parquet file {path}: {e}")
    except ValueError as e:   # a named column that is absent, no usable column
        _file_error(scan, "corrupt", f"Parquet file {path}: {e}")
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid & co: a damaged file, one error
        _file_error(scan, "corrupt", f"Parquet file {path} cannot be read: {type(e).__name__}: {e}")
    return scan


def _file_error(scan: ShardScan, status: str, reason: str) -> None:
    scan.status, scan.reason = status, reason
    scan.samples = []
    scan.errors = [{"shard": scan.path, "key": None, "reason": reason}]


def _image_heads(table, column: str | None):
    """Per row: a list of ``(first bytes or None, flat index)`` per image, and a function giving the
    whole value of flat image ``j`` (for headers past the first bytes)."""
    if column is None:
        return None, None
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = table.column(column).combine_chunks()
    listed = pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
    if listed:
        offsets = arr.offsets.to_pylist()
        valid = arr.is_valid().to_pylist()
        flat = arr.flatten()
    else:   # one image per row; a null one (a text row of a datasets Image() column) is no image
        offsets, valid, flat = list(range(len(arr) + 1)), arr.is_valid().to_pylist(), arr
    if pa.types.is_null(flat.type):
        # Arrow types a column with no image value at all as null (every row an empty list or null,
        # e.g. a file of text and video rows): no image, or images without bytes where a list holds nulls.
        return [[(None, j, None, 0) for j in range(offsets[r], offsets[r + 1])] if valid[r] else []
                for r in range(len(offsets) - 1)], lambda j: None
    if pa.types.is_struct(flat.type):
        names = [flat.type.field(i).name for i in range(flat.type.num_fields)]
        if "bytes" not in names:
            raise ValueError(f"image column {column!r} holds structs without a 'bytes' field ({names})")
        data = pc.struct_field(flat, "bytes")
        paths = pc.struct_field(flat, "path").to_pylist() if "path" in names else [None] * len(flat)
    elif pa.types.is_binary(flat.type) or pa.types.is_large_binary(flat.type):
        data, paths = flat, [None] * len(flat)
    else:
        raise ValueError(f"image column {column!r} has type {arr.type}, expected a list of "
                         "{bytes, path} structs, one such struct, or binary")
    heads = pc.binary_slice(data, 0, FIRST_READ).to_pylist()
    lengths = pc.binary_length(data).to_pylist()
    rows = []
    for r in range(len(offsets) - 1):
        if not valid[r]:
            rows.append([])
            continue
        rows.append([(heads[j], j, paths[j], lengths[j]) for j in range(offsets[r], offsets[r + 1])])
    return rows, lambda j: _Value(data, j, heads[j])


class _Value:
    """One image value of the column, read through ``pread`` (what ``imagesize`` takes): its first
    bytes from ``head``, any other range copied out of Arrow's buffer alone (not the whole value)."""

    def __init__(self, data, j: int, head: bytes) -> None:
        self._data, self._j, self._head, self._buffer = data, j, head, None

    def pread(self, n: int, offset: int) -> bytes:
        if offset + n <= len(self._head):
            return self._head[offset:offset + n]
        if self._buffer is None:
            self._buffer = self._data[self._j].as_buffer()   # zero-copy: a view of the column's data
        return self._buffer[offset:offset + n].to_pybytes()


def _row(scan: ShardScan, key: str, where: str, rg: int, row: int, images, full, messages_col,
         messages, text, exif: str = "ignore", audios=None, videos=None,
         video_files: dict | None = None, video_col: str | None = None,
         text_col: str | None = None) -> ScannedSample | None:
    def fail(reason: str) -> None:
        scan.errors.append({"shard": scan.path, "key": key, "reason": f"{where}: {reason}"})

    # The row's text column holds nothing (a null, or no chat turns): the processor has nothing to
    # render (dataset_lengths refuses such a row too). An empty string is text: an image-only row.
    if text is None and messages == [] and messages_col:
        return fail(f"column {messages_col!r} is an empty list: the row has no chat turns")
    if text is None and messages is None and (messages_col or text_col):
        named = " and ".join(repr(c) for c in (messages_col, text_col) if c)
        return fail(f"column {named} is null: the row has no text (missing data; an empty string would be "
                    "an image-only row)")

    audio = audio_reason({AUDIO_FIELDS[0]: audios, "messages": messages}, holder="column")
    if audio:
        return fail(audio)
    sizes = []
    for n, (head, j, path, length) in enumerate(images or []):
        named = f"image {n}" + (f" ({path!r})" if path else "")
        if head is None:
            return fail(f"{named} has no bytes (only a path); embed the images, e.g. datasets' "
                        "cast_column(..., Image(decode=True)) before to_parquet")
        try:
            # As a tar member's: the header (read past the first bytes where it lies further, a large
            # EXIF / ICC block), the orientation, and the end check: the value is whole as Parquet
            # stored it, but the image in it may be cut short (a download that stopped).
            wh, full_read = read_image_size(full(j), 0, length, exif=exif)
        except ImageSizeError as e:
            return fail(f"{named} is not a readable image: {e}")
        scan.n_full_reads += full_read
        sizes.append(wh)
    pieces: list[str] | None = None
    chat = None
    parts = 0
    try:
        if messages is not None:
            turns = messages
            kind = "messages"
            if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "value" in turns[0] \
                    and "content" not in turns[0]:
                kind = "conversations"
            pieces = json_text({kind: turns})
            chat = chat_messages({kind: turns})
            parts = image_parts({kind: turns})
        elif text is not None:
            if not isinstance(text, str):
                raise SampleTextError(f"text is {type(text).__name__}, not a string")
            pieces = [text]
    except SampleTextError as e:
        return fail(f"column {messages_col or 'text'!r}: {e}")
    try:
        row_videos = _row_videos(videos, chat, messages_col, video_files, video_col or VIDEO_COLUMN)
    except ValueError as e:
        return fail(str(e))
    if not sizes and not pieces and not row_videos:
        return fail("has neither images nor text nor a video")
    mismatch = placeholder_mismatch(pieces, parts, len(sizes), "the row has")
    if mismatch:
        return fail(mismatch)
    return ScannedSample(key=key, members=[(ROW_EXT, rg, row)], image_sizes=sizes,
                         text=join_text(pieces or []), chat=chat, videos=row_videos or None)


def _row_videos(value, chat: list | None, messages_col: str | None, files: dict | None,
                video_col: str = VIDEO_COLUMN) -> list:
    """The row's videos (``SampleVideo``, each held by the row, member 0), read from their container
    headers as ``dataset_lengths`` reads a row's videos: the ``videos`` column's value (paths, bytes
    or ``{bytes, path}`` structs) when it holds any, else the file each ``{"type": "video"}`` part
    names under ``video`` / ``url`` / ``path`` (a path or bytes). A path is used as given (relative
    to the working directory, as the processor opens it); its (size, mtime) go to ``files``.
    ``ValueError`` when the row has video parts but not one video per part (as
    ``text.placeholder_mismatch`` for images), or a video cannot be read."""
    from tokenbal.index.video import VideoError, probe_file, probe_video
    from tokenbal.index.videoindex import SampleVideo, part_params

    video_parts = [p for p in content_parts(chat) if p.get("type") == "video"] if chat is not None else []
    items: list[tuple[object, str, dict]] = []
    if value is not None and not (isinstance(value, list) and not value):
        listed = value if isinstance(value, list) else [value]
        items = [(v, f"{video_col}[{j}]", {}) for j, v in enumerate(listed)]
    else:
        for j, part in enumerate(video_parts):
            where = f"{messages_col} video part {j}"
            key = part_file_key(part, "video", where)
            if key is not None:
                items.append((part[key], f"{where} ({key})", part_params(part, where)))
    if video_parts and len(video_parts) != len(items):   # none: the videos go first, as images do
        raise ValueError(f"has {len(video_parts)} video part(s) in column {messages_col!r} but "
                         f"{len(items)} video(s) (the {video_col!r} column, else the files the parts "
                         "name); the processor would fail or pair text and videos wrongly")
    out = []
    for v, where, params in items:
        src = v.get("bytes") if isinstance(v, dict) and v.get("bytes") is not None else (
            v.get("path") if isinstance(v, dict) else v)
        try:
            if isinstance(src, str) and src:
                if "://" in src:
                    raise ValueError(f"video {where} {src!r} is a URL; only local video files and video "
                                     "bytes in the row are read")
                try:
                    st = os.stat(src)
                except OSError as e:
                    if files is not None:   # missing at this build: a later one rescans once it appears
                        files[os.path.abspath(src)] = (-1, -1)
                    raise VideoError(f"cannot read the video: {e}") from None
                if files is not None:   # before the header read: an unreadable file replaced is rescanned
                    files[os.path.abspath(src)] = (st.st_size, st.st_mtime_ns)
                info = probe_file(src, st)
            elif isinstance(src, (bytes, bytearray)):
                info = probe_video(bytes(src))
            else:
                raise ValueError(f"video {where} is {type(v).__name__}; expected a path, bytes or a {{bytes, "
                                 "path}} struct (a video file; frame lists are not counted)")
        except VideoError as e:
            shown = repr(src) if isinstance(src, str) else f"({len(src)} bytes)"
            raise ValueError(f"video {where} {shown}: {e}") from None
        out.append(SampleVideo(member=0, info=info, params=params))
    return out
