"""Packed-batch forward for transformers 5.x LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``).

The shared scheme is :mod:`collate.models.core` with the crop tower of
:mod:`collate.models.anyres_vision`. What this family sets:

- Plain 1-D RoPE language model (Qwen2): the packed ``(1, T)`` positions go through
  :func:`collate.ops.apply_mrope` with one position row and :func:`collate.ops.varlen_attention`.
- Images: transformers' ``pack_image_features`` loop (:func:`anyres_vision.pack_image_features`)
  with ``vision_aspect_ratio`` ("anyres_max_9":
  the unpadded crop grid is downsampled above 9 base views); an image that shares its sample
  with other images keeps only its base view (``batch_num_images``, per sample).
- Videos: every frame through the same tower call, then transformers' ``apply_pooling`` (2x2
  bilinear), all frames of a video in a row plus one ``image_newline``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from collate.models import anyres_vision, core

SUPPORTED_MODEL_TYPES = ("llava_onevision",)


def _encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
            idle_vision: bool) -> core.Encoded | None:
    return anyres_vision.encode(model, kwargs, vision, idle_vision, videos=True)


def _check(model: nn.Module, text_model: nn.Module) -> None:
    anyres_vision.check(model, text_model)
    if not hasattr(model.model, "apply_pooling"):
        raise TypeError(f"{type(model.model).__name__} has no 'apply_pooling'; "
                        "transformers version not supported")


FAMILY = anyres_vision.family("llava_onevision", SUPPORTED_MODEL_TYPES, _encode, _check)


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on one zero crop when a packed batch has no image or
    video, so every FSDP rank issues the same collectives.
    """
    return core.enable(model, FAMILY, idle_vision)


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    return core.disable(model)
