"""Idefics3 and SmolVLM: image splitting into a grid of square tiles plus one global view.

The image processor (transformers 5.24 ``Idefics3ImageProcessor[Pil]``; ``SmolVLMImageProcessor``
is the same code) does three things that decide the token count:

1. resize so that the **longest** edge equals ``size.longest_edge`` (up- or down-scaling; the other
   edge is ``int()``-truncated and bumped to even), then cap at 4096 px;
2. ``resize_for_vision_encoder``: round the long side up to a multiple of the tile size T
   (``max_image_size.longest_edge``), derive the short side from the aspect ratio, round it up too;
3. split into ``rows x cols`` tiles of T when the result is larger than one tile (else no split).

Every tile and the global view cost ``image_seq_len`` ``<image>`` tokens. The processor's prompt
string adds, per tile, ``<fake_token_around_image><row_r_col_c>``, a ``"\\n"`` after each tile row,
and ``"\\n<fake_token_around_image><global-img>" ... "<fake_token_around_image>"`` around the global
view (``Idefics3Processor.replace_image_token``); those are :meth:`image_wrapper_tokens`.

Because step 1 always rescales to ``longest_edge``, the count depends only on the aspect ratio.
We port the processor's resize logic (not the pixel-free ``get_number_of_image_patches`` helper,
which derives the tile rows from the wrong height when ``longest_edge`` is not a multiple of the
tile; research note §7.9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenbal.estimate._sizes import as_side, pair_dims
from tokenbal.estimate.base import Estimator

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap after the first resize


def resized_size(width: int, height: int, longest_edge: int) -> tuple[int, int]:
    """(width, height) after step 1 (``get_resize_output_image_size``)."""
    aspect = width / height
    if width >= height:
        w = longest_edge
        h = int(w / aspect)
        h += h % 2
    else:
        h = longest_edge
        w = int(h * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    # _resize_output_size_scale_below_upper_bound(..., MAX_IMAGE_SIZE)
    aspect = w / h
    if w >= h and w > MAX_IMAGE_SIZE:
        w = MAX_IMAGE_SIZE
        h = int(w / aspect)
    elif h > w and h > MAX_IMAGE_SIZE:
        h = MAX_IMAGE_SIZE
        w = int(h * aspect)
    return max(w, 1), max(h, 1)


def tile_grid(width: int, height: int, longest_edge: int, tile: int) -> tuple[int, int]:
    """(rows, cols) of the split, ``(0, 0)`` when the image is not split."""
    w, h = resized_size(width, height, longest_edge)
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = int(w / aspect)
        h = math.ceil(h / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = int(h * aspect)
        w = math.ceil(w / tile) * tile
    if h > tile or w > tile:
        return (h - tile) // tile + 1, (w - tile) // tile + 1
    return 0, 0


def _resized_np(w: np.ndarray, h: np.ndarray, longest_edge: int) -> tuple[np.ndarray, np.ndarray]:
    aspect = w / h
    wide = w >= h
    # int() of a positive float truncates like astype(int64); same float64 operations as above
    h1 = np.where(wide, (longest_edge / aspect).astype(np.int64), longest_edge)
    w1 = np.where(wide, longest_edge, (longest_edge * aspect).astype(np.int64))
    h1 = np.where(wide, h1 + h1 % 2, h1)
    w1 = np.where(wide, w1, w1 + w1 % 2)
    h1, w1 = np.maximum(h1, 1), np.maximum(w1, 1)
    if longest_edge > MAX_IMAGE_SIZE:  # only then can step 1 exceed the cap
        a2 = w1 / h1
        cap_w = (w1 >= h1) & (w1 > MAX_IMAGE_SIZE)
        cap_h = (h1 > w1) & (h1 > MAX_IMAGE_SIZE)
        h1 = np.where(cap_w, (MAX_IMAGE_SIZE / a2).astype(np.int64), h1)
        w1 = np.where(cap_w, MAX_IMAGE_SIZE, w1)
        w1 = np.where(cap_h, (MAX_IMAGE_SIZE * a2).astype(np.int64), w1)
        h1 = np.where(cap_h, MAX_IMAGE_SIZE, h1)
        h1, w1 = np.maximum(h1, 1), np.maximum(w1, 1)
    return w1, h1


def tile_grid_np(w: np.ndarray, h: np.ndarray, longest_edge: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`tile_grid` (same float64 operations in the same order)."""
    w1, h1 = _resized_np(w, h, longest_edge)
    aspect = w1 / h1
    wide = w1 >= h1
    wa = np.ceil(w1 / tile).astype(np.int64) * tile
    ha = np.ceil((wa / aspect).astype(np.int64) / tile).astype(np.int64) * tile
    hb = np.ceil(h1 / tile).astype(np.int64) * tile
    wb = np.ceil((hb * aspect).astype(np.int64) / tile).astype(np.int64) * tile
    w2, h2 = np.where(wide, wa, wb), np.where(wide, ha, hb)
    split = (h2 > tile) | (w2 > tile)
    rows = np.where(split, (h2 - tile) // tile + 1, 0)
    cols = np.where(split, (w2 - tile) // tile + 1, 0)
    return rows, cols


@dataclass(frozen=True)
class Idefics3Estimator(Estimator):
    """Idefics3 / SmolVLM ``<image>`` counts; :func:`make_idefics3` gives the official defaults.

    Fields:
      family: "idefics3" | "smolvlm" (the name reported; the arithmetic is the same).
      longest_edge: image processor ``size.longest_edge`` (step 1 target).
      tile_size: ``max_image_size.longest_edge`` (T).
      image_seq_len: ``<image>`` tokens per tile / global view (processor's ``image_seq_len``).
      do_image_splitting: when False every image is one T x T view (``image_seq_len`` tokens).
      split_newline_tokens: tokens the text tokenizer makes of the ``"\\n\\n"`` between the last
        tile row and the global view: 1 if it merges the two newlines (what
        ``Idefics3Processor._get_num_multimodal_tokens`` calls ``extra_split_newline = 0``), else 2.
        Only used by :meth:`image_wrapper_tokens`.
    """

    family: str = "idefics3"
    longest_edge: int = 4 * 364
    tile_size: int = 364
    image_seq_len: int = 169
    do_image_splitting: bool = True
    split_newline_tokens: int = 1

    SETTING_ALIASES = {"max_image_size": "tile_size", "image_seq_length": "image_seq_len"}

    def __post_init__(self) -> None:
        self.check_field_types()
        if not isinstance(self.do_image_splitting, bool):
            raise ValueError(
                f"{self.family}: do_image_splitting must be a bool, got {self.do_image_splitting!r}"
            )
        if self.split_newline_tokens not in (1, 2):
            raise ValueError(
                f"{self.family}: split_newline_tokens must be 1 or 2, got {self.split_newline_tokens!r}"
            )

    @property
    def wrapper_tokens(self) -> int:
        """The fixed part of the wrapper: ``<fake_token_around_image><global-img>`` before and
        ``<fake_token_around_image>`` after the global view (3). A split image adds more (per tile
        and per row); :meth:`image_wrapper_tokens` gives the exact per-image value."""
        return 3

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of the tile split; ``(0, 0)`` = not split (global view only)."""
        w, h = as_side(width, "width"), as_side(height, "height")
        if not self.do_image_splitting:
            return 0, 0
        return tile_grid(w, h, self.longest_edge, self.tile_size)

    def image_tokens(self, width: int, height: int) -> int:
        """``<image>`` placeholders for one image: ``image_seq_len * (rows * cols + 1)``."""
        r, c = self.tile_grid(width, height)
        return self.image_seq_len * (r * c + 1)

    def image_tokens_batch(self, widths, heights) -> np.ndarray:
        """Vectorised :meth:`image_tokens`; identical values, int64."""
        r, c = self._grid_batch(widths, heights)
        return self.image_seq_len * (r * c + 1)

    def image_wrapper_tokens(self, width: int, height: int) -> int:
        """Non-``<image>`` tokens of one image's prompt string (tile markers, row newlines, the
        global view's markers); ``image_tokens + image_wrapper_tokens`` is what the processor's
        ``_get_num_multimodal_tokens`` reports."""
        r, c = self.tile_grid(width, height)
        return int(self._wrapper(np.array([r]), np.array([c]))[0])

    def image_wrapper_tokens_batch(self, widths, heights) -> np.ndarray:
        """Vectorised :meth:`image_wrapper_tokens`, int64."""
        r, c = self._grid_batch(widths, heights)
        return self._wrapper(r, c)

    def _wrapper(self, r: np.ndarray, c: np.ndarray) -> np.ndarray:
        # split: <fake><row_i_col_j> per tile, "\n" after rows 1..r-1, then the last row's "\n" and
        # the global view's leading "\n" ("\n\n"); always <fake><global-img> ... <fake> (3)
        split = 2 * r * c + (r - 1) + self.split_newline_tokens
        return 3 + np.where(r > 0, split, 0)

    def _grid_batch(self, widths, heights) -> tuple[np.ndarray, np.ndarray]:
        w, h = pair_dims(widths, heights)
        if not self.do_image_splitting:
            z = np.zeros(w.shape, dtype=np.int64)
            return z, z
        return tile_grid_np(w, h, self.longest_edge, self.tile_size)


# Official hub values (research note §4.2): Idefics3-8B-Llama3 and SmolVLM-256M/500M-Instruct.
IDEFICS3_DEFAULTS = {"longest_edge": 4 * 364, "tile_size": 364, "image_seq_len": 169}
SMOLVLM_DEFAULTS = {"longest_edge": 4 * 512, "tile_size": 512, "image_seq_len": 64}


def make_idefics3(family: str = "idefics3", **overrides) -> Idefics3Estimator:
    """``family="idefics3"``: HuggingFaceM4/Idefics3-8B-Llama3 (``size.longest_edge`` 1456, tile
    364, 169 tokens per tile) = also transformers' class defaults. ``family="smolvlm"``:
    SmolVLM-256M / 500M-Instruct (2048, tile 512, 64 tokens per tile); transformers'
    ``SmolVLMImageProcessor`` class defaults are Idefics3's (1456/364) and ``SmolVLMProcessor``'s
    ``image_seq_len`` default is 169, so a checkpoint's own files matter. SmolVLM-Instruct and
    SmolVLM2-2.2B use ``longest_edge=1536, tile_size=384, image_seq_len=81``."""
    base = SMOLVLM_DEFAULTS if family == "smolvlm" else IDEFICS3_DEFAULTS
    return Idefics3Estimator(family=family, **base).replace(**overrides)
