"""Position ids for one sample: plain 1-D and Qwen2-VL / Qwen2.5-VL chunked M-RoPE.

Everything here is numpy on the host. A packed batch is built by computing positions per sample
and concatenating them (``get_rope_index`` treats a row as one sequence, so it cannot be run on
an already packed row; see LlamaFactory#7754, NeMo-Automodel#2172).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["mrope_positions", "text_positions", "as_grid"]


def text_positions(length: int) -> np.ndarray:
    """1-D positions ``0 .. length-1`` (int64) for one sample."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return np.arange(length, dtype=np.int64)


def as_grid(grid: Any, name: str = "grid_thw") -> np.ndarray:
    """``grid`` (None, list, numpy array or torch tensor) as an ``(n, 3)`` int64 array."""
    if grid is None:
        return np.zeros((0, 3), dtype=np.int64)
    arr = _to_numpy(grid)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim == 1 and arr.shape[0] == 3:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"{name} must have shape (n, 3), got {tuple(arr.shape)}")
    if (arr <= 0).any():
        raise ValueError(f"{name} must be positive, got {arr.tolist()}")
    return arr.astype(np.int64, copy=False)


def _to_numpy(x: Any) -> np.ndarray:
    # Duck-typed so that this module does not need torch at import time.
    if hasattr(x, "detach") and hasattr(x, "numpy"):
        x = x.detach()
        if getattr(x, "device", None) is not None and x.device.type != "cpu":
            raise ValueError(f"expected a host tensor, got one on {x.device}")
        return x.numpy()
    return np.asarray(x)


def _vision_block(grid: np.ndarray, merge: int, start: int, interval: float | None) -> tuple[np.ndarray, int]:
    """Positions (3, t*h*w/merge^2) of one image/video starting at ``start``, and the block's max offset."""
    gt, gh, gw = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    if interval is None:
        t_off = np.arange(gt, dtype=np.int64)
    else:
        # transformers computes (arange(gt) * interval).long() in float32 (an int64 tensor times a python
        # float gives float32); doing the same keeps the truncation identical for fractional intervals.
        t_off = (np.arange(gt, dtype=np.float32) * np.float32(interval)).astype(np.int64)
    hw = gh * gw
    pos = np.empty((3, gt * hw), dtype=np.int64)
    pos[0] = np.repeat(t_off, hw)
    pos[1] = np.tile(np.repeat(np.arange(gh, dtype=np.int64), gw), gt)
    pos[2] = np.tile(np.arange(gw, dtype=np.int64), gt * gh)
    max_off = max(int(t_off[-1]), gh - 1, gw - 1)
    pos += start
    return pos, max_off


def mrope_positions(
    input_ids: Any,
    image_grid_thw: Any,
    video_grid_thw: Any,
    *,
    image_token_id: int,
    video_token_id: int | None,
    vision_start_token_id: int | None,
    spatial_merge_size: int,
    second_per_grid_ts: Sequence[float] | Any | None = None,
    tokens_per_second: float | None = None,
) -> np.ndarray:
    """Chunked M-RoPE position ids ``(3, L)`` int64 for ONE unpadded sample (Qwen2-VL / Qwen2.5-VL).

    Text tokens get ``t = h = w = current + arange(n)``. An image or video whose grid is ``(t, h, w)``
    patches covers ``t*h*w / merge**2`` consecutive placeholder tokens and gets
    ``T = start + floor(arange(t) * interval)``, ``H = start + arange(h/merge)``,
    ``W = start + arange(w/merge)`` (meshgrid, ``ij`` order), where ``start`` is the position the next
    text token would have had. ``interval`` is 1 for images and for Qwen2-VL videos
    (``tokens_per_second=None``); for Qwen2.5-VL videos it is ``tokens_per_second *
    second_per_grid_ts[i]`` (default 1 s per grid, as transformers does), kept as a float (the
    transformers 5.x behaviour, not 4.x's integer truncation, cf. transformers#48669).

    Where text resumes after a vision block:

    * after an **image**: ``start + max(h, w) / merge``, exactly transformers 5.24's
      ``get_rope_index``. For the images Qwen processors emit (``t == 1``) this is also "max position
      so far + 1", i.e. the same as transformers 4.x and the original Qwen2-VL code.
    * after a **video**: ``max position so far + 1`` (the original Qwen2-VL / transformers 4.x rule,
      which includes the video's temporal extent). transformers 5.24 instead resumes at
      ``start + max(h, w) / merge``, which makes text after a long video reuse the positions of the
      video's later frames. We keep the original rule because that is what the released checkpoints
      were trained with. ``tests/test_positions.py`` pins this with golden values.

    Vision blocks are found in token order: each maximal run of image (video) tokens is consumed by
    the next image (video) grids in order, so adjacent images without separators are handled.
    If ``vision_start_token_id`` is given, every block must directly follow that token (as the Qwen
    chat template emits it); this catches placeholders that were truncated or shifted.

    Raises ``ValueError`` when the placeholder counts do not match the grids.
    """
    ids = _to_numpy(input_ids)
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {tuple(ids.shape)}")
    ids = ids.astype(np.int64, copy=False)
    length = ids.shape[0]
    merge = int(spatial_merge_size)
    grids = {
        "image": as_grid(image_grid_thw, "image_grid_thw"),
        "video": as_grid(video_grid_thw, "video_grid_thw"),
    }
    is_img = ids == image_token_id
    is_vid = ids == video_token_id if video_token_id is not None else np.zeros(length, dtype=bool)
    for kind, mask in (("image", is_img), ("video", is_vid)):
        grid = grids[kind]
        if ((grid[:, 1] % merge) != 0).any() or ((grid[:, 2] % merge) != 0).any():
            raise ValueError(f"{kind}_grid_thw h and w must be multiples of spatial_merge_size={merge}")
        expected = int((grid.prod(axis=1) // (merge * merge)).sum())
        found = int(mask.sum())
        if found != expected:
            raise ValueError(
                f"{found} {kind} placeholder tokens in input_ids but {kind}_grid_thw "
                f"{grid.tolist()} needs {expected} (sum(t*h*w) / {merge}**2)"
            )
    n_videos = grids["video"].shape[0]
    if second_per_grid_ts is None:
        seconds = np.ones(n_videos, dtype=np.float64)
    else:
        seconds = _to_numpy(second_per_grid_ts).astype(np.float64).reshape(-1)
        if seconds.shape[0] != n_videos:
            raise ValueError(f"second_per_grid_ts has {seconds.shape[0]} entries for {n_videos} videos")

    # Text positions are ``index + shift`` where the shift is constant between vision blocks; start
    # from shift 0 everywhere and fix up one block at a time (a handful of blocks per sample).
    pos = np.broadcast_to(np.arange(length, dtype=np.int64), (3, length)).copy()
    vision_idx = np.flatnonzero(is_img | is_vid)
    next_grid = {"image": 0, "video": 0}
    shift = 0
    k = 0
    while k < vision_idx.shape[0]:
        begin = int(vision_idx[k])
        kind = "image" if is_img[begin] else "video"
        mask = is_img if kind == "image" else is_vid
        gi = next_grid[kind]
        next_grid[kind] += 1
        grid = grids[kind][gi]
        n = int(grid.prod()) // (merge * merge)
        end = begin + n
        if end > length or not mask[begin:end].all():
            raise ValueError(
                f"{kind} {gi} with grid {grid.tolist()} needs {n} consecutive placeholder tokens "
                f"from index {begin}, but the run is shorter"
            )
        if vision_start_token_id is not None and (begin == 0 or ids[begin - 1] != vision_start_token_id):
            raise ValueError(
                f"{kind} {gi} at token index {begin} does not follow vision_start_token_id "
                f"{vision_start_token_id}"
            )
        start = begin + shift
        interval = None
        if kind == "video" and tokens_per_second is not None:
            interval = float(tokens_per_second) * float(seconds[gi])
        block, max_off = _vision_block(grid, merge, start, interval)
        pos[:, begin:end] = block
        if kind == "image":
            resume = start + max(int(grid[1]), int(grid[2])) // merge  # transformers 5.24
        else:
            resume = start + max_off + 1  # original Qwen2-VL rule, see docstring
        new_shift = resume - end
        pos[:, end:] += new_shift - shift  # later tokens already carry the old shift
        shift = new_shift
        k += n
    return pos
