"""Packed calls of the ``grid_thw`` vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; GLM-4V's is the
same shape): patches of all images and videos in one ``(N, C*T*P*P)`` tensor, one grid row each.

1. Each vision block's ``attn.forward`` is replaced: with the opaque ``tokenbal_vision`` kwarg
   (:class:`VisionAttentionInfo`) it runs :func:`collate.ops.varlen_attention` (non-causal) over
   the segments whose device ``cu_seqlens`` it was handed, using their host ends; transformers'
   own non-flash path splits by ``cu_seqlens.tolist()`` in every block. Per-head ``q_norm`` /
   ``k_norm`` (GLM-OCR) are applied before the rotary, as transformers does. A tower that hands its
   blocks no kwargs (GLM-OCR, every release that has it) never passes the info on: its blocks run
   transformers' own attention (exact, one host read per block).
2. :func:`encode` runs the tower once per packed forward, on all images and videos together (each
   grid entry is attended to on its own, so this is the same math), with the collator's
   precomputed ``vision_*`` fields (:mod:`collate.vision`: rotary ids, frame segments, Qwen2.5-VL's
   windows) under the kwarg names transformers' ``vision_utils`` pops, so nothing is derived from
   ``grid_thw`` on the host. A batch with no image or video runs one zero-valued ``merge x merge``
   dummy image instead (the idle pass; see :func:`collate.models.core.embed_with_vision`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from collate.models import core

VISION_KWARG = "tokenbal_vision"


@dataclasses.dataclass(frozen=True)
class VisionSegments:
    """One attention layout of the vision tower (frames, or Qwen2.5-VL's windows); read by
    :func:`varlen_attention` like a batch."""

    cu_seqlens: torch.Tensor  # (n+1,) int32, on the tower's device
    cu_seqlens_list: list[int]  # host ends, no leading 0
    max_seqlen: int


@dataclasses.dataclass(frozen=True)
class VisionAttentionInfo:
    """The layouts of one tower call. A block's attention gets a ``cu_seqlens`` tensor from the
    tower and finds its host twin here by identity: transformers hands the very tensors it was
    given to the blocks."""

    layouts: tuple[VisionSegments, ...]

    def find(self, cu_seqlens: Any) -> VisionSegments | None:
        return next((seg for seg in self.layouts if seg.cu_seqlens is cu_seqlens), None)


def vision_attentions(model: nn.Module) -> list[nn.Module]:
    visual = getattr(getattr(model, "model", None), "visual", None)
    return [] if visual is None else [block.attn for block in visual.blocks]


def check_vision_attentions(model: nn.Module) -> None:
    """Raise ``TypeError`` unless every vision block's attention has what the packed one uses."""
    for attn in vision_attentions(model):
        for name in ("qkv", "proj", "num_heads", "scaling"):
            if not hasattr(attn, name):
                raise TypeError(f"{type(attn).__name__} has no {name!r}; transformers version not supported")
        if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
            raise TypeError(f"{type(attn).__name__} normalises only one of q / k; not supported")
        if not hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb_vision"):
            raise TypeError(f"{type(attn).__module__} has no apply_rotary_pos_emb_vision; transformers "
                            "version not supported")


def packed_vision_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    info: VisionAttentionInfo | None = kwargs.pop(VISION_KWARG, None)
    segments = None if info is None else info.find(cu_seqlens)
    if segments is None or position_embeddings is None:
        return core.call_original(self, hidden_states, cu_seqlens=cu_seqlens,
                                  position_embeddings=position_embeddings, max_seqlen=max_seqlen, **kwargs)
    # transformers splits q/k/v by ``cu_seqlens.tolist()`` for every non-flash backend; here the
    # host ends come with the batch and the backend is varlen_attention's (flash-attn, NPU, SDPA).
    num_tokens = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(num_tokens, 3, self.num_heads, -1).unbind(1)
    if getattr(self, "q_norm", None) is not None:
        # GLM-OCR: per-head RMS norms of q and k before the rotary, as its own forward does
        q, k = self.q_norm(q), self.k_norm(k)
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision
    q, k = rotate(q, k, *position_embeddings)
    dropout = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
    out = core.varlen_attention(q, k, v, segments, causal=False, scale=self.scaling, dropout_p=dropout)
    return self.proj(out.reshape(num_tokens, -1))


def install_vision_attentions(model: nn.Module) -> None:
    for attn in vision_attentions(model):
        core.install(attn, packed_vision_attention_forward)


def uninstall_vision_attentions(model: nn.Module) -> None:
    for attn in vision_attentions(model):
        core.uninstall(attn)


def family(name: str, model_types: tuple[str, ...], rope: Callable[[nn.Module, nn.Module], core.RopeLayout],
           encode: core.EncodeFn, check: Callable[[nn.Module, nn.Module], None], *,
           install: Callable[[nn.Module], None] | None = None,
           uninstall: Callable[[nn.Module], None] | None = None, **options: Any) -> core.Family:
    """The :class:`core.Family` of a grid-tower model: after the family's own ``check`` the vision
    blocks' attentions are checked (:func:`check_vision_attentions`), and they are patched before
    the family's own ``install`` and restored before its ``uninstall``. ``options``: the other
    :class:`core.Family` fields."""

    def check_all(model: nn.Module, text_model: nn.Module) -> None:
        check(model, text_model)
        check_vision_attentions(model)

    def install_all(model: nn.Module) -> None:
        install_vision_attentions(model)
        if install is not None:
            install(model)

    def uninstall_all(model: nn.Module) -> None:
        uninstall_vision_attentions(model)
        if uninstall is not None:
            uninstall(model)

    return core.Family(name=name, model_types=model_types, rope=rope, encode=encode, check=check_all,
                       install=install_all, uninstall=uninstall_all, **options)


def tower_kwargs(model: nn.Module, vision: dict[str, Any], windowed: bool = False) -> dict[str, Any]:
    """The batch's precomputed tower inputs under the names transformers pops, plus the host
    segment lists for the patched attention (``windowed``: Qwen2.5-VL's window layout too).
    Whatever the batch lacks (a hand-made batch), transformers derives from the grids itself,
    with host reads."""
    from tokenbal import hf_compat

    takes = hf_compat.tower_inputs(model.model.visual)
    kwargs: dict[str, Any] = {}
    layouts: list[VisionSegments] = []
    if "cu_seqlens" not in takes:
        # transformers before 5.9: the tower derives its segments and rotary ids from grid_thw
        # (host reads) and hands the blocks its own cu_seqlens, so a kwarg of that name would reach
        # them twice. The blocks then run transformers' own vision attention: exact, not sync-free.
        return kwargs

    def segments(layout: str, cu_name: str, max_name: str) -> None:
        cu, ends = vision.get(f"vision_cu_{layout}seqlens"), vision.get(f"vision_cu_{layout}seqlens_list")
        longest = vision.get(f"vision_max_{layout}seqlen")
        if cu is None:
            return
        kwargs[cu_name] = cu
        if longest:  # 0 is PackedBatch's "absent"
            if max_name in takes:  # 5.19+ pops it (5.9 would hand it on to every block)
                kwargs[max_name] = int(longest)
            if ends is not None:
                layouts.append(VisionSegments(cu, [int(e) for e in ends], int(longest)))

    if vision.get("vision_position_ids") is not None and "position_ids" in takes:
        kwargs["position_ids"] = vision["vision_position_ids"]
    segments("", "cu_seqlens", "max_seqlen")
    if windowed and vision.get("vision_window_index") is not None and "window_index" in takes:
        kwargs["window_index"] = vision["vision_window_index"]
        segments("window_", "cu_window_seqlens", "max_window_seqlen")
    if layouts:
        kwargs[VISION_KWARG] = VisionAttentionInfo(tuple(layouts))
    return kwargs


def idle_tower_inputs(model: nn.Module, device: torch.device, window: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A zero-valued ``merge x merge`` dummy image for ranks without vision, with its precomputed
    tower inputs; built once per device (copied there once), then reused by every idle step."""
    from collate.vision import tower_fields

    cache = core.idle_cache(model)
    if device not in cache:
        visual = model.model.visual
        merge = visual.spatial_merge_size
        patch = visual.patch_embed
        patch_dim = patch.in_channels * patch.temporal_patch_size * patch.patch_size**2
        grid = [[1, merge, merge]]
        fields = tower_fields(grid, merge, window)
        fields = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        cache[device] = (torch.zeros(merge * merge, patch_dim, device=device),
                         torch.tensor(grid, device=device), fields)
    return cache[device]


# tower_kwargs(model, vision, grids, num_patches) -> the tower call's extra kwargs
TowerKwargs = Callable[[nn.Module, dict[str, Any], torch.Tensor, int], dict[str, Any]]


def encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any], idle_vision: bool,
           extra_kwargs: TowerKwargs, idle_zero: Callable[[Any], torch.Tensor],
           window: int | None = None,
           tower_grid: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor] | None = None
           ) -> core.Encoded | None:
    """One tower call on all images and videos (images first, the order of the collator's
    ``vision_token_index``), or on the idle dummy; pops the pixel fields from ``kwargs``.
    ``extra_kwargs`` builds the tower's extra inputs; ``idle_zero(out)`` is the idle pass's zero
    (it must depend on every tower output); ``window``: the idle dummy's Qwen2.5-VL window;
    ``tower_grid(grids, vision)``: the grid rows the tower is called with (GLM-4V: one per frame)."""
    from tokenbal import hf_compat

    visual = model.model.visual
    config = model.config
    pixel_values, image_grid = kwargs.pop("pixel_values", None), kwargs.pop("image_grid_thw", None)
    pixel_values_videos = kwargs.pop("pixel_values_videos", None)
    video_grid = kwargs.pop("video_grid_thw", None)
    parts = [(pix, grid, token) for pix, grid, token in (
        (pixel_values, image_grid, config.image_token_id),
        (pixel_values_videos, video_grid, config.video_token_id)) if pix is not None]
    if not parts:
        if not idle_vision:
            return None
        device = kwargs["inputs_embeds"].device
        pixels, grid, fields = idle_tower_inputs(model, device, window)
        out = hf_compat.tower_output(visual(pixels.type(visual.dtype), grid_thw=grid,
                                            **extra_kwargs(model, fields, grid, pixels.shape[0])))
        return core.Encoded(None, idle_zero=idle_zero(out), raw=out)
    for _, grid, _ in parts:
        if grid is None:
            raise ValueError("pixel_values / pixel_values_videos given without their grid_thw")
    pixels = torch.cat([pix for pix, _, _ in parts]).type(visual.dtype)
    grids = torch.cat([grid for _, grid, _ in parts])
    tower_grids = grids if tower_grid is None else tower_grid(grids, vision)
    out = hf_compat.tower_output(visual(pixels, grid_thw=tower_grids,
                                        **extra_kwargs(model, vision, grids, pixels.shape[0])))
    return core.Encoded(out.pooler_output, placeholder_ids=tuple(token for _, _, token in parts), raw=out)
