"""Scan one webdataset tar shard: member byte ranges, samples, image sizes and text, and errors.

Samples follow the webdataset key convention: a member's *key* is its name up to the first dot of
the basename, directories kept (``a/b/0001.0.jpg`` -> key ``a/b/0001``, extension ``0.jpg``); all
members of one key must be adjacent in the tar. A member is an image when the last dot-component
of its extension (lower case) is an image type, so ``k.jpg``, ``k.0.jpg``, ``k.1.png`` and
``k.left.webp`` are all images of sample ``k``, kept in tar member order.

Members are listed by ``tokenbal.io.tar`` (a raw header walk, ~5x faster than ``tarfile``)
whenever it can do so exactly as ``tarfile`` would; anything else, including every damaged header,
is listed by ``tarfile`` itself, so the rules below are ``tarfile``'s behaviour plus the tail check.

Shard damage policy: CPython's ``tarfile`` treats a damaged header after the first member as the end
of the archive *silently*, so after the scan everything from the end of the last member to EOF must
be zeros and at least 1024 bytes (the two end-of-archive blocks). A shard that fails that check, or
that ``tarfile`` cannot read to the end, is indexed *not at all*: its status is ``corrupt`` or
``truncated`` and one shard-level error is recorded. Salvaging the members before the damage would
risk indexing a sample that lost some of its members with it, and is one ``tar`` repair away anyway.

Sample errors (each one recorded with shard, key and reason, never a crash): an image member that is
empty or not a readable image, a text member that is not UTF-8 / valid JSON or has a malformed
schema, a JSON with no known text field, a video member that is not a readable video
(``tokenbal.index.video.probe_video``: the reason), a sample with neither images, videos nor text
(an empty caption with no image or video included: it would be a 0-token sample), a text whose image
placeholders are not one per image (``tokenbal.index.text.placeholder_mismatch``), an image cut
short (no end marker, ``imagesize``), non-adjacent members of a key, a duplicated member name, a
non-regular member, a GNU sparse member (its stored bytes are not its contents, so it cannot be read
by offset); and per member: a name with no extension or not valid UTF-8. A shard path that is not a
regular file (a FIFO, a device) is status ``unreadable``, never opened for reading.

Member stamps: every member's own ustar header checksum and mtime (``tokenbal.io.tar.header_stamp``) are
kept per member and hashed, with names, offsets and sizes, into the shard's ``headers_digest``:
``verify`` and the reader use them to catch a member rewritten in place at the same size.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenbal.index.imagesize import IMAGE_EXTS, PREFIX_BYTES, ImageSizeError, pread_exact, read_image_size
from tokenbal.index.text import (
    TEXT_EXTS,
    SampleTextError,
    join_text,
    member_text,
    placeholder_mismatch,
    video_slot_mismatch,
)
from tokenbal.index.video import VideoError, probe_video
from tokenbal.io.tar import TarMember, header_stamp, walk_members

AnyMember = TarMember | tarfile.TarInfo      # the fast walk's members, or tarfile's
VIDEO_EXTS = frozenset({"mp4", "avi", "mkv", "webm", "mov", "m4v", "flv", "mpeg", "mpg"})
FINGERPRINT_SPAN = 1 << 20
# How often a scan reports its progress within one file: every this many bytes of a tar shard,
# JSONL or JSON file scanned, every this many samples whose text is counted (``build.index_shard``).
# Counts, not the clock: the reports of a file are the same on every run.
PROGRESS_BYTES = 4 << 20
PROGRESS_ROWS = 2000
# (done, total, unit): unit "B" (bytes of the file), "rows" (of a Parquet file), "samples" (whose
# text tokens are counted) or HEADERS (a tar shard's member listing: done is the offset of the header
# the walk reached, total the shard's bytes; the listing comes before the shard's "B" reports)
Progress = Callable[[int, int, str], None]
HEADERS = "headers"


class ProgressMarks:
    """One phase's reports of one file: ``progress(done, total, unit)`` each time ``done`` passes
    ``PROGRESS_BYTES`` more (``at``), and ``(total, total, unit)`` at the end (``end``). A count, not a
    clock; ``done`` never goes back (a listing restarted by ``tarfile`` reports only past the walk)."""

    def __init__(self, progress: Progress | None, total: int, unit: str) -> None:
        self.progress, self.total, self.unit, self.reported = progress, total, unit, 0

    def at(self, done: int) -> None:
        if self.progress is not None and done - self.reported >= PROGRESS_BYTES:
            self.progress(done, self.total, self.unit)
            self.reported = done

    def end(self) -> None:
        if self.progress is not None:
            self.progress(self.total, self.total, self.unit)
_EOF_BLOCKS = 1024   # a tar ends with two 512-byte zero blocks
COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


@dataclass
class ScannedSample:
    key: str
    members: list[tuple[str, int, int]]      # (extension as stored, payload offset, payload size)
    image_sizes: list[tuple[int, int]]       # (width, height) per image member, in member order
    text: str
    paths: list[str] | None = None           # annotation sources: "name\0absolute path" per member
    videos: list | None = None               # tokenbal.index.videoindex.SampleVideo per video member
    stamps: list[tuple[int, int]] | None = None   # (header checksum, mtime) per member; -1 unknown
    chat: list | None = None                 # chat turns for a processor's template (index/text.py)


@dataclass
class ShardScan:
    path: str
    size: int = 0
    mtime_ns: int = 0
    fingerprint: str | None = None
    status: str = "ok"                       # ok | empty | corrupt | truncated | missing | unreadable
    reason: str | None = None
    n_members: int = 0
    end_of_members: int = 0
    n_full_reads: int = 0                    # images whose header did not fit in the read prefix
    headers_digest: str | None = None        # hash of every member's name, range and stamp
    # Samples left out because a read failed (an I/O error, a remote read that ran out of retries),
    # not because of their bytes: such a shard is never reused as "unchanged" (a rebuild retries it).
    n_read_failures: int = 0
    samples: list[ScannedSample] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)   # more manifest entry fields (remote: etag, ...)


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name by the webdataset convention; ``None`` without a dot."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:      # no dot, or a dot-file like "dir/.hidden": no key
        return None
    return name[:dot], name[dot + 1:]


def member_kind(ext: str) -> str:
    """``image`` | ``text`` | ``video`` | ``other`` for a member extension."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in IMAGE_EXTS:
        return "image"
    if last in TEXT_EXTS:
        return "text"
    if last in VIDEO_EXTS:
        return "video"
    return "other"


# Compression suffixes webdataset's decoders strip (``gzfilter`` for .gz) or users add: a member
# ``k.jpg.gz`` is an image the index cannot read without decompressing it.
COMPRESSED_SUFFIXES = ("gz", "bz2", "xz", "zst", "lz4")


def compressed_kind(ext: str) -> str | None:
    """The kind (``image`` / ``text`` / ``video``) of a compressed member extension such as
    ``jpg.gz``; ``None`` for anything else (``npy.gz`` included: not counted either way)."""
    inner, _, last = ext.lower().rpartition(".")
    if last not in COMPRESSED_SUFFIXES or not inner:
        return None
    kind = member_kind(inner)
    return kind if kind != "other" else None


def shard_fingerprint(path: str, size: int | None = None) -> str:
    """Hash of the file size and its first and last MiB.

    Size alone is not enough: tar pads to 10 KiB records, so a rewritten shard often keeps its size.
    A change confined to the middle of a shard larger than 2 MiB is not detected (the cost of
    hashing whole multi-GB shards at every verify is not worth it for the common failure: a shard
    regenerated with different samples changes its first or last MiB).
    """
    if size is None:
        size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(min(size, FINGERPRINT_SPAN)))
        if size > FINGERPRINT_SPAN:
            f.seek(max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN))
            h.update(f.read(FINGERPRINT_SPAN))
    return "blake2b:" + h.hexdigest()


def regular_file_stat(path: str) -> os.stat_result:
    """``os.stat(path)``, raising ``OSError`` naming the kind when it is not a regular file: opening
    a FIFO for reading blocks until a writer appears, i.e. forever for a build."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        mode = st.st_mode
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise OSError(f"{path} is {kind}, not a regular file; shards must be regular files")
    return st


def headers_digest(members: list) -> str:
    """Hash of (name, payload offset, size, header checksum, header mtime) of every member."""
    h = hashlib.blake2b(digest_size=16)
    for m in members:
        line = f"{m.name}\0{m.offset_data}:{m.size}:{m.chksum}:{m.mtime}\n"
        h.update(line.encode("utf-8", "surrogateescape"))
    return "blake2b:" + h.hexdigest()


def list_shard_members(path: str) -> tuple[list[AnyMember], ShardScan]:
    """Every member of the shard at ``path``, with stamps (header checksum and mtime), and the scan
    state that says whether the listing is complete (``status == "ok"``); no payload is read."""
    scan = ShardScan(path=path)
    st = regular_file_stat(path)
    scan.size, scan.mtime_ns = st.st_size, st.st_mtime_ns
    members = _list_members(path, scan)
    if scan.status == "ok":
        _check_tail(path, scan)
    return members, scan


def scan_shard(path: str, prefix: int = PREFIX_BYTES, exif: str = "ignore",
               progress: Progress | None = None) -> ShardScan:
    """Scan the shard at ``path`` (see the module docstring for the rules). Never raises for bad
    data or a missing/unreadable file: those end up in ``.status``/``.reason`` and ``.errors``.
    ``exif``: the orientation policy for image sizes (``imagesize.read_image_size``).
    ``progress(done, total, unit)`` is called as the members are listed (unit ``HEADERS``: ``done`` the
    offset of the header reached, every ``PROGRESS_BYTES`` of the shard, and (size, size) once the
    listing is complete), then as the samples are read (unit ``"B"``: ``done`` the end of the last
    sample read, every ``PROGRESS_BYTES`` of the shard, and (size, size) at the end)."""
    scan = ShardScan(path=path)
    try:
        st = regular_file_stat(path)
        scan.size, scan.mtime_ns = st.st_size, st.st_mtime_ns
        scan.fingerprint = shard_fingerprint(path, st.st_size)
        listing = ProgressMarks(progress, scan.size, HEADERS)
        members = _list_members(path, scan, listing)
        if scan.status == "ok":
            _check_tail(path, scan)
        if scan.status == "ok":
            listing.end()
            scan.headers_digest = headers_digest(members)
            _read_samples(path, members, scan, prefix, exif, progress)
    except FileNotFoundError as e:
        shard_error(scan, "missing", f"shard not found: {e}")
    except OSError as e:
        shard_error(scan, "unreadable", f"cannot read shard: {e}")
    if scan.status != "ok":
        scan.samples = []
        scan.errors = [e for e in scan.errors if e["key"] is None]   # the shard error says it all
    return scan


def shard_error(scan: ShardScan, status: str, reason: str) -> None:
    scan.status, scan.reason = status, reason
    scan.errors.append({"shard": scan.path, "key": None, "reason": reason})


def _list_members(path: str, scan: ShardScan, listing: ProgressMarks | None = None) -> list[AnyMember]:
    listing = listing or ProgressMarks(None, scan.size, HEADERS)
    if scan.size == 0:
        shard_error(scan, "empty", "shard is an empty (0-byte) file")
        return []
    with open(path, "rb") as f:
        magic = f.read(6)
    for sig, name in COMPRESSED_MAGIC.items():
        if magic.startswith(sig):
            shard_error(scan, "corrupt", f"shard is {name}-compressed; only uncompressed tar shards can be "
                                          "indexed for random access (decompress it first)")
            return []
    fd = os.open(path, os.O_RDONLY)
    try:
        fast = walk_members(fd, scan.size, listing.at, PROGRESS_BYTES)
    finally:
        os.close(fd)
    if fast is not None:
        members, scan.end_of_members = fast
        scan.n_members = len(members)
        if not members:
            shard_error(scan, "empty", "shard is a valid tar with no members")
        return members
    members = _list_with_tarfile(path, scan, listing)
    if scan.status == "ok":
        # tarfile's TarInfo.mtime may come from a PAX record; the stamp is the ustar header's own.
        fd = os.open(path, os.O_RDONLY)
        try:
            for ti in members:
                ti.chksum, ti.mtime = header_stamp(os.pread(fd, 512, ti.offset_data - 512))
        finally:
            os.close(fd)
    return members


def _list_with_tarfile(path: str, scan: ShardScan, listing: ProgressMarks) -> list[AnyMember]:
    # Anything unusual (a bad header, a truncation, exotic member types): tarfile judges it.
    members: list[AnyMember] = []
    try:
        with tarfile.open(path, "r:") as tf:
            try:
                for ti in tf:
                    members.append(ti)
                    listing.at(ti.offset)
            finally:
                scan.end_of_members = tf.offset
    except tarfile.TarError as e:
        where = f"after member #{len(members)} ({members[-1].name!r})" if members else "at the first header"
        status = "truncated" if "unexpected end of data" in str(e) else "corrupt"
        shard_error(scan, status, f"shard is {status}: tarfile cannot read it {where}: {e}")
        return []
    scan.n_members = len(members)
    if not members:
        shard_error(scan, "empty", "shard is a valid tar with no members")
    return members


def _check_tail(path: str, scan: ShardScan) -> None:
    with open(path, "rb") as f:
        check_tail(lambda n, offset: os.pread(f.fileno(), n, offset), scan)


def check_tail(pread: Callable[[int, int], bytes], scan: ShardScan) -> None:
    """After the last member a tar holds only zeros, at least the end-of-archive marker: anything
    else is a damaged header that hid the members behind it. ``pread(n, offset)`` reads the shard
    (a local file or a remote object alike)."""
    end, size = scan.end_of_members, scan.size
    pos = end
    while pos < size:
        chunk = pread(min(1 << 20, size - pos), pos)
        if not chunk:
            break
        if chunk.count(0) != len(chunk):
            first = pos + next(i for i, b in enumerate(chunk) if b)
            shard_error(scan, "corrupt",
                         f"shard is corrupt or truncated: tarfile stopped at byte {end} after "
                         f"{scan.n_members} members, but byte {first} of {size} is not zero "
                         "(a damaged member header; the members after it are unreadable)")
            return
        pos += len(chunk)
    if size - end < _EOF_BLOCKS:
        shard_error(scan, "truncated",
                     f"shard is truncated: only {size - end} bytes after the last member at byte {end}, "
                     f"the end-of-archive marker needs {_EOF_BLOCKS} zero bytes")


def _read_samples(path: str, members: list[AnyMember], scan: ShardScan, prefix: int, exif: str,
                  progress: Progress | None = None) -> None:
    runs = group_members(members, scan)
    fd = os.open(path, os.O_RDONLY)
    read = ProgressMarks(progress, scan.size, "B")
    try:
        for key, run in runs:
            sample = read_sample(fd, key, run, scan, prefix, exif)
            if sample is not None:
                scan.samples.append(sample)
            read.at(run_end(run))
    finally:
        os.close(fd)
    read.end()


def run_end(run: list[AnyMember]) -> int:
    """The shard offset where a sample's members end (its progress mark)."""
    return run[-1].offset_data + run[-1].size


def group_members(members: list[AnyMember], scan: ShardScan) -> list[tuple[str, list[AnyMember]]]:
    """Runs of adjacent members with the same key; bad members and keys go to ``scan.errors``."""
    runs: list[tuple[str, list[AnyMember]]] = []
    for ti in members:
        if ti.isdir():
            continue
        name = ti.name
        if "/" not in name and name.startswith("__") and name.endswith("__"):
            continue   # webdataset's convention for shard-level metadata members
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:   # tarfile keeps undecodable bytes as surrogates
            shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            scan.errors.append({"shard": scan.path, "key": shown,
                                "reason": f"member name {shown!r} is not valid UTF-8"})
            continue
        split = split_name(name)
        if split is None:
            scan.errors.append({"shard": scan.path, "key": name,
                                "reason": f"member {name!r} has no extension, so it belongs to no sample"})
            continue
        key = split[0]
        if runs and runs[-1][0] == key:
            runs[-1][1].append(ti)
        else:
            runs.append((key, [ti]))
    count: dict[str, int] = {}
    for key, _ in runs:
        count[key] = count.get(key, 0) + 1
    good, reported = [], set()
    for key, run in runs:
        if count[key] == 1:
            good.append((key, run))
        elif key not in reported:
            reported.add(key)
            names = [ti.name for k, r in runs if k == key for ti in r]
            scan.errors.append({"shard": scan.path, "key": key, "reason": (
                f"sample {key!r}: its members are not adjacent in the shard ({count[key]} separate runs: "
                f"{', '.join(map(repr, names))}); the key is duplicated or the shard is not grouped")})
    return good


def read_sample(fd: int, key: str, run: list[AnyMember], scan: ShardScan,
                 prefix: int, exif: str = "ignore") -> ScannedSample | None:
    def fail(reason: str) -> None:
        scan.errors.append({"shard": scan.path, "key": key, "reason": f"sample {key!r}: {reason}"})

    chat: list | None = None
    seen: set[str] = set()
    members, sizes, pieces, videos = [], [], [], []
    has_text_member, parts = False, 0
    for ti in run:
        ext = ti.name[len(key) + 1:]
        if isinstance(ti, tarfile.TarInfo) and ti.issparse():
            return fail(f"member {ti.name!r} is a GNU sparse file: its stored bytes are not its contents, "
                        "so it cannot be read by offset (re-create the shard without --sparse)")
        if not ti.isfile():
            return fail(f"member {ti.name!r} is not a regular file (tar type {ti.type!r})")
        # webdataset lower-cases extensions, so k.JPG and k.jpg would collide when loading.
        if ext.lower() in seen:
            return fail(f"member {ti.name!r} appears twice")
        seen.add(ext.lower())
        members.append((ext, ti.offset_data, ti.size))
        kind = member_kind(ext)
        packed = compressed_kind(ext) if kind == "other" else None
        if packed is not None:
            codec = ext.rsplit(".", 1)[1]
            return fail(f"member {ti.name!r} is a compressed {packed} member ({codec}), which the index "
                        "does not decompress: the sample would be counted without it; store it uncompressed")
        try:
            if kind == "image":
                wh, full = read_image_size(fd, ti.offset_data, ti.size, prefix, exif)
                sizes.append(wh)
                scan.n_full_reads += full
            elif kind == "text":
                has_text_member = True
                got, turns, image_parts = member_text(ext.lower(), pread_exact(fd, ti.size, ti.offset_data))
                parts += image_parts
                if got is not None:
                    pieces.extend(got)
                if turns is not None:
                    chat = turns if chat is None else chat + turns   # two JSON members: both, in order
            elif kind == "video":
                videos.append(_probe_member(fd, ti, len(members) - 1))
        except VideoError as e:
            return fail(f"member {ti.name!r} is not a readable video: {e}")
        except ImageSizeError as e:
            return fail(f"member {ti.name!r} is not a readable image: {e}")
        except SampleTextError as e:
            return fail(f"member {ti.name!r}: {e}")
        except OSError as e:
            scan.n_read_failures += 1
            return fail(f"cannot read member {ti.name!r}: {e}")
    if has_text_member and not pieces:   # only JSON members, none with a known text field
        return fail("no text found: its JSON has none of conversations / messages / text / caption")
    if not sizes and not has_text_member and not videos:
        names = ", ".join(repr(ti.name) for ti in run)
        return fail(f"has neither images nor text nor a video (members: {names})")
    mismatch = (placeholder_mismatch(pieces, parts, len(sizes), "the sample has")
                or video_slot_mismatch(chat, len(videos), "the sample has"))
    if mismatch:
        return fail(mismatch)
    text = join_text(pieces)
    if not sizes and not videos and not text.strip():
        return fail("its text is empty and it has no image or video: it would be a 0-token sample")
    return ScannedSample(key=key, members=members, image_sizes=sizes, text=text,
                         videos=videos or None, stamps=[(ti.chksum, ti.mtime) for ti in run], chat=chat)


def _probe_member(fd: Any, ti: AnyMember, position: int):
    from tokenbal.index.videoindex import SampleVideo

    return SampleVideo(member=position, info=probe_video((fd, ti.offset_data, ti.size)))
