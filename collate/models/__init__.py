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

from collate.models import (  # noqa: F401 - see _PATCHES
    glm4v,
    internvl,
    llava_next,
    llava_onevision,
    paddleocr_vl,
    qwen2_vl,
    qwen3_vl,
)
from tokenbal.estimate.families import FAMILIES

# model_type -> (enable, disable), from the family table: a family's packed file (``Family.packed``,
# imported above) patches its transformers model types. Qwen2.5-VL shares Qwen2-VL's file (same
# attention / rotary code); Qwen3-VL adds q/k head norms, interleaved M-RoPE and DeepStack features;
# LLaVA-NeXT / OneVision and InternVL are 1-D RoPE language models behind crop towers; GLM-4.1V has
# a partial pair-wise M-RoPE and one tower grid row per video frame.
# PACKED_ONLY: model types patched here whose family has no token estimator in the table (so no
# row there: every row has one). PaddleOCR-VL's image processor resizes small images its own way
# (not Qwen2-VL's rule), a rule tokenbal does not count yet (nor does dataset_lengths, which refuses
# its processor); packed training takes its lengths from the processor itself or any other source.
PACKED_ONLY: dict[str, str] = {"paddleocr_vl": "paddleocr_vl"}
_PATCHES: dict[str, Any] = {
    model_type: (globals()[module].enable_packed, globals()[module].disable_packed)
    for model_type, module in [*((mt, f.packed) for f in FAMILIES if f.packed is not None
                                 for mt in f.model_types), *PACKED_ONLY.items()]
}


# Families transformers has that share a collator layout or a text stack with a patched family but
# are not patched, and why (named in enable_packed's error so nobody forces the nearest patch on).
REFUSED: dict[str, str] = {
    "cosmos3_edge": "Cosmos3-Edge is a Llama text model behind a SigLIP2 tower, not Qwen3-VL's",
    "cosmos3_omni": "Cosmos3-Omni runs Qwen3-VL's code, but transformers ships no processor for it, so "
                    "its token counts and collated placeholders cannot be checked",
    "glm4v_moe": "GLM-4.5V's MoE text stack is not one the packed attention is checked against",
    **{model_type: f"{name} thinker: its positions also place audio blocks (audio interleaved "
                   "into video with use_audio_in_video, video time from position_id_per_seconds), "
                   "a layout the collator does not lay out"
       for model_type, name in (("qwen2_5_omni", "Qwen2.5-Omni"), ("qwen2_5_omni_thinker", "Qwen2.5-Omni"),
                                ("qwen3_omni_moe", "Qwen3-Omni"), ("qwen3_omni_moe_thinker", "Qwen3-Omni"))},
}


def _patch_for(model: nn.Module) -> Any:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in REFUSED and model_type not in _PATCHES:
        raise TypeError(f"enable_packed: model_type={model_type!r} ({type(model).__name__}) is not patched: "
                        f"{REFUSED[model_type]}")
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
