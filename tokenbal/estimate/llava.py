"""LLaVA-NeXT (v1.6, "anyres") and LLaVA-OneVision ("anyres_max_9") image token counts.

An image picks the best "pinpoint" resolution (max effective pixels, then min waste), is cut into
base-size crops, and the model keeps the crop features minus the letterbox padding ("unpad"), plus
one ``image_newline`` per feature row, plus the base view. OneVision additionally downsamples the
unpadded grid when it exceeds 9 base views (ratio > 1.1).

Port of transformers 5.24 ``LlavaNextProcessor._get_number_of_features`` /
``LlavaOnevisionProcessor._get_number_of_features`` and ``image_processing_utils.select_best_resolution``,
including ``int(round(x, 7))`` in the unpad step (the original LLaVA code uses ``int(x)``; they
differ on rare sizes such as 1408x792, research note §7.8). No wrapper tokens: the prompt holds
only ``<image>`` repeated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from tokenbal.estimate._sizes import as_dim, as_side, chunked, fixed_frames_of, pair_dims
from tokenbal.estimate.base import Estimator

LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # (h, w), v1.6
ONEVISION_PINPOINTS = tuple((384 * i, 384 * j) for i in range(1, 7) for j in range(1, 7))


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    best, best_eff, best_waste = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        eff = min(int(width * scale) * int(height * scale), width * height)
        waste = pw * ph - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ph, pw), eff, waste
    return best


def _select_best_np(h: np.ndarray, w: np.ndarray, pinpoints) -> tuple[np.ndarray, np.ndarray]:
    grid = _as_grid(tuple(tuple(p) for p in pinpoints))
    if grid is not None:
        return _select_best_grid(h, w, *grid, pinpoints)
    return _select_best_sweep(h, w, pinpoints)


@lru_cache(maxsize=32)
def _as_grid(pinpoints: tuple) -> tuple[int, int, int] | None:
    """(c, a, b) when ``pinpoints`` is every (c*i, c*j), 1 <= i <= a, 1 <= j <= b (OneVision's 36)."""
    c = min(min(p) for p in pinpoints)
    a = max(p[0] for p in pinpoints) // c
    b = max(p[1] for p in pinpoints) // c
    want = {(c * i, c * j) for i in range(1, a + 1) for j in range(1, b + 1)}
    return (c, a, b) if len(pinpoints) == len(want) and set(pinpoints) == want else None


def _select_best_grid(h: np.ndarray, w: np.ndarray, c: int, a: int, b: int, pinpoints
                      ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`select_best_resolution` for a grid of pinpoints in closed form (same results).

    An image that some pinpoint contains gets its full area as "effective" there and less in every
    other pinpoint (a scale below 1 truncates at least one side), so the winner is the containing
    pinpoint of least area: (c * ceil(h / c), c * ceil(w / c)). Otherwise the largest pinpoint
    (c*a, c*b) has the largest scale; when the width binds (scale = c*b / w), every pinpoint of
    width c*b and height >= h * c*b / w has exactly that scale, hence the same effective pixels, and
    the least waste is the lowest such height; any other pinpoint loses at least one pixel column
    (or c rows) of effective area. Where float rounding could make that last claim fail (the
    binding side truncating to c*b - 1, or the other side to 0) the sweep decides instead.
    """
    hh, ww = c * a, c * b
    need_h, need_w = -(-h // c), -(-w // c)
    contain = (need_h <= a) & (need_w <= b)
    wide = ww * h <= hh * w                                   # the width binds at (hh, ww)
    bh = np.where(contain, c * need_h, np.where(wide, c * (-(-(b * h) // w)), hh))
    bw = np.where(contain, c * need_w, np.where(wide, ww, c * (-(-(a * w) // h))))
    scale = np.where(wide, ww / w, hh / h)
    side_w = (w * scale).astype(np.int64)
    side_h = (h * scale).astype(np.int64)
    ok = contain | np.where(wide, (side_w == ww) & (side_h >= 1), (side_h == hh) & (side_w >= 1))
    bad = np.flatnonzero(~ok)
    if bad.size:
        bh[bad], bw[bad] = _select_best_sweep(h[bad], w[bad], pinpoints)
    return bh, bw


def _select_best_sweep(h: np.ndarray, w: np.ndarray, pinpoints) -> tuple[np.ndarray, np.ndarray]:
    # One key per pinpoint orders (effective pixels, then least waste) as the scalar loop does:
    # eff <= pinpoint area < K (a scale truncates each side to at most the pinpoint's), waste =
    # area - eff >= 0, so eff * K - waste = eff * (K + 1) - area is increasing in both; strict >
    # keeps the first pinpoint on ties.
    K = max(ph * pw for ph, pw in pinpoints) + 1
    if K * (K + 1) >= 2**53:  # keys beyond float64's integers: the int64 sweep
        return _select_best_sweep_int(h, w, pinpoints, K)
    best = np.zeros(h.shape, dtype=np.int64)  # index into pinpoints
    wf, hf = w.astype(np.float64), h.astype(np.float64)
    # The image area may round in float64, but min(eff, area) only picks it when it is at most a
    # pinpoint's area (< K), where it is exact.
    area = wf * hf
    best_key = np.full(h.shape, -np.inf)
    scale, side, key = np.empty_like(wf), np.empty_like(wf), np.empty_like(wf)
    for k, (ph, pw) in enumerate(pinpoints):
        np.divide(pw, wf, out=scale)
        np.divide(ph, hf, out=side)
        np.minimum(scale, side, out=scale)
        # int() of a positive float is trunc(); the truncated sides are at most the pinpoint's, so
        # their product, the key and every step here are exact float64 integers (< 2**53).
        np.multiply(wf, scale, out=key)
        np.trunc(key, out=key)
        np.multiply(hf, scale, out=side)
        np.trunc(side, out=side)
        key *= side
        np.minimum(key, area, out=key)
        key *= K + 1
        key -= ph * pw
        # copyto(where=) instead of boolean-mask assignment: same result, several times cheaper
        np.copyto(best, k, where=key > best_key)
        np.maximum(best_key, key, out=best_key)
    table = np.asarray(pinpoints, dtype=np.int64)
    return table[best, 0], table[best, 1]


def _select_best_sweep_int(h: np.ndarray, w: np.ndarray, pinpoints, K: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_select_best_sweep` with int64 keys, for pinpoints too large for float64 keys."""
    best = np.zeros(h.shape, dtype=np.int64)
    best_key = np.full(h.shape, np.iinfo(np.int64).min)
    area = w * h
    wf, hf = w.astype(np.float64), h.astype(np.float64)
    for k, (ph, pw) in enumerate(pinpoints):
        scale = np.minimum(pw / wf, ph / hf)
        eff = np.minimum((wf * scale).astype(np.int64) * (hf * scale).astype(np.int64), area)
        key = eff * (K + 1) - ph * pw
        np.copyto(best, k, where=key > best_key)
        np.maximum(best_key, key, out=best_key)
    table = np.asarray(pinpoints, dtype=np.int64)
    return table[best, 0], table[best, 1]


def unpadded_grid(height: int, width: int, cur_h: int, cur_w: int) -> tuple[int, int]:
    """Feature rows/cols left after removing the letterbox padding (transformers' rounding)."""
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    return cur_h, cur_w


def _unpadded_np(h, w, cur_h, cur_w):
    wide = w / h > cur_w / cur_h
    # int(round(x, 7)): numpy's round(x, 7) is not Python's correctly-rounded decimal round, but the
    # two can only disagree on whether x lands on an integer, so we use numpy where x is clearly away
    # from one and the exact scalar port (few elements) where it is within 1e-6 of one.
    x = np.where(wide, h * (cur_w / w), w * (cur_h / h))
    n = np.floor(x).astype(np.int64)
    near = np.flatnonzero(np.abs(x - np.round(x)) < 1e-6)
    for i in near:
        n[i] = int(round(float(x[i]), 7))
    cur = np.where(wide, cur_h, cur_w)
    cut = cur - ((cur - n) >> 1 << 1)         # cur - 2 * ((cur - n) // 2); >> floors like //
    return np.where(wide, cut, cur_h), np.where(wide, cur_w, cut)


class _AnyResEstimator(Estimator):
    """The LLaVA estimators' shared identity: ``pinpoints`` (a tuple of (height, width) tuples) is
    written to the config as lists, and taken from overrides as any pairs of ints."""

    def config_fields(self) -> dict:
        d = asdict(self)
        d["pinpoints"] = [list(p) for p in self.pinpoints]
        return d

    def normalize_settings(self, overrides: dict) -> dict:
        if "pinpoints" in overrides:
            overrides = {
                **overrides,
                "pinpoints": tuple(tuple(int(x) for x in p) for p in overrides["pinpoints"]),
            }
        return overrides


@dataclass(frozen=True)
class LlavaNextEstimator(_AnyResEstimator):
    """LLaVA-NeXT v1.6 (CLIP ViT-L/14-336). Defaults = llava-hf ``llava-v1.6-*-hf`` configs:
    crop 336, patch 14, the five v1.6 pinpoints, ``vision_feature_select_strategy="default"``
    (CLS dropped: 576 base tokens). ``image_tokens`` = ``576 + rows*cols + rows``."""

    family: str = "llava-next"
    crop_size: int = 336
    patch_size: int = 14
    pinpoints: tuple = LLAVA_NEXT_PINPOINTS
    wrapper_tokens: int = 0

    def __post_init__(self) -> None:
        _check_common(self)
        if self.crop_size % self.patch_size:
            raise ValueError(
                f"{self.family}: crop_size {self.crop_size} is not a multiple of patch {self.patch_size}"
            )

    @property
    def grid_side(self) -> int:
        return self.crop_size // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        w, h = as_side(width, "width"), as_side(height, "height")
        g = self.grid_side
        bh, bw = select_best_resolution(h, w, self.pinpoints)
        rows, cols = unpadded_grid(h, w, g * (bh // self.crop_size), g * (bw // self.crop_size))
        return g * g + rows * cols + rows

    def image_tokens_batch(self, widths, heights) -> np.ndarray:
        w, h = pair_dims(widths, heights)
        return chunked(self._tokens_np, w, h)

    def _tokens_np(self, w: np.ndarray, h: np.ndarray, offset: int) -> np.ndarray:
        g = self.grid_side
        bh, bw = _select_best_np(h, w, self.pinpoints)
        rows, cols = _unpadded_np(h, w, g * (bh // self.crop_size), g * (bw // self.crop_size))
        rows *= cols + 1
        rows += g * g
        return rows


@dataclass(frozen=True)
class LlavaOneVisionEstimator(_AnyResEstimator):
    """LLaVA-OneVision (SigLIP-so400m/14 @ 384, 27x27 = 729 tokens per view, no CLS).
    Defaults = llava-hf ``llava-onevision-qwen2-*-ov-hf``: the 36 pinpoints (384*i, 384*j),
    ``vision_aspect_ratio="anyres_max_9"``. When a sample holds more than one image, transformers
    5.x gives each only the base view + newline (730): pass ``images_in_sample``.
    Videos: 196 pooled tokens per frame + 1 newline (frames as sampled by the caller)."""

    family: str = "llava-onevision"
    crop_size: int = 384
    patch_size: int = 14
    pinpoints: tuple = ONEVISION_PINPOINTS
    max_num_views: int = 9
    wrapper_tokens: int = 0
    video_frames: int | None = None

    def __post_init__(self) -> None:
        _check_common(self)
        _check_video_frames(self)

    @property
    def grid_side(self) -> int:
        return self.crop_size // self.patch_size  # 27 (int(sqrt(729)))

    def _single(self, rows: int, cols: int) -> tuple[int, int]:
        g = self.grid_side
        feats, newlines = rows * cols, rows
        ratio = math.sqrt(rows * cols / (self.max_num_views * g * g))
        if ratio > 1.1:  # the model bilinearly downsamples the unpadded grid
            feats = int(rows // ratio) * int(cols // ratio)
            newlines = int(rows // ratio)
        return feats, newlines

    def image_tokens(self, width: int, height: int, images_in_sample: int = 1) -> int:
        w, h = as_side(width, "width"), as_side(height, "height")
        g = self.grid_side
        if as_dim(images_in_sample, "images_in_sample") > 1:
            return g * g + 1
        bh, bw = select_best_resolution(h, w, self.pinpoints)
        rows, cols = unpadded_grid(h, w, g * (bh // self.crop_size), g * (bw // self.crop_size))
        feats, newlines = self._single(rows, cols)
        return g * g + feats + newlines

    def image_tokens_batch(self, widths, heights, images_in_sample: int = 1) -> np.ndarray:
        w, h = pair_dims(widths, heights)
        g = self.grid_side
        if as_dim(images_in_sample, "images_in_sample") > 1:
            return np.full(w.shape, g * g + 1, dtype=np.int64)
        return chunked(self._tokens_np, w, h)

    def _tokens_np(self, w: np.ndarray, h: np.ndarray, offset: int) -> np.ndarray:
        g = self.grid_side
        bh, bw = _select_best_np(h, w, self.pinpoints)
        cur_h, cur_w = g * (bh // self.crop_size), g * (bw // self.crop_size)
        rows, cols = _unpadded_np(h, w, cur_h, cur_w)
        # rows <= cur_h and cols <= cur_w take few values, so the downsampling step is a table.
        max_cols = g * max(pw for _, pw in self.pinpoints) // self.crop_size
        table = _downsampled_tokens(g, self.max_num_views, g * max(ph for ph, _ in self.pinpoints)
                                    // self.crop_size, max_cols)
        rows *= max_cols + 1
        rows += cols
        return table[rows]

    def video_tokens(self, num_frames: int, width: int, height: int, fps: float | None = None) -> int:
        """``<video>`` tokens: frames are resized to 384^2 and pooled 27 -> 14 per side, plus one
        newline per video, so only the frame count matters: ``video_frames`` if set (a fixed
        number of uniformly sampled frames), else all ``num_frames`` (the caller sampled them).
        ``fps`` is not used."""
        n = _frames_used(self, num_frames)
        as_side(width, "width")
        as_side(height, "height")
        pooled = math.ceil(self.grid_side / 2)
        return n * pooled * pooled + 1


@lru_cache(maxsize=8)
def _downsampled_tokens(g: int, max_num_views: int, max_rows: int, max_cols: int) -> np.ndarray:
    """OneVision's tokens for every unpadded grid (rows, cols), rows <= max_rows, cols <= max_cols,
    flat at ``rows * (max_cols + 1) + cols``: base view + features + newlines after the optional
    bilinear downsampling (the same float arithmetic as :meth:`LlavaOneVisionEstimator._single`)."""
    rows, cols = np.divmod(np.arange((max_rows + 1) * (max_cols + 1), dtype=np.int64), max_cols + 1)
    ratio = np.sqrt(rows * cols / (max_num_views * g * g))
    big = ratio > 1.1
    # np.floor_divide on floats follows Python's float // (same divmod algorithm)
    r_small = np.floor_divide(rows, np.where(big, ratio, 1.0)).astype(np.int64)
    c_small = np.floor_divide(cols, np.where(big, ratio, 1.0)).astype(np.int64)
    feats = np.where(big, r_small * c_small, rows * cols)
    newlines = np.where(big, r_small, rows)
    table = (g * g + feats + newlines).astype(np.int64)
    table.flags.writeable = False  # shared by every call through the cache
    return table


def _check_video_frames(est) -> None:
    v = est.video_frames
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise ValueError(f"{est.family}: video_frames must be None or a positive int, got {v!r}")


def _frames_used(est, num_frames: int) -> int:
    n = as_dim(num_frames, "num_frames")
    return n if est.video_frames is None else fixed_frames_of(est.family, est.video_frames, n)


def _check_common(est) -> None:
    est.check_field_types(allow_zero=True)
    if est.crop_size <= 0 or est.patch_size <= 0:
        raise ValueError(f"{est.family}: crop_size and patch_size must be > 0")
    pp = est.pinpoints
    if not pp or not all(len(p) == 2 and all(isinstance(x, int) and x > 0 for x in p) for p in pp):
        raise ValueError(
            f"{est.family}: pinpoints must be a non-empty list of (height, width) ints, got {pp!r}"
        )
    bad = [p for p in pp if p[0] % est.crop_size or p[1] % est.crop_size]
    if bad:
        raise ValueError(f"{est.family}: pinpoints {bad} are not multiples of crop_size {est.crop_size}")


