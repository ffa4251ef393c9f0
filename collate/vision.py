"""What a Qwen-VL vision tower derives from ``grid_thw``, computed on the host by the collator.

transformers' Qwen2-VL / Qwen2.5-VL towers compute their rotary position ids, attention segments
and (Qwen2.5-VL) window order from ``grid_thw`` inside ``forward`` with python loops over
``grid_thw.tolist()``; once the grids live on an accelerator every one of those reads is a host
sync. transformers 5.x lets a caller pass them in precomputed (``transformers.vision_utils``: the
``get_vision_*`` helpers pop ``position_ids`` / ``cu_seqlens`` / ``max_seqlen`` / ``window_index`` /
``cu_window_seqlens`` from the tower's kwargs), so :class:`collate.PackedCollator` builds them here,
with numpy, next to the text fields. Those helpers are the oracle the tests compare against.

Every function takes the batch's grids in tower order (all images, then all videos), as one
``(n, 3)`` int array of ``(t, h, w)`` in patches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from collate.positions import _arange

__all__ = ["frame_seqlens", "tower_fields", "vision_rotary_positions", "vision_window_index",
           "window_in_merged_tokens"]


def tower_fields(grids: np.ndarray, merge: int | None = None, window: int | None = None, *,
                 checked: bool = False) -> dict[str, Any]:
    """The ``vision_*`` fields of :class:`collate.PackedBatch` for these grids (host tensors, ints, lists).

    Always the per-frame attention segments (``vision_cu_seqlens`` with its host ends list and
    ``vision_max_seqlen``); with ``merge`` (Qwen-VL towers) the rotary ``vision_position_ids``; with
    ``window`` as well (Qwen2.5-VL) the window order and segments. ``checked=True``: the caller has
    already verified that every ``h`` and ``w`` is a positive multiple of ``merge`` (the collator's
    positions do), so the rotary ids skip that pass.
    """
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    frames = frame_seqlens(g)
    cu = _cumulative(frames)
    fields: dict[str, Any] = dict(vision_cu_seqlens=torch.from_numpy(cu),
                                  vision_cu_seqlens_list=cu[1:].tolist(),
                                  vision_max_seqlen=int(frames.max(initial=0)))
    if merge is None:
        return fields
    rotary = _rotary_positions(g, merge) if checked else vision_rotary_positions(g, merge)
    fields["vision_position_ids"] = torch.from_numpy(rotary)
    if window is not None:
        window_index, windows = vision_window_index(g, merge, window)
        window_cu = _cumulative(windows)
        fields.update(vision_window_index=torch.from_numpy(window_index),
                      vision_cu_window_seqlens=torch.from_numpy(window_cu),
                      vision_cu_window_seqlens_list=window_cu[1:].tolist(),
                      vision_max_window_seqlen=int(windows.max(initial=0)))
    return fields


def window_in_merged_tokens(vision_config: Any) -> int | None:
    """Qwen2.5-VL's attention window side in merged tokens, from its vision config; None without one.

    transformers computes ``window_size // spatial_merge_size // patch_size``; chained floor
    divisions of positive ints equal one division by the product.
    """
    window, patch = getattr(vision_config, "window_size", None), getattr(vision_config, "patch_size", None)
    if window is None or patch is None:
        return None
    return int(window) // (int(getattr(vision_config, "spatial_merge_size", 2)) * int(patch))


def _cumulative(lengths: np.ndarray) -> np.ndarray:
    """``[0, l0, l0+l1, ...]`` as int32: cu_seqlens with the leading 0."""
    out = np.zeros(lengths.shape[0] + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _check_grids(grids: np.ndarray, merge: int) -> np.ndarray:
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    bad = np.flatnonzero((g[:, 1] % merge != 0) | (g[:, 2] % merge != 0) | (g <= 0).any(1))
    if bad.size:
        raise ValueError(
            f"vision grid {bad[0]} (t, h, w) = {g[bad[0]].tolist()}: h and w must be positive multiples "
            f"of spatial_merge_size={merge}"
        )
    return g


def frame_seqlens(grids: np.ndarray) -> np.ndarray:
    """Patches per attention segment: one ``h*w`` entry per frame (``t`` per grid)."""
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    return np.repeat(g[:, 1] * g[:, 2], g[:, 0])


def vision_rotary_positions(grids: np.ndarray, merge: int) -> np.ndarray:
    """``(Σ t·h·w, 2)`` int64 (row, column) of every patch, in the tower's patch order.

    Patches arrive block-major: ``merge x merge`` blocks in row-major order, row-major inside a
    block, every frame of a grid repeating its image's ids (what
    ``transformers.vision_utils.get_vision_position_ids`` returns).
    """
    return _rotary_positions(_check_grids(grids, merge), merge)


def _rotary_positions(g: np.ndarray, merge: int) -> np.ndarray:
    """:func:`vision_rotary_positions` of grids already checked (``(n, 3)`` int64, h and w positive
    multiples of ``merge``)."""
    if g.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64)
    mm = merge * merge
    lh, lw = g[:, 1] // merge, g[:, 2] // merge
    # One "band" = one row of merge blocks of one frame: lw * merge² patches. Patch q of the band of
    # block row r sits at (r * merge + q // merge % merge, q // merge² * merge + q % merge), whatever
    # the band's width, so every band reads a prefix of row r of one small table: the whole output
    # is one gather, indexed by a ramp per band (no division over the patches).
    frames_lh = np.repeat(lh, g[:, 0])  # block rows of every frame, grid after grid
    band_len = np.repeat(np.repeat(lw * mm, g[:, 0]), frames_lh)
    band_ends = np.cumsum(band_len)
    total = int(band_ends[-1])
    band_row = _arange(band_len.shape[0]) - np.repeat(np.cumsum(frames_lh) - frames_lh, frames_lh)
    width, rows = int(lw.max()) * mm, int(lh.max())
    if rows * width <= max(total, _TABLE_MIN):
        table = _band_table(merge, rows, width)
        stride = table.shape[1]
        local = _arange(total) - np.repeat(band_ends - band_len - band_row * stride, band_len)
        # np.take: plain indexing copies 2-element rows ~10x slower.
        return np.take(table.reshape(-1, 2), local, axis=0)
    # A table larger than the output (very uneven grids): one band row, the block rows added after.
    q = np.arange(width, dtype=np.int64)
    band = np.stack((q // merge % merge, q // mm * merge + q % merge), axis=1)
    out = np.take(band, _arange(total) - np.repeat(band_ends - band_len, band_len), axis=0)
    out[:, 0] += np.repeat(band_row * merge, band_len)
    return out


# Band tables up to this many entries (1 MiB) are kept per merge size and reused by later batches;
# a larger one is built for its batch only, and only when the batch's output is larger still.
_TABLE_MIN = 1 << 16
_TABLES: dict[int, np.ndarray] = {}


def _band_table(merge: int, rows: int, width: int) -> np.ndarray:
    """``(R, W, 2)`` int64 with ``R >= rows``, ``W >= width``, read-only: entry ``[r, q]`` is the
    (row, column) of patch ``q`` of a band in block row ``r``."""
    table = _TABLES.get(merge)
    if table is not None:
        if table.shape[0] >= rows and table.shape[1] >= width:
            return table
        grown = max(rows, table.shape[0]), max(width, table.shape[1])
        if grown[0] * grown[1] <= _TABLE_MIN:
            rows, width = grown
    mm = merge * merge
    q = np.arange(width, dtype=np.int64)
    table = np.empty((rows, width, 2), dtype=np.int64)
    table[:, :, 0] = (q // merge % merge)[None, :] + np.arange(rows, dtype=np.int64)[:, None] * merge
    table[:, :, 1] = (q // mm * merge + q % merge)[None, :]
    table.flags.writeable = False
    if rows * width <= _TABLE_MIN:
        _TABLES[merge] = table
    return table


def vision_window_index(grids: np.ndarray, merge: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's windowed attention layout: ``(window_index, window_seqlens)``.

    ``window`` is the window side in merged tokens (``vision_config.window_size //
    (spatial_merge_size * patch_size)``). Each frame's ``(h/merge, w/merge)`` grid of merged tokens
    is cut into ``window x window`` tiles (the last row and column of tiles may be smaller);
    ``window_index`` lists the merged tokens tile by tile (row-major inside a tile), numbered over
    the whole batch; ``window_seqlens`` is each tile's length in patches (merged tokens ×
    merge²). transformers pads every frame by a full extra row and column of empty tiles and then
    drops the resulting zero-length segments with ``unique_consecutive``; the non-empty tiles and
    their order are the ones computed here.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1 merged tokens, got {window}")
    g = _check_grids(grids, merge)
    index_parts, length_parts = [], []
    offset = 0
    cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for t, h, w in g.tolist():
        lh, lw = h // merge, w // merge
        frame = cache.get((lh, lw))
        if frame is None:
            frame = _frame_windows(lh, lw, window)
            cache[(lh, lw)] = frame
        order, lengths = frame
        per_frame = lh * lw
        index_parts.append((order[None, :] + per_frame * np.arange(t)[:, None]).reshape(-1) + offset)
        length_parts.append(np.tile(lengths, t))
        offset += t * per_frame
    if not index_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(index_parts), np.concatenate(length_parts) * merge * merge


def _frame_windows(lh: int, lw: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """One frame: merged-token order tile by tile, and each tile's merged-token count."""
    nh, nw = -(-lh // window), -(-lw // window)
    padded = np.full((nh * window, nw * window), -1, dtype=np.int64)
    padded[:lh, :lw] = np.arange(lh * lw).reshape(lh, lw)
    tiles = padded.reshape(nh, window, nw, window).transpose(0, 2, 1, 3).reshape(nh * nw, window * window)
    keep = tiles >= 0
    return tiles[keep], keep.sum(1)
