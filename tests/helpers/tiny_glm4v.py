"""A tiny random GLM-4.1V config (partial pair-wise M-RoPE, frames as image tokens inside a video
span) and its samples, laid out as ``Glm4vProcessor`` lays out prompts; grids come from the index's
estimator and video plan. transformers is imported when a config is built."""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 128
IMG, VIDEO_TOKEN, ISTART, IEND, VSTART, VEND = 120, 121, 122, 123, 124, 125
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch
# The index's estimator: GLM's image budget compares 2*h*w with max_pixels (<= 12 tokens here).
EST = dict(min_pixels=2 * 28 * 28, max_pixels=2 * 28 * 28 * 12)


def tiny_config(attn: str = "sdpa"):
    from transformers import Glm4vConfig

    from tokenbal.hf_compat import rope_config

    # head_dim 32, partial_rotary_factor 0.5: 16 channels rotate (8 frequencies, sections 2/3/3).
    return Glm4vConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         **rope_config(Glm4vConfig, 10000.0, mrope_section=[2, 3, 3],
                                       partial_rotary_factor=0.5)),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, out_hidden_size=64, intermediate_size=64, image_size=56),
        image_token_id=IMG, video_token_id=VIDEO_TOKEN, image_start_token_id=ISTART, image_end_token_id=IEND,
        video_start_token_id=VSTART, video_end_token_id=VEND, attn_implementation=attn)


def estimator():
    from tokenbal.estimate.vision import get_estimator

    return get_estimator("glm-4.1v", **EST)


def video_plan(frames: int, width: int, height: int):
    from tokenbal.estimate.video import VideoRequest, plan_video

    return plan_video(estimator(), VideoRequest(frames=frames, fps=2.0, width=width, height=height))


def make_sample(g: torch.Generator, spec: list) -> dict:
    """``spec``: ("text", n) / ("image", (width, height)) / ("video", (frames, width, height)) in
    order; grids from the index's estimator and video plan, the processor's prompt layout."""
    est = estimator()
    ids: list[int] = []
    images, image_px, videos, video_px = [], [], [], []

    def text(n: int) -> list[int]:
        return torch.randint(0, 100, (n,), generator=g).tolist()

    for kind, arg in spec:
        if kind == "text":
            ids += text(arg)
        elif kind == "image":
            grid = est.image_grid(*arg)
            ids += [ISTART] + [IMG] * (int(np.prod(grid)) // 4) + [IEND]
            images.append(list(grid))
            image_px.append(torch.randn(int(np.prod(grid)), PATCH_DIM, generator=g))
        else:
            plan = video_plan(*arg)
            t, h, w = plan.grid
            ids.append(VSTART)
            for _ in range(t):  # <|begin_of_image|> frame <|end_of_image|> timestamp
                ids += [ISTART] + [IMG] * (h * w // 4) + [IEND] + text(1)
            ids.append(VEND)
            videos.append([t, h, w])
            video_px.append(torch.randn(t * h * w, PATCH_DIM, generator=g))
    input_ids = torch.tensor(ids)
    labels = torch.where(input_ids == IMG, -100, input_ids)
    sample = {"input_ids": input_ids, "labels": labels}
    if images:
        sample.update(pixel_values=torch.cat(image_px), image_grid_thw=torch.tensor(images))
    if videos:
        sample.update(pixel_values_videos=torch.cat(video_px), video_grid_thw=torch.tensor(videos))
    return sample
