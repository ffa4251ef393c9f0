"""The collator's positions for M-RoPE families whose layout equals one it knows, against the
installed transformers' own ``get_rope_index`` of each family (tiny config, meta-device model).

GLM-4.6V and GLM-OCR lay out positions as GLM-4.1V does, Cosmos3-Omni and Cosmos3-Edge as Qwen3-VL
does (one block per video frame), PaddleOCR-VL as Qwen2-VL does for images (its model takes no
video). Each packed row of random samples (text-only, images, videos, several per sample, in any
order) built as the family's processor writes prompts must give, per sample, exactly the positions
of the family's ``get_rope_index``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collate import PackedCollator

transformers = pytest.importorskip("transformers")

from tokenbal.hf_compat import get_rope_index, rope_config  # noqa: E402

MERGE = 2
# Token ids of the tiny configs (GLM: image, video, begin/end of image, begin/end of video;
# Qwen-style: image, video, vision start/end).
IMG, VID, ISTART, IEND, VSTART, VEND = 120, 121, 122, 123, 124, 125
_TEXT = dict(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8)
_GLM_IDS = dict(image_token_id=IMG, video_token_id=VID, image_start_token_id=ISTART, image_end_token_id=IEND,
                video_start_token_id=VSTART, video_end_token_id=VEND)
_QWEN_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=ISTART,
                 vision_end_token_id=IEND)

# config class -> (layout style, takes videos)
FAMILIES = {
    "Glm46VConfig": ("glm", True),
    "GlmOcrConfig": ("glm", True),
    "Cosmos3OmniConfig": ("qwen3", True),
    "Cosmos3EdgeConfig": ("qwen3", True),
    "PaddleOCRVLConfig": ("qwen2", False),
}


def tiny_config(name: str):
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    style, _ = FAMILIES[name]
    ids = _GLM_IDS if style == "glm" else _QWEN_IDS
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                  spatial_merge_size=MERGE)
    cls = getattr(transformers, name)
    # head_dim 8; GLM rotates half of it (partial_rotary_factor 0.5): sections of 4 and 2 frequencies.
    rope = (rope_config(cls, 1e4, mrope_section=[1, 0, 1], partial_rotary_factor=0.5) if style == "glm"
            else rope_config(cls, 1e4, mrope_section=[2, 1, 1]))
    return cls(text_config={**_TEXT, **rope}, vision_config=vision, **ids)


_MODELS: dict[str, object] = {}


def tiny_model(name: str):
    """The family's base model (the class holding ``get_rope_index``), without weights."""
    if name not in _MODELS:
        with torch.device("meta"):
            try:
                model = transformers.AutoModel.from_config(tiny_config(name))
            except ValueError:  # 5.6-5.9 map PaddleOCR-VL only by its generation class
                model = transformers.AutoModelForImageTextToText.from_config(tiny_config(name)).model
        _MODELS[name] = model
    return _MODELS[name]


def mm_token_type_ids(style: str, ids: list[int]) -> torch.Tensor:
    """What the family's processor returns: GLM's own rule (``Glm46VProcessor``: the image token
    inside a video span is video), else 1 for the image token and 2 for the video token."""
    if style == "glm":
        from transformers.models.glm46v.processing_glm46v import Glm46VProcessor

        rule = SimpleNamespace(video_start_id=VSTART, video_end_id=VEND, image_token_id=IMG)
        return torch.tensor(Glm46VProcessor.create_mm_token_type_ids(rule, [ids]))
    x = torch.tensor([ids])
    return ((x == IMG).int() + 2 * (x == VID).int())


def build(style: str, parts: list[tuple]) -> dict:
    """One sample laid out as the family's processor writes it; ``parts`` in order."""
    ids: list[int] = []
    images, videos = [], []
    for kind, *arg in parts:
        if kind == "text":
            ids += [7 + (i % 90) for i in range(arg[0])]
            continue
        t, gh, gw = arg
        n = gh * gw  # merged tokens per frame
        if kind == "image":
            images.append([1, MERGE * gh, MERGE * gw])
            ids += [ISTART] + [IMG] * n + [IEND]
        else:
            videos.append([t, MERGE * gh, MERGE * gw])
            # GLM: <|begin_of_video|> (<|begin_of_image|> frame <|end_of_image|> time)* <|end_of_video|>
            if style == "glm":
                ids += [VSTART] + ([ISTART] + [IMG] * n + [IEND, 9]) * t + [VEND]
            elif style == "qwen3":  # (<t seconds> <|vision_start|> frame <|vision_end|>)*
                ids += ([8, 9] + [ISTART] + [VID] * n + [IEND]) * t
            else:
                ids += [ISTART] + [VID] * (t * n) + [IEND]
    if not ids:
        ids = [5]
    sample: dict = {"input_ids": np.asarray(ids, np.int64)}
    for key, grids, pixels in (("image_grid_thw", images, "pixel_values"),
                               ("video_grid_thw", videos, "pixel_values_videos")):
        if grids:
            sample[key] = np.asarray(grids, np.int64)
            sample[pixels] = np.zeros((int(np.prod(grids, axis=1).sum()), 4), np.float32)
    return sample


def hf_positions(name: str, sample: dict) -> np.ndarray:
    style, _ = FAMILIES[name]
    ids = sample["input_ids"].tolist()
    img, vid = sample.get("image_grid_thw"), sample.get("video_grid_thw")
    if img is None and vid is None:
        # The family's model gives a text-only row plain positions (it calls get_rope_index only
        # with vision inputs); on all three rows.
        return np.broadcast_to(np.arange(len(ids)), (3, len(ids)))
    pos = get_rope_index(tiny_model(name), torch.tensor([ids]),
                         mm_token_type_ids=mm_token_type_ids(style, ids),
                         image_grid_thw=None if img is None else torch.as_tensor(img),
                         video_grid_thw=None if vid is None else torch.as_tensor(vid))
    return pos[:, 0].numpy()


grid = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4))  # frames, merged rows, columns
part = st.one_of(st.tuples(st.just("text"), st.integers(1, 5)),
                 st.builds(lambda g: ("image", *g), grid),
                 st.builds(lambda g: ("video", *g), grid))
rows = st.lists(st.lists(part, max_size=5), min_size=1, max_size=5)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=rows)
def test_collator_positions_equal_the_familys_get_rope_index(name, specs):
    style, takes_videos = FAMILIES[name]
    if not takes_videos:
        specs = [[p for p in spec if p[0] != "video"] for spec in specs]
    samples = [build(style, spec) for spec in specs]
    batch = PackedCollator.from_config(tiny_config(name), pin_memory=False)(samples)
    cu = batch.cu_seqlens_list
    for i, (s, start, end) in enumerate(zip(samples, [0, *cu[:-1]], cu, strict=True)):
        np.testing.assert_array_equal(batch.position_ids[:, 0, start:end].numpy(), hf_positions(name, s),
                                      err_msg=f"{name} sample {i}")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_from_config_picks_the_known_layout(name):
    cfg = tiny_config(name)
    coll = PackedCollator.from_config(cfg)
    style, takes_videos = FAMILIES[name]
    assert coll.rope == "mrope" and coll.image_token_id == IMG
    assert coll.mrope_style == ("glm4v" if style == "glm" else "qwen")
    if style == "glm":
        assert coll.video_span_token_ids == (VSTART, VEND) and coll.vision_start_token_id == ISTART
    else:
        assert coll.split_video_frames == (style == "qwen3") and coll.tokens_per_second is None
        assert coll.vision_start_token_id == ISTART
    assert coll.video_token_id == (VID if takes_videos else None)


def test_image_only_family_refuses_video_grids():
    """PaddleOCR-VL's model takes no video (its get_rope_index would lay out a multi-frame video by
    Qwen2-VL's 5.x rule, but its forward never encodes one): refused, by sample."""
    coll = PackedCollator.from_config(tiny_config("PaddleOCRVLConfig"), pin_memory=False)
    ok = build("qwen2", [("text", 3), ("image", 1, 2, 2)])
    video = build("qwen2", [("text", 2), ("video", 2, 1, 2), ("text", 2)])
    with pytest.raises(ValueError, match=r"sample 1: field 'video_grid_thw' given, but .* takes no video"):
        coll([ok, video])


# GLM-4.6V: test_glm46v.py; GLM-OCR (GLM-4.1V's patch): models/test_glm_ocr.py; PaddleOCR-VL:
# models/test_paddleocr_vl.py
_PATCHED = {"Glm46VConfig", "GlmOcrConfig", "PaddleOCRVLConfig"}


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - _PATCHED))
def test_enable_packed_refuses_these_families_by_name(name):
    """The collator lays them out, but no packed forward patches their model classes: a clear
    TypeError naming the model type and why, never a forward that silently ignores the packing."""
    from collate.models import enable_packed

    cfg = tiny_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    with pytest.raises(TypeError, match=rf"model_type='{cfg.model_type}' .* is not patched: "):
        enable_packed(model)
