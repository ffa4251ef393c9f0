"""Position ids: plain 1-D and Qwen2-VL / Qwen2.5-VL / Qwen3-VL M-RoPE.

Everything here is numpy on the host. A packed row's positions are the per-sample positions
concatenated (``get_rope_index`` treats a row as one sequence, so it cannot be run on an already
packed row; see LlamaFactory#7754, NeMo-Automodel#2172). :func:`mrope_positions` does one sample
block by block and is the readable reference with detailed errors; :func:`packed_mrope_positions`
computes a whole packed row with a fixed number of numpy calls (no per-sample or per-block python
loop) and falls back to the per-sample function only to word an error.

Which M-RoPE "variant" a model uses only changes two inputs here:
Qwen2-VL: defaults. Qwen2.5-VL: ``tokens_per_second`` (video time steps are
``tokens_per_second * second_per_grid_ts``). Qwen3-VL: ``split_video_frames=True`` (each video
frame is its own ``t=1`` grid between timestamp text, as its ``get_rope_index`` does); the
interleaved frequency layout is the RoPE op's business (``apply_mrope(..., interleaved=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SPATIAL", "TEMPORAL", "VIDEO_TEXT_RESUME", "mrope_positions", "packed_mrope_positions",
           "packed_mrope_positions_and_slots", "text_positions", "as_grid", "split_frames",
           "block_token_offsets"]


_ARANGE = np.arange(0, dtype=np.int64)

# Where text resumes after a Qwen2-VL / Qwen2.5-VL video block (``video_text_resume``, see
# :func:`mrope_positions`): after the video's temporal extent (the original code, transformers 4.x)
# or after its spatial one, as after an image (transformers 5.x).
TEMPORAL, SPATIAL = "temporal", "spatial"
VIDEO_TEXT_RESUME = (TEMPORAL, SPATIAL)


def _spatial_resume(rule: str) -> bool:
    if rule not in VIDEO_TEXT_RESUME:
        raise ValueError(f"video_text_resume must be one of {VIDEO_TEXT_RESUME}, got {rule!r}")
    return rule == SPATIAL


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` int64, as a read-only view of one cached array (grown when needed): the
    collator needs several per batch and building one costs a pass over the row."""
    global _ARANGE
    if _ARANGE.shape[0] < n:
        grown = np.arange(max(n, 2 * _ARANGE.shape[0]), dtype=np.int64)
        grown.flags.writeable = False
        _ARANGE = grown
    return _ARANGE[:n]


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


def split_frames(video_grid_thw: np.ndarray) -> np.ndarray:
    """Qwen3-VL layout: every ``(t, h, w)`` video grid becomes ``t`` grids ``(1, h, w)``."""
    grid = np.repeat(video_grid_thw, video_grid_thw[:, 0], axis=0)
    grid[:, 0] = 1
    return grid


def _intervals(seconds: np.ndarray, tokens_per_second: float, whole_seconds: bool = False) -> np.ndarray:
    # transformers computes ``tokens_per_second * second_per_grid_ts[i]`` with the float32 tensor the
    # processor returns, then ``arange(t) * interval`` in float32 and truncates. Doing the same float32
    # steps keeps the truncation identical (a float64 product differs in ~5% of random cases).
    # ``whole_seconds``: transformers up to 5.9 first truncates each entry to whole seconds
    # (4.57: an int64 cast; 5.6-5.9: ``int()``), so 0.5 s per grid is a step of 0.
    seconds = seconds.astype(np.float32)
    if whole_seconds:
        seconds = np.trunc(seconds)
    return np.float32(tokens_per_second) * seconds


def _vision_block(
    grid: np.ndarray, merge: int, start: int, interval: np.float32 | None
) -> tuple[np.ndarray, int]:
    """Positions (3, t*h*w/merge^2) of one image/video starting at ``start``, and the block's max offset."""
    gt, gh, gw = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    if interval is None:
        t_off = np.arange(gt, dtype=np.int64)
    else:
        t_off = (np.arange(gt, dtype=np.float32) * interval).astype(np.int64)
    hw = gh * gw
    pos = np.empty((3, gt * hw), dtype=np.int64)
    pos[0] = np.repeat(t_off, hw)
    pos[1] = np.tile(np.repeat(np.arange(gh, dtype=np.int64), gw), gt)
    pos[2] = np.tile(np.arange(gw, dtype=np.int64), gt * gh)
    max_off = max(int(t_off[-1]), gh - 1, gw - 1)
    pos += start
    return pos, max_off


def _seconds(second_per_grid_ts: Any, n_videos: int) -> np.ndarray:
    if second_per_grid_ts is None:
        return np.ones(n_videos, dtype=np.float32)  # transformers' default: 1 s per grid
    seconds = _to_numpy(second_per_grid_ts).reshape(-1)
    if seconds.dtype.kind not in "iuf":
        raise ValueError(f"second_per_grid_ts must be numeric, got dtype {seconds.dtype}")
    if seconds.shape[0] != n_videos:
        raise ValueError(f"second_per_grid_ts has {seconds.shape[0]} entries for {n_videos} videos")
    if not (np.isfinite(seconds).all() and (seconds >= 0).all()):
        # NaN would read as "unscaled", inf and negatives give garbage time positions
        raise ValueError(f"second_per_grid_ts must be finite and >= 0, got {seconds.tolist()}")
    return seconds.astype(np.float32)


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
    split_video_frames: bool = False,
    whole_seconds: bool = False,
    video_text_resume: str = TEMPORAL,
) -> np.ndarray:
    """M-RoPE position ids ``(3, L)`` int64 for ONE unpadded sample (Qwen2-VL / 2.5-VL / 3-VL).

    Text tokens get ``t = h = w = current + arange(n)``. An image or video whose grid is ``(t, h, w)``
    patches covers ``t*h*w / merge**2`` consecutive placeholder tokens and gets
    ``T = start + floor(arange(t) * interval)``, ``H = start + arange(h/merge)``,
    ``W = start + arange(w/merge)`` (meshgrid, ``ij`` order), where ``start`` is the position the next
    text token would have had. ``interval`` is 1 for images and for Qwen2-VL videos
    (``tokens_per_second=None``); for Qwen2.5-VL videos it is ``tokens_per_second *
    second_per_grid_ts[i]`` (default 1 s per grid, as transformers does), kept as a float32 (what
    transformers 5.19+ does, cf. transformers#48669); ``whole_seconds=True`` truncates each entry to
    whole seconds first, as transformers 4.57-5.9 do (the collator asks the installed version:
    :func:`tokenbal.hf_compat.qwen2_5_vl_whole_seconds`).

    ``split_video_frames=True`` is Qwen3-VL: each video grid ``(t, h, w)`` is first split into ``t``
    grids ``(1, h, w)``, one per frame, each its own block (the processor puts a timestamp and
    ``<vision_start>`` before every frame); ``tokens_per_second`` and ``second_per_grid_ts`` are
    then unused, exactly like transformers' ``Qwen3VLModel.get_rope_index``.

    Where text resumes after a vision block:

    * after an **image**: ``start + max(h, w) / merge``, exactly transformers 5.24's
      ``get_rope_index``. For the images Qwen processors emit (``t == 1``) this is also "max position
      so far + 1", i.e. the same as transformers 4.x and the original Qwen2-VL code.
    * after a **video**, ``video_text_resume`` says which rule. ``"temporal"`` (``TEMPORAL``, the
      default here): ``max position so far + 1``, the original Qwen2-VL code's rule (transformers
      4.x, vLLM), which includes the video's temporal extent. ``"spatial"`` (``SPATIAL``):
      ``start + max(h, w) / merge`` as after an image, transformers 5.x's rule (5.6 to 5.25,
      measured), which makes text after a long video reuse the positions of its later frames.
      ``PackedCollator.from_config`` takes the installed transformers' rule
      (:func:`tokenbal.hf_compat.qwen2_vl_video_text_resume`), so packed positions equal its own
      ``get_rope_index``; pass ``video_text_resume="temporal"`` there to keep the original rule on
      5.x. With ``split_video_frames`` every frame has ``t == 1`` and both rules agree.

    Vision blocks are found in token order: each maximal run of image (video) tokens is consumed by
    the next image (video) grids in order, so adjacent images without separators are handled.
    If ``vision_start_token_id`` is given, every block must directly follow that token (as the Qwen
    chat template emits it); this catches placeholders that were truncated or shifted.

    Raises ``ValueError`` when the placeholder counts do not match the grids.
    """
    spatial = _spatial_resume(video_text_resume)
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
    n_videos = grids["video"].shape[0]
    seconds = _seconds(second_per_grid_ts, n_videos)
    if split_video_frames:
        grids["video"] = split_frames(grids["video"])
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
    intervals = None
    if tokens_per_second is not None and not split_video_frames:
        intervals = _intervals(seconds, tokens_per_second, whole_seconds)

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
        interval = intervals[gi] if kind == "video" and intervals is not None else None
        block, max_off = _vision_block(grid, merge, start, interval)
        pos[:, begin:end] = block
        if kind == "image" or spatial:
            resume = start + max(int(grid[1]), int(grid[2])) // merge  # transformers 5.x
        else:
            resume = start + max_off + 1  # the original Qwen2-VL rule, see the docstring
        new_shift = resume - end
        pos[:, end:] += new_shift - shift  # later tokens already carry the old shift
        shift = new_shift
        k += n
    return pos


def packed_mrope_positions(
    input_ids: np.ndarray,
    cu_seqlens: np.ndarray,
    image_grid_thw: np.ndarray | None,
    video_grid_thw: np.ndarray | None,
    *,
    images_per_sample: np.ndarray,
    videos_per_sample: np.ndarray,
    image_token_id: int,
    video_token_id: int | None,
    vision_start_token_id: int | None,
    spatial_merge_size: int,
    second_per_grid_ts: np.ndarray | None = None,
    tokens_per_second: float | None = None,
    split_video_frames: bool = False,
    whole_seconds: bool = False,
    video_text_resume: str = TEMPORAL,
) -> np.ndarray:
    """Positions ``(3, T)`` of a packed row: equal to :func:`mrope_positions` per sample, concatenated.

    ``input_ids`` (T,) is the packed row, ``cu_seqlens`` (n+1,) its sample boundaries,
    ``image_grid_thw`` / ``video_grid_thw`` all samples' grids in sample order (``(k, 3)`` int64 or
    None), ``images_per_sample`` / ``videos_per_sample`` (n,) how many grid rows each sample owns,
    ``second_per_grid_ts`` one entry per video row (None: 1 s each). Same rules as
    :func:`mrope_positions`; a bad sample raises ``ValueError("sample i: ...")`` with its message.

    How it works without a python loop over samples or blocks: image (video) tokens of the row, in
    order, are consumed by the image (video) grid rows in order, so block ``b`` starts at the
    ``cumsum(tokens)[b-1]``-th placeholder. Text positions are ``index + offset``, where the offset is
    constant between events (a sample start resets it, a block end moves it by ``advance_b -
    tokens_b``): a cumsum over the few events, expanded with one ``repeat``. Vision offsets inside a
    block (frame, row, column) are nested ``repeat``s over frames and rows, without divisions.
    """
    return packed_mrope_positions_and_slots(
        input_ids,
        cu_seqlens,
        image_grid_thw,
        video_grid_thw,
        images_per_sample=images_per_sample,
        videos_per_sample=videos_per_sample,
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        vision_start_token_id=vision_start_token_id,
        spatial_merge_size=spatial_merge_size,
        second_per_grid_ts=second_per_grid_ts,
        tokens_per_second=tokens_per_second,
        split_video_frames=split_video_frames,
        whole_seconds=whole_seconds,
        video_text_resume=video_text_resume,
    )[0]


def packed_mrope_positions_and_slots(
    input_ids: np.ndarray,
    cu_seqlens: np.ndarray,
    image_grid_thw: np.ndarray | None,
    video_grid_thw: np.ndarray | None,
    *,
    images_per_sample: np.ndarray,
    videos_per_sample: np.ndarray,
    image_token_id: int,
    video_token_id: int | None,
    vision_start_token_id: int | None,
    spatial_merge_size: int,
    second_per_grid_ts: np.ndarray | None = None,
    tokens_per_second: float | None = None,
    split_video_frames: bool = False,
    whole_seconds: bool = False,
    video_text_resume: str = TEMPORAL,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`packed_mrope_positions` and the row indices of the vision placeholders (all image
    placeholders, then all video ones, int64): where the vision tower's merged features go, which
    the collator would otherwise find with a second scan of the row."""
    ids = input_ids
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = ids.shape[0]
    merge = int(spatial_merge_size)
    starts = cu[:-1]
    n_samples = starts.shape[0]
    img = np.zeros((0, 3), np.int64) if image_grid_thw is None else image_grid_thw
    vid = np.zeros((0, 3), np.int64) if video_grid_thw is None else video_grid_thw
    img_per = np.asarray(images_per_sample, dtype=np.int64)
    vid_per = np.asarray(videos_per_sample, dtype=np.int64)
    ref_kwargs = dict(
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        vision_start_token_id=vision_start_token_id,
        spatial_merge_size=merge,
        tokens_per_second=tokens_per_second,
        split_video_frames=split_video_frames,
        whole_seconds=whole_seconds,
        video_text_resume=video_text_resume,
    )
    spatial = _spatial_resume(video_text_resume)
    vid_in, vid_per_in = vid, vid_per  # as given, for the per-sample error path

    def fail() -> None:
        _raise_first_error(ids, cu, img, img_per, vid_in, vid_per_in, second_per_grid_ts, ref_kwargs)

    if second_per_grid_ts is not None and np.shape(second_per_grid_ts)[0] != vid.shape[0]:
        raise ValueError(
            f"second_per_grid_ts has {np.shape(second_per_grid_ts)[0]} entries for {vid.shape[0]} videos"
        )
    if second_per_grid_ts is not None and not (np.isfinite(second_per_grid_ts).all()
                                               and (np.asarray(second_per_grid_ts) >= 0).all()):
        fail()  # names the first sample with a NaN, infinite or negative entry
    if (img <= 0).any() or (vid <= 0).any():
        fail()
    intervals = None
    if tokens_per_second is not None and not split_video_frames and vid.shape[0]:
        seconds = np.ones(vid.shape[0], np.float32) if second_per_grid_ts is None else second_per_grid_ts
        intervals = _intervals(np.asarray(seconds), tokens_per_second, whole_seconds)
    if split_video_frames and vid.shape[0]:
        owner = np.repeat(np.arange(n_samples), vid_per)
        vid_per = np.bincount(owner, weights=vid[:, 0], minlength=n_samples).astype(np.int64)
        vid = split_frames(vid)

    firsts, counts, grids, slots = [], [], [], []  # per kind with grids
    n_images = 0
    kinds = ((img, img_per, image_token_id), (vid, vid_per, video_token_id))
    for kind, (grid, per, tok) in enumerate(kinds):
        if grid.shape[0] == 0:
            if tok is not None and (ids == tok).any():
                fail()
            continue
        if ((grid[:, 1:] % merge) != 0).any():
            fail()
        n_tok = grid.prod(axis=1) // (merge * merge)
        where = np.flatnonzero(ids == tok)
        # Per sample: placeholders found == placeholders the sample's grids need.
        found = np.diff(np.searchsorted(where, cu))
        need = np.zeros(n_tok.shape[0] + 1, np.int64)
        np.cumsum(n_tok, out=need[1:])
        grid_cu = np.zeros(per.shape[0] + 1, np.int64)
        np.cumsum(per, out=grid_cu[1:])
        if grid_cu[-1] != grid.shape[0] or not np.array_equal(found, need[grid_cu[1:]] - need[grid_cu[:-1]]):
            fail()
        first = where[need[:-1]]
        if not np.array_equal(where[need[1:] - 1] - first + 1, n_tok):  # each block one contiguous run
            fail()
        firsts.append(first)
        counts.append(n_tok)
        grids.append(grid)
        slots.append(where)
        if kind == 0:
            n_images = grid.shape[0]
    pos = np.empty((3, total), dtype=np.int64)
    if not firsts:
        pos[:] = np.arange(total, dtype=np.int64) - np.repeat(starts, np.diff(cu))
        return pos, np.zeros(0, np.int64)

    one = len(firsts) == 1  # the common case: images only (or videos only), no concatenation
    begin = firsts[0] if one else np.concatenate(firsts)
    n_tok = counts[0] if one else np.concatenate(counts)
    grid = grids[0] if one else np.concatenate(grids)
    where = slots[0] if one else np.concatenate(slots)  # block order = token order inside each block
    n_blocks = begin.shape[0]
    is_video = np.zeros(n_blocks, dtype=bool)
    if vid.shape[0]:
        is_video[n_images:] = True
    if vision_start_token_id is not None:
        # A block at a sample's first token has no start token before it (and at index 0 of the
        # row ids[-1] would wrap): the first test catches both.
        owner = np.searchsorted(cu, begin, side="right") - 1
        if (begin == starts[owner]).any() or not (ids[begin - 1] == vision_start_token_id).all():
            fail()
    gt, gh, gw = grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge
    t_last = gt - 1
    if intervals is not None:
        t_last = t_last.copy()
        t_last[n_images:] = ((gt[n_images:] - 1).astype(np.float32) * intervals).astype(np.int64)
    # Image (and video under "spatial"): transformers 5.x's start + max(h, w)/merge. Video under
    # "temporal": the original "max so far + 1".
    hw_max = np.maximum(gh, gw)
    advance = hw_max if spatial else np.where(is_video, np.maximum(t_last, hw_max - 1) + 1, hw_max)

    # Text: position = index + offset; the offset changes only at events. Block ends are listed
    # before sample starts so that, where both fall on one index, the stable sort keeps the block
    # with the sample it belongs to.
    ev_pos = np.concatenate((begin + n_tok, starts))
    ev_delta = np.zeros(ev_pos.shape[0], np.int64)
    ev_delta[:n_blocks] = advance - n_tok
    order = np.argsort(ev_pos, kind="stable")
    ev_pos = ev_pos[order]
    acc = np.cumsum(ev_delta[order])
    is_start = order >= n_blocks
    sample_of = np.cumsum(is_start) - 1
    offset = acc - acc[is_start][sample_of] - starts[sample_of]
    seg = np.empty_like(ev_pos)
    seg[:-1] = ev_pos[1:] - ev_pos[:-1]
    seg[-1] = total - ev_pos[-1]
    text = np.repeat(offset, seg)
    text += _arange(total)
    pos[:] = text

    t_scale = None
    if intervals is not None:
        t_scale = np.full(n_blocks, np.nan, np.float32)
        t_scale[n_images:] = intervals
    t_off, h_off, w_off = block_token_offsets(gt, gh, gw, t_scale)
    start = np.repeat(text[begin], n_tok)
    t_off += start
    h_off += start
    w_off += start
    pos[0, where] = t_off
    pos[1, where] = h_off
    pos[2, where] = w_off
    return pos, where


def block_token_offsets(
    gt: np.ndarray, gh: np.ndarray, gw: np.ndarray, t_scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(frame, row, column) of every merged token of blocks ``(gt, gh, gw)`` (int64, in merged
    tokens), laid out block after block, frame-major then row-major (the placeholder order).

    ``t_scale`` (float32 per block, NaN = unscaled) turns a frame index ``k`` into ``floor(k * scale)``
    in float32, Qwen2.5-VL's video time steps. Built with nested ``repeat`` over frames and rows,
    since integer division over every token costs more than the few small arrays this needs.
    """
    n_blocks = gt.shape[0]
    frame_block = np.repeat(np.arange(n_blocks), gt)
    frame_gh, frame_gw = gh[frame_block], gw[frame_block]
    t = _segment_arange(gt)
    if t_scale is not None:
        scale = t_scale[frame_block]
        scaled = ~np.isnan(scale)
        t[scaled] = (t[scaled].astype(np.float32) * scale[scaled]).astype(np.int64)
    t_off = np.repeat(t, frame_gh * frame_gw)
    row_gw = np.repeat(frame_gw, frame_gh)
    h_off = np.repeat(_segment_arange(frame_gh), row_gw)
    w_off = _segment_arange(row_gw)
    return t_off, h_off, w_off


def _segment_arange(lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(l) for l in lengths)`` as int64, with one arange and one repeat."""
    ends = np.cumsum(lengths)
    return _arange(int(ends[-1]) if ends.shape[0] else 0) - np.repeat(ends - lengths, lengths)


def _raise_first_error(
    ids: np.ndarray,
    cu: np.ndarray,
    img: np.ndarray,
    img_per: np.ndarray,
    vid: np.ndarray,
    vid_per: np.ndarray,
    seconds: np.ndarray | None,
    kwargs: dict[str, Any],
) -> None:
    """Re-run the per-sample reference to word the error of the first bad sample."""
    img_cu = np.concatenate(([0], np.cumsum(img_per)))
    vid_cu = np.concatenate(([0], np.cumsum(vid_per)))
    for i in range(cu.shape[0] - 1):
        v = slice(vid_cu[i], vid_cu[i + 1])
        try:
            mrope_positions(
                ids[cu[i] : cu[i + 1]],
                img[img_cu[i] : img_cu[i + 1]],
                vid[v],
                second_per_grid_ts=None if seconds is None else seconds[v],
                **kwargs,
            )
        except ValueError as e:
            raise ValueError(f"sample {i}: {e}") from None
    raise ValueError("packed M-RoPE positions: grids and placeholder tokens do not line up")


# -- GLM-4.1V / GLM-4.5V ------------------------------------------------------------------------
# transformers' ``Glm4vModel.get_rope_index`` differs from Qwen's in three ways: (1) a video frame's
# placeholders are the *image* token (``<|image|>``), told apart only by the ``<|begin_of_video|>``
# ... ``<|end_of_video|>`` span around them (the processor's ``mm_token_type_ids``: 0 text, 1 image,
# 2 video); (2) every video grid ``(t, h, w)`` is split into ``t`` frames ``(1, h, w)``, each its own
# block (a timestamp text separates them); (3) after every block, image or frame, text resumes at
# ``start + max(h, w) / merge``. Each maximal run of same-type placeholders is one block.

GLM_TEXT, GLM_IMAGE, GLM_VIDEO = 0, 1, 2


def glm4v_token_types(
    input_ids: np.ndarray,
    cu_seqlens: np.ndarray,
    *,
    image_token_id: int,
    video_start_token_id: int,
    video_end_token_id: int,
) -> np.ndarray:
    """Per token 0 (text), 1 (image placeholder) or 2 (video-frame placeholder) for a packed row,
    the rule of ``Glm4vProcessor.create_mm_token_type_ids`` applied to every sample on its own:
    an image token is a video token while more ``<|begin_of_video|>`` than ``<|end_of_video|>``
    precede it in its sample."""
    ids = np.asarray(input_ids)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    opened = np.cumsum((ids == video_start_token_id).astype(np.int64) - (ids == video_end_token_id))
    before = np.concatenate(([0], opened))[cu[:-1]]  # the count just before each sample
    inside = (opened - np.repeat(before, lens)) > 0
    is_img = ids == image_token_id
    return np.where(is_img, np.where(inside, GLM_VIDEO, GLM_IMAGE), GLM_TEXT).astype(np.int8)


def glm4v_positions(
    input_ids: Any,
    image_grid_thw: Any,
    video_grid_thw: Any,
    *,
    image_token_id: int,
    video_start_token_id: int,
    video_end_token_id: int,
    spatial_merge_size: int,
    image_start_token_id: int | None = None,
    video_token_id: int | None = None,
) -> np.ndarray:
    """GLM-4.1V M-RoPE position ids ``(3, L)`` int64 for ONE unpadded sample, equal to transformers
    5.24 ``Glm4vModel.get_rope_index`` (with the processor's ``mm_token_type_ids``).

    Runs of text get ``current + arange(n)``. Every maximal run of image (video) placeholders is
    one block, consumed by the next image grid (the next video *frame*: each video grid ``(t, h,
    w)`` is split into ``t`` grids ``(1, h, w)``); a block of grid ``(t, h, w)`` patches covers
    ``t*h*w / merge**2`` tokens with ``T = start + arange(t)``, ``H = start + arange(h/merge)``,
    ``W = start + arange(w/merge)`` (meshgrid, ``ij``), and text resumes at ``start + max(h, w) /
    merge``. ``image_start_token_id`` (``<|begin_of_image|>``): every block must follow it, as the
    processor writes it for images and for every video frame. ``video_token_id`` (``<|video|>``)
    must not appear: the processor replaces it by the frames. ``ValueError`` on any mismatch.
    """
    ids = _to_numpy(input_ids)
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {tuple(ids.shape)}")
    ids = ids.astype(np.int64, copy=False)
    length = ids.shape[0]
    merge = int(spatial_merge_size)
    grids = {GLM_IMAGE: as_grid(image_grid_thw, "image_grid_thw"),
             GLM_VIDEO: split_frames(as_grid(video_grid_thw, "video_grid_thw"))}
    names = {GLM_IMAGE: "image", GLM_VIDEO: "video frame"}
    for kind, grid in grids.items():
        if ((grid[:, 1] % merge) != 0).any() or ((grid[:, 2] % merge) != 0).any():
            raise ValueError(f"{names[kind]} grid_thw h and w must be multiples of "
                             f"spatial_merge_size={merge}")
    if video_token_id is not None and (ids == video_token_id).any():
        raise ValueError(f"input_ids hold the unexpanded video token {video_token_id}; the GLM-4V processor "
                         "replaces it by one <|begin_of_image|> block per frame")
    types = glm4v_token_types(ids, np.array([0, length]), image_token_id=image_token_id,
                              video_start_token_id=video_start_token_id,
                              video_end_token_id=video_end_token_id)
    pos = np.empty((3, length), dtype=np.int64)
    used = {GLM_IMAGE: 0, GLM_VIDEO: 0}
    current = 0
    begin = 0
    while begin < length:
        kind = int(types[begin])
        end = begin + 1
        while end < length and types[end] == kind:
            end += 1
        if kind == GLM_TEXT:
            pos[:, begin:end] = current + np.arange(end - begin, dtype=np.int64)
            current += end - begin
        else:
            gi = used[kind]
            if gi >= grids[kind].shape[0]:
                raise ValueError(f"{names[kind]} placeholder run at token index {begin} has no grid left: "
                                 f"the sample's grids give {grids[kind].shape[0]} {names[kind]}s")
            grid = grids[kind][gi]
            used[kind] += 1
            n = int(grid.prod()) // (merge * merge)
            if end - begin != n:
                raise ValueError(f"{names[kind]} {gi} with grid {grid.tolist()} needs {n} placeholder "
                                 f"tokens, but the run at token index {begin} has {end - begin}")
            if image_start_token_id is not None and (begin == 0 or ids[begin - 1] != image_start_token_id):
                raise ValueError(f"{names[kind]} {gi} at token index {begin} does not follow "
                                 f"image_start_token_id {image_start_token_id}")
            pos[:, begin:end], _ = _vision_block(grid, merge, current, None)
            current += max(int(grid[1]), int(grid[2])) // merge
        begin = end
    for kind, grid in grids.items():
        if used[kind] != grid.shape[0]:
            raise ValueError(f"{used[kind]} {names[kind]} placeholder runs in input_ids but the grids give "
                             f"{grid.shape[0]} {names[kind]}s {grid.tolist()}")
    return pos


def packed_glm4v_positions(
    input_ids: np.ndarray,
    cu_seqlens: np.ndarray,
    image_grid_thw: np.ndarray | None,
    video_grid_thw: np.ndarray | None,
    *,
    images_per_sample: np.ndarray,
    videos_per_sample: np.ndarray,
    image_token_id: int,
    video_start_token_id: int,
    video_end_token_id: int,
    spatial_merge_size: int,
    image_start_token_id: int | None = None,
    video_token_id: int | None = None,
    token_types: np.ndarray | None = None,
) -> np.ndarray:
    """Positions ``(3, T)`` of a packed GLM-4.1V row: :func:`glm4v_positions` per sample,
    concatenated, with a fixed number of numpy calls. Arguments as for
    :func:`collate.positions.packed_mrope_positions` (``videos_per_sample`` counts video grids, not
    frames); ``token_types``: :func:`glm4v_token_types` of the row, if already computed. A bad
    sample raises ``ValueError("sample i: ...")`` with the per-sample function's message."""
    ids = np.asarray(input_ids, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = ids.shape[0]
    merge = int(spatial_merge_size)
    starts, lens = cu[:-1], np.diff(cu)
    img = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw, np.int64)
    vid = np.zeros((0, 3), np.int64) if video_grid_thw is None else np.asarray(video_grid_thw, np.int64)
    img_per = np.asarray(images_per_sample, dtype=np.int64)
    vid_per = np.asarray(videos_per_sample, dtype=np.int64)
    ref_kwargs = dict(image_token_id=image_token_id, video_start_token_id=video_start_token_id,
                      video_end_token_id=video_end_token_id, spatial_merge_size=merge,
                      image_start_token_id=image_start_token_id, video_token_id=video_token_id)

    def fail() -> None:
        img_cu = np.concatenate(([0], np.cumsum(img_per)))
        vid_cu = np.concatenate(([0], np.cumsum(vid_per)))
        for i in range(lens.shape[0]):
            try:
                glm4v_positions(ids[cu[i]:cu[i + 1]], img[img_cu[i]:img_cu[i + 1]],
                                vid[vid_cu[i]:vid_cu[i + 1]], **ref_kwargs)
            except ValueError as e:
                raise ValueError(f"sample {i}: {e}") from None
        raise ValueError("packed GLM-4V positions: grids and placeholder tokens do not line up")

    if (img <= 0).any() or (vid <= 0).any() or img_per.sum() != img.shape[0] or vid_per.sum() != vid.shape[0]:
        fail()
    if video_token_id is not None and (ids == video_token_id).any():
        fail()
    types = token_types
    if types is None:
        types = glm4v_token_types(ids, cu, image_token_id=image_token_id,
                                  video_start_token_id=video_start_token_id,
                                  video_end_token_id=video_end_token_id)
    owner = np.repeat(np.arange(lens.shape[0]), vid_per)
    frame_per = np.bincount(owner, weights=vid[:, 0], minlength=lens.shape[0]).astype(np.int64)
    frames = split_frames(vid)
    local = np.arange(total, dtype=np.int64) - np.repeat(starts, lens)
    first_of_sample = local == 0
    last_of_sample = local == np.repeat(lens - 1, lens)
    prev_type = np.concatenate(([-1], types[:-1]))
    next_type = np.concatenate((types[1:], [-1]))
    run_begin = (types != GLM_TEXT) & (first_of_sample | (types != prev_type))
    run_end = (types != GLM_TEXT) & (last_of_sample | (types != next_type))

    blocks = []
    for grid, per, kind in ((img, img_per, GLM_IMAGE), (frames, frame_per, GLM_VIDEO)):
        begin = np.flatnonzero(run_begin & (types == kind))
        end = np.flatnonzero(run_end & (types == kind))
        if not np.array_equal(np.diff(np.searchsorted(begin, cu)), per):
            fail()
        if grid.shape[0] == 0:
            continue
        if ((grid[:, 1:] % merge) != 0).any():
            fail()
        n_tok = grid.prod(axis=1) // (merge * merge)
        if not np.array_equal(end - begin + 1, n_tok):
            fail()
        blocks.append((begin, n_tok, grid))
    pos = np.empty((3, total), dtype=np.int64)
    if not blocks:
        pos[:] = local
        return pos
    begin = np.concatenate([b[0] for b in blocks])
    n_tok = np.concatenate([b[1] for b in blocks])
    grid = np.concatenate([b[2] for b in blocks])
    if image_start_token_id is not None:
        if not ((local[begin] > 0) & (ids[np.maximum(begin - 1, 0)] == image_start_token_id)).all():
            fail()
    gh, gw = grid[:, 1] // merge, grid[:, 2] // merge
    delta = np.zeros(total + 1, dtype=np.int64)
    delta[begin + n_tok] = np.maximum(gh, gw) - n_tok  # blocks are disjoint runs: distinct ends
    shift = np.cumsum(delta[:total])
    shift -= np.repeat(shift[starts], lens)
    text = local + shift
    pos[:] = text
    block_of = np.repeat(np.arange(begin.shape[0]), n_tok)
    j = np.arange(block_of.shape[0], dtype=np.int64) - np.concatenate(([0], np.cumsum(n_tok)[:-1]))[block_of]
    hw = (gh * gw)[block_of]
    w_b = gw[block_of]
    t_idx = j // hw
    h_idx = (j - t_idx * hw) // w_b
    w_idx = j - t_idx * hw - h_idx * w_b
    where = begin[block_of] + j
    start = text[begin][block_of]
    pos[0, where] = start + t_idx
    pos[1, where] = start + h_idx
    pos[2, where] = start + w_idx
    return pos


__all__ += ["glm4v_positions", "packed_glm4v_positions", "glm4v_token_types"]
