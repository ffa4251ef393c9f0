"""Video token plans per model family: which frames the family's pipeline feeds the model, and how
many placeholder, special and text tokens one video costs.

``plan_video(est, req)`` takes a vision estimator (``get_estimator(...)``) and a
:class:`VideoRequest` (the container's frame count / fps / size, plus the per-video options of a
Qwen-style message part: ``fps``, ``min_frames``, ``max_frames``, ``nframes``, ``video_start``,
``video_end``) and returns a :class:`VideoPlan`: the source frame numbers to decode, in order, the
``<video>`` placeholder count, the special tokens around them, and the plain-text pieces
(timestamps, frame labels) that the processor inserts, to be counted with the text tokenizer.
``video_pipeline(est)`` names the rules (it goes into the index manifest); ``None`` means the
family has no video support here.

Rules (ports of transformers 5.24 and qwen-vl-utils 0.0.14, operation for operation):

* Clip fields ``video_start`` / ``video_end`` (seconds) cut the clip the way qwen-vl-utils'
  ``calculate_video_frame_range`` does (start frame ``ceil(start * fps)``, end frame
  ``floor(end * fps)``, inclusive); every family then samples within that range. Frame numbers in
  the plan (and the timestamps) are those of the source video.
* Qwen2-VL / Qwen2.5-VL, ``pipeline="hf"``: ``Qwen2VLVideoProcessor.sample_frames``
  (``do_sample_frames=True``): ``n`` from fps (floor to even) or ``nframes`` (round to even),
  frames ``torch.arange(0, total, total / n).int()``; then the frames are pre-sampled input to the
  estimator. ``pipeline="qwen-vl-utils"``: ``smart_nframes`` and ``linspace(start, end, n).round()``
  (the decord / torchcodec readers). Qwen3-VL ``hf``: ``Qwen3VLVideoProcessor.sample_frames``
  (``int(total / fps * 2)`` clamped to [min, max], ``linspace(0, total-1, n).round()``), and one
  ``<t seconds>`` text per temporal pair (``Qwen3VLProcessor._calculate_timestamps``).
* LLaVA-OneVision: ``BaseVideoProcessor`` default sampling (``arange(n) * total // n``) with
  ``nframes`` / the estimator's ``video_frames`` / ``fps``; all frames without any of them.
* InternVL: ``InternVLVideoProcessor.sample_frames`` (``initial_shift=True``:
  ``arange(total/n/2, total, total/n).int()``, the official ``get_index`` segment midpoints),
  ``n`` = ``nframes`` or the estimator's ``video_frames`` (``num_segments``); text
  ``"Frame{i}: "`` before each frame, joined by newlines.
* GLM-4.1V: ``Glm4vVideoProcessor.sample_frames`` (2 fps, ``max_duration`` 300 s, duplicates
  dropped, padded to even; without ``do_sample_frames`` every frame), 3-D ``smart_resize`` over the
  whole clip with the class ``size`` (12544 .. 47040000 pixels), the frames padded to a multiple of
  ``temporal_patch_size`` by repeating the last (``patchify``), per temporal patch
  ``<|begin_of_image|>`` + placeholders + ``<|end_of_image|>`` + ``str(int(t))``, and
  ``<|begin_of_video|>`` / ``<|end_of_video|>``. Other settings of a loaded video processor:
  :class:`GlmVideoSettings` (transformers 5.19-5.25 alike).
* SmolVLM (through its processor only, ``tokenbal.estimate.chat_video``; not in ``plan_video``):
  :func:`smolvlm_frames`, ``SmolVLMVideoProcessor.sample_frames`` (``round(fps * duration)``
  frames capped at ``num_frames``, a second skipped at each end of long clips, ``linspace``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GLM_VIDEO = {"fps": 2.0, "max_duration": 300, "min_pixels": 112 * 112, "max_pixels": 28 * 28 * 2 * 30000}


@dataclass(frozen=True)
class GlmVideoSettings:
    """What of a ``Glm4vVideoProcessor`` changes a video's count: its ``fps`` and ``max_duration``
    (``sample_frames``), ``size.shortest_edge`` / ``size.longest_edge`` (``min_pixels`` /
    ``max_pixels`` of the 3-D ``smart_resize``), the patch geometry, and ``do_sample_frames``
    (``sample``; off: every frame). The defaults are the class's (= the checkpoints')."""

    fps: float = GLM_VIDEO["fps"]
    max_duration: int = GLM_VIDEO["max_duration"]
    min_pixels: int = GLM_VIDEO["min_pixels"]
    max_pixels: int = GLM_VIDEO["max_pixels"]
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    sample: bool = True


@dataclass(frozen=True)
class VideoRequest:
    frames: int                  # frames in the source video (``VideoInfo.frames``)
    fps: float                   # its average rate
    width: int
    height: int
    sample_fps: float | None = None      # message part ``fps``
    min_frames: int | None = None
    max_frames: int | None = None
    nframes: int | None = None
    start: float | None = None           # ``video_start`` (s)
    end: float | None = None             # ``video_end`` (s)


@dataclass(frozen=True)
class VideoPlan:
    indices: tuple[int, ...]     # source frame numbers fed to the processor, in order
    tokens: int                  # placeholder tokens
    special: int                 # special tokens around them (vision start/end, per-frame markers)
    texts: tuple[str, ...]       # plain text the processor inserts (timestamps, frame labels)
    grid: tuple[int, int, int] | None = None   # (t, h, w) patches, for the Qwen / GLM families


def video_pipeline(est) -> str | None:
    """A name for the video rules of ``est`` (recorded in the index manifest), or ``None``."""
    fam = getattr(est, "family", None)
    if fam in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"):
        if est.pipeline == "qwen-vl-utils":
            return f"{fam}: qwen-vl-utils 0.0.14 fetch_video (smart_nframes, linspace frames) -> processor"
        return f"{fam}: transformers {fam.replace('.', '_').replace('-', '_')} video processor sample_frames"
    if fam == "llava-onevision":
        return "llava-onevision: transformers BaseVideoProcessor sampling, 384^2 frames pooled to 196 tokens"
    if fam == "internvl":
        return "internvl: transformers InternVLVideoProcessor sampling (initial_shift), one tile per frame"
    if fam == "glm-4.1v":
        return f"glm-4.1v: transformers Glm4vVideoProcessor sample_frames {GLM_VIDEO}"
    return None


def clip_range(frames: int, fps: float, start: float | None, end: float | None) -> tuple[int, int]:
    """(first, last) frame, inclusive, of the clip; qwen-vl-utils ``calculate_video_frame_range``."""
    if start is None and end is None:
        return 0, frames - 1
    duration = frames / fps
    first = math.ceil(max(0.0, min(start, duration)) * fps) if start is not None else 0
    last = min(math.floor(max(0.0, min(end, duration)) * fps), frames - 1) if end is not None else frames - 1
    if first >= last:
        raise ValueError(f"clip video_start={start} video_end={end} selects frames {first}..{last} of a "
                         f"{duration:.2f} s video ({frames} frames at {fps:g} fps): empty")
    return first, last


def plan_video(est, req: VideoRequest, glm: GlmVideoSettings | None = None) -> VideoPlan:
    """The :class:`VideoPlan` of one video (``ValueError`` with the reason when the family's
    pipeline would reject it, or has no video support). ``glm``: a GLM-4.1V video processor's
    settings (default: the class's, with ``est``'s patch geometry)."""
    fam = getattr(est, "family", None)
    if req.frames <= 0 or req.width <= 0 or req.height <= 0 or not (req.fps > 0):
        raise ValueError(f"video {req.frames} frames {req.width}x{req.height} at {req.fps} fps: "
                         "nothing to sample")
    if req.nframes is not None and req.sample_fps is not None:
        raise ValueError("a video part may give either fps or nframes, not both")
    first, last = clip_range(req.frames, req.fps, req.start, req.end)
    total = last - first + 1
    if fam in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"):
        return _qwen(est, req, first, last, total)
    if fam == "llava-onevision":
        rel = _default_sample(total, req.fps, req.nframes or est.video_frames, req.sample_fps)
        idx = tuple(first + i for i in rel)
        e = est.replace(video_frames=None)     # the frames are sampled already
        return VideoPlan(idx, int(e.video_tokens(len(idx), req.width, req.height)), 0, ())
    if fam == "internvl":
        n = req.nframes or est.video_frames
        if n is None and req.sample_fps is not None:
            n = int(total / req.fps * req.sample_fps)
        if n is None:
            n = total
        if not 0 < n <= total:
            raise ValueError(f"InternVL samples {n} frames from a clip of {total}")
        rel = _torch_arange_int(total / n / 2, total, total / n)
        idx = tuple(first + i for i in rel)
        texts = tuple(("" if i == 0 else "\n") + f"Frame{i + 1}: " for i in range(len(idx)))
        e = est.replace(video_frames=None)     # the frames are sampled already
        return VideoPlan(idx, int(e.video_tokens(len(idx), req.width, req.height)),
                         int(e.video_wrapper_tokens(len(idx))), texts)
    if fam == "glm-4.1v":
        return _glm(est, req, first, total, glm)
    raise ValueError(f"estimator {getattr(est, 'name', est)!r} has no video support")


def _torch_arange_int(start: float, stop: float, step: float) -> list[int]:
    # transformers samples with a float32 torch.arange; reproduce it bit for bit with torch itself
    import torch

    return torch.arange(start, stop, step).int().tolist()


def _default_sample(total: int, fps: float, num_frames: int | None, sample_fps: float | None) -> list[int]:
    """transformers ``default_sample_indices_fn``."""
    if num_frames is None and sample_fps is not None:
        num_frames = max(1, int(total / fps * sample_fps))
    if num_frames is None:
        return list(range(total))
    if num_frames > total:
        raise ValueError(f"asked for {num_frames} frames of a clip of {total}")
    return (np.arange(num_frames, dtype=int) * total // num_frames).tolist()


def _qwen(est, req: VideoRequest, first: int, last: int, total: int) -> VideoPlan:
    from tokenbal.estimate.qwen import qwen2_frame_indices

    over = {}
    if req.sample_fps is not None:
        over["video_fps"] = float(req.sample_fps)
    if req.min_frames is not None:
        over["video_min_frames"] = int(req.min_frames)
    if req.max_frames is not None:
        over["video_max_frames"] = int(req.max_frames)
    e = est.replace(**over) if over else est
    k = 2
    if e.pipeline == "qwen-vl-utils":
        if req.nframes is not None:
            n = round(req.nframes / k) * k
            if not k <= n <= total:
                raise ValueError(f"nframes={req.nframes} -> {n}: needs {k} <= n <= {total}")
        else:
            n = e.sampled_frames(total, req.fps)
        idx = tuple(np.linspace(first, last, n).round().astype(np.int64).tolist())
        # the video_grid of exactly n sampled frames: pin smart_nframes to n
        pinned = e.replace(video_min_frames=n, video_max_frames=n)
        grid = pinned.video_grid(n, req.width, req.height, pinned.video_fps)
    else:
        if e.family == "qwen3-vl":
            if req.nframes is not None:
                # Qwen3VLVideoProcessor.sample_frames takes num_frames as it is, above the clip's
                # frame count too (linspace repeats frames)
                n = int(req.nframes)
                if n <= 0:
                    raise ValueError(f"nframes={n}: no frames to sample")
            else:
                n = e.sampled_frames(total, req.fps)
            rel = np.linspace(0, total - 1, n).round().astype(int).tolist()
        else:
            if req.nframes is not None:
                # Qwen2VLVideoProcessor.sample_frames rounds num_frames to its temporal patch
                tp = e.temporal_patch_size
                n = round(req.nframes / tp) * tp
                if not 0 < n <= total:
                    raise ValueError(f"nframes={req.nframes} -> {n}: the clip has {total} frames")
            else:
                n = e.sampled_frames(total, req.fps)
            # refused where the processor's float arange picks the frame after the clip (IndexError)
            rel = qwen2_frame_indices(total, n, e.family)
        idx = tuple(first + i for i in rel)
        grid = e.video_grid(len(idx), req.width, req.height, None)   # pre-sampled frames
    t, gh, gw = grid
    tokens = t * gh * gw // (e.merge_size * e.merge_size)
    special = 2 if e.family != "qwen3-vl" else 2 + 2 * t
    texts: tuple[str, ...] = ()
    if e.family == "qwen3-vl":
        ts = [i / req.fps for i in idx]
        if len(ts) % k:
            ts += [ts[-1]] * (k - len(ts) % k)
        texts = tuple(f"<{(ts[i] + ts[i + k - 1]) / 2:.1f} seconds>" for i in range(0, len(ts), k))
    return VideoPlan(idx, int(tokens), special, texts, (int(t), int(gh), int(gw)))


def _glm(est, req: VideoRequest, first: int, total: int, video: GlmVideoSettings | None = None) -> VideoPlan:
    from tokenbal.estimate.qwen import smart_resize_3d

    v = video or GlmVideoSettings(patch_size=est.patch_size, merge_size=est.merge_size,
                                  temporal_patch_size=est.temporal_patch_size)
    last = total - 1
    if not v.sample:
        uniq = list(range(total))
    else:
        fps = req.sample_fps if req.sample_fps is not None else v.fps
        duration = total / req.fps
        if duration <= v.max_duration:
            n = max(int(math.floor(duration * fps)), 1)
            rel = [min(last, int(math.ceil(i * req.fps / fps))) for i in range(n)]
        else:
            num = int(v.max_duration * fps)
            if num >= total:
                rel = list(range(total))
            else:
                seconds = np.linspace(0, duration, num, endpoint=True)
                rel = [min(last, int(math.ceil(t * req.fps))) for t in seconds]
        uniq = list(dict.fromkeys(rel))
        if len(uniq) & 1:          # sample_frames pads to even, whatever temporal_patch_size is
            uniq.append(uniq[-1])
    idx = tuple(first + i for i in uniq)
    tp = v.temporal_patch_size
    f = v.patch_size * v.merge_size
    h, w = smart_resize_3d(len(idx), req.height, req.width, tp, f, v.min_pixels, v.max_pixels)
    # patchify repeats the last frame up to a multiple of temporal_patch_size
    t, gh, gw = -(-len(idx) // tp), h // v.patch_size, w // v.patch_size
    per = gh * gw // (v.merge_size * v.merge_size)
    # replace_video_token: every second frame's timestamp, the first t of them, the last repeated
    stamps = [i / req.fps for i in idx][::2][:t]
    stamps += stamps[-1:] * (t - len(stamps))
    return VideoPlan(idx, t * per, 2 + 2 * t, tuple(str(int(s)) for s in stamps), (t, gh, gw))


def smolvlm_frames(total: int, fps: float, num_frames: int, sample_fps: float,
                   skip_secs: float = 1) -> list[int]:
    """``SmolVLMVideoProcessor.sample_frames`` (transformers 5.19-5.25, the same code on each): the
    source frames it keeps of a ``total``-frame clip at ``fps`` with ``num_frames`` (its maximum)
    and ``sample_fps`` (its target rate): ``round(sample_fps * duration)`` frames capped at
    ``num_frames`` (at least 1), ``skip_secs`` cut from both ends when the clip is long enough,
    ``linspace(start, end, n)`` truncated to int, duplicates dropped."""
    duration = total / fps
    desired = max(1, min(int(round(sample_fps * duration)), num_frames))
    start, end = 0, total - 1
    if skip_secs > 0 and (duration - 2 * skip_secs) > (num_frames * sample_fps):
        start, end = int(skip_secs * fps), int(total - skip_secs * fps)
    start, end = max(0, start), min(end, total - 1)
    if start >= end:
        start, end = 0, total - 1
    return np.unique(np.linspace(start, end, desired, dtype=int)).tolist()
