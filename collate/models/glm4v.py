"""Packed-batch forward for transformers GLM-4.1V (``Glm4vForConditionalGeneration``), and GLM-4.6V /
GLM-OCR, which run its code (see ``SUPPORTED_MODEL_TYPES``).

The shared scheme is :mod:`collate.models.core` (wrapper, attention info, packed text attention,
one tower call, feature scatter) with the ``grid_thw`` tower of :mod:`collate.models.grid_vision`.
What this family sets:

1. Rotary: GLM's text rotary is *partial* (only the first ``2 * inv_freq.numel()`` channels of a
   head rotate, ``partial_rotary_factor``; the rest pass through) and *pair-wise* (GPT-J style:
   channels ``(2i, 2i+1)`` rotate together, HF's ``rotate_half_llm``), with the chunked
   ``mrope_section`` (T, H, W frequency blocks) choosing which position row each frequency reads.
   :func:`glm_rope` applies it on the packed ``(T, H, D)`` q/k from the per-token positions, in
   the dtype HF uses (cos/sin in float32, then cast to q's dtype), on the device, no host read.
2. Vision tower: ``Glm4vVisionModel`` takes one grid row *per frame* (HF's ``get_video_features``
   flattens every video grid ``(t, h, w)`` into ``t`` rows ``(1, h, w)``: its position-embedding
   resampler indexes the grid rows by attention segment). The tower is called once on all images
   and frames with the collator's rotary ids and frame segments; the frame grid rows are built on
   the device with a host-known ``output_size`` (the number of frame segments).
3. Placeholders: a video frame's placeholders are the *image* token, so a hand-made batch (no
   collator ``vision_token_index``) may hold images or videos, not both; the collator tells them
   apart by the ``<|begin_of_video|>`` span (:func:`collate.positions.glm4v_token_types`).
4. No mask: the text model always calls ``create_causal_mask``; it gets the core's zero-sized mask.

The vision attention and the text attention go through :func:`collate.ops.varlen_attention`
(flash-attn varlen / NPU TND / SDPA per segment), never transformers' attention kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from collate.models import core, grid_vision
from collate.ops.rope.common import frequency_axes, normalize_positions

# GLM-4.6V (glm46v) is GLM-4V's model class subclassed unchanged, its towers built from its
# sub-configs: patched when the text model is GLM-4V's dense one (checked in _check). GLM-OCR
# (glm_ocr) is GLM-4V's generation class with GLM-4V's text stack under its own names
# (glm_ocr_text: q/k/v without bias, head_dim from the config) and a tower whose attention adds
# per-head q / k RMS norms before the rotary (grid_vision's packed vision attention applies them).
SUPPORTED_MODEL_TYPES = ("glm4v", "glm46v", "glm_ocr")
# The dense text stacks whose attention and rotary are GLM-4V's (what glm_rope and the core reproduce).
TEXT_MODEL_TYPES = ("glm4v_text", "glm_ocr_text")


def glm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             mrope_section: tuple[int, int, int], interleaved: bool = False,
             attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4V's rotary on packed ``q`` ``(T, H, D)`` and ``k`` ``(T, Hkv, D)``: equal to transformers'
    ``Glm4vTextRotaryEmbedding`` + ``apply_rotary_pos_emb`` per token.

    ``positions``: ``(3, 1, T)`` / ``(3, T)`` M-RoPE ids, transformers' ``(4, 1, T)`` (row 0, the
    text positions, unused) or ``(1, T)`` 1-D ids; ``inv_freq``
    ``(R/2,)``: the rotated width is ``R`` (the first ``R`` channels); frequency ``j`` reads
    position row ``a`` where ``j`` falls in section ``a`` of ``mrope_section`` (chunked);
    ``interleaved`` is accepted for the core's signature and must be False.
    """
    if interleaved:
        raise ValueError("GLM-4V's M-RoPE sections are chunked, not interleaved")
    half = inv_freq.shape[0]
    rotary = 2 * half
    # (A, T) with A = 1 or 3: also drops row 0 (text positions) of transformers' (4, 1, T) form
    pos = normalize_positions(positions, q.shape[0])
    if pos.shape[0] == 1:
        pos = pos.expand(3, -1)
    # The frequency -> position row map, cached per device: built from a python list in every layer
    # it was a blocking host-to-device copy each time.
    axis = frequency_axes(mrope_section, False, pos.device)
    freqs = pos.index_select(0, axis).t().float() * inv_freq.to(device=q.device, dtype=torch.float)
    cos = (freqs.cos() * attention_scaling).to(q.dtype)[:, None, :]  # (T, 1, R/2)
    sin = (freqs.sin() * attention_scaling).to(q.dtype)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x[..., :rotary].unflatten(-1, (half, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((out, x[..., rotary:]), dim=-1)

    return rotate(q), rotate(k)


def _frame_grids(grids: torch.Tensor, vision: dict[str, Any]) -> torch.Tensor:
    """One ``(1, h, w)`` row per frame, as HF's ``get_video_features`` feeds the tower (images
    have ``t == 1`` already). The collator's frame segment ends give the row count on the host."""
    ends = vision.get("vision_cu_seqlens_list")
    rows = torch.repeat_interleave(grids[:, 1:], grids[:, 0], dim=0,
                                   output_size=None if ends is None else len(ends))
    return torch.cat([torch.ones_like(rows[:, :1]), rows], dim=1)


def _tower_kwargs(model: nn.Module, vision: dict[str, Any], grids: Any, num_patches: int) -> dict[str, Any]:
    return grid_vision.tower_kwargs(model, vision)


def _encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
            idle_vision: bool) -> core.Encoded | None:
    both = kwargs.get("pixel_values") is not None and kwargs.get("pixel_values_videos") is not None
    if both and vision.get("vision_token_index") is None:
        raise ValueError("a GLM-4V batch with images and videos needs the collator's vision_token_index: "
                         "both use the image token, so their placeholders cannot be told apart by id")
    encoded = grid_vision.encode(model, kwargs, vision, idle_vision, _tower_kwargs,
                                 core.zero_of_output, tower_grid=_frame_grids)
    if encoded is not None and encoded.features is not None:
        encoded.placeholder_ids = (int(model.config.image_token_id),)
    return encoded


def _check(model: nn.Module, text_model: nn.Module) -> None:
    text_type = getattr(getattr(model.config, "text_config", None), "model_type", "glm4v_text")
    if text_type not in TEXT_MODEL_TYPES:
        # GLM-4.6V's text model is whatever its text_config names (the large one's is MoE):
        # only GLM-4V's dense text stack is patched and tested.
        raise TypeError(f"enable_packed: model_type={model.config.model_type!r} with a {text_type!r} "
                        f"text model is not patched (only {' / '.join(map(repr, TEXT_MODEL_TYPES))})")
    core.check_mrope_section(text_model)  # 3 sections covering the rotary frequencies
    half = int(text_model.rotary_emb.inv_freq.numel())
    for layer in text_model.layers:
        if 2 * half > layer.self_attn.head_dim:
            raise ValueError(f"rotary width {2 * half} exceeds head_dim {layer.self_attn.head_dim}")
    if not hasattr(getattr(model, "model", None), "visual"):
        raise TypeError(f"{type(model).__name__}: expected Glm4vForConditionalGeneration (.model.visual)")


# GLM's sections are chunked like Qwen2-VL's; glm_rope applies them partially and pair-wise.
FAMILY = grid_vision.family("glm4v", SUPPORTED_MODEL_TYPES, core.chunked_mrope, _encode, _check,
                            attention_mask=core.empty_mask, apply_rope=glm_rope)


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on a zero-weighted dummy image when a packed batch has no
    image or video, so every FSDP rank issues the same collectives.
    """
    return core.enable(model, FAMILY, idle_vision)


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    return core.disable(model)
