"""Phi-4-multimodal images: 448-px crops (up to ``dynamic_hd``) plus a global view.

Port of transformers 5.24 ``Phi4MultimodalImageProcessor`` (torchvision backend only; there is no
PIL class). The image is fitted into a ``gw x gh`` grid of 448 crops: ``ceil(W/448) x ceil(H/448)``
when that is at most ``dynamic_hd`` crops, else the InternVL-style closest aspect ratio among all
grids of at most ``dynamic_hd`` crops. It is resized to fill the grid's width or height and padded;
a 32x32-per-crop attention mask zeroes the padded patch columns/rows, and the count is

    256 + 1 + ceil(R/2) * ceil(C/2) + ceil(R/2) + 16

(global 16x16 view, separator, the valid 2x2-merged HD patches, one newline per merged HD row,
16 global newlines) with R, C the valid mask rows/columns. All of them are ``<|image|>`` tokens in
the prompt (``Phi4MultimodalProcessor.replace_image_token``), so there are no wrapper tokens.
The processor raises when the resized short side is below 10 px; so do we.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tokenbal.estimate._sizes import as_side, chunked, pair_dims
from tokenbal.estimate.base import Estimator
from tokenbal.estimate.tiles import closest_grid, sweep_np

CROP = 448  # transformers hardcodes the 256 + 16 global-view tokens for this crop / patch size
PATCH = 14
MASK = CROP // PATCH  # 32 mask cells per crop side
MIN_SIDE = 10  # "the aspect ratio is very extreme"


@lru_cache(maxsize=8)
def phi4_grids(max_num: int, min_num: int = 1) -> tuple[tuple[int, int], ...]:
    """Candidate (columns, rows) in the processor's order: a *set* sorted by crop count (stable),
    so equal-count grids keep Python's set iteration order, which is deterministic for int tuples."""
    ratios = {
        (i, j)
        for n in range(min_num, max_num + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_num <= i * j <= max_num
    }
    return tuple(sorted(ratios, key=lambda x: x[0] * x[1]))


def _closest(width: int, height: int, max_num: int) -> tuple[int, int]:
    return closest_grid(width, height, CROP, phi4_grids(max_num))


def _closest_np(w: np.ndarray, h: np.ndarray, max_num: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`_closest` (the same sweep result, see ``tiles.sweep_np``)."""
    return sweep_np(w, h, CROP, phi4_grids(max_num), lambda a, b: _closest(a, b, max_num))


def _extreme(width: int, height: int, new_w: int, new_h: int) -> ValueError:
    return ValueError(
        f"image {width}x{height} (width x height) is resized to {new_w}x{new_h} for its crop grid; "
        f"Phi-4-multimodal's processor rejects a side below {MIN_SIDE} px (aspect ratio too extreme)"
    )


@dataclass(frozen=True)
class Phi4MultimodalEstimator(Estimator):
    """Phi-4-multimodal ``<|image|>`` counts. Field: ``dynamic_hd`` (max crops, hub 36)."""

    family: str = "phi-4-multimodal"
    dynamic_hd: int = 36

    def __post_init__(self) -> None:
        self.check_field_types()

    @property
    def wrapper_tokens(self) -> int:
        """0: separators and newlines are part of the ``<|image|>`` run (:meth:`image_tokens`)."""
        return 0

    def crop_grid(self, width: int, height: int) -> tuple[int, int]:
        """(columns, rows) of 448-px crops."""
        w, h = as_side(width, "width"), as_side(height, "height")
        wc, hc = math.ceil(w / float(CROP)), math.ceil(h / float(CROP))
        if wc * hc > self.dynamic_hd:
            return _closest(w, h, self.dynamic_hd)
        return wc, hc

    def image_tokens(self, width: int, height: int) -> int:
        """``<|image|>`` tokens for one image (everything the image costs)."""
        w, h = as_side(width, "width"), as_side(height, "height")
        gw, gh = self.crop_grid(w, h)
        tw, th = CROP * gw, CROP * gh
        if tw / w < th / h:
            new_w, new_h = tw, int(h * (tw / w))
            pad_w, pad_h = 0, th - new_h
        else:
            new_w, new_h = int(w * (th / h)), th
            pad_w, pad_h = tw - new_w, 0
        if min(new_h, th) < MIN_SIDE or min(new_w, tw) < MIN_SIDE:
            raise _extreme(w, h, new_w, new_h)
        rows = MASK * gh - (math.floor(pad_h / PATCH) if pad_h >= PATCH else 0)
        cols = MASK * gw - (math.floor(pad_w / PATCH) if pad_w >= PATCH else 0)
        hr, hc = -(-rows // 2), -(-cols // 2)
        return 256 + 1 + hr * hc + hr + 16

    def image_tokens_batch(self, widths, heights) -> np.ndarray:
        """Vectorised :meth:`image_tokens`; identical values, int64."""
        w, h = pair_dims(widths, heights)
        return chunked(self._tokens_np, w, h)

    def _tokens_np(self, w: np.ndarray, h: np.ndarray, offset: int) -> np.ndarray:
        gw = np.ceil(w / float(CROP)).astype(np.int64)
        gh = np.ceil(h / float(CROP)).astype(np.int64)
        over = gw * gh > self.dynamic_hd
        if over.any():  # more than dynamic_hd crops: closest aspect ratio among the allowed grids
            gw[over], gh[over] = _closest_np(w[over], h[over], self.dynamic_hd)
        tw, th = CROP * gw, CROP * gh
        fit_w = tw / w < th / h
        new_h = np.where(fit_w, (h * (tw / w)).astype(np.int64), th)
        new_w = np.where(fit_w, tw, (w * (th / h)).astype(np.int64))
        # new_h <= th and new_w <= tw (the fitted side is scaled by the smaller ratio), so the
        # scalar path's min(new_h, th) is new_h, and 0 <= pad < PATCH gives pad // PATCH == 0.
        if new_h.size and min(int(new_h.min()), int(new_w.min())) < MIN_SIDE:
            i = int(np.flatnonzero((new_h < MIN_SIDE) | (new_w < MIN_SIDE))[0])
            raise ValueError(
                f"element {offset + i}: {_extreme(int(w[i]), int(h[i]), int(new_w[i]), int(new_h[i]))}"
            )
        rows = MASK * gh - (th - new_h) // PATCH
        cols = MASK * gw - (tw - new_w) // PATCH
        hr, hc = (rows + 1) >> 1, (cols + 1) >> 1
        return 256 + 1 + hr * hc + hr + 16


def make_phi4(**overrides) -> Phi4MultimodalEstimator:
    """microsoft/Phi-4-multimodal-instruct: ``dynamic_hd=36`` (also transformers' class default)."""
    return Phi4MultimodalEstimator().replace(**overrides)
