"""``TokenIndex.image_tokens_table`` (the per-image counts cost models read) for LLaVA-OneVision:
an image that shares its sample with other images counts what transformers' processor gives it
(base view + newline), as the index's per-sample ``vision_tokens`` already do."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from transformers import LlavaOnevisionProcessor  # noqa: E402

from tokenbal.hf_compat import image_processor_class  # noqa: E402

LlavaOnevisionImageProcessorPil = image_processor_class("LlavaOnevisionImageProcessorPil")

from tests.helpers.corpus import Sample, write_shard  # noqa: E402
from tokenbal.index import TokenIndex, build_index  # noqa: E402


def processor() -> LlavaOnevisionProcessor:
    # __init__ insists on a video processor (torchvision); the counting methods do not need it.
    p = object.__new__(LlavaOnevisionProcessor)
    p.image_processor = LlavaOnevisionImageProcessorPil(
        image_grid_pinpoints=[[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)],
        size={"height": 384, "width": 384})
    p.num_image_tokens = 729
    p.vision_feature_select_strategy = "full"
    p.vision_aspect_ratio = "anyres_max_9"
    p.image_token = "<image>"
    return p


def processor_counts(proc: LlavaOnevisionProcessor, sizes: list[tuple[int, int]]) -> list[int]:
    """The ``<image>`` count the processor writes for each image of one sample."""
    images = [Image.new("RGB", (w, h), (40, 80, 120)) for w, h in sizes]
    out = proc.image_processor(images=images, return_tensors="np")
    out = {**out, "batch_num_images": [len(sizes)]}
    if hasattr(proc, "replace_image_token"):  # 5.x: the per-image expansion helper
        return [proc.replace_image_token(out, image_idx=j).count("<image>") for j in range(len(sizes))]
    # 4.57 has no per-image helper: the expansion its __call__ runs, on one "|"-separated prompt
    height, width = out["pixel_values"][0][0].shape[-2:]
    text, _ = proc._expand_image_tokens(["|".join(["<image>"] * len(sizes))], iter(out["image_sizes"]),
                                        height, width, "<image>", iter([len(sizes)]))
    return [part.count("<image>") for part in text[0].split("|")]


def test_shared_onevision_images_count_as_the_processor_does(tmp_path):
    samples = [("a", [(640, 480), (300, 900)]), ("b", []), ("c", [(1024, 768)]),
               ("d", [(50, 40), (800, 600), (384, 384)])]
    shard = write_shard(tmp_path / "s.tar", [
        Sample(key, images=[("png", w, h) for w, h in sizes], caption=key) for key, sizes in samples])
    out = build_index([shard], tmp_path / "idx", model="llava-onevision", progress=False)
    idx = TokenIndex.open(out.out)
    offsets, tokens = idx.image_tokens_table
    proc = processor()
    want = [n for _, sizes in samples if sizes for n in processor_counts(proc, sizes)]
    assert offsets.tolist() == [0, 2, 2, 3, 6]
    assert tokens.tolist() == want
    assert 730 in want and max(want) > 730  # shared images and a single one with its crops
    # The per-image table adds up to the index's per-sample vision tokens (no wrapper tokens).
    assert np.add.reduceat(tokens, offsets[:-1][np.diff(offsets) > 0]).tolist() == \
        [int(v) for v in np.asarray(idx.vision_tokens) if v]
