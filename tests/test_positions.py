"""collate.positions against transformers 5.x ``get_rope_index`` on tiny real Qwen2-VL / Qwen2.5-VL models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collate.positions import mrope_positions, text_positions

transformers = pytest.importorskip("transformers")
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel  # noqa: E402

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
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
)
_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)


@pytest.fixture(scope="module")
def qwen2vl() -> Qwen2VLModel:
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, spatial_merge_size=MERGE)
    return Qwen2VLModel(Qwen2VLConfig(text_config=_TEXT, vision_config=vision, **_IDS))


@pytest.fixture(scope="module")
def qwen25vl() -> Qwen2_5_VLModel:
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=16,
        num_heads=2,
        spatial_merge_size=MERGE,
        tokens_per_second=TPS,
    )
    return Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=_TEXT, vision_config=vision, **_IDS))


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
    pos, _ = model.get_rope_index(
        input_ids,
        mm_token_type_ids=mm,
        image_grid_thw=torch.as_tensor(images) if len(images) else None,
        video_grid_thw=torch.as_tensor(videos) if len(videos) else None,
        **kwargs,
    )
    return pos[:, 0].numpy()


def ours(ids, images, videos, seconds=None, tps=None) -> np.ndarray:
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
def test_video_blocks_match_hf_layout(model_name, request):
    """Within every video block the T/H/W layout equals transformers; up to the end of the first
    video everything is identical; after it, text follows the original "max + 1" rule."""
    model = request.getfixturevalue(model_name)
    tps = TPS if model_name == "qwen25vl" else None
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(40):
        ids, images, videos = random_sample(rng, max_images=2, max_videos=2)
        if not len(videos):
            continue
        seconds = rng.choice([0.5, 1.0, 1.5, 2.0], size=len(videos)) if tps else None
        got = ours(ids, images, videos, seconds=seconds, tps=tps)
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


def test_video_rule_golden_qwen25(qwen25vl):
    """Pinned choice: text after a video resumes at max position + 1 (Qwen2-VL / transformers 4.x),
    not at start + max(h, w)/merge as transformers 5.24 does. 6 temporal grids, 2x2 LLM grid,
    tokens_per_second=2, 1 s per grid."""
    ids = np.array([7, VS] + [VID] * 24 + [VE, 8, 9], dtype=np.int64)
    videos = np.array([[6, 4, 4]])
    got = ours(ids, None, videos, seconds=[1.0], tps=TPS)
    t_row = [0, 1] + [2 + 2 * (i // 4) for i in range(24)] + [13, 14, 15]
    h_row = [0, 1] + [2 + (i // 2) % 2 for i in range(24)] + [13, 14, 15]
    w_row = [0, 1] + [2 + i % 2 for i in range(24)] + [13, 14, 15]
    np.testing.assert_array_equal(got, [t_row, h_row, w_row])
    # transformers 5.24 restarts the trailing text at 2 + max(2, 2) = 4 (documented divergence).
    ref = hf_positions(qwen25vl, ids, np.zeros((0, 3), np.int64), videos, seconds=[1.0])
    np.testing.assert_array_equal(ref[:, -3:], [[4, 5, 6]] * 3)
    np.testing.assert_array_equal(ref[:, :-3], got[:, :-3])


def test_video_rule_golden_qwen2():
    # Qwen2-VL: temporal step 1; t=3 > 2x2 LLM grid, so the temporal extent decides where text resumes.
    ids = np.array([VS] + [VID] * 12 + [VE], dtype=np.int64)
    got = ours(ids, None, [[3, 4, 4]])
    np.testing.assert_array_equal(got[0], [0] + [1] * 4 + [2] * 4 + [3] * 4 + [4])
    np.testing.assert_array_equal(got[1], [0] + [1, 1, 2, 2] * 3 + [4])
    np.testing.assert_array_equal(got[2], [0] + [1, 2, 1, 2] * 3 + [4])


def test_fractional_seconds_are_not_truncated():
    ids = np.array([VS] + [VID] * 4 + [VE], dtype=np.int64)
    got = ours(ids, None, [[4, 2, 2]], seconds=[0.75], tps=2)  # interval 1.5
    np.testing.assert_array_equal(got[0], [0, 1, 2, 4, 5, 6])  # floor(0, 1.5, 3, 4.5) + 1; then max+1


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
