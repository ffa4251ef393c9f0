"""Packed-batch forward for transformers 5.x LLaVA-NeXT (``LlavaNextForConditionalGeneration``).

The shared scheme is :mod:`collate.models.core` with the crop tower of
:mod:`collate.models.anyres_vision`. What this family sets:

- Plain 1-D RoPE language model (Llama, Mistral, Qwen2, ...): the packed ``(1, T)`` positions go
  through the same :func:`collate.ops.apply_mrope` (one position row) and
  :func:`collate.ops.varlen_attention` as the M-RoPE families; no padding, no ``T x T`` mask.
- Images only: each image's crops go through transformers' ``pack_image_features`` loop (unpad,
  one ``image_newline`` per feature row, base view first).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from collate.models import anyres_vision, core

SUPPORTED_MODEL_TYPES = ("llava_next",)


def _encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
            idle_vision: bool) -> core.Encoded | None:
    return anyres_vision.encode(model, kwargs, vision, idle_vision, videos=False)


FAMILY = anyres_vision.family("llava_next", SUPPORTED_MODEL_TYPES, _encode, anyres_vision.check)


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on one zero crop when a packed batch has no image, so
    every FSDP rank issues the same collectives.
    """
    return core.enable(model, FAMILY, idle_vision)


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    return core.disable(model)
