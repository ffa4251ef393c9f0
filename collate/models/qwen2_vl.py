"""Packed-batch forward for transformers Qwen2-VL and Qwen2.5-VL (4.57 to the newest 5.x).

The shared scheme is :mod:`collate.models.core` (wrapper, attention info, packed text attention,
one tower call, feature scatter) with the ``grid_thw`` tower of :mod:`collate.models.grid_vision`.
What this family sets:

- M-RoPE in the chunked ``TTT..HHH..WWW`` layout, ``mrope_section`` from the text rotary module.
- Qwen2.5-VL's tower also takes the collator's window order and window segments
  (``vision_window_index`` / ``vision_cu_window_seqlens``); the idle dummy image gets them too.
- The text model accepts a prepared mask mapping, so each layer is handed None.

The one waste left: HF's text model still builds its ``(1, T, D)`` cos/sin table once per forward
from ``position_ids`` (not per layer); the patched attention ignores it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from collate.models import core, grid_vision

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def _window(model: nn.Module) -> int | None:
    if model.config.model_type != "qwen2_5_vl":
        return None
    from collate.vision import window_in_merged_tokens

    return window_in_merged_tokens(model.config.vision_config)


def _tower_kwargs(model: nn.Module, vision: dict[str, Any], grids: Any, num_patches: int) -> dict[str, Any]:
    return grid_vision.tower_kwargs(model, vision, windowed=model.config.model_type == "qwen2_5_vl")


def _encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
            idle_vision: bool) -> core.Encoded | None:
    if not hasattr(getattr(model, "model", None), "visual"):
        return None
    return grid_vision.encode(model, kwargs, vision, idle_vision, _tower_kwargs,
                              core.zero_of_output, window=_window(model))


def _check(model: nn.Module, text_model: nn.Module) -> None:
    core.check_mrope_section(text_model)


FAMILY = grid_vision.family("qwen2_vl", SUPPORTED_MODEL_TYPES, core.chunked_mrope, _encode, _check,
                            attention_mask=core.prepared_mask_mapping)


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on a zero-weighted dummy image when a packed batch has no
    image or video, so every FSDP rank issues the same collectives.
    """
    return core.enable(model, FAMILY, idle_vision and hasattr(getattr(model, "model", None), "visual"))


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    return core.disable(model)
