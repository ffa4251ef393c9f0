"""Packed-batch forward for transformers InternVL (``InternVLForConditionalGeneration``).

The shared scheme is :mod:`collate.models.core`. What this family sets:

- Plain 1-D RoPE language model (Qwen2 / Llama): the packed ``(1, T)`` positions go through
  :func:`collate.ops.apply_mrope` with one position row and :func:`collate.ops.varlen_attention`.
- The tower: transformers' own ``get_image_features`` already makes one call on all tiles of the
  batch (each tile ``tokens_per_tile`` features after the pixel shuffle, no host read), so it is
  used as is; a batch without tiles runs it on one zero tile (the idle pass). Video frames reach
  InternVL as tiles under the image token, so there is no separate video path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from collate.models import anyres_vision, core

SUPPORTED_MODEL_TYPES = ("internvl",)


def _features(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    from tokenbal import hf_compat

    return hf_compat.internvl_image_features(model, pixels).flatten(0, 1)


def _encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
            idle_vision: bool) -> core.Encoded | None:
    pixel_values = kwargs.pop("pixel_values", None)
    for name in anyres_vision.ANYRES_KEYS:
        kwargs.pop(name, None)
    if pixel_values is None:
        if not idle_vision:
            return None
        height, width = model.config.vision_config.image_size
        tile = anyres_vision.idle_crop(model, kwargs["inputs_embeds"].device, height, width)
        return core.Encoded(None, idle_zero=0.0 * _features(model, tile).sum())
    return core.Encoded(_features(model, pixel_values), placeholder_ids=(int(model.config.image_token_id),))


def _check(model: nn.Module, text_model: nn.Module) -> None:
    if not hasattr(getattr(model, "model", None), "get_image_features"):
        raise TypeError(f"{type(model).__name__}.model has no get_image_features; "
                        "transformers version not supported")


FAMILY = anyres_vision.family("internvl", SUPPORTED_MODEL_TYPES, _encode, _check)


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on one zero tile when a packed batch has no image, so
    every FSDP rank issues the same collectives.
    """
    return core.enable(model, FAMILY, idle_vision)


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    return core.disable(model)
