"""Dynamic tiling (InternVL 1.5 / 2 / 2.5 / 3 and any model that tiles the same way).

The image is resized to the tile grid (columns x rows, ``min_tiles <= c*r <= max_tiles``) whose
aspect ratio is closest to the image's, cut into ``tile_size`` tiles, and, when there is more than
one tile, a thumbnail of the whole image is added. Every tile costs ``tokens_per_tile`` tokens
(InternVL: (448/14)^2 * 0.5^2 = 256 after pixel shuffle) between ``<img>`` and ``</img>``.

Port of transformers 5.24 ``GotOcr2ImageProcessor.get_number_of_image_patches`` /
``get_optimal_tiled_canvas`` (what ``InternVLProcessor`` uses, with ``crop_to_patches=True``),
including its tie rule (equal aspect-ratio distance: prefer the later, larger grid while the image
area exceeds half the grid's pixel area) and its candidate order (sorted by tile count, stable).
The research note found the official InternVL ``dynamic_preprocess`` order gives the same result
on a dense 333k-size scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tokenbal.estimate._sizes import as_dim, as_side, fixed_frames_of, pair_dims
from tokenbal.estimate.base import Estimator


@lru_cache(maxsize=32)
def tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Candidate (columns, rows) grids in transformers' order."""
    grids = [
        (c, r)
        for c in range(1, max_tiles + 1)
        for r in range(1, max_tiles + 1)
        if min_tiles <= c * r <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def closest_grid(
    width: int, height: int, tile_size: int, grids: tuple[tuple[int, int], ...]
) -> tuple[int, int]:
    """transformers' closest-aspect-ratio sweep over the candidate ``grids`` (in their order): the
    first (columns, rows) with the smallest ``|aspect - c/r|``, then each later one at exactly that
    distance while the image area exceeds half the grid's pixel area. InternVL's tiles and
    Phi-4-multimodal's crops differ only in their candidates."""
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * c * r:
            best = (c, r)
    return best


def best_grid(width: int, height: int, tile_size: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) chosen for a ``width`` x ``height`` image."""
    return closest_grid(width, height, tile_size, tile_grids(min_tiles, max_tiles))


@lru_cache(maxsize=32)
def _ratio_table(grids: tuple[tuple[int, int], ...]):
    """Candidates grouped by their aspect ratio value ``c / r`` (as the float the sweep computes).

    Returns ``(q, cols, rows, prods)``: ``q`` the sorted distinct ratio values; row ``j`` of the
    (n, L) tables lists the grids with ratio ``q[j]`` in sweep order (increasing tile count),
    padded with the last entry and an infinite tile count.
    """
    groups: dict[float, list[tuple[int, int]]] = {}
    for c, r in grids:  # sweep order
        groups.setdefault(c / r, []).append((c, r))
    q = np.array(sorted(groups))
    width = max(len(v) for v in groups.values())
    cols = np.zeros((len(q), width), dtype=np.int64)
    rows = np.zeros((len(q), width), dtype=np.int64)
    prods = np.full((len(q), width), np.inf)
    for j, value in enumerate(q.tolist()):
        members = groups[value]
        padded = members + [members[-1]] * (width - len(members))
        cols[j], rows[j] = [c for c, _ in padded], [r for _, r in padded]
        prods[j, : len(members)] = [c * r for c, r in members]
    return q, cols, rows, prods


def sweep_np(w: np.ndarray, h: np.ndarray, tile_size: int, grids: tuple[tuple[int, int], ...], scalar):
    """The result of transformers' closest-aspect-ratio sweep over ``grids`` for every element,
    without sweeping.

    The sweep keeps the first grid with the smallest ``|aspect - c/r|`` and then moves to each
    later grid with *exactly* the same distance while ``area > 0.5 * tile^2 * c * r``. Only the one
    or two ratio values next to ``aspect`` can hold the smallest distance (distinct ratios differ
    by far more than float rounding), and grids sharing a ratio value come in increasing tile
    count, so the condition holds for a prefix of them: the answer is the ``m``-th grid of the
    nearest ratio value, ``m`` = how many of its later grids pass the area test. Elements exactly
    midway between two ratio values (equal float distances) are left to ``scalar(w, h)``, the
    sweep itself.
    """
    q, cols, rows, prods = _ratio_table(grids)
    aspect = w / h
    area = w * h
    j = np.searchsorted(q, aspect)
    left = np.clip(j - 1, 0, len(q) - 1)
    right = np.clip(j, 0, len(q) - 1)
    d_left = np.abs(aspect - q[left])
    d_right = np.abs(aspect - q[right])
    pick = np.where(d_right < d_left, right, left)
    m = np.zeros(w.shape, dtype=np.int64)
    half_tile2 = 0.5 * tile_size * tile_size
    for k in range(1, prods.shape[1]):
        m += area > half_tile2 * prods[pick, k]
    c, r = cols[pick, m], rows[pick, m]
    tie = np.flatnonzero((d_left == d_right) & (left != right))
    for i in tie:
        c[i], r[i] = scalar(int(w[i]), int(h[i]))
    return c, r


def best_grid_np(w: np.ndarray, h: np.ndarray, tile_size: int, min_tiles: int, max_tiles: int):
    """Vectorised :func:`best_grid` (see :func:`sweep_np`); identical results."""
    return sweep_np(
        w,
        h,
        tile_size,
        tile_grids(min_tiles, max_tiles),
        lambda a, b: best_grid(a, b, tile_size, min_tiles, max_tiles),
    )


@dataclass(frozen=True)
class TilesEstimator(Estimator):
    """Tile-count estimator; :func:`make_tiles` gives InternVL's defaults.

    Fields: ``tile_size`` (px), ``tokens_per_tile``, ``min_tiles``/``max_tiles`` (InternVL's
    ``min_dynamic_patch``/``max_dynamic_patch``, transformers' ``min_patches``/``max_patches``),
    ``use_thumbnail`` (transformers always adds it; the original InternVL code makes it a
    setting), ``wrapper_tokens`` (``<img>``/``</img>`` = 2), ``family`` (the name reported).
    """

    family: str = "tiles"
    tile_size: int = 448
    tokens_per_tile: int = 256
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True
    wrapper_tokens: int = 2
    video_frames: int | None = None

    SETTING_ALIASES = {
        "max_num": "max_tiles",
        "min_num": "min_tiles",
        "max_patches": "max_tiles",
        "min_patches": "min_tiles",
        "max_dynamic_patch": "max_tiles",
        "min_dynamic_patch": "min_tiles",
        "image_size": "tile_size",
        "num_image_token": "tokens_per_tile",
        "image_seq_length": "tokens_per_tile",
        "num_segments": "video_frames",
    }

    def __post_init__(self) -> None:
        v = self.video_frames
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{self.family}: video_frames must be None or a positive int, got {v!r}")
        self.check_field_types(allow_zero=True)
        if self.tile_size <= 0 or self.tokens_per_tile <= 0 or self.min_tiles <= 0:
            raise ValueError(f"{self.family}: tile_size, tokens_per_tile and min_tiles must be > 0")
        if self.min_tiles > self.max_tiles:
            raise ValueError(f"{self.family}: min_tiles={self.min_tiles} > max_tiles={self.max_tiles}")
        if not isinstance(self.use_thumbnail, bool):
            raise ValueError(f"{self.family}: use_thumbnail must be a bool, got {self.use_thumbnail!r}")

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """(columns, rows) of the tile grid (before the thumbnail)."""
        w, h = as_side(width, "width"), as_side(height, "height")
        if self.max_tiles <= 1:  # transformers skips cropping entirely when max_patches == 1
            return 1, 1
        return best_grid(w, h, self.tile_size, self.min_tiles, self.max_tiles)

    def num_tiles(self, width: int, height: int) -> int:
        """Tiles fed to the vision encoder, thumbnail included (transformers' ``num_patches``)."""
        c, r = self.tile_grid(width, height)
        n = c * r
        return n + 1 if (self.use_thumbnail and n > 1) else n

    def image_tokens(self, width: int, height: int) -> int:
        """``<IMG_CONTEXT>`` tokens for one image (wrappers not included)."""
        return self.tokens_per_tile * self.num_tiles(width, height)

    def image_tokens_batch(self, widths, heights) -> np.ndarray:
        """Vectorised :meth:`image_tokens`; identical values, int64."""
        w, h = pair_dims(widths, heights)
        if self.max_tiles <= 1:
            n = np.ones(w.shape, dtype=np.int64)
        else:
            c, r = best_grid_np(w, h, self.tile_size, self.min_tiles, self.max_tiles)
            n = c * r
            if self.use_thumbnail:
                n = n + (n > 1)
        return self.tokens_per_tile * n

    def video_tokens(self, num_frames: int, width: int, height: int, fps: float | None = None) -> int:
        """InternVL video: one tile per frame (``max_num=1``, no thumbnail), ``tokens_per_tile``
        each. Frames used: ``video_frames`` if set (the official ``num_segments``, e.g. 8 or 32),
        else all ``num_frames`` (the caller sampled them). ``fps`` is not used. Each frame also
        gets ``<img>``/``</img>`` (:meth:`video_wrapper_tokens`) and a ``FrameN: `` text label
        (tokenizer-dependent, not counted)."""
        as_side(width, "width")
        as_side(height, "height")
        return self.tokens_per_tile * self._frames_used(num_frames)

    def video_wrapper_tokens(self, num_frames: int, fps: float | None = None) -> int:
        return self.wrapper_tokens * self._frames_used(num_frames)

    def _frames_used(self, num_frames: int) -> int:
        n = as_dim(num_frames, "num_frames")
        return n if self.video_frames is None else fixed_frames_of(self.family, self.video_frames, n)


def make_tiles(family: str = "tiles", **overrides) -> TilesEstimator:
    """InternVL 2.5 / 3 defaults (``force_image_size`` 448, ``max_dynamic_patch`` 12,
    ``use_thumbnail`` True, 256 tokens per tile, ``<img>``/``</img>``), then ``overrides``
    (``max_num=6`` etc. are accepted as aliases)."""
    base = TilesEstimator(family=family)
    return base.replace(**overrides) if overrides else base
