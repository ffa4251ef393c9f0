"""collate.positions against transformers 5.x ``get_rope_index`` on tiny real Qwen2/2.5/3-VL models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collate.positions import mrope_positions, packed_mrope_positions, text_positions

transformers = pytest.importorskip("transformers")
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel  # noqa: E402

from tokenbal.hf_compat import (  # noqa: E402
    get_rope_index,
    qwen2_5_vl_whole_seconds,
    qwen2_vl_video_text_resume,
    rope_config,
)

IMG, VID, VS, VE = 60, 61, 62, 63
MERGE = 2
TPS = 2  # tokens_per_second of the tiny Qwen2.5-VL config

_TEXT = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=64,
    bos_token_id=None,
    eos_token_id=None,
    **rope_config(Qwen2VLConfig, 10000.0, mrope_section=[1, 1, 2]),
)
_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)


@pytest.fixture(scope="module")
def qwen2vl() -> Qwen2VLModel:
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, spatial_merge_size=MERGE)
    return Qwen2VLModel(Qwen2VLConfig(text_config=_TEXT, vision_config=vision, **_IDS))


@pytest.fixture(scope="module")
def qwen25vl() -> Qwen2_5_VLModel:
    return _qwen25(TPS)


def _qwen25(tps: float) -> Qwen2_5_VLModel:
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=16,
        num_heads=2,
        spatial_merge_size=MERGE,
        tokens_per_second=tps,
    )
    return Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=_TEXT, vision_config=vision, **_IDS))


@pytest.fixture(scope="module")
def qwen3vl() -> Qwen3VLModel:
    text = {
        **_TEXT,
        "head_dim": 8,
        **rope_config(Qwen3VLConfig, 10000.0, mrope_section=[2, 1, 1]),
    }
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=16,
        spatial_merge_size=MERGE,
        deepstack_visual_indexes=[0],
        num_position_embeddings=16,
    )
    return Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision, **_IDS))


def random_sample(rng: np.random.Generator, max_images: int = 4, max_videos: int = 0):
    """Qwen-template-like sample: text, then <vs> placeholders <ve> blocks with text between them."""
    n_img, n_vid = int(rng.integers(0, max_images + 1)), int(rng.integers(0, max_videos + 1))
    kinds = ["image"] * n_img + ["video"] * n_vid
    rng.shuffle(kinds)
    ids: list[int] = list(rng.integers(0, 50, size=int(rng.integers(0, 6))))
    images, videos = [], []
    for kind in kinds:
        t = 1 if kind == "image" else int(rng.integers(1, 7))
        h, w = (MERGE * int(x) for x in rng.integers(1, 7, size=2))
        (images if kind == "image" else videos).append([t, h, w])
        ids += [VS] + [IMG if kind == "image" else VID] * (t * h * w // MERGE**2) + [VE]
        ids += list(rng.integers(0, 50, size=int(rng.integers(0, 8))))
    if not ids:
        ids = [1]
    return (
        np.asarray(ids, dtype=np.int64),
        np.asarray(images, dtype=np.int64).reshape(-1, 3),
        np.asarray(videos, dtype=np.int64).reshape(-1, 3),
    )


def hf_positions(model, ids, images, videos, seconds=None) -> np.ndarray:
    input_ids = torch.as_tensor(ids)[None]
    mm = (input_ids == IMG).int() + 2 * (input_ids == VID).int()
    kwargs = {}
    if seconds is not None:
        kwargs["second_per_grid_ts"] = torch.as_tensor(seconds)
    pos = get_rope_index(
        model, input_ids,
        mm_token_type_ids=mm,
        image_grid_thw=torch.as_tensor(images) if len(images) else None,
        video_grid_thw=torch.as_tensor(videos) if len(videos) else None,
        **kwargs,
    )
    return pos[:, 0].numpy()


# The installed transformers' Qwen2.5-VL rule for fractional seconds (4.57-5.9 truncate them to
# whole seconds); the collator picks the same (PackedCollator.from_config).
WHOLE_SECONDS = qwen2_5_vl_whole_seconds()
# The installed transformers' rule for text after a Qwen2-VL / Qwen2.5-VL video (4.57: past the
# video's frames; 5.x: past its spatial extent); the collator picks the same (PackedCollator).
RESUME = {"qwen2vl": qwen2_vl_video_text_resume("qwen2_vl"),
          "qwen25vl": qwen2_vl_video_text_resume("qwen2_5_vl")}


def ours(ids, images, videos, seconds=None, tps=None, whole_seconds=None, resume=None) -> np.ndarray:
    return mrope_positions(
        ids,
        images,
        videos,
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        spatial_merge_size=MERGE,
        second_per_grid_ts=seconds,
        tokens_per_second=tps,
        whole_seconds=WHOLE_SECONDS if whole_seconds is None else whole_seconds,
        video_text_resume=RESUME["qwen25vl" if tps else "qwen2vl"] if resume is None else resume,
    )


def test_text_positions():
    np.testing.assert_array_equal(text_positions(5), np.arange(5))
    assert text_positions(0).shape == (0,)
    assert text_positions(3).dtype == np.int64


@pytest.mark.parametrize("model_name", ["qwen2vl", "qwen25vl"])
def test_images_equal_hf_get_rope_index(model_name, request):
    model = request.getfixturevalue(model_name)
    tps = TPS if model_name == "qwen25vl" else None
    rng = np.random.default_rng(0)
    for _ in range(40):
        ids, images, videos = random_sample(rng)
        got = ours(ids, images, videos, tps=tps)
        assert got.shape == (3, len(ids)) and got.dtype == np.int64
        np.testing.assert_array_equal(got, hf_positions(model, ids, images, videos))


def test_text_only_equals_hf(qwen2vl):
    ids = np.arange(7, dtype=np.int64)
    np.testing.assert_array_equal(ours(ids, None, None), np.tile(np.arange(7), (3, 1)))


def test_adjacent_images_without_separator():
    # Two 1x2x2 images back to back: each is its own block (transformers 5.x would merge the run).
    ids = np.array([5, VS] + [IMG] * 2 + [IMG] * 2 + [VE], dtype=np.int64)
    got = mrope_positions(
        ids,
        [[1, 2, 4], [1, 2, 4]],
        None,
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=None,
        spatial_merge_size=MERGE,
    )
    # first image starts at 2 (after 5, VS), spans w=2 -> second starts at 4, then VE at 6
    np.testing.assert_array_equal(got, [[0, 1, 2, 2, 4, 4, 6], [0, 1, 2, 2, 4, 4, 6], [0, 1, 2, 3, 4, 5, 6]])


def _first_video_span(ids):
    idx = np.flatnonzero(ids == VID)
    return idx[0], idx[0] + np.argmax(ids[idx[0] :] != VID) if (ids[idx[0] :] != VID).any() else len(ids)


@pytest.mark.parametrize("model_name", ["qwen2vl", "qwen25vl"])
def test_video_rows_equal_hf_get_rope_index(model_name, request):
    """With the installed transformers' rule for text after a video (what PackedCollator.from_config
    picks), rows of images and videos in any order equal its own ``get_rope_index``: on 5.x text
    resumed after the video's frames before, so every token after a long video differed."""
    model = request.getfixturevalue(model_name)
    tps = TPS if model_name == "qwen25vl" else None
    rows = list(_video_rows(np.random.default_rng(7), 60, tps))
    for ids, images, videos, seconds in rows:
        ref = hf_positions(model, ids, images, videos, seconds=seconds)
        np.testing.assert_array_equal(ours(ids, images, videos, seconds=seconds, tps=tps), ref)
    assert len(rows) >= 10


def _video_rows(rng, draws: int, tps):
    """Of ``draws`` random rows (text, up to 2 images, up to 2 videos), those with a video:
    (ids, images, videos, seconds per grid, or None without ``tps``)."""
    for _ in range(draws):
        ids, images, videos = random_sample(rng, max_images=2, max_videos=2)
        if len(videos):
            yield ids, images, videos, rng.choice([0.5, 1.0, 1.5, 2.0], size=len(videos)) if tps else None


@pytest.mark.parametrize("model_name", ["qwen2vl", "qwen25vl"])
def test_video_blocks_match_hf_layout(model_name, request):
    """Under the original rule (``video_text_resume="temporal"``) on any version: within every video
    block the T/H/W layout equals transformers; up to the end of the first video everything is
    identical; after it, text follows the original "max + 1" rule."""
    model = request.getfixturevalue(model_name)
    tps = TPS if model_name == "qwen25vl" else None
    checked = 0
    for ids, images, videos, seconds in _video_rows(np.random.default_rng(1), 40, tps):
        got = ours(ids, images, videos, seconds=seconds, tps=tps, resume="temporal")
        ref = hf_positions(model, ids, images, videos, seconds=seconds)
        begin, end = _first_video_span(ids)
        np.testing.assert_array_equal(got[:, :end], ref[:, :end])
        # Relative layout of every vision block is the same, only its offset may differ.
        vis = (ids == IMG) | (ids == VID)
        starts = np.flatnonzero(vis & ~np.r_[False, vis[:-1]])
        for s in starts:
            e = s + np.argmax(~vis[s:]) if (~vis[s:]).any() else len(ids)
            np.testing.assert_array_equal(got[:, s:e] - got[:, s : s + 1], ref[:, s:e] - ref[:, s : s + 1])
        # After each video: text resumes at max-so-far + 1.
        for s in starts:
            e = s + np.argmax(~vis[s:]) if (~vis[s:]).any() else len(ids)
            if ids[s] == VID and e < len(ids):
                assert got[0, e] == got[:, :e].max() + 1
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("resume", ["temporal", "spatial"])
def test_video_rule_golden_qwen25(qwen25vl, resume):
    """Both rules, pinned: text after a video resumes at max position + 1 ("temporal": Qwen2-VL's
    code, transformers 4.x) or at start + max(h, w)/merge ("spatial": transformers 5.x). 6 temporal
    grids, 2x2 LLM grid, tokens_per_second=2, 1 s per grid. The installed transformers gives one."""
    ids = np.array([7, VS] + [VID] * 24 + [VE, 8, 9], dtype=np.int64)
    videos = np.array([[6, 4, 4]])
    got = ours(ids, None, videos, seconds=[1.0], tps=TPS, resume=resume)
    tail = [13, 14, 15] if resume == "temporal" else [4, 5, 6]
    t_row = [0, 1] + [2 + 2 * (i // 4) for i in range(24)] + tail
    h_row = [0, 1] + [2 + (i // 2) % 2 for i in range(24)] + tail
    w_row = [0, 1] + [2 + i % 2 for i in range(24)] + tail
    np.testing.assert_array_equal(got, [t_row, h_row, w_row])
    ref = hf_positions(qwen25vl, ids, np.zeros((0, 3), np.int64), videos, seconds=[1.0])
    np.testing.assert_array_equal(ref[:, :-3], got[:, :-3])
    assert (ref[:, -3:].tolist() == got[:, -3:].tolist()) == (resume == RESUME["qwen25vl"])


@pytest.mark.parametrize("resume", ["temporal", "spatial"])
def test_video_rule_golden_qwen2(resume):
    # Qwen2-VL: temporal step 1; t=3 > 2x2 LLM grid, so the rules differ after the video.
    ids = np.array([VS] + [VID] * 12 + [VE], dtype=np.int64)
    got = ours(ids, None, [[3, 4, 4]], resume=resume)
    after = 4 if resume == "temporal" else 3
    np.testing.assert_array_equal(got[0], [0] + [1] * 4 + [2] * 4 + [3] * 4 + [after])
    np.testing.assert_array_equal(got[1], [0] + [1, 1, 2, 2] * 3 + [after])
    np.testing.assert_array_equal(got[2], [0] + [1, 2, 1, 2] * 3 + [after])


def test_an_unknown_video_rule_is_refused():
    with pytest.raises(ValueError, match="video_text_resume must be one of"):
        ours(np.array([VS, VID, VID, VID, VID], dtype=np.int64), None, [[1, 4, 4]], resume="frames")


def test_fractional_seconds_are_not_truncated():
    ids = np.array([VS] + [VID] * 4 + [VE], dtype=np.int64)
    got = ours(ids, None, [[4, 2, 2]], seconds=[0.75], tps=2, whole_seconds=False,
               resume="temporal")  # interval 1.5
    np.testing.assert_array_equal(got[0], [0, 1, 2, 4, 5, 6])  # floor(0, 1.5, 3, 4.5) + 1; then max+1
    # transformers 4.57-5.9: 0.75 s truncates to 0 s, every frame at the block's start
    got = ours(ids, None, [[4, 2, 2]], seconds=[2.75], tps=2, whole_seconds=True,
               resume="temporal")  # interval 2 * 2
    np.testing.assert_array_equal(got[0], [0, 1, 5, 9, 13, 14])


@pytest.mark.parametrize(
    "ids,images,match",
    [
        ([VS] + [IMG] * 3 + [VE], [[1, 4, 4]], "3 image placeholder tokens"),
        ([VS] + [IMG] * 4 + [VE], None, "4 image placeholder tokens"),
        ([VS] + [IMG] * 4 + [VE], [[1, 4, 3]], "multiples of spatial_merge_size"),
        ([5] + [IMG] * 4 + [VE], [[1, 4, 4]], "does not follow vision_start"),
        ([VS] + [IMG] * 2 + [VE, VS] + [IMG] * 2, [[1, 4, 4]], "run is shorter"),
        ([VS] + [IMG] * 4, [[1, 4, 4.0]], "integer"),
    ],
)
def test_errors(ids, images, match):
    with pytest.raises(ValueError, match=match):
        ours(np.asarray(ids), images, None)


def test_accepts_torch_and_lists():
    ids = [VS] + [IMG] * 4 + [VE]
    a = ours(ids, [[1, 4, 4]], None)
    b = ours(torch.tensor(ids), torch.tensor([[1, 4, 4]]), None)
    np.testing.assert_array_equal(a, b)


def random_qwen3_sample(rng: np.random.Generator, max_images: int = 3, max_videos: int = 2):
    """Qwen3-VL prompt layout: a video of t temporal grids is t frames, each written as
    ``<timestamp text> <vs> frame placeholders <ve>``; the grid stays one ``(t, h, w)`` row."""
    n_img, n_vid = int(rng.integers(0, max_images + 1)), int(rng.integers(0, max_videos + 1))
    kinds = ["image"] * n_img + ["video"] * n_vid
    rng.shuffle(kinds)
    ids: list[int] = list(rng.integers(0, 50, size=int(rng.integers(0, 6))))
    images, videos = [], []
    for kind in kinds:
        h, w = (MERGE * int(x) for x in rng.integers(1, 6, size=2))
        if kind == "image":
            images.append([1, h, w])
            ids += [VS] + [IMG] * (h * w // MERGE**2) + [VE]
        else:
            t = int(rng.integers(1, 6))
            videos.append([t, h, w])
            for _ in range(t):
                ids += list(rng.integers(0, 50, size=int(rng.integers(1, 5))))  # "<0.5 seconds>"
                ids += [VS] + [VID] * (h * w // MERGE**2) + [VE]
        ids += list(rng.integers(0, 50, size=int(rng.integers(0, 8))))
    if not ids:
        ids = [1]
    return (
        np.asarray(ids, dtype=np.int64),
        np.asarray(images, dtype=np.int64).reshape(-1, 3),
        np.asarray(videos, dtype=np.int64).reshape(-1, 3),
    )


def test_qwen3vl_images_and_videos_equal_hf(qwen3vl):
    """Qwen3-VL: per-frame t=1 video grids; every token (also text after videos) equals transformers."""
    rng = np.random.default_rng(7)
    n_videos = 0
    for _ in range(40):
        ids, images, videos = random_qwen3_sample(rng)
        got = mrope_positions(
            ids,
            images,
            videos,
            image_token_id=IMG,
            video_token_id=VID,
            vision_start_token_id=VS,
            spatial_merge_size=MERGE,
            split_video_frames=True,
        )
        np.testing.assert_array_equal(got, hf_positions(qwen3vl, ids, images, videos))
        n_videos += len(videos)
    assert n_videos >= 20


def test_qwen3vl_unsplit_frames_fail_clearly():
    # Qwen2-style video (one block for all frames) given to the Qwen3 rule: the frame run is too long.
    ids = np.array([VS] + [VID] * 8 + [VE], dtype=np.int64)
    with pytest.raises(ValueError, match="does not follow vision_start|run is shorter"):
        mrope_positions(
            ids,
            None,
            [[2, 4, 4]],
            image_token_id=IMG,
            video_token_id=VID,
            vision_start_token_id=VS,
            spatial_merge_size=MERGE,
            split_video_frames=True,
        )


@pytest.mark.parametrize("tps", [2, 3])
def test_qwen25_fractional_seconds_equal_hf_video_block(tps):
    """Qwen2.5-VL video blocks with real-world second_per_grid_ts (temporal_patch_size / fps, float32
    as the processor returns it): every video block's T/H/W layout equals transformers, and the whole
    prefix up to the end of the first video is identical (text after a video: documented rule).
    tokens_per_second=3 (not a power of two) checks the scaling is not hard-wired to the default."""
    qwen25vl = _qwen25(tps)
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(60):
        ids, images, videos = random_sample(rng, max_images=2, max_videos=2)
        if not len(videos):
            continue
        fps = rng.uniform(0.3, 30.0, size=len(videos))
        seconds = torch.tensor(2.0 / fps, dtype=torch.float32)
        got = ours(ids, images, videos, seconds=seconds, tps=tps)
        ref = hf_positions(qwen25vl, ids, images, videos, seconds=seconds)
        vid_idx = np.flatnonzero(ids == VID)
        first_end = vid_idx[0] + int(videos[0].prod()) // MERGE**2
        np.testing.assert_array_equal(got[:, :first_end], ref[:, :first_end])
        offset = 0
        for g in videos:  # each video block, relative to its own first token
            n = int(g.prod()) // MERGE**2
            blk = vid_idx[offset : offset + n]
            np.testing.assert_array_equal(got[:, blk] - got[:, blk[:1]], ref[:, blk] - ref[:, blk[:1]])
            offset += n
        checked += 1
    assert checked >= 20


def _packed_case(rng, n, variant):
    samples = []
    for _ in range(n):
        if variant == "qwen3":
            samples.append(random_qwen3_sample(rng))
        else:
            samples.append(random_sample(rng, max_images=3, max_videos=2))
    ids = np.concatenate([s[0] for s in samples])
    cu = np.concatenate(([0], np.cumsum([len(s[0]) for s in samples])))
    img = np.concatenate([s[1] for s in samples])
    vid = np.concatenate([s[2] for s in samples])
    per_img = np.array([len(s[1]) for s in samples])
    per_vid = np.array([len(s[2]) for s in samples])
    seconds = rng.uniform(0.1, 3.0, size=len(vid)).astype(np.float32) if variant == "qwen25" else None
    return samples, ids, cu, img, vid, per_img, per_vid, seconds


@pytest.mark.parametrize("variant", ["qwen2", "qwen25", "qwen3"])
def test_packed_equals_per_sample(variant):
    """The vectorised packed path is the per-sample reference, concatenated, for all three variants."""
    rng = np.random.default_rng({"qwen2": 0, "qwen25": 1, "qwen3": 2}[variant])
    kw = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, spatial_merge_size=MERGE)
    kw["tokens_per_second"] = TPS if variant == "qwen25" else None
    kw["split_video_frames"] = variant == "qwen3"
    for n in (1, 2, 7, 16):
        for _ in range(5):
            samples, ids, cu, img, vid, per_img, per_vid, seconds = _packed_case(rng, n, variant)
            got = packed_mrope_positions(
                ids, cu, img, vid, images_per_sample=per_img, videos_per_sample=per_vid,
                second_per_grid_ts=seconds, **kw,
            )  # fmt: skip
            ref, v0 = [], 0
            for s in samples:
                sec = None if seconds is None else seconds[v0 : v0 + len(s[2])]
                ref.append(mrope_positions(s[0], s[1], s[2], second_per_grid_ts=sec, **kw))
                v0 += len(s[2])
            np.testing.assert_array_equal(got, np.concatenate(ref, axis=1))


def test_packed_error_names_sample():
    rng = np.random.default_rng(4)
    samples, ids, cu, img, vid, per_img, per_vid, _ = _packed_case(rng, 5, "qwen2")
    kw = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, spatial_merge_size=MERGE)
    # Sample 3's first token becomes an image placeholder: one more than its grids need.
    bad = ids.copy()
    bad[cu[3]] = IMG
    with pytest.raises(ValueError, match=r"^sample 3: "):
        packed_mrope_positions(bad, cu, img, vid, images_per_sample=per_img, videos_per_sample=per_vid, **kw)


def test_packed_equals_per_sample_adjacent_blocks():
    """No separators: blocks back to back, at a sample's first token, and images next to videos."""
    rng = np.random.default_rng(5)
    kw = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=None, spatial_merge_size=MERGE)
    for _ in range(30):
        samples = []
        for _ in range(int(rng.integers(1, 6))):
            ids, images, videos = [], [], []
            for _ in range(int(rng.integers(0, 4))):
                kind = "image" if rng.random() < 0.6 else "video"
                t = 1 if kind == "image" else int(rng.integers(1, 4))
                h, w = (MERGE * int(x) for x in rng.integers(1, 4, size=2))
                (images if kind == "image" else videos).append([t, h, w])
                ids += [IMG if kind == "image" else VID] * (t * h * w // MERGE**2)
                ids += [5] * int(rng.integers(0, 2))  # often no text at all between blocks
            samples.append(
                (np.asarray(ids or [5], np.int64), np.reshape(images, (-1, 3)), np.reshape(videos, (-1, 3)))
            )
        ids = np.concatenate([s[0] for s in samples])
        cu = np.concatenate(([0], np.cumsum([len(s[0]) for s in samples])))
        got = packed_mrope_positions(
            ids,
            cu,
            np.concatenate([s[1] for s in samples]).astype(np.int64),
            np.concatenate([s[2] for s in samples]).astype(np.int64),
            images_per_sample=np.array([len(s[1]) for s in samples]),
            videos_per_sample=np.array([len(s[2]) for s in samples]),
            **kw,
        )
        ref = [mrope_positions(s[0], s[1], s[2], **kw) for s in samples]
        np.testing.assert_array_equal(got, np.concatenate(ref, axis=1))


def test_packed_rejects_bad_grids_and_seconds():
    ids = np.array([VS, IMG, VE, 5], dtype=np.int64)
    kw = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, spatial_merge_size=MERGE)
    cu, one, zero = np.array([0, 4]), np.array([1]), np.array([0])
    with pytest.raises(ValueError, match=r"^sample 0: .*must be positive"):
        packed_mrope_positions(
            ids, cu, np.array([[0, 2, 2]]), None, images_per_sample=one, videos_per_sample=zero, **kw
        )
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 entries for 0 videos"):
        packed_mrope_positions(
            ids, cu, np.array([[1, 2, 2]]), None, images_per_sample=one, videos_per_sample=zero,
            second_per_grid_ts=np.ones(2), **kw,
        )  # fmt: skip
