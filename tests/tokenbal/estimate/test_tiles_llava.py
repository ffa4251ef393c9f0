"""InternVL / tiles, LLaVA-NeXT and LLaVA-OneVision estimators against transformers' processors.

Oracles (transformers 5.24, PIL backends, no torchvision):
  * InternVL: ``GotOcr2ImageProcessorPil(crop_to_patches=True)`` -> ``num_patches`` on real images
    (subset) and its pixel-free ``get_number_of_image_patches`` on the full grid;
    tokens = 256 * num_patches (``InternVLProcessor.replace_image_token``).
  * LLaVA-NeXT: ``LlavaNextProcessor`` with a synthetic word-level tokenizer: ``<image>`` count in
    ``input_ids`` for real images (subset) and ``_get_num_multimodal_tokens`` on the full grid.
  * LLaVA-OneVision: ``LlavaOnevisionProcessor``'s own ``_get_number_of_features`` /
    ``replace_image_token`` (the instance is made without ``__init__``, whose video-processor
    check needs torchvision), plus the real image processor's crop count for the pinpoint choice.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.sizes import size_grid
from tokenbal.estimate import get_estimator, load_estimator

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from tests.helpers.oracles import require_oracle  # noqa: E402
from tests.helpers.processors import NEXT_PINPOINTS, write_json  # noqa: E402
from tokenbal.hf_compat import image_processor_class  # noqa: E402

GotOcr2ImageProcessorPil = image_processor_class("GotOcr2ImageProcessorPil")

EDGE = [
    (1, 1),
    (10, 10),
    (14, 14),
    (27, 29),
    (3000, 20),
    (11, 2000),
    (448, 448),
    (896, 448),
    (448, 1344),
    (1344, 896),
    (336, 672),
    (672, 336),
    (1008, 336),
    (1408, 792),
    (792, 1408),
    (384, 2304),
    (2304, 384),
    (5000, 1),
    (1, 5000),
    (20000, 100),
]




GRID = size_grid(EDGE)
WS = [w for w, _ in GRID]
HS = [h for _, h in GRID]


def img(w: int, h: int) -> Image.Image:
    return Image.new("RGB", (w, h), (200, 40, 90))


# ---------------------------------------------------------------------------------------------
# InternVL / tiles


@pytest.mark.parametrize("max_num", [12, 6])
def test_internvl_equals_gotocr2_on_grid(max_num):
    proc = GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448}, crop_to_patches=True, max_patches=max_num
    )
    est = get_estimator("internvl", max_num=max_num)
    want = [256 * proc.get_number_of_image_patches(h, w, {}) for w, h in GRID]
    got = [est.image_tokens(w, h) for w, h in GRID]
    assert got == want
    assert est.image_tokens_batch(WS, HS).tolist() == want
    assert est.wrapper_tokens == 2 and est.name == "internvl"


def test_internvl_equals_real_processor():
    proc = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True, max_patches=12)
    est = get_estimator("internvl")
    for w, h in [
        (10, 10),
        (448, 448),
        (1024, 768),
        (300, 2000),
        (2000, 300),
        (5000, 1),
        (897, 449),
        (640, 640),
    ]:
        num = proc(images=img(w, h), input_data_format="channels_last")["num_patches"][0]
        assert est.num_tiles(w, h) == num == proc.get_number_of_image_patches(h, w, {}), (w, h)


def test_tiles_settings_and_dense_batch():
    rng = np.random.default_rng(0)
    w = rng.integers(1, 5000, 20000)
    h = rng.integers(1, 5000, 20000)
    for kw in [
        {},
        {"max_tiles": 6, "use_thumbnail": False},
        {"tile_size": 336, "min_tiles": 2, "max_tiles": 9},
        {"max_tiles": 1},
    ]:
        est = get_estimator("tiles", **kw)
        assert est.image_tokens_batch(w, h).tolist() == [
            est.image_tokens(int(a), int(b)) for a, b in zip(w, h, strict=True)
        ]
    assert get_estimator("tiles", max_tiles=1).image_tokens(4000, 100) == 256
    no_thumb = get_estimator("internvl", use_thumbnail=False)
    assert no_thumb.image_tokens(1024, 768) == 3072 and no_thumb.image_tokens(448, 448) == 256
    with pytest.raises(TypeError, match="unknown setting 'max_numm'"):
        get_estimator("internvl", max_numm=3)
    with pytest.raises(ValueError, match="min_tiles=5 > max_tiles=4"):
        get_estimator("tiles", min_tiles=5, max_tiles=4)


# ---------------------------------------------------------------------------------------------
# LLaVA-NeXT

def test_llava_next_equals_processor_on_grid(next_proc):
    want = next_proc._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in GRID])["num_image_tokens"]
    est = get_estimator("llava-next")
    assert [est.image_tokens(w, h) for w, h in GRID] == want
    assert est.image_tokens_batch(WS, HS).tolist() == want
    assert est.wrapper_tokens == 0
    # research note §7.8: transformers' int(round(x, 7)) at an exact-fraction size
    assert (est.image_tokens(1408, 792), est.image_tokens(792, 1408)) == (1948, 1968)


def test_llava_next_end_to_end_placeholders(next_proc):
    est = get_estimator("llava-next")
    for w, h in [(10, 10), (336, 336), (1024, 768), (1408, 792), (300, 2000), (3000, 20), (640, 480)]:
        out = next_proc(text="hi <image>", images=img(w, h), return_tensors="np")
        assert int((out["input_ids"] == 1).sum()) == est.image_tokens(w, h), (w, h)


# ---------------------------------------------------------------------------------------------
# LLaVA-OneVision

def test_llava_onevision_equals_processor_on_grid(ov_proc):
    want = [ov_proc._get_number_of_features(h, w, 384, 384) for w, h in GRID]
    est = get_estimator("llava-onevision")
    assert [est.image_tokens(w, h) for w, h in GRID] == want
    assert est.image_tokens_batch(WS, HS).tolist() == want


def test_llava_onevision_real_images_and_multi_image(ov_proc):
    est = get_estimator("llava-onevision")
    ip = ov_proc.image_processor
    for w, h in [(10, 10), (384, 384), (1024, 768), (300, 2000), (2000, 300), (800, 600)]:
        out = ip(images=img(w, h), input_data_format="channels_last", return_tensors="np")
        n_crops = out["pixel_values"].shape[1]  # base view + best-resolution crops
        bh, bw = _best(est, w, h)
        assert n_crops == 1 + (bh // 384) * (bw // 384), (w, h)
        # the processor's own placeholder string for this image (single-image sample)
        assert _ov_placeholders(ov_proc, out, 1) == est.image_tokens(w, h)
        assert _ov_placeholders(ov_proc, out, 2) == est.image_tokens(w, h, images_in_sample=2) == 730
    assert est.image_tokens_batch([100, 200], [100, 50], images_in_sample=3).tolist() == [730, 730]
    assert est.video_tokens(8, 640, 480) == 8 * 196 + 1


def _ov_placeholders(proc, out: dict, images_in_sample: int) -> int:
    """The ``<image>`` count the processor writes for the first image of a sample with
    ``images_in_sample`` images: 5.x's ``replace_image_token``, else (4.57-5.9) the expansion its
    ``__call__`` runs (``_expand_image_tokens``) on a one-image prompt."""
    if hasattr(proc, "replace_image_token"):
        return proc.replace_image_token({**out, "batch_num_images": [images_in_sample]},
                                        image_idx=0).count("<image>")
    height, width = out["pixel_values"][0][0].shape[-2:]
    text, _ = proc._expand_image_tokens(["<image>"], iter(out["image_sizes"]), height, width, "<image>",
                                        iter([images_in_sample]))
    return text[0].count("<image>")


def _best(est, w, h):
    from tokenbal.estimate.llava import select_best_resolution

    return select_best_resolution(h, w, est.pinpoints)


def test_llava_dense_batch_equals_scalar():
    rng = np.random.default_rng(2)
    w = rng.integers(1, 6000, 20000)
    h = rng.integers(1, 6000, 20000)
    # exact-fraction sizes around multiples of the grid stress the int(round(x, 7)) fallback
    w = np.concatenate([w, np.arange(1, 3000, 11), np.full(300, 1408), np.arange(700, 1000)])
    h = np.concatenate([h, np.arange(2999, 0, -11), np.arange(500, 800), np.full(300, 792)])
    for name in ("llava-next", "llava-onevision"):
        est = get_estimator(name)
        assert est.image_tokens_batch(w, h).tolist() == [
            est.image_tokens(int(a), int(b)) for a, b in zip(w, h, strict=True)
        ]


def test_llava_errors():
    with pytest.raises(ValueError, match=r"heights\[2\] must be a positive integer, got 0"):
        get_estimator("llava-next").image_tokens_batch([1, 2, 3], [1, 2, 0])
    with pytest.raises(ValueError, match="not multiples of crop_size 336"):
        get_estimator("llava-next", pinpoints=[[336, 500]])
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['foo'\]"):
        get_estimator("llava-onevision", foo=1)


# ---------------------------------------------------------------------------------------------
# load_estimator


def test_load_internvl_hf_and_original(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    write_json(hf, "config.json", {"model_type": "internvl"})
    write_json(
        hf,
        "preprocessor_config.json",
        {
            "image_processor_type": "GotOcr2ImageProcessor",
            "crop_to_patches": False,
            "size": {"height": 448, "width": 448},
            "max_patches": 12,
        },
    )
    write_json(hf, "processor_config.json", {"image_seq_length": 256, "processor_class": "InternVLProcessor"})
    assert load_estimator(hf) == get_estimator("internvl")
    orig = tmp_path / "orig"
    orig.mkdir()
    write_json(
        orig,
        "config.json",
        {
            "model_type": "internvl_chat",
            "force_image_size": 448,
            "max_dynamic_patch": 6,
            "use_thumbnail": True,
            "downsample_ratio": 0.5,
            "vision_config": {"patch_size": 14, "image_size": 448},
        },
    )
    assert load_estimator(orig) == get_estimator("internvl", max_num=6)


def test_load_llava(tmp_path):
    write_json(
        tmp_path,
        "config.json",
        {
            "model_type": "llava_next",
            "vision_feature_select_strategy": "default",
            "vision_config": {"patch_size": 14},
        },
    )
    write_json(
        tmp_path,
        "preprocessor_config.json",
        {"image_grid_pinpoints": NEXT_PINPOINTS, "crop_size": {"height": 336, "width": 336}},
    )
    est = load_estimator(tmp_path)
    assert est == get_estimator("llava-next")
    import json

    assert json.loads(json.dumps(est.config))["pinpoints"] == NEXT_PINPOINTS


def test_video_tokens_equal_processor_placeholders(ov_proc):
    # the processors' own replace_video_token on inputs shaped like their video processors' output
    ov_proc.video_token = "<video>"
    for frames in (1, 8, 33):
        video = {"pixel_values_videos": [np.zeros((frames, 3, 384, 384), dtype=np.float32)]}
        require_oracle(ov_proc, "replace_video_token")
        want = ov_proc.replace_video_token(video, video_idx=0).count("<video>")
        assert get_estimator("llava-onevision").video_tokens(frames, 640, 480, None) == want
        assert get_estimator("llava-onevision", video_frames=frames).video_tokens(900, 640, 480, 30.0) == want

    from transformers import InternVLProcessor

    p = object.__new__(InternVLProcessor)  # __init__ needs a real InternVL tokenizer; the method does not
    p.start_image_token, p.end_image_token, p.image_token, p.image_seq_length = "<img>", "</img>", "<C>", 256
    est = get_estimator("internvl", num_segments=8)
    video = {"pixel_values_videos": [np.zeros((8, 3, 448, 448), dtype=np.float32)]}
    text = p.replace_video_token(video, video_idx=0)
    assert text.count("<C>") == est.video_tokens(1000, 640, 480, 30.0) == 8 * 256
    assert text.count("<img>") + text.count("</img>") == est.video_wrapper_tokens(1000)


@pytest.mark.parametrize(
    ("min_tiles", "max_tiles", "tile"), [(1, 12, 448), (1, 6, 448), (2, 9, 384), (1, 36, 448)]
)
def test_vectorised_grid_choice_equals_the_sweep_dense(min_tiles, max_tiles, tile):
    # best_grid_np jumps to the nearest ratio value instead of sweeping; the scalar best_grid is the
    # sweep itself (checked against transformers above). A dense box holds every kind of exact tie
    # (equal distances to two ratio values, e.g. aspect 1.25 between 1 and 3/2 when 5/4 is not a
    # candidate) plus big images.
    from tokenbal.estimate.tiles import best_grid, best_grid_np

    hs, ws = np.meshgrid(np.arange(1, 161), np.arange(1, 161), indexing="ij")
    rng = np.random.default_rng(7)
    w = np.concatenate([ws.ravel(), rng.integers(1, 20000, 5000), ws.ravel() * 37])
    h = np.concatenate([hs.ravel(), rng.integers(1, 20000, 5000), hs.ravel() * 29])
    c, r = best_grid_np(w, h, tile, min_tiles, max_tiles)
    want = [best_grid(int(a), int(b), tile, min_tiles, max_tiles) for a, b in zip(w, h, strict=True)]
    assert list(zip(c.tolist(), r.tolist(), strict=True)) == want
