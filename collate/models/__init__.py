"""Patches that let real transformers model classes consume packed batches.

``enable_packed(model)`` picks the patch from ``model.config.model_type``. The shared machinery
(wrapper, attention info, packed text attention, the one vision-tower call, the feature scatter)
is :mod:`collate.models.core`; each family file only says what differs. After it,
``model(**packed_batch)`` runs M-RoPE via ``collate.ops.apply_mrope`` and attention via
``collate.ops.varlen_attention``; calls without packing fields are unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from collate.models import glm4v, internvl, llava_next, llava_onevision, qwen2_vl, qwen3_vl

# model_type -> (enable, disable). Qwen2.5-VL's text stack is Qwen2-VL's (same attention/rotary code).
_PATCHES: dict[str, Any] = {
    "qwen2_vl": (qwen2_vl.enable_packed, qwen2_vl.disable_packed),
    "qwen2_5_vl": (qwen2_vl.enable_packed, qwen2_vl.disable_packed),
    # Qwen3-VL: q/k head norms, interleaved M-RoPE, DeepStack visual features in the first layers.
    "qwen3_vl": (qwen3_vl.enable_packed, qwen3_vl.disable_packed),
    "qwen3_vl_moe": (qwen3_vl.enable_packed, qwen3_vl.disable_packed),
    # 1-D RoPE language models behind crop towers.
    "llava_next": (llava_next.enable_packed, llava_next.disable_packed),
    "llava_onevision": (llava_onevision.enable_packed, llava_onevision.disable_packed),
    "internvl": (internvl.enable_packed, internvl.disable_packed),
    # GLM-4.1V: partial pair-wise M-RoPE, one tower grid row per video frame.
    "glm4v": (glm4v.enable_packed, glm4v.disable_packed),
}


def _patch_for(model: nn.Module) -> Any:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _PATCHES:
        raise TypeError(
            f"enable_packed: no packed patch for model_type={model_type!r} ({type(model).__name__}); "
            f"supported: {sorted(_PATCHES)}"
        )
    return _PATCHES[model_type]


def enable_packed(model: nn.Module, sp_group: Any = None, **options: Any) -> nn.Module:
    """Patch this model instance so that ``model(**packed_batch)`` works; returns the model.

    ``options`` go to the family's patch (e.g. ``idle_vision=False`` for Qwen2-VL / Qwen3-VL).
    ``sp_group``: a process group to run sequence parallel over (Ulysses attention, whole images
    per rank; feed it :func:`collate.sp.shard_batch` slices). ``ValueError`` when the text heads
    cannot be split over the group.
    """
    patch = _patch_for(model)
    if sp_group is not None:
        from collate.models import core

        # Checked before patching, so a bad group leaves the model as it was.
        core.set_sp_group(model, sp_group)
    try:
        return patch[0](model, **options)
    except BaseException:
        model.__dict__.pop("_tokenbal_sp_group", None)
        raise


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance; returns the model."""
    return _patch_for(model)[1](model)


__all__ = ["enable_packed", "disable_packed"]
