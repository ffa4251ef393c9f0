"""A tiny random Qwen3-VL (interleaved M-RoPE, deepstack, learned position grid) and its samples,
for the packed-model and sequence-parallel tests. transformers is imported when a config is built."""

from __future__ import annotations

import torch

from tests.helpers.samples import vl_sample

VOCAB = 128
IMG, VID, VSTART, VEND = 120, 121, 122, 123
PATCH = 4
PATCH_DIM = 3 * 2 * PATCH * PATCH  # channels * temporal_patch * patch * patch
DEEPSTACK = [0, 1]


def tiny_config(attn: str = "sdpa"):
    from transformers import Qwen3VLConfig

    from tokenbal.hf_compat import rope_config

    # head_dim 32 -> 16 rotary frequencies; section (6, 5, 5) interleaves as THW THW ... THW T, the
    # real checkpoints' (24, 20, 20) pattern in small. 3 text layers: deepstack feeds layers 0 and
    # 1, layer 2 gets none. num_position_embeddings 16: a 4x4 learned grid, interpolated to every
    # image's grid.
    return Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, bos_token_id=None,
                         eos_token_id=None, max_position_embeddings=4096,
                         **rope_config(Qwen3VLConfig, 1e4, mrope_section=[6, 5, 5], mrope_interleaved=True)),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=DEEPSTACK),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        attn_implementation=attn)


def make_sample(g: torch.Generator, spec: list) -> dict:
    """spec: ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w)) in patch units; a video is
    laid out per frame with timestamp tokens, as Qwen3-VL's processor does."""
    return vl_sample(g, spec, image=IMG, video=VID, start=VSTART, end=VEND, patch_dim=PATCH_DIM,
                     text_vocab=100, frame_stamps=True)
