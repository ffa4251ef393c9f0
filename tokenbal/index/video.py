"""Video metadata from the container, without decoding: frames, fps, duration, size, rotation.

``probe_video(src)`` opens a video (a path, bytes, or a byte range of an open file such as a tar
member) with PyAV (``av``, imported lazily) and returns a :class:`VideoInfo`, or raises
:class:`VideoError` with the reason. No frame is decoded.

The frame count is the number of frames the decoder will produce, not a guess. What was measured
(PyAV 18.1 / FFmpeg 8.1; h264, vp9 and mpeg4 files written by PyAV; ``tests/tokenbal/index/test_video.py``
checks every rule below against a full decode):

* mp4 / mov (``mov,mp4,...`` demuxer): the sample table in ``moov`` is read by ``av.open`` and is
  exposed as ``stream.index_entries``: one entry per frame, exact (constant and variable rate,
  B-frames), less the entries an edit list discards (``is_discard``: a file cut with
  ``ffmpeg -ss T -c copy`` keeps the frames before T in its table, and the decoder drops them).
  No packet is read, so only the ``moov`` box is fetched from the file, plus one header read per
  top-level box: a file whose boxes do not tile it (a "faststart" file cut inside its
  ``mdat``, which opens fine and fails only when the lost frames are decoded) is an error.
* webm / mkv: ``stream.frames`` is 0 (Matroska stores no frame count) and ``index_entries`` holds
  only the cue points (keyframes). ``duration x average_rate`` is exact for constant-rate files
  (37 frames at 30 fps: 1.233 s x 30 = 37.0) but wrong for variable-rate ones (40 frames with
  33/50/100 ms gaps: the muxer records ``average_rate`` 30, so 2.412 s x 30 = 72). Counting the
  packets while demuxing (no decoding) gave the exact count in every case, so that is the rule.
  The count is taken by :func:`mkv_video_frames`, a walk over the EBML element headers that counts
  the first video track's (Simple)Blocks, lacing included (the same number as the demuxer's
  packets, about 10x cheaper than a PyAV packet object each); layouts it does not handle
  (unknown-size clusters of live-streamed WebM, damaged headers) fall back to demuxing.
* avi and anything else: packets counted the same way (an AVI header's frame count can include
  zero-size "dropped frame" packets, which the decoder turns into no frame; they are not counted).
  A packet the demuxer marks corrupt (a program stream cut inside its last pack) is an error.

``fps`` is the stream's ``average_rate`` (what decord, torchvision and transformers' PyAV loader
report and what the families' frame samplers divide by), else ``frames / duration``. For a
variable-rate Matroska file that is the nominal rate the muxer wrote, not ``frames / duration``;
``duration`` is kept so both are available.

``width`` / ``height`` are the coded frame size as decoded (decoders, including PyAV's
``to_ndarray``, torchvision and decord, do not apply the display rotation), and ``rotation`` is the
display-matrix rotation in degrees counter-clockwise (mp4 / mov ``tkhd`` matrix; 0 elsewhere),
kept for information: token counts use the decoded size, as the pipelines do.
"""

from __future__ import annotations

import io
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from tokenbal.index.boxes import boxes_fault

MAX_SIDE = 32768                 # larger frames are refused: no real clip is bigger, and a damaged
MAX_FRAME_PIXELS = 1 << 28       # header must not make a reader allocate gigabytes per frame
_MOOV_LIMIT = 64 << 20


class VideoError(ValueError):
    """A video that cannot be indexed; the message says why."""


@dataclass(frozen=True)
class VideoInfo:
    frames: int          # frames the decoder produces
    fps: float           # the stream's average rate (see the module docstring)
    duration: float      # seconds
    width: int           # decoded frame size (rotation not applied)
    height: int
    rotation: int = 0    # display rotation, degrees counter-clockwise
    codec: str = ""
    container: str = ""


class _Slice(io.RawIOBase):
    """A read-only, seekable view of ``size`` bytes at ``offset`` of an open file descriptor (or of
    anything with ``pread(n, offset)``: a remote shard's ranged reads), so PyAV reads only what it
    needs of a tar member (for mp4 just the ``moov`` box)."""

    def __init__(self, fd: Any, offset: int, size: int) -> None:
        super().__init__()
        self.fd, self.offset, self.size, self.pos = fd, offset, size, 0
        self._pread = fd.pread if hasattr(fd, "pread") else (lambda n, at: os.pread(fd, n, at))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        left = self.size - self.pos
        if n is None or n < 0 or n > left:
            n = max(left, 0)
        if n == 0:
            return b""
        data = self._pread(n, self.offset + self.pos)
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


# A path, the bytes, or (an open fd or an object with pread(n, offset), offset, size).
VideoSource = str | bytes | bytearray | memoryview | tuple[Any, int, int]


def _file(src: VideoSource):
    if isinstance(src, str):
        return open(src, "rb")
    if isinstance(src, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(src))
    fd, offset, size = src
    return _Slice(fd, offset, size)


def _size(src: VideoSource) -> int:
    if isinstance(src, str):
        return os.path.getsize(src)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return len(src)
    return int(src[2])


# For containers whose header lists the streams (mp4 / mov, Matroska), FFmpeg's stream probing
# need not decode anything: the decoder skips every frame and only the header is read (h264:
# ~6 ms -> ~0.5 ms per 320x180 clip). FFmpeg's native vp9 decoder ignores skip_frame, so a vp9
# WebM still decodes its first frames here (measured in scripts/bench_video.py).
_HEADER_ONLY = {"skip_frame": "all", "probesize": "32"}


def _header_listed(f) -> bool:
    f.seek(0)
    head = f.read(12)
    f.seek(0)
    return head[:4] == b"\x1a\x45\xdf\xa3" or head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide")


def _av():
    from tokenbal._extras import require

    # A MissingExtraError, not a per-sample error: every video would fail the same way.
    return require("av", "video samples")


def _open(f, header_only: bool = False):
    av = _av()

    try:
        return av.open(f, mode="r", options=_HEADER_ONLY if header_only and _header_listed(f) else None)
    except av.error.FFmpegError as e:
        # e.g. an mp4 cut short: its moov box (written last by most muxers) is missing
        raise VideoError(f"not a readable video container ({e.strerror or e}; truncated or not a "
                         "video?)") from None
    except (ValueError, UnicodeDecodeError) as e:   # PyAV surfaces some probe errors so
        raise VideoError(f"not a readable video container ({e})") from None


def probe_video(src: VideoSource) -> VideoInfo:
    """Metadata of the video at ``src`` (a path, bytes, or ``(fd, offset, size)``) without decoding;
    :class:`VideoError` for an empty, unreadable, audio-only, zero-frame or absurdly large video."""
    av = _av()

    try:
        if _size(src) == 0:
            raise VideoError("empty (0-byte) video")
        f = _file(src)
    except OSError as e:
        raise VideoError(f"cannot read the video: {e}") from None
    with f:
        c = _open(f, header_only=True)
        v = c.streams.video
        if v and (int(v[0].width or 0) <= 0 or int(v[0].height or 0) <= 0):
            # The header-only probe can leave a stream's size unset (an MPEG-4 Part 2 stream before
            # another video stream in an mp4): probe it as FFmpeg does by default before judging it.
            c.close()
            f.seek(0)
            c = _open(f)
        try:
            if not c.streams.video:
                kinds = sorted({s.type for s in c.streams})
                if kinds:
                    raise VideoError(f"no video stream (only {', '.join(kinds)}: audio-only?)")
                raise VideoError("no stream with any frames (a video track with zero frames?)")
            s = c.streams.video[0]
            w, h = int(s.width or 0), int(s.height or 0)
            if w <= 0 or h <= 0:
                raise VideoError(f"video stream has no usable frame size ({w}x{h}: missing, or too large "
                                 "for FFmpeg to accept); damaged header?")
            if w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_FRAME_PIXELS:
                raise VideoError(f"frame size {w}x{h} is implausible (max side {MAX_SIDE}, "
                                 f"max {MAX_FRAME_PIXELS} pixels); damaged header?")
            fmt = c.format.name
            try:
                frames = None
                if fmt.startswith("mov,"):
                    # An edit list (``ffmpeg -ss T -c copy``, a trimmed end) leaves samples in the table
                    # that the demuxer marks discarded and the decoder never outputs.
                    frames = sum(1 for e in s.index_entries if not e.is_discard)
                elif fmt.startswith("matroska"):
                    # its own handle (PyAV keeps its own read position), buffered: the walk reads
                    # a few bytes per block, which would otherwise be a system call each
                    raw = _file(src)
                    g = raw if isinstance(raw, io.BytesIO) else io.BufferedReader(raw, 4096)
                    with g:
                        frames = mkv_video_frames(g, _size(src))
                if frames is None:
                    frames = _demuxed_frames(c, s)
            except av.error.FFmpegError as e:
                raise VideoError(f"cannot read the video's packets: {e}") from None
            if frames <= 0:
                raise VideoError("video stream has no frames")
            duration = 0.0
            if s.duration is not None and s.time_base is not None:
                duration = float(s.duration * s.time_base)
            elif c.duration is not None:
                duration = c.duration / 1_000_000
            rate = s.average_rate or s.guessed_rate
            fps = float(rate) if rate else (frames / duration if duration > 0 else 0.0)
            if not (math.isfinite(fps) and fps > 0):
                raise VideoError("video has no frame rate and no duration")
            rotation = 0
            if fmt.startswith("mov,"):
                cut = _mp4_cut(f)
                if cut:
                    raise VideoError(cut)
                rotation = _mp4_rotation(f)
            return VideoInfo(frames=frames, fps=fps, duration=duration, width=w, height=h,
                             rotation=rotation, codec=s.codec_context.name, container=fmt.split(",")[0])
        finally:
            c.close()


def count_decoded_frames(src: VideoSource) -> int:
    """Frames a full decode produces: the slow reference for :func:`probe_video`."""
    with _file(src) as f:
        c = _open(f)
        try:
            return sum(1 for _ in c.decode(video=0))
        finally:
            c.close()


def decode_frames(src: VideoSource, indices) -> object:
    """Frames ``indices`` (0-based decode order, repeats allowed) as a uint8 array (T, H, W, 3), RGB,
    rotation not applied (as the families' readers give them)."""
    import numpy as np

    want = [int(i) for i in indices]
    if not want:
        raise VideoError("no frames requested")
    needed = set(want)
    last = max(want)
    got: dict[int, object] = {}
    with _file(src) as f:
        c = _open(f)
        try:
            for i, frame in enumerate(c.decode(video=0)):
                if i in needed:
                    got[i] = frame.to_ndarray(format="rgb24")
                if i >= last:
                    break
        finally:
            c.close()
    missing = sorted(needed - set(got))
    if missing:
        raise VideoError(f"video decodes to fewer frames than indexed: frame {missing[0]} is missing")
    return np.stack([got[i] for i in want])


# --- mp4 / mov display matrix ------------------------------------------------------------------

def _boxes(buf: bytes, start: int, end: int):
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", buf, pos)
        head = 8
        if size == 1 and pos + 16 <= end:
            size, head = struct.unpack_from(">Q", buf, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < head or pos + size > end:
            return
        yield kind, pos + head, pos + size
        pos += size


def _mp4_cut(f) -> str | None:
    """Why an mp4 / mov file is cut short or damaged, from its top-level box sizes; ``None`` if they
    tile the file. A "faststart" file (``moov`` first) cut inside ``mdat`` opens and lists every
    frame, and fails only when the lost frames are decoded: its ``mdat`` box says how long it was."""
    f.seek(0, 2)
    total = f.tell()

    def read(n: int, at: int) -> bytes:
        f.seek(at)
        return f.read(n)

    return boxes_fault(read, total)


def _read_moov(f) -> bytes | None:
    f.seek(0, 2)
    total = f.tell()
    pos = 0
    while pos + 8 <= total:
        f.seek(pos)
        head = f.read(16)
        if len(head) < 8:
            return None
        size, kind = struct.unpack_from(">I4s", head)
        if size == 1 and len(head) >= 16:
            size = struct.unpack_from(">Q", head, 8)[0]
        elif size == 0:
            size = total - pos
        if size < 8:
            return None
        if kind == b"moov":
            if size > _MOOV_LIMIT:
                return None
            f.seek(pos)
            return f.read(size)
        pos += size
    return None


def _mp4_rotation(f) -> int:
    """Rotation (degrees counter-clockwise, a multiple of 90) of the first video track's ``tkhd``
    matrix; 0 when there is none or it cannot be read (informational only)."""
    try:
        moov = _read_moov(f)
    except OSError:
        return 0
    if not moov:
        return 0
    for kind, a, b in _boxes(moov, 8, len(moov)):
        if kind != b"trak":
            continue
        tkhd = None
        video = False
        for k2, a2, b2 in _boxes(moov, a, b):
            if k2 == b"tkhd":
                tkhd = (a2, b2)
            elif k2 == b"mdia":
                for k3, a3, _b3 in _boxes(moov, a2, b2):
                    if k3 == b"hdlr" and moov[a3 + 8:a3 + 12] == b"vide":
                        video = True
        if video and tkhd is not None:
            a2, b2 = tkhd
            version = moov[a2]
            m = a2 + 4 + (32 if version == 1 else 20) + 8 + 8   # times/ids/duration, reserved, layer...
            if m + 36 > b2:
                return 0
            ma, mb, _u, mc, md = struct.unpack_from(">iiiii", moov, m)
            if not (ma or mb or mc or md):
                return 0
            # The tkhd matrix maps stored -> displayed pixels (clockwise angles); FFmpeg reports
            # the counter-clockwise angle, as PyAV's VideoFrame.rotation does.
            deg = math.degrees(math.atan2(mb, ma))
            return int(round(-deg / 90.0)) * 90 % 360 if deg else 0
    return 0


# --- Matroska / WebM block count -----------------------------------------------------------------
# Demuxing through PyAV costs ~10 us per packet (a Python object each); walking the EBML element
# headers and counting the video track's blocks gives the same number (checked against a full
# decode in the tests) at a fraction of that, reading only element headers.

_EBML_UNKNOWN = object()
_SEGMENT, _CLUSTER, _TRACKS, _TRACK_ENTRY = 0x18538067, 0x1F43B675, 0x1654AE6B, 0xAE
_TRACK_NUMBER, _TRACK_TYPE, _SIMPLE_BLOCK, _BLOCK_GROUP, _BLOCK = 0xD7, 0x83, 0xA3, 0xA0, 0xA1


def _read_vint(f, keep_marker: bool):
    first = f.read(1)
    if not first:
        return None, 0
    b = first[0]
    if b == 0:
        raise ValueError("invalid EBML length")
    n = 8 - b.bit_length() + 1
    rest = f.read(n - 1) if n > 1 else b""
    if len(rest) != n - 1:
        return None, 0
    value = b if keep_marker else b & ((1 << (8 - n)) - 1)
    for x in rest:
        value = (value << 8) | x
    if not keep_marker and value == (1 << (7 * n)) - 1:
        return _EBML_UNKNOWN, n
    return value, n


def _elements(f, end: int):
    """(id, payload start, payload size or _EBML_UNKNOWN) of the elements from ``f.tell()`` to ``end``;
    the consumer may move ``f`` between items."""
    pos = f.tell()
    while pos < end:
        f.seek(pos)
        eid, _ = _read_vint(f, keep_marker=True)
        if eid is None:
            return
        size, _ = _read_vint(f, keep_marker=False)
        if size is None:
            return
        at = f.tell()
        yield eid, at, size
        if size is _EBML_UNKNOWN:
            return
        pos = at + size


def _block_frames(f, at: int, size: int, counts: dict) -> None:
    f.seek(at)
    track, n = _read_vint(f, keep_marker=False)
    if track is None or track is _EBML_UNKNOWN or size < n + 3:
        raise ValueError("bad block header")
    f.seek(at + n + 2)
    flags = f.read(1)[0]
    frames = 1
    if flags & 0x06:                     # laced: the lace count follows the flags
        frames = f.read(1)[0] + 1
    counts[track] = counts.get(track, 0) + frames


class MatroskaCut(VideoError):
    """A Matroska / WebM file that ends inside an element its header says is longer (an interrupted
    download or copy): the frames after the cut are lost, and the block at it would be counted."""


def _demuxed_frames(container, stream) -> int:
    """The video packets a demux of ``stream`` yields (zero-size "dropped frame" packets excluded).

    A read that runs past the end of the file (an MPEG program stream cut inside its last pack) gives
    a short packet that the demuxer marks corrupt, and the parser cuts it into frames the decoder
    partly cannot decode (a file cut at half its size: 37 packets, 36 frames). So a corrupt packet is
    an error, as a cut mp4 or Matroska file is, not a count."""
    frames = 0
    for i, packet in enumerate(container.demux(stream)):
        if packet.is_corrupt:
            raise VideoError(f"cut short or damaged: the demuxer marks packet {i} of the video stream "
                             "corrupt (a read past the end of the file?)")
        frames += packet.size > 0
    return frames


def mkv_video_frames(f, total: int) -> int | None:
    """Blocks of the first video track of a Matroska / WebM file, or ``None`` when the layout is
    one this walk does not handle (unknown-size clusters, damaged headers): then demux instead.
    Raises :class:`MatroskaCut` for a file whose segment or a cluster runs past its end (as a cut mp4
    is an error, not the frames before the cut)."""
    try:
        f.seek(0)
        counts: dict[int, int] = {}
        video_tracks: list[int] = []
        for eid, at, size in _elements(f, total):
            if eid != _SEGMENT:
                continue
            if size is not _EBML_UNKNOWN and at + size > total:
                raise MatroskaCut(f"cut short: its segment declares {at + size} bytes, the file has {total}")
            seg_end = total if size is _EBML_UNKNOWN else at + size
            f.seek(at)
            for cid, cat, csize in _elements(f, seg_end):
                if csize is _EBML_UNKNOWN:
                    return None
                if cat + csize > total:
                    raise MatroskaCut(f"cut short: a cluster at byte {cat} runs to byte {cat + csize}, the "
                                      f"file ends at {total}")
                if cid == _TRACKS:
                    video_tracks += _video_track_numbers(f, cat, cat + csize)
                elif cid == _CLUSTER:
                    f.seek(cat)
                    for bid, bat, bsize in _elements(f, cat + csize):
                        if bsize is _EBML_UNKNOWN:
                            return None
                        if bid == _SIMPLE_BLOCK:
                            _block_frames(f, bat, bsize, counts)
                        elif bid == _BLOCK_GROUP:
                            f.seek(bat)
                            for gid, gat, gsize in _elements(f, bat + bsize):
                                if gid == _BLOCK and gsize is not _EBML_UNKNOWN:
                                    _block_frames(f, gat, gsize, counts)
            break
        if not video_tracks:
            return None
        return counts.get(video_tracks[0], 0)
    except MatroskaCut:
        raise
    except (ValueError, IndexError, OSError):
        return None


def _video_track_numbers(f, start: int, end: int) -> list[int]:
    out = []
    f.seek(start)
    for eid, at, size in _elements(f, end):
        if eid == _TRACK_ENTRY and size is not _EBML_UNKNOWN:
            number = kind = None
            f.seek(at)
            for tid, tat, tsize in _elements(f, at + size):
                if tid in (_TRACK_NUMBER, _TRACK_TYPE) and tsize is not _EBML_UNKNOWN and tsize <= 8:
                    f.seek(tat)
                    v = int.from_bytes(f.read(tsize), "big")
                    if tid == _TRACK_NUMBER:
                        number = v
                    else:
                        kind = v
            if kind == 1 and number is not None:
                out.append(number)
    return out


# Videos of dataset rows (dataset_lengths, the packed Trainer collator, annotation records of the
# index). Headers read from files are kept by (path, size, mtime): rows often share a video (several
# questions on one clip); a changed file has a new key. Bounded: cleared when full.
_PROBED: dict[tuple, VideoInfo] = {}
_PROBED_MAX = 1 << 16


def probe_file(path: str, st: os.stat_result | None = None) -> VideoInfo:
    """``probe_video(path)``, read once per process for each (path, size, mtime) (``st``: the
    file's ``os.stat`` when the caller has it)."""
    try:
        st = os.stat(path) if st is None else st
    except OSError as e:
        raise VideoError(f"cannot read the video: {e}") from None
    key = (path, st.st_size, st.st_mtime_ns)
    info = _PROBED.get(key)
    if info is None:
        info = probe_video(path)
        if len(_PROBED) >= _PROBED_MAX:
            _PROBED.clear()
        _PROBED[key] = info
    return info


def probe_row_video(value: object, row: int, where: str) -> VideoInfo:
    """The :class:`VideoInfo` of one row video (a path, bytes, or a
    ``{"bytes", "path"}`` dict), else ``ValueError`` naming the row, the field and the file."""
    src, name = value, None
    if isinstance(value, dict):
        src = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(src, (str, os.PathLike)):
        name = os.fspath(src)
        if "://" in name:
            raise ValueError(f"row {row}: video {where} {name!r} is a URL; only local video files are read")
    elif isinstance(src, (bytes, bytearray, memoryview)):
        src = bytes(src)
    else:
        raise ValueError(f"row {row}: video {where} is a {type(value).__name__}; expected a path, bytes or a "
                         "{bytes, path} dict (a video file; decoded frame lists are not counted)")
    try:
        return probe_file(name) if name is not None else probe_video(src)
    except (VideoError, OSError, ImportError) as e:
        label = f" ({name!r})" if name else f" ({len(src)} bytes)"
        raise ValueError(f"row {row}: video {where}{label}: {e}") from e
