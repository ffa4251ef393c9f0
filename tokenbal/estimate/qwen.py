"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL: exact vision placeholder counts without touching pixels.

An image of H x W pixels is resized by ``smart_resize`` to H' x W' (multiples of
``factor = patch_size * merge_size``, area within [min_pixels, max_pixels]); the processor then emits
``image_grid_thw = (1, H'/patch, W'/patch)`` and the prompt gets ``(H'/factor) * (W'/factor)``
``<|image_pad|>`` tokens between ``<|vision_start|>`` and ``<|vision_end|>``.

The functions below are ports of transformers 5.24 (``models/qwen2_vl/image_processing_qwen2_vl.py``,
``models/qwen2_vl/video_processing_qwen2_vl.py``, ``models/qwen3_vl/video_processing_qwen3_vl.py``)
and of qwen-vl-utils 0.0.14 (``vision_process.py``), operation for operation, because the counts
are sensitive to details: Python's ``round`` is half-to-even (H=70 -> round(2.5)=2 -> 56 px), the
``max(factor, ...)`` guards, and the 200:1 aspect-ratio error. The numpy versions use the same
float64 operations in the same order (IEEE division, sqrt, floor/ceil are correctly rounded in both
Python and numpy, and ``np.round`` is also half-to-even), so they agree bit for bit; the tests check
this on dense scans.

Two preprocessing pipelines exist in the wild and give different counts (research note §1, §7):

* ``pipeline="hf"`` (default): only the transformers processor, configured like the official
  checkpoint (hub ``preprocessor_config.json`` / ``video_preprocessor_config.json``). With a source
  ``fps``, video frames are sampled by the processor's own ``sample_frames`` at ``video_fps``
  (``do_sample_frames=True``; Qwen3's default, opt-in for Qwen2/2.5); with ``fps=None`` the
  ``num_frames`` frames are taken as already sampled (``do_sample_frames=False``).
* ``pipeline="qwen-vl-utils"``: the models' README recipe, ``qwen_vl_utils.process_vision_info``
  (0.0.14: token-based bounds, ``smart_nframes``, a per-clip pixel budget) followed by the
  processor. For Qwen2/2.5-VL the README lets the processor resize again (``processor_resize=True``);
  for Qwen3-VL it passes ``do_resize=False`` (``processor_resize=False``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenbal.estimate._sizes import as_dim, as_side, pair_dims
from tokenbal.estimate.base import PatchGridEstimator

MAX_RATIO = 200  # transformers and qwen-vl-utils both refuse images more elongated than 200:1
QVU_FRAME_FACTOR = 2  # qwen-vl-utils FRAME_FACTOR (frames are sampled in pairs)

PIPELINES = ("hf", "qwen-vl-utils")


# --------------------------------------------------------------------------------------------------
# smart_resize ports (scalar) — argument order (height, width) as in the originals


def _ratio_error(height: int, width: int, what: str = "image") -> ValueError:
    ratio = max(height, width) / min(height, width)
    return ValueError(
        f"{what} {width}x{height} (width x height) has aspect ratio {ratio:.4g}, above the {MAX_RATIO}:1 "
        f"limit of Qwen's smart_resize (the HF processor raises on it)"
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers ``qwen2_vl`` ``smart_resize``: returns (resized_height, resized_width)."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise _ratio_error(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _composed_ratio_error(w0: int, h0: int, w: int, h: int) -> ValueError:
    return ValueError(
        f"image {w0}x{h0} (width x height): qwen-vl-utils resizes it to {w}x{h}, aspect ratio "
        f"{max(h, w) / min(h, w):.4g}, above the {MAX_RATIO}:1 limit, so the processor's own resize raises"
    )


def qvu_smart_resize(
    height: int, width: int, factor: int, min_pixels: float, max_pixels: float
) -> tuple[int, int]:
    """qwen-vl-utils 0.0.14 ``smart_resize``. Differs from transformers' for sides <= factor/2
    (``max(factor, round(...))`` instead of relying on the min-pixels upscale) and has no
    ``max(factor, ...)`` guard when downscaling (research note §7.3)."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise _ratio_error(height, width)
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_3d(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    *,
    check_frames: bool = True,
    upscale_small: bool = True,
    ceil_frames: bool = False,
) -> tuple[int, int]:
    """transformers ``qwen3_vl`` video ``smart_resize``: the pixel budget covers the whole clip
    (``t * h * w``) and sides shorter than ``factor`` are first scaled up.

    The keywords select an older release's variant (:func:`tokenbal.hf_compat.qwen3_vl_video_resize`
    reads them off the installed one): ``upscale_small=False`` refuses a side shorter than
    ``factor`` (4.57-5.9), ``ceil_frames=True`` rounds the frame count up to the temporal patch
    (5.6-5.9; others round half to even), ``check_frames=False`` accepts fewer frames than the
    temporal patch (5.6-5.9)."""
    if check_frames and num_frames < temporal_factor:
        raise ValueError(
            f"video has {num_frames} frame(s) after sampling; Qwen3-VL's video smart_resize needs at least "
            f"temporal_patch_size={temporal_factor}"
        )
    if height < factor or width < factor:
        if not upscale_small:
            raise ValueError(f"video frame {width}x{height} (width x height) has a side shorter than "
                             f"{factor}, which this transformers' Qwen3-VL video smart_resize refuses")
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise _ratio_error(height, width, "video frame")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if ceil_frames:
        t_bar = math.ceil(num_frames / temporal_factor) * temporal_factor
    else:
        t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# --------------------------------------------------------------------------------------------------
# vectorised ports: same float64 operations in the same order as the scalar ones


def _check_ratio_np(h: np.ndarray, w: np.ndarray) -> None:
    # max > 200 * min in exact int64 arithmetic equals the float test max / min > 200 for any side
    # below 2**40 (a ratio just above 200 differs from 200 by >= 1/min, far more than float64's
    # rounding), and it is several times cheaper than a division over the whole batch
    over = np.maximum(h, w) > MAX_RATIO * np.minimum(h, w)
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(f"element {i}: {_ratio_error(int(h[i]), int(w[i]))}")


def smart_resize_np(
    h: np.ndarray, w: np.ndarray, factor: int, min_pixels: float, max_pixels: float, *, qvu: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`smart_resize` (``qvu=False``) or :func:`qvu_smart_resize` (``qvu=True``)."""
    _check_ratio_np(h, w)
    h_bar = np.round(h / factor).astype(np.int64) * factor
    w_bar = np.round(w / factor).astype(np.int64) * factor
    if qvu:
        h_bar = np.maximum(factor, h_bar)
        w_bar = np.maximum(factor, w_bar)
    return fit_budget_np(h, w, h_bar, w_bar, factor, min_pixels, max_pixels, floor_guard=not qvu)


def fit_budget_np(
    h: np.ndarray,
    w: np.ndarray,
    h_bar: np.ndarray,
    w_bar: np.ndarray,
    factor: int,
    min_pixels: float,
    max_pixels: float,
    *,
    frames: int = 1,
    rounded_frames: int = 1,
    floor_guard: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The pixel-budget step shared by the vectorised ``smart_resize`` ports: where the rounded
    size ``rounded_frames * h_bar * w_bar`` is above ``max_pixels``, the sides ``h``, ``w`` are
    scaled down by ``sqrt(frames * h * w / max_pixels)`` and floored to multiples of ``factor``
    (and to at least ``factor`` with ``floor_guard``; qwen-vl-utils has no such guard); where it is
    below ``min_pixels``, scaled up and ceiled. ``frames`` > 1: Qwen3-VL's / GLM's 3-D budget over
    the whole clip. Returns ``h_bar``, ``w_bar``, changed in place."""
    # int64: exact (sides are far below 2**31), and exactly representable as float64
    area = frames * h * w
    prod = rounded_frames * h_bar * w_bar
    down = prod > max_pixels
    up = ~down & (prod < min_pixels)
    if down.any():
        beta = np.sqrt(area[down] / max_pixels)
        hd = np.floor(h[down] / beta / factor).astype(np.int64) * factor
        wd = np.floor(w[down] / beta / factor).astype(np.int64) * factor
        if floor_guard:
            hd, wd = np.maximum(factor, hd), np.maximum(factor, wd)
        h_bar[down], w_bar[down] = hd, wd
    if up.any():
        beta = np.sqrt(min_pixels / area[up])
        h_bar[up] = np.ceil(h[up] * beta / factor).astype(np.int64) * factor
        w_bar[up] = np.ceil(w[up] * beta / factor).astype(np.int64) * factor
    return h_bar, w_bar


# --------------------------------------------------------------------------------------------------
# the estimator


@dataclass(frozen=True)
class QwenVLEstimator(PatchGridEstimator):
    """Vision placeholder counts of Qwen2-VL / Qwen2.5-VL / Qwen3-VL; see the module docstring.

    Defaults (via :func:`qwen2_vl`, :func:`qwen3_vl`, ...) are the official hub configs, **not**
    transformers' class defaults (which cap Qwen2-VL images at 1280 tokens instead of 16384).

    Fields:
      family: "qwen2-vl" | "qwen2.5-vl" | "qwen3-vl" (Qwen3 uses the 3-D video resize and its own
        frame sampler and emits per-temporal-group wrappers).
      patch_size, merge_size, temporal_patch_size: vision encoder geometry.
      min_pixels, max_pixels: image processor ``size.shortest_edge`` / ``size.longest_edge``.
      pipeline: "hf" or "qwen-vl-utils" (see the module docstring).
      processor_resize: "qwen-vl-utils" pipeline only: whether the processor resizes the frames
        qwen-vl-utils already resized (README: True for Qwen2/2.5-VL, False for Qwen3-VL).
      video_min_pixels, video_max_pixels: video processor ``size`` (for Qwen3-VL a whole-clip
        budget, for Qwen2/2.5-VL a per-frame one).
      video_fps, video_min_frames, video_max_frames: frame sampling (processor's ``fps``,
        ``min_frames``, ``max_frames``; qwen-vl-utils' ``FPS``, ``FPS_MIN_FRAMES``, ``FPS_MAX_FRAMES``).
      cap_pixels_per_frame, max_video_tokens: transformers' opt-in per-frame cap ("hf" pipeline).
        Off by default as in transformers 5.24 (which only warns when it is unset).
      qvu_*: qwen-vl-utils 0.0.14 constants (IMAGE_MIN/MAX_TOKEN_NUM, VIDEO_MIN/MAX_TOKEN_NUM,
        MODEL_SEQ_LEN).
    """

    family: str
    patch_size: int
    min_pixels: int
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    max_video_tokens: int
    processor_resize: bool
    merge_size: int = 2
    temporal_patch_size: int = 2
    pipeline: str = "hf"
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    cap_pixels_per_frame: bool = False
    qvu_image_min_tokens: int = 4
    qvu_image_max_tokens: int = 16384
    qvu_video_min_tokens: int = 128
    qvu_video_max_tokens: int = 768
    qvu_model_seq_len: int = 128000

    FAMILY_SETTABLE = True   # one class for the three Qwen families

    def __post_init__(self) -> None:
        if self.family not in QWEN_FAMILIES:
            raise ValueError(f"family must be one of {QWEN_FAMILIES}, got {self.family!r}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        self.check_field_types(bools=True)
        if not (
            isinstance(self.video_fps, (int, float))
            and not isinstance(self.video_fps, bool)
            and math.isfinite(self.video_fps)
            and self.video_fps > 0
        ):
            raise ValueError(f"{self.family}: video_fps must be a finite number > 0, got {self.video_fps!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"{self.family}: min_pixels={self.min_pixels} > max_pixels={self.max_pixels}")
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"{self.family}: video_min_pixels={self.video_min_pixels} > "
                f"video_max_pixels={self.video_max_pixels}"
            )

    # ---- identity (name, config, replace), factor, image_grid, image_tokens: PatchGridEstimator ----
    @property
    def wrapper_tokens(self) -> int:
        """``<|vision_start|>`` and ``<|vision_end|>`` around each image."""
        return 2

    # ---- images -------------------------------------------------------------------------------
    def _qvu_image_bounds(self) -> tuple[int, int]:
        f2 = self.factor * self.factor
        return self.qvu_image_min_tokens * f2, self.qvu_image_max_tokens * f2

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the image the vision encoder sees."""
        w = as_side(width, "width")
        h = as_side(height, "height")
        f = self.factor
        if self.pipeline == "qwen-vl-utils":
            h0, w0 = h, w
            h, w = qvu_smart_resize(h, w, f, *self._qvu_image_bounds())
            if not self.processor_resize:
                return w, h
            if max(h, w) / min(h, w) > MAX_RATIO:
                raise _composed_ratio_error(w0, h0, w, h)
        h, w = smart_resize(h, w, f, self.min_pixels, self.max_pixels)
        return w, h

    def image_tokens_batch(self, widths, heights) -> np.ndarray:
        """Vectorised :meth:`image_tokens`; identical values, int64."""
        w, h = pair_dims(widths, heights)
        f = self.factor
        if self.pipeline == "qwen-vl-utils":
            h0, w0 = h, w
            h, w = smart_resize_np(h, w, f, *self._qvu_image_bounds(), qvu=True)
            if self.processor_resize:
                bad = np.flatnonzero(np.maximum(h, w) / np.minimum(h, w) > MAX_RATIO)
                if bad.size:
                    i = int(bad[0])
                    raise ValueError(f"element {i}: {_composed_ratio_error(w0[i], h0[i], w[i], h[i])}")
                h, w = smart_resize_np(h, w, f, self.min_pixels, self.max_pixels)
        else:
            h, w = smart_resize_np(h, w, f, self.min_pixels, self.max_pixels)
        return (h // f) * (w // f)

    # ---- videos -------------------------------------------------------------------------------
    def sampled_frames(self, num_frames: int, fps: float | None) -> int:
        """Frames fed to the vision encoder for a video of ``num_frames`` frames at ``fps``.

        ``fps=None`` means the frames were sampled already (every one is used; "hf" pipeline only).
        """
        total = as_dim(num_frames, "num_frames")
        if fps is None:
            if self.pipeline == "qwen-vl-utils":
                raise ValueError(
                    "qwen-vl-utils pipeline needs the source video's fps to sample frames (fps=None, i.e. "
                    "a pre-sampled frame list, goes through a different qwen-vl-utils path, not modelled)"
                )
            return total
        src_fps = _as_fps(fps)
        if self.pipeline == "qwen-vl-utils":  # qwen_vl_utils.smart_nframes (0.0.10+: floor to even)
            k = QVU_FRAME_FACTOR
            min_f = math.ceil(self.video_min_frames / k) * k
            max_f = math.floor(min(self.video_max_frames, total) / k) * k
            n = total / src_fps * self.video_fps
            n = min(min(max(n, min_f), max_f), total)
            n = math.floor(n / k) * k
            if not (k <= n <= total):
                raise ValueError(
                    f"video of {total} frames: qwen-vl-utils samples {n} frames, needs {k} <= n <= {total}"
                )
            return n
        if self.family == "qwen3-vl":  # Qwen3VLVideoProcessor.sample_frames
            n = int(total / src_fps * self.video_fps)
            return min(max(n, self.video_min_frames), self.video_max_frames, total)
        # Qwen2VLVideoProcessor.sample_frames (do_sample_frames=True, fps given)
        k = self.temporal_patch_size
        max_f = math.floor(min(self.video_max_frames, total) / k) * k
        n = total / src_fps * self.video_fps
        n = min(max(n, self.video_min_frames), max_f, total)
        n = math.floor(n / k) * k
        if n <= 0:  # the processor would divide by zero in arange(0, total, total / n)
            raise ValueError(
                f"video of {total} frame(s) is too short for the {self.family} frame sampler "
                f"(needs at least temporal_patch_size={k} frames)"
            )
        qwen2_frame_indices(total, n, self.family)   # refuses the counts the processor cannot sample
        return n

    def _hf_video_size(self, t: int, h: int, w: int) -> tuple[int, int]:
        f = self.factor
        lo, hi = self.video_min_pixels, self.video_max_pixels
        if self.family == "qwen3-vl":
            if self.cap_pixels_per_frame:
                per_frame = max(min(self.max_video_tokens * f * f, hi // t), int(lo * 1.05))
                hi = per_frame * t
            from tokenbal.hf_compat import qwen3_vl_video_resize

            return smart_resize_3d(t, h, w, self.temporal_patch_size, f, lo, hi, **qwen3_vl_video_resize())
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * f * f * 0.9)
            hi = max(min(hi, total_pixels * self.temporal_patch_size // t), int(lo * 1.05))
        return smart_resize(h, w, f, lo, hi)

    def video_grid(self, num_frames: int, width: int, height: int, fps: float | None) -> tuple[int, int, int]:
        """``video_grid_thw`` (t, h, w) in patches for a video of ``num_frames`` frames at ``fps``
        (source frame rate; ``None`` = frames already sampled)."""
        w = as_side(width, "width")
        h = as_side(height, "height")
        t = self.sampled_frames(num_frames, fps)
        f = self.factor
        if self.pipeline == "qwen-vl-utils":
            lo = self.qvu_video_min_tokens * f * f
            total_pixels = self.qvu_model_seq_len * f * f * 0.9
            hi = max(
                min(self.qvu_video_max_tokens * f * f, total_pixels / t * QVU_FRAME_FACTOR), int(lo * 1.05)
            )
            h, w = qvu_smart_resize(h, w, f, lo, hi)
            if self.processor_resize:
                h, w = self._hf_video_size(t, h, w)
        else:
            h, w = self._hf_video_size(t, h, w)
        grid_t = -(-t // self.temporal_patch_size)  # odd counts: the processor repeats the last frame
        return grid_t, h // self.patch_size, w // self.patch_size

    def video_tokens(self, num_frames: int, width: int, height: int, fps: float | None) -> int:
        """``<|video_pad|>`` tokens for one video (wrappers and timestamp text not included)."""
        t, gh, gw = self.video_grid(num_frames, width, height, fps)
        return t * gh * gw // (self.merge_size * self.merge_size)

    def video_wrapper_tokens(self, num_frames: int, fps: float | None) -> int:
        """Special tokens around one video's placeholders.

        Qwen2/2.5-VL: ``<|vision_start|>`` + ``<|vision_end|>`` (2). Qwen3-VL (transformers 5.24
        ``Qwen3VLProcessor.replace_video_token``): every temporal group gets its own start/end pair
        inside the chat template's pair, i.e. ``2 + 2 * grid_t``; the ``<x.x seconds>`` text before
        each group is ordinary text (see :meth:`video_timestamps`) and is not counted here.
        """
        if self.family != "qwen3-vl":
            return 2
        grid_t = -(-self.sampled_frames(num_frames, fps) // self.temporal_patch_size)
        return 2 + 2 * grid_t

    def video_timestamps(self, num_frames: int, fps: float | None) -> list[str]:
        """Qwen3-VL: the ``<x.x seconds>`` strings the processor puts before each temporal group
        (count them with the text tokenizer); empty for Qwen2/2.5-VL."""
        if self.family != "qwen3-vl":
            return []
        total = as_dim(num_frames, "num_frames")
        n = self.sampled_frames(total, fps)
        src_fps = 24.0 if fps is None else _as_fps(fps)  # the processor's fallback when fps is unknown
        idx = (
            np.linspace(0, total - 1, n).round().astype(np.int64).tolist()
            if fps is not None
            else list(range(n))
        )
        k = self.temporal_patch_size
        if len(idx) % k:
            idx += [idx[-1]] * (k - len(idx) % k)
        ts = [i / src_fps for i in idx]
        return [f"<{(ts[i] + ts[i + k - 1]) / 2:.1f} seconds>" for i in range(0, len(ts), k)]


QWEN_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")


def qwen2_frame_indices(total: int, n: int, family: str = "qwen2-vl") -> list[int]:
    """The frames ``Qwen2VLVideoProcessor.sample_frames`` picks to sample ``n`` of a ``total``-frame
    clip: ``torch.arange(0, total, total / n).int()`` (the same code in transformers 4.57 to 5.25),
    reproduced with torch itself, float32 steps and all. For some (total, n), e.g. 59 frames sampled
    to 58, the float arange takes one step more and its last index is the frame after the clip, so
    the processor's ``video[indices]`` raises IndexError: a ``ValueError`` saying so, not a count of
    frames that are not there."""
    import torch

    indices = torch.arange(0, total, total / n).int().tolist()
    if indices[-1] >= total:
        raise ValueError(f"{family}: Qwen2VLVideoProcessor.sample_frames picks frame {indices[-1]} of a "
                         f"{total}-frame clip when sampling {n} frames (float arange), and the processor "
                         "raises IndexError on it")
    return indices


def _as_fps(fps: object) -> float:
    if isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating)):
        raise ValueError(f"fps must be a finite number > 0, got {fps!r}")
    f = float(fps)
    if not math.isfinite(f) or f <= 0:
        raise ValueError(f"fps must be a finite number > 0, got {fps!r}")
    return f


# The hub defaults of make_qwen's docstring, one row per generation (Qwen2-VL and Qwen2.5-VL ship
# the same preprocessor_config.json values).
_QWEN2_HUB = dict(patch_size=14, min_pixels=3136, max_pixels=12845056, video_min_pixels=3136,
                  video_max_pixels=12845056, max_video_tokens=128000, processor_resize=True)
_QWEN3_HUB = dict(patch_size=16, min_pixels=65536, max_pixels=16777216, video_min_pixels=4096,
                  video_max_pixels=25165824, max_video_tokens=768, processor_resize=False)


def make_qwen(family: str, **overrides) -> QwenVLEstimator:
    """The estimator for ``family`` with the official hub defaults, then ``overrides``.

    Hub defaults (not transformers' class defaults):
      * Qwen2-VL / Qwen2.5-VL ``preprocessor_config.json``: patch 14, merge 2, temporal 2,
        min_pixels 3136 (56^2), max_pixels 12845056 (16384 * 28^2). Video: we assume the checkpoint
        has no ``video_preprocessor_config.json`` (the research note quotes none; not re-checked on
        the hub), in which case transformers builds the video processor from the same file, so the
        per-frame bounds are 3136..12845056 (the video class default 128*28^2..768*28^2 is then
        unused). ``load_estimator`` reads whichever file a real checkpoint folder has.
      * Qwen3-VL ``preprocessor_config.json``: patch 16, merge 2, ``size`` 65536..16777216 (64..16384
        tokens); ``video_preprocessor_config.json``: ``size`` 4096..25165824 for the whole clip
        (<= 12288 tokens), fps 2, 4..768 frames.
    """
    if family not in QWEN_FAMILIES:
        raise ValueError(f"unknown Qwen family {family!r}; known: {QWEN_FAMILIES}")
    hub = _QWEN3_HUB if family == "qwen3-vl" else _QWEN2_HUB
    base = QwenVLEstimator(family=family, **hub)
    return base.replace(**overrides) if overrides else base

