"""Video metadata from container headers (tokenbal.index.video) against a full decode, on real files
written with PyAV; bad videos give a reason."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest

pytest.importorskip("av")

from tests.helpers.videos import huge_header_avi, write_audio_only, write_no_frames, write_video  # noqa: E402
from tokenbal.index.video import (  # noqa: E402
    VideoError,
    count_decoded_frames,
    decode_frames,
    mkv_video_frames,
    probe_video,
)

NTSC = Fraction(30000, 1001)
CASES = [   # name, frames, width, height, fps, extra
    ("cfr.mp4", 37, 34, 18, 30, {}),
    ("ntsc.mp4", 45, 20, 30, NTSC, {}),
    ("vfr.mp4", 40, 32, 32, 30, {"gaps_ms": [33, 50, 100]}),
    ("cfr.webm", 37, 34, 18, 30, {}),
    ("odd.webm", 23, 33, 17, NTSC, {}),
    ("vfr.webm", 40, 32, 32, 30, {"gaps_ms": [33, 50, 100]}),
    ("ntsc.mkv", 45, 20, 30, NTSC, {}),
    ("pal.avi", 31, 32, 16, 25, {}),
    ("program.mpg", 40, 32, 16, 25, {"codec": "mpeg2video"}),
    ("mpeg4.mov", 50, 16, 16, NTSC, {}),
    ("one.webm", 1, 18, 10, 24, {}),
    ("portrait.mp4", 12, 18, 32, 24, {}),
]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return {name: write_video(str(d / name), n, w, h, fps, **kw) for name, n, w, h, fps, kw in CASES}


@pytest.mark.parametrize("name,n,w,h,fps,kw", CASES, ids=[c[0] for c in CASES])
def test_header_equals_decode(videos, name, n, w, h, fps, kw):
    path = videos[name]
    info = probe_video(path)
    assert info.frames == count_decoded_frames(path) == n
    assert (info.width, info.height) == (w, h)
    assert info.duration > 0
    if name.endswith((".webm", ".mkv")):   # the EBML block walk itself, not the demux fallback
        with open(path, "rb") as f:
            assert mkv_video_frames(f, os.path.getsize(path)) == n
    if not kw:      # constant rate: the stored rate is the one written
        assert info.fps == pytest.approx(float(fps), rel=1e-6)
    # the same from bytes and from a byte range of a bigger file (a tar member)
    data = open(path, "rb").read()
    assert probe_video(data) == info
    padded = path + ".padded"
    with open(padded, "wb") as f:
        f.write(b"\0" * 777 + data + b"\1" * 99)
    fd = os.open(padded, os.O_RDONLY)
    try:
        assert probe_video((fd, 777, len(data))) == info
    finally:
        os.close(fd)


def test_vfr_mp4_rate_is_frames_over_duration(videos):
    info = probe_video(videos["vfr.mp4"])
    assert info.fps == pytest.approx(info.frames / info.duration, rel=1e-3)


def test_duration_times_rate_is_wrong_for_vfr_matroska(videos):
    # The finding behind counting packets: Matroska stores the nominal rate, so duration x rate
    # overcounts a variable-rate clip while the packet count is exact.
    info = probe_video(videos["vfr.webm"])
    assert round(info.duration * info.fps) != info.frames == count_decoded_frames(videos["vfr.webm"])


def test_matroska_with_audio_counts_the_video_track(tmp_path):
    import av
    import numpy as np

    path = str(tmp_path / "av.mkv")
    with av.open(path, "w") as out:
        a = out.add_stream("aac", rate=8000)
        v = out.add_stream("h264", rate=24)
        v.width, v.height, v.pix_fmt = 16, 16, "yuv420p"
        for i in range(30):
            img = np.full((16, 16, 3), i * 8, np.uint8)
            for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
            af = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            af.sample_rate, af.pts = 8000, i * 1024
            for p in a.encode(af):
                out.mux(p)
        for s in (v, a):
            for p in s.encode():
                out.mux(p)
    with open(path, "rb") as f:
        assert mkv_video_frames(f, os.path.getsize(path)) == 30
    assert probe_video(path).frames == count_decoded_frames(path) == 30


@pytest.mark.parametrize("deg", [0, 90, 180, 270])
def test_rotation_matches_decoder(tmp_path, deg):
    import av

    path = write_video(str(tmp_path / f"r{deg}.mp4"), 4, 16, 32, 30, rotation=deg)
    with av.open(path) as c:
        decoded = next(c.decode(video=0)).rotation
    info = probe_video(path)
    assert info.rotation == decoded % 360 == deg
    assert (info.width, info.height) == (16, 32)      # stored size: decoders do not rotate


def test_decode_frames_picks_indices(videos):
    frames = decode_frames(videos["cfr.webm"], [0, 5, 5, 36])
    assert frames.shape == (4, 18, 34, 3)
    assert (frames[1] == frames[2]).all() and not (frames[0] == frames[1]).all()
    with pytest.raises(VideoError, match="frame 37 is missing"):
        decode_frames(videos["cfr.webm"], [37])


def test_bad_videos(tmp_path, videos):
    data = open(videos["cfr.mp4"], "rb").read()
    small = write_video(str(tmp_path / "raw.avi"), 3, 2, 2, 10, codec="rawvideo")
    cases = {
        "moov missing": (data[: len(data) // 2], "not a readable video container"),
        "garbage": (b"not a video" * 50, "not a readable video container"),
        "empty": (b"", "empty"),
        "audio only": (write_audio_only(str(tmp_path / "a.mp4")), "audio-only"),
        "no frames": (write_no_frames(str(tmp_path / "z.mp4")), "zero frames"),
        "huge": (huge_header_avi(str(tmp_path / "h.avi"), small), "frame size"),
        "missing": (str(tmp_path / "nope.mp4"), "cannot read"),
    }
    for src, reason in cases.values():
        with pytest.raises(VideoError, match=reason):
            probe_video(src)


@pytest.mark.parametrize("name", ["ntsc.mkv", "cfr.webm", "vfr.webm"])
@pytest.mark.parametrize("keep", [0.5, 0.8])
def test_a_matroska_file_cut_short_is_an_error_not_a_frame_too_many(videos, name, keep):
    # An interrupted download: the walk would count the block at the cut, which the decoder never gives.
    data = open(videos[name], "rb").read()
    with pytest.raises(VideoError, match=r"cut short: (its segment declares|a cluster at byte)"):
        probe_video(data[:int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.3, 0.5, 0.7, 0.9])
def test_a_cut_program_stream_is_refused_or_counted_exactly(videos, keep):
    # The demux fallback (no header count in MPEG-PS): the packet at the cut is short, and the parser
    # cuts frames from it that the decoder cannot decode all of.
    data = open(videos["program.mpg"], "rb").read()
    cut = data[:int(len(data) * keep)]
    try:
        frames = probe_video(cut).frames
    except VideoError as e:
        assert "cut short" in str(e)
        return
    assert frames == count_decoded_frames(cut)


@pytest.mark.slow
def test_long_clips_header_equals_decode(tmp_path):
    for name, fps, seconds in (("long.mp4", NTSC, 120), ("long.webm", 25, 60)):
        n = int(seconds * fps)
        path = write_video(str(tmp_path / name), n, 16, 16, fps)
        info = probe_video(path)
        assert info.frames == count_decoded_frames(path) == n
        assert info.duration == pytest.approx(seconds, rel=0.01)


def _box(buf: bytes, path: list[bytes], start: int = 0, end: int | None = None) -> int:
    """Offset of the box at ``path`` (e.g. moov / trak / edts / elst) in an mp4's bytes."""
    import struct

    end = len(buf) if end is None else end
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", buf, pos)
        if kind == path[0]:
            return pos if len(path) == 1 else _box(buf, path[1:], pos + 8, pos + size)
        pos += size
    raise AssertionError(f"no {path[0]!r} box")


@pytest.mark.parametrize("trim", ["start", "end"])
def test_an_edit_list_counts_the_frames_the_decoder_gives(tmp_path, trim):
    # `ffmpeg -ss T -c copy` keeps the frames before T in the sample table behind an edit list that
    # starts at T: the decoder drops them, and so must the count (not len(index_entries)).
    import struct

    import av
    import numpy as np

    src = str(tmp_path / "src.mp4")
    with av.open(src, "w") as out:
        s = out.add_stream("h264", rate=30)
        s.width, s.height, s.pix_fmt, s.options = 64, 48, "yuv420p", {"g": "10"}
        for i in range(60):
            img = np.full((48, 64, 3), (7 * i) % 251, np.uint8)
            out.mux(s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(s.encode())
    buf = bytearray(open(src, "rb").read())
    pos = _box(buf, [b"moov", b"trak", b"edts", b"elst"])      # version 0, one entry
    duration, media_time = struct.unpack_from(">Ii", buf, pos + 16)
    if trim == "start":                                        # play from frame 20 (timescale 15360)
        struct.pack_into(">Ii", buf, pos + 16, duration * 40 // 60, media_time + 20 * 512)
    else:                                                      # play the first 30 frames only
        struct.pack_into(">Ii", buf, pos + 16, duration // 2, media_time)
    path = str(tmp_path / "trimmed.mp4")
    open(path, "wb").write(buf)
    assert probe_video(path).frames == count_decoded_frames(path) == (40 if trim == "start" else 30)


def test_an_mpeg4_stream_before_another_video_stream_is_probed_with_its_size(tmp_path):
    # The header-only probe leaves such a stream's size unset (0x0): it is probed again in full, not
    # refused as a damaged header.
    import av
    import numpy as np

    path = str(tmp_path / "two.mp4")
    with av.open(path, "w") as out:
        streams = []
        for codec, w, h in (("mpeg4", 32, 32), ("h264", 64, 48)):
            s = out.add_stream(codec, rate=10)
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            streams.append(s)
        for i in range(20):
            for s in streams:
                img = np.full((s.height, s.width, 3), i * 10, np.uint8)
                out.mux(s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        for s in streams:
            out.mux(s.encode())
    info = probe_video(path)
    assert (info.width, info.height, info.codec) == (32, 32, "mpeg4")
    assert info.frames == count_decoded_frames(path) == 20
