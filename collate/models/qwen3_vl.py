"""Packed-batch forward for transformers Qwen3-VL (``Qwen3VLForConditionalGeneration``).

The shared scheme is :mod:`collate.models.core` (wrapper, attention info, packed text attention,
one tower call, feature scatter) with the ``grid_thw`` tower of :mod:`collate.models.grid_vision`.
What differs from Qwen2-VL:

1. Text attention: Qwen3 normalises every query and key head (``q_norm`` / ``k_norm``, RMSNorm over
   the head dim) before the rotary, and its M-RoPE frequencies are interleaved (``THWTHW...T``), so
   the patched layer calls :func:`collate.ops.apply_mrope` with ``interleaved=True``. The section
   and ``attention_scaling`` are read from the text rotary module, as HF's own forward uses them.
2. DeepStack: the vision tower also returns one merged feature map per
   ``vision_config.deepstack_visual_indexes`` entry, and HF adds map ``i`` to the hidden states of
   the visual tokens after text layer ``i``. HF finds those tokens with a ``(B, T)`` boolean mask
   (``hidden[mask] += ...``, a host sync in every such layer, plus one per modality to size the
   joint image+video map). The packed path runs the tower once on all images and videos, keeps
   the maps in tower order (images, then videos: the order of the collator's
   ``vision_token_index``), and hands the text model an opaque :class:`DeepstackSlots` instead of
   the mask; the text model's ``_deepstack_process`` is patched (per instance) to add each map with
   one ``index_add`` at those slots. HF's own loop decides which layers get a map, so the layer
   count and order are HF's.
3. No mask: Qwen3's text model always calls ``create_causal_mask`` (there is no prepared-mapping
   shortcut as in Qwen2-VL), so the packed call hands it the core's zero-sized 4-D mask
   (:func:`collate.models.core.empty_mask`).

The vision tower's attention is per frame, like Qwen2-VL's (``get_vision_attention_seqlens`` with
``merge_temporal=False``), so the collator's ``vision_cu_seqlens`` / ``vision_position_ids`` are
the ones the tower would build. Qwen3's tower also resamples a learned position table to every
grid (``get_vision_interpolation_indices_and_weights``), where ``repeat_interleave`` by tensor
counts and ``arange(counts.sum())`` read sizes back (host syncs on an accelerator). Those taps
depend only on each patch's (row, column), which the collator's ``vision_position_ids`` already
carry, and on its grid's ``(h, w)``; :func:`interpolation_kwargs` computes them on the device with
transformers' own per-axis function and the patch count known on the host (``output_size``), so
nothing is synced and nothing more is shipped (a per-patch host table would be ~48 bytes a patch).
With the collator's fields a packed forward and backward read nothing back from the device, idle
dummy image included; a hand-made batch without them still works (transformers then derives
everything from the grids, with host reads).

``disable_packed(model)`` restores everything.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn

from collate.models import core, grid_vision

# Qwen3-VL-MoE: the same attention, rotary, tower and DeepStack; only the MLPs are experts.
SUPPORTED_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")

# The deepstack maps and their slots travel from the model wrapper to the text model under this
# kwarg (popped there; nothing in transformers reads it).
DEEPSTACK_KWARG = "tokenbal_deepstack"

_PREV_DEEPSTACK = "_tokenbal_prev_deepstack_process"


@dataclasses.dataclass(frozen=True)
class DeepstackSlots:
    """Where the visual tokens are in the packed row (``(N,)`` int64 on the device, tower order)
    and the tower's deepstack maps (each ``(N, hidden)``, same order). Passed to the text model as
    its ``visual_pos_masks`` argument, which the patched ``_deepstack_process`` recognises."""

    slots: torch.Tensor
    features: tuple[torch.Tensor, ...]


def _check(model: nn.Module, text_model: nn.Module) -> None:
    from tokenbal import hf_compat

    core.check_mrope_section(text_model)
    if not hasattr(text_model, "_deepstack_process"):
        raise TypeError(
            f"{type(text_model).__name__} has no _deepstack_process; transformers version not supported"
        )
    visual = model.model.visual
    needed = ["deepstack_visual_indexes", "spatial_merge_size", "patch_embed", "num_grid_per_side"]
    if "interp_indices" in hf_compat.tower_inputs(visual):
        # Only a tower that takes precomputed taps (5.19+) gets them, from its own mode.
        needed += ["interpolation_mode", "interpolation_align_corners"]
    for name in needed:
        if not hasattr(visual, name):
            raise TypeError(f"{type(visual).__name__} has no {name!r}; transformers version not supported")


def _packed_text_model_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The text model's forward; a packed call's deepstack maps replace HF's mask and maps."""
    deepstack: DeepstackSlots | None = kwargs.pop(DEEPSTACK_KWARG, None)
    if deepstack is not None:
        kwargs["visual_pos_masks"] = deepstack
        kwargs["deepstack_visual_embeds"] = list(deepstack.features)
    return core.call_original(self, *args, **kwargs)


def _packed_deepstack_process(
    self: nn.Module, hidden_states: torch.Tensor, visual_pos_masks: Any, visual_embeds: torch.Tensor
) -> torch.Tensor:
    """Add one deepstack map at the packed slots (one ``index_add``, no mask, no host read);
    HF's boolean-mask version for every other call."""
    if not isinstance(visual_pos_masks, DeepstackSlots):
        return type(self)._deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds)
    # Slots are distinct, so this is HF's ``hidden[mask] = hidden[mask] + embeds`` (out of place).
    added = hidden_states[0].index_add(0, visual_pos_masks.slots, visual_embeds.to(hidden_states.dtype))
    return added[None]


def interpolation_kwargs(
    visual: nn.Module, grids: torch.Tensor, positions: torch.Tensor, num_patches: int
) -> dict[str, torch.Tensor]:
    """``interp_indices`` / ``interp_weights`` for the tower, equal to transformers'
    ``get_vision_interpolation_indices_and_weights(grids, ...)`` but without reading the device.

    ``positions`` are the patches' (row, column) in tower order (the collator's
    ``vision_position_ids``, on the grids' device) and ``num_patches`` their number (a host int:
    ``pixel_values.shape[0]``), which lets ``repeat_interleave`` size its output without a sync.
    The per-axis taps and weights come from transformers' own helper, so the values are the
    tower's bit for bit; if that helper is gone (another transformers version), returns ``{}`` and
    the tower computes them itself.
    """
    from tokenbal import hf_compat

    if "interp_indices" not in hf_compat.tower_inputs(visual):
        return {}  # the tower computes its own taps (transformers before 5.19)
    from transformers import vision_utils

    axis = getattr(vision_utils, "_interpolation_axis_taps_weights", None)
    if axis is None:
        return {}
    counts = grids[:, 0] * grids[:, 1] * grids[:, 2]
    heights = torch.repeat_interleave(grids[:, 1], counts, output_size=num_patches)
    widths = torch.repeat_interleave(grids[:, 2], counts, output_size=num_patches)
    side, mode = visual.num_grid_per_side, visual.interpolation_mode
    corners = visual.interpolation_align_corners
    h_taps, h_weights = axis(positions[:, 0], heights, side, mode, corners)
    w_taps, w_weights = axis(positions[:, 1], widths, side, mode, corners)
    taps = h_taps.shape[1] * w_taps.shape[1]
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, taps)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, taps)
    return {"interp_indices": indices, "interp_weights": weights}


def _tower_kwargs(
    model: nn.Module, vision: dict[str, Any], grids: torch.Tensor, num_patches: int
) -> dict[str, Any]:
    """The grid tower's kwargs (the collator's rotary ids and frame segments) plus the position
    embedding's taps, computed on the device from those rotary ids."""
    kwargs = grid_vision.tower_kwargs(model, vision)
    positions = vision.get("vision_position_ids")
    if positions is not None:
        kwargs.update(interpolation_kwargs(model.model.visual, grids, positions, num_patches))
    return kwargs


def _zero_weighted(out: Any) -> torch.Tensor:
    """A zero that depends on every output of the tower (merger and deepstack mergers), so every
    vision parameter is in the graph on every rank."""
    total = out.pooler_output.sum()
    for feature in out.deepstack_features or ():
        total = total + feature.sum()
    return 0.0 * total


def _encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
            idle_vision: bool) -> core.Encoded | None:
    return grid_vision.encode(model, kwargs, vision, idle_vision, _tower_kwargs, _zero_weighted)


def _after_embed(model: nn.Module, kwargs: dict[str, Any], encoded: core.Encoded | None) -> None:
    """Hand the text model the deepstack maps with their slots (none when the batch has no
    vision tokens)."""
    if encoded is None or encoded.features is None:
        return
    dtype = kwargs["inputs_embeds"].dtype
    deepstack = tuple(feature.to(dtype) for feature in encoded.raw.deepstack_features or ())
    if deepstack:
        kwargs[DEEPSTACK_KWARG] = DeepstackSlots(encoded.slots, deepstack)


def _install(model: nn.Module) -> None:
    """The text model's deepstack patches (the tower's attentions: grid_vision.family)."""
    text_model = model.model.language_model
    core.install(text_model, _packed_text_model_forward)
    text_model.__dict__[_PREV_DEEPSTACK] = text_model.__dict__.get("_deepstack_process")
    text_model._deepstack_process = types.MethodType(_packed_deepstack_process, text_model)


def _uninstall(model: nn.Module) -> None:
    text_model = model.model.language_model
    core.uninstall(text_model)
    text_model.__dict__.pop("_deepstack_process", None)
    prev = text_model.__dict__.pop(_PREV_DEEPSTACK, None)
    if prev is not None:
        text_model._deepstack_process = prev


FAMILY = grid_vision.family("qwen3_vl", SUPPORTED_MODEL_TYPES, core.interleaved_mrope, _encode, _check,
                            attention_mask=core.empty_mask, qk_norm=True, install=_install,
                            uninstall=_uninstall, after_embed=_after_embed)


def _require_visual(model: nn.Module) -> None:
    if not hasattr(getattr(model, "model", None), "visual"):
        raise TypeError(
            f"{type(model).__name__}: expected Qwen3VLForConditionalGeneration (.model.visual and "
            ".model.language_model)"
        )


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on a zero-weighted dummy image when a packed batch has no
    image or video, so every FSDP rank issues the same collectives.
    """
    if getattr(model, core.ENABLED, False):
        return model
    _require_visual(model)
    return core.enable(model, FAMILY, idle_vision)


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    return core.disable(model)
