"""A tiny random Qwen2-VL and a text / image / video sample mixture, shared by the FSDP2, stage-cost,
empty-rank, packed-vision and sequence-parallel tests. transformers is imported when a config is
built, so importing this module needs none of it."""

from __future__ import annotations

import torch

from tests.helpers.samples import vl_sample

VOCAB, IMG, VID, VSTART, VEND = 96, 90, 91, 92, 93
PATCH_DIM = 3 * 2 * 14 * 14


def tiny_config():
    """A 2-layer Qwen2-VL text model with a 2-block vision tower (random weights come from the
    model class; this is only the config)."""
    from transformers import Qwen2VLConfig

    from tokenbal.hf_compat import rope_config

    return Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                         **rope_config(Qwen2VLConfig, 1e4, mrope_section=[1, 1, 2])),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        attn_implementation="sdpa")


def make_sample(g: torch.Generator, spec: list) -> dict:
    """spec: ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w)) in patch units."""
    return vl_sample(g, spec, image=IMG, video=VID, start=VSTART, end=VEND, patch_dim=PATCH_DIM)


SPECS = [
    [("text", 11)],
    [("text", 3), ("image", (1, 4, 6)), ("text", 5)],
    [("text", 2), ("video", (3, 4, 4)), ("text", 6)],  # text after a video: positions resume at max + 1
    [("text", 4), ("image", (1, 2, 2)), ("text", 3), ("video", (2, 2, 4)), ("text", 2)],
    [("text", 17)],
    [("image", (1, 6, 4)), ("text", 9)],
]


def make_samples(seed: int = 0) -> list[dict]:
    """The SPECS mixture; text runs get a seed-dependent extra length so samples differ in size."""
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, 12, (sum(len(spec) for spec in SPECS),), generator=g).tolist()
    specs = [[(kind, arg + extra.pop() if kind == "text" else arg) for kind, arg in spec] for spec in SPECS]
    return [make_sample(g, spec) for spec in specs]
