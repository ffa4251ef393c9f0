"""Tiny random LLaVA-NeXT / LLaVA-OneVision configs and the transformers reference loss of the
LLaVA-style packed-model tests (InternVL's too). transformers is imported when a config is built."""

from __future__ import annotations

import torch

from tests.helpers.reference import token_weighted_loss

IMG, VID = 120, 121
SIDE = 32  # crop side in pixels; patch 8 -> 4 x 4 features per crop
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=SIDE, patch_size=8)


def tiny_config(family: str, attn: str = "sdpa"):
    """``family``: "llava_next" (Llama text, CLIP tower) or "llava_onevision" (Qwen2 text, SigLIP)."""
    from transformers import LlavaNextConfig, LlavaOnevisionConfig

    if family == "llava_next":
        return LlavaNextConfig(
            text_config=dict(model_type="llama", **TEXT),
            vision_config=dict(model_type="clip_vision_model", projection_dim=32, **VISION),
            image_token_index=IMG, image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
            attn_implementation=attn)
    # OneVision: Qwen2 text, SigLIP tower; the 96 x 128 pinpoint's 12 x 16 feature grid exceeds 9
    # base views by more than 1.1, so its features are downsampled.
    return LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", **TEXT),
        vision_config=dict(model_type="siglip_vision_model", **VISION),
        image_token_index=IMG, video_token_index=VID,
        image_grid_pinpoints=[[32, 32], [32, 64], [64, 32], [64, 64], [96, 128]], attn_implementation=attn)


def hf_inputs(sample: dict) -> dict:
    out = {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]}
    for key in ("pixel_values", "image_sizes", "pixel_values_videos"):
        if key in sample:
            out[key] = sample[key]
    if "image_sizes" in sample and "pixel_values_videos" not in sample:
        out["batch_num_images"] = torch.tensor([sample["image_sizes"].shape[0]])
    return out


def hf_kwargs(model, sample: dict) -> dict:
    out = hf_inputs(sample)
    if model.config.model_type != "llava_onevision":
        out.pop("batch_num_images", None)
    return out


def reference_loss(model, samples: list[dict]) -> torch.Tensor:
    """Token-weighted mean of per-sample unpacked HF losses (each sample's own first label is
    never a target: HF shifts)."""
    return token_weighted_loss(model, samples, lambda s: hf_kwargs(model, s))
