"""Property: the vectorised packed M-RoPE positions are the per-sample reference, concatenated.

Random packed rows of text-only, image, multi-image and video samples (blocks with or without a
``<vision_start>`` before them, back to back, at a sample's first or last token), for Qwen2-VL,
Qwen2.5-VL (fractional video time steps) and Qwen3-VL (per-frame video grids). The reference is
:func:`collate.positions.mrope_positions`, which the other tests pin against transformers'
``get_rope_index``. Also the vision-token slots and the tower's rotary ids.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from collate.positions import mrope_positions, packed_mrope_positions_and_slots
from collate.vision import vision_rotary_positions

IMG, VID, VS = 60, 61, 62
MERGE = 2

block = st.tuples(
    st.sampled_from(["image", "video"]),
    st.integers(1, 4),  # frames (videos)
    st.integers(1, 4),  # merged rows
    st.integers(1, 4),  # merged columns
    st.integers(0, 3),  # text tokens after the block
)
sample = st.tuples(st.integers(0, 4), st.lists(block, max_size=4))


def _build(spec, with_start: bool, per_frame: bool):
    lead, blocks = spec
    ids = [5] * lead
    images, videos = [], []
    for kind, t, gh, gw, after in blocks:
        t = 1 if kind == "image" else t
        (images if kind == "image" else videos).append([t, MERGE * gh, MERGE * gw])
        tok = IMG if kind == "image" else VID
        start = [VS] if with_start else []
        if per_frame and kind == "video":  # Qwen3-VL: every frame is its own block
            ids += (start + [tok] * (gh * gw)) * t
        else:
            ids += start + [tok] * (t * gh * gw)
        ids += [7] * after
    if not ids:
        ids = [5]
    return np.asarray(ids, np.int64), np.reshape(images, (-1, 3)).astype(np.int64), \
        np.reshape(videos, (-1, 3)).astype(np.int64)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(sample, min_size=1, max_size=8),
    variant=st.sampled_from(["qwen2", "qwen25", "qwen3"]),
    with_start=st.booleans(),
    seconds_seed=st.integers(0, 2**16),
)
def test_packed_positions_equal_per_sample(specs, variant, with_start, seconds_seed):
    samples = [_build(s, with_start, variant == "qwen3") for s in specs]
    ids = np.concatenate([s[0] for s in samples])
    cu = np.concatenate(([0], np.cumsum([len(s[0]) for s in samples])))
    img = np.concatenate([s[1] for s in samples])
    vid = np.concatenate([s[2] for s in samples])
    seconds = None
    if variant == "qwen25":
        seconds = np.random.default_rng(seconds_seed).uniform(0.05, 3.0, len(vid)).astype(np.float32)
    kw = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS if with_start else None,
              spatial_merge_size=MERGE, tokens_per_second=2.0 if variant == "qwen25" else None,
              split_video_frames=variant == "qwen3")
    pos, slots = packed_mrope_positions_and_slots(
        ids, cu, img, vid, images_per_sample=[len(s[1]) for s in samples],
        videos_per_sample=[len(s[2]) for s in samples], second_per_grid_ts=seconds, **kw)
    ref, v0 = [], 0
    for s in samples:
        sec = None if seconds is None else seconds[v0:v0 + len(s[2])]
        ref.append(mrope_positions(s[0], s[1], s[2], second_per_grid_ts=sec, **kw))
        v0 += len(s[2])
    np.testing.assert_array_equal(pos, np.concatenate(ref, axis=1))
    want_slots = np.concatenate([np.flatnonzero(ids == IMG), np.flatnonzero(ids == VID)])
    np.testing.assert_array_equal(slots, want_slots)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5)), max_size=6))
def test_rotary_positions_equal_per_grid_loop(grids):
    g = np.asarray(grids, np.int64).reshape(-1, 3) * [1, MERGE, MERGE]
    want = []
    for t, h, w in g.tolist():  # patches block-major: merge x merge blocks, row-major inside
        for _ in range(t):
            for bh in range(h // MERGE):
                for bw in range(w // MERGE):
                    for a in range(MERGE):
                        for c in range(MERGE):
                            want.append((bh * MERGE + a, bw * MERGE + c))
    got = vision_rotary_positions(g, MERGE)
    np.testing.assert_array_equal(got, np.asarray(want, np.int64).reshape(-1, 2))


def _rotary_loop(g: np.ndarray, merge: int) -> np.ndarray:
    want = [(bh * merge + a, bw * merge + c)
            for t, h, w in g.tolist() for _ in range(t)
            for bh in range(h // merge) for bw in range(w // merge)
            for a in range(merge) for c in range(merge)]
    return np.asarray(want, np.int64).reshape(-1, 2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9)), max_size=5),
                min_size=1, max_size=3),
       st.integers(1, 3), st.booleans())
def test_rotary_positions_cached_table_equal_fresh(batches, merge, small_tables):
    """The rotary ids read one band table cached per merge size and grown across batches; whatever
    the batches before (and with the table cache off: the one-band path), the ids are the loop's."""
    import collate.vision as vision

    saved = vision._TABLES.copy(), vision._TABLE_MIN
    vision._TABLES.clear()
    vision._TABLE_MIN = 0 if small_tables else saved[1]
    try:
        for grids in batches:
            g = np.asarray(grids, np.int64).reshape(-1, 3) * [1, merge, merge]
            np.testing.assert_array_equal(vision.vision_rotary_positions(g, merge), _rotary_loop(g, merge))
    finally:
        vision._TABLES.clear()
        vision._TABLES.update(saved[0])
        vision._TABLE_MIN = saved[1]
