"""Packed-batch forward for transformers PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``, 5.6+).

The shared scheme is :mod:`collate.models.core`. What this family sets:

- Text: an ERNIE-4.5 stack whose rotary is Qwen2-VL's chunked M-RoPE (``TTT..HHH..WWW`` sections
  of the rotate-half layout; transformers 5.6-5.9 apply it in the attention, 5.19+ in the rotary
  module: the same values), with q/k/v/o projections and a causal mask: the core's packed
  attention with :func:`collate.models.core.chunked_mrope`. The positions are the collator's
  Qwen2-VL image rule (``PackedCollator.from_config``; no video: the model takes none).
- Tower: a SigLIP encoder with a 2-D rotary and per-image attention segments, then a projector
  that merges ``2 x 2`` patches image by image. transformers' own ``get_image_features`` already
  makes one call on all images of the batch (each image attended to on its own, each projected on
  its own: the same math as per sample), so it is used as is. It reads the grids back to the host
  (segments, rotary ids, the projector's split): exact, not sync-free, like GLM-OCR's tower. A
  batch without images runs it on one zero ``merge x merge`` image (the idle pass).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from collate.models import core

SUPPORTED_MODEL_TYPES = ("paddleocr_vl",)


def _features(model: nn.Module, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    from tokenbal import hf_compat

    return hf_compat.paddleocr_vl_image_features(model, pixels, grids)


def _idle_inputs(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One zero ``merge x merge``-patch image and its grid row, built once per device."""
    cache = core.idle_cache(model)
    if device not in cache:
        vision = model.config.vision_config
        merge, patch = int(vision.spatial_merge_size), int(vision.patch_size)
        cache[device] = (torch.zeros(merge * merge, vision.num_channels, patch, patch, device=device),
                         torch.tensor([[1, merge, merge]], device=device))
    return cache[device]


def _encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
            idle_vision: bool) -> core.Encoded | None:
    pixel_values, grids = kwargs.pop("pixel_values", None), kwargs.pop("image_grid_thw", None)
    for name in ("pixel_values_videos", "video_grid_thw"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"PaddleOCR-VL takes no video: {name} given")
    if pixel_values is None:
        if not idle_vision:
            return None
        pixels, grid = _idle_inputs(model, kwargs["inputs_embeds"].device)
        return core.Encoded(None, idle_zero=0.0 * _features(model, pixels, grid).sum())
    if grids is None:
        raise ValueError("pixel_values given without image_grid_thw")
    if pixel_values.dim() == 2:  # the collator's rows of C*P*P values; the tower embeds (C, P, P) patches
        vision = model.config.vision_config
        pixel_values = pixel_values.view(-1, vision.num_channels, vision.patch_size, vision.patch_size)
    return core.Encoded(_features(model, pixel_values, grids),
                        placeholder_ids=(int(model.config.image_token_id),))


def _check(model: nn.Module, text_model: nn.Module) -> None:
    core.check_mrope_section(text_model)  # 3 sections covering the rotary frequencies
    inner = getattr(model, "model", None)
    if not (hasattr(inner, "get_image_features") and hasattr(inner, "visual")):
        raise TypeError(f"{type(model).__name__}: expected PaddleOCRVLForConditionalGeneration "
                        "(.model.visual, .model.get_image_features)")


FAMILY = core.Family(name="paddleocr_vl", model_types=SUPPORTED_MODEL_TYPES, rope=core.chunked_mrope,
                     encode=_encode, check=_check, attention_mask=core.empty_mask)


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on one zero image when a packed batch has no image, so
    every FSDP rank issues the same collectives.
    """
    return core.enable(model, FAMILY, idle_vision)


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    return core.disable(model)
