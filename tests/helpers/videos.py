"""Real video files for the tests, written with PyAV (h264 / vp9 / mpeg4, constant or variable rate)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

CODEC_OF = {"mp4": "h264", "mov": "mpeg4", "mkv": "h264", "webm": "libvpx-vp9", "avi": "mpeg4"}


def write_video(path: str, n: int, width: int, height: int, fps: float | Fraction = 30, *,
                codec: str | None = None, gaps_ms: list[int] | None = None, rotation: int = 0,
                noise: bool = False, faststart: bool = False) -> str:
    """``n`` frames of ``width`` x ``height`` at ``fps``; ``gaps_ms`` (cycled) makes the frame
    timestamps irregular (variable frame rate); ``rotation`` sets a display matrix (mp4 / mov);
    ``noise`` moving random texture (a realistic bitrate, hence decode cost) instead of a ramp;
    ``faststart`` writes an mp4's ``moov`` box before its ``mdat`` (as streaming sites serve them)."""
    import av

    ext = path.rsplit(".", 1)[-1]
    codec = codec or CODEC_OF[ext]
    rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
    out = av.open(path, "w", options={"movflags": "faststart"} if faststart else None)
    try:
        s = out.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        if codec == "libvpx-vp9":
            s.options = {"deadline": "realtime", "cpu-used": "8"}
        if rotation:
            s.set_display_rotation(rotation)
        tb = Fraction(1, 1000)
        if gaps_ms:
            s.codec_context.time_base = tb
        t = 0
        ramp = np.arange(width, dtype=np.int64)[None, :, None]
        texture = np.random.default_rng(0).integers(0, 256, (height, 2 * width, 3), dtype=np.uint8)
        for i in range(n):
            if noise:
                shift = (5 * i) % width
                img = texture[:, shift:shift + width]
            else:
                img = np.broadcast_to((ramp * 3 + 9 * i) % 251, (height, width, 3)).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            if gaps_ms:
                frame.pts, frame.time_base = t, tb
                t += gaps_ms[i % len(gaps_ms)]
            for p in s.encode(frame):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    finally:
        out.close()
    return path


def write_audio_only(path: str) -> str:
    import av

    out = av.open(path, "w", format="mp4")
    try:
        s = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            out.mux(p)
        for p in s.encode():
            out.mux(p)
    finally:
        out.close()
    return path


def write_no_frames(path: str) -> str:
    """An mp4 with a video track header and not a single frame."""
    import av

    out = av.open(path, "w")
    try:
        s = out.add_stream("h264", rate=30)
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        out.start_encoding()
    finally:
        out.close()
    return path


def huge_header_avi(path: str, small_avi: str) -> str:
    """``small_avi`` (rawvideo) with its frame size patched to 100000 x 100000 in both headers."""
    import struct

    data = bytearray(open(small_avi, "rb").read())
    strf = data.find(b"strf")
    struct.pack_into("<ii", data, strf + 12, 100000, 100000)
    avih = data.find(b"avih")
    struct.pack_into("<II", data, avih + 8 + 32, 100000, 100000)
    with open(path, "wb") as f:
        f.write(data)
    return path


def import_without_torchvision(modname: str):
    """Import ``modname`` (a transformers video-processor module or ``qwen_vl_utils``), which imports
    torchvision at the top, with shape-only torchvision stand-ins that exist only during the import
    (torchvision cannot be installed beside this torch build). Only the frame-sampling and sizing
    functions of the module are used as oracles; ``resize`` returns an empty tensor of the asked size."""
    import contextlib
    import importlib
    import sys
    import types

    import torch

    def resize(video, size, *args, **kwargs):
        return torch.empty((*video.shape[:-2], int(size[0]), int(size[1])), dtype=torch.uint8)

    names = ["torchvision", "torchvision.io", "torchvision.transforms", "torchvision.transforms.functional",
             "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    stubs = {n: types.ModuleType(n) for n in names}
    for n in names[1:]:
        parent, child = n.rsplit(".", 1)
        setattr(stubs[parent], child, stubs[n])
    stubs["torchvision"].__version__ = "0.0"
    stubs["torchvision.transforms"].InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic")
    stubs["torchvision.transforms.functional"].resize = resize
    stubs["torchvision.transforms.v2.functional"].resize = resize
    # transformers asks importlib whether torchvision is installed (a cached answer); asked first with
    # the stubs in place, importlib raises on them (no __spec__): ask before they go in
    with contextlib.suppress(ImportError):
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    saved = {n: sys.modules.get(n) for n in [*names, modname]}
    sys.modules.pop(modname, None)
    sys.modules.update(stubs)
    try:
        return importlib.import_module(modname)
    finally:
        for n, v in saved.items():
            if n == modname:
                continue
            if v is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = v
