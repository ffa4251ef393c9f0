"""GLM-4.1V-Thinking / GLM-4.5V images: Qwen-style patches with the 3-D ``smart_resize``.

transformers 5.24 ``Glm4vImageProcessor[Pil]`` resizes every image with the video ``smart_resize``
called with ``num_frames = temporal_patch_size = 2``: sides shorter than ``factor`` (28) are first
scaled up (``int()``-truncated), the 200:1 aspect limit is checked after that, and the pixel budget
compares ``2 * h * w`` with ``size.longest_edge`` (so an image gets about ``longest_edge / 2``
pixels). Tokens = ``(H'/28) * (W'/28)`` ``<|image|>`` placeholders; the chat template puts
``<|begin_of_image|>`` / ``<|end_of_image|>`` around them (2 wrapper tokens). Videos are not
modelled (frame de-duplication and timestamps; see docs/estimators.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbal.estimate._sizes import as_side, pair_dims
from tokenbal.estimate.base import PatchGridEstimator
from tokenbal.estimate.qwen import MAX_RATIO, fit_budget_np, smart_resize_3d


def _ratio_error_np(h: np.ndarray, w: np.ndarray, h0: np.ndarray, w0: np.ndarray, batch: bool = True) -> None:
    bad = np.flatnonzero(np.maximum(h, w) / np.minimum(h, w) > MAX_RATIO)
    if bad.size:
        i = int(bad[0])
        ratio = max(h[i], w[i]) / min(h[i], w[i])
        where = f"element {i}: " if batch else ""
        raise ValueError(
            f"{where}image {w0[i]}x{h0[i]} (width x height) has aspect ratio {ratio:.4g} (after "
            f"GLM's small-side upscale), above the {MAX_RATIO}:1 limit of its smart_resize"
        )


def _upscaled(h: np.ndarray, w: np.ndarray, factor: int) -> tuple[np.ndarray, np.ndarray]:
    # sides shorter than factor: scale both so the short one reaches factor (int() truncation)
    small = (h < factor) | (w < factor)
    if not small.any():
        return h, w
    scale = np.maximum(factor / h, factor / w)
    return np.where(small, (h * scale).astype(np.int64), h), np.where(small, (w * scale).astype(np.int64), w)


def smart_resize_3d_np(
    t: int, h: np.ndarray, w: np.ndarray, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int,
    upscale_small: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`tokenbal.estimate.qwen.smart_resize_3d` for a constant frame count ``t``.
    ``upscale_small=False``: transformers 4.57's rule, a side shorter than ``factor`` is refused."""
    h0, w0 = h, w
    if not upscale_small:
        small = np.flatnonzero((h < factor) | (w < factor))
        if small.size:
            i = int(small[0])
            raise ValueError(_small_side_message(int(w0[i]), int(h0[i]), factor, f"element {i}: "))
    h, w = _upscaled(h, w, factor)
    _ratio_error_np(h, w, h0, w0)
    h_bar = np.round(h / factor).astype(np.int64) * factor
    w_bar = np.round(w / factor).astype(np.int64) * factor
    t_bar = round(t / temporal_factor) * temporal_factor
    return fit_budget_np(h, w, h_bar, w_bar, factor, min_pixels, max_pixels, frames=t, rounded_frames=t_bar)


def _small_side_message(width: int, height: int, factor: int, where: str = "") -> str:
    return (f"{where}image {width}x{height} (width x height) has a side shorter than {factor}, which "
            "this transformers' GLM-4V smart_resize refuses (4.57; later releases scale it up)")


def _upscales_small() -> bool:
    from tokenbal.hf_compat import glm4v_upscales_small

    return glm4v_upscales_small()


@dataclass(frozen=True)
class Glm4vEstimator(PatchGridEstimator):
    """GLM-4.1V image placeholder counts; :func:`make_glm4v` gives the defaults.

    Fields: ``patch_size`` (14), ``merge_size`` (2), ``temporal_patch_size`` (2, also the frame
    count the image resize budgets for), ``min_pixels`` / ``max_pixels`` (image processor
    ``size.shortest_edge`` / ``size.longest_edge``).
    """

    family: str = "glm-4.1v"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 12544
    max_pixels: int = 9633792

    def __post_init__(self) -> None:
        self.check_field_types()
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"{self.family}: min_pixels={self.min_pixels} > max_pixels={self.max_pixels}")

    @property
    def wrapper_tokens(self) -> int:
        """``<|begin_of_image|>`` and ``<|end_of_image|>`` around each image."""
        return 2

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the image the vision encoder sees."""
        w, h = as_side(width, "width"), as_side(height, "height")
        t = self.temporal_patch_size
        if (h < self.factor or w < self.factor) and not _upscales_small():
            raise ValueError(_small_side_message(w, h, self.factor))
        # the same check smart_resize_3d makes, with a message about an image, not a video frame
        h0, w0 = np.array([h]), np.array([w])
        _ratio_error_np(*_upscaled(h0, w0, self.factor), h0, w0, batch=False)
        h2, w2 = smart_resize_3d(t, h, w, t, self.factor, self.min_pixels, self.max_pixels)
        return w2, h2

    def image_tokens_batch(self, widths, heights) -> np.ndarray:
        """Vectorised :meth:`image_tokens`; identical values, int64."""
        w, h = pair_dims(widths, heights)
        t, f = self.temporal_patch_size, self.factor
        h2, w2 = smart_resize_3d_np(t, h, w, t, f, self.min_pixels, self.max_pixels, _upscales_small())
        return (h2 // f) * (w2 // f)


def make_glm4v(**overrides) -> Glm4vEstimator:
    """GLM-4.1V-9B-Thinking defaults: patch 14, merge 2, temporal 2, ``size`` = 12544 (112^2) ..
    9633792 (= 14*14*2*2*2*6144, i.e. at most 6144 tokens per image).

    Provenance: these ``size`` values are what zai-org's GLM-V ``preprocessor_config.json`` files
    use (the GLM-OCR file is quoted verbatim in public code; the GLM-4.1V-9B-Thinking file is from
    memory and was not fetched from the hub here), and 9633792 is also the ``max_pixels`` default of
    transformers' ``glm4v`` ``smart_resize`` function. transformers' ``Glm4vImageProcessor`` *class*
    default is ``longest_edge = 28*28*15000`` (11760000, at most 7500 tokens): pass
    ``max_pixels=11760000`` to match a processor built without a config file.
    """
    return Glm4vEstimator().replace(**overrides) if overrides else Glm4vEstimator()
