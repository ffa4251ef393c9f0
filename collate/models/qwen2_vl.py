"""Packed-batch forward for transformers 5.2x Qwen2-VL and Qwen2.5-VL.

``enable_packed(model)`` patches one model instance (nothing global, nothing on the class):

1. ``model.forward`` is wrapped. A call carrying packing fields (``cu_seqlens`` / ``cu_seqlens_list``)
   has them popped into one :class:`PackedAttentionInfo` that travels to every text attention layer as
   the single extra kwarg ``tokenbal_packed``. transformers forwards ``**kwargs`` to the vision tower
   as well, where a plain ``cu_seqlens`` / ``max_seqlen`` / ``position_ids`` kwarg would be *popped and
   used* for the image attention (``vision_utils.get_vision_cu_seqlens``); one opaque object under a
   name nothing in transformers reads cannot leak like that. Then the original forward runs with
   ``position_ids`` = the packed 3-row M-RoPE ids (so HF never calls ``get_rope_index``) and
   ``attention_mask`` = a prepared mask mapping of ``None`` (so no T x T mask is ever built).
2. Each text ``self_attn.forward`` is replaced. With ``tokenbal_packed`` present it projects q/k/v
   as ``(T, H, D)``, applies :func:`collate.ops.apply_mrope` from the per-token positions (HF's
   cos/sin are not used) and :func:`collate.ops.varlen_attention` over the batch's segments; without
   it, it runs the original HF forward, so unpacked calls and ``generate`` behave exactly as before.
3. Each vision block's ``attn.forward`` is replaced the same way: with the opaque
   ``tokenbal_vision`` kwarg (:class:`VisionAttentionInfo`) it runs :func:`varlen_attention`
   (non-causal) over the segments whose device ``cu_seqlens`` it was handed, using their host ends;
   transformers' own non-flash path splits by ``cu_seqlens.tolist()`` in every block.

The vision tower runs once per packed forward, on all images and videos of the batch together
(transformers calls it once per modality, and only when present). Under FSDP2 every rank must
issue the vision blocks' all-gathers and reduce-scatters the same number of times, so a batch with
no image or video runs one zero-valued dummy image whose output enters the embeddings times zero
(``enable_packed(model, idle_vision=False)`` turns that off for single-device training). The tower
gets the collator's precomputed ``vision_*`` fields (:mod:`collate.vision`: rotary ids, frame
segments, Qwen2.5-VL's windows) under the kwarg names transformers' ``vision_utils`` pops, and the
features go to the collator's ``vision_token_index`` slots, so nothing is derived from
``grid_thw`` on the host. ``disable_packed(model)`` restores everything. Nothing in the packed path
reads a device tensor back to the host: boundaries come from host lists, maxima are python ints
(a hand-made batch without the ``vision_*`` fields still works; transformers then computes them
from the grids, with host reads).

The one waste left: HF's text model still builds its ``(1, T, D)`` cos/sin table once per forward
from ``position_ids`` (not per layer); the patched attention ignores it.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from collate.ops import apply_mrope, varlen_attention
from collate.ops.attention import segment_ends

PACKED_KWARG = "tokenbal_packed"

# The collator's precomputed vision-tower inputs (collate.vision): handed to the tower under the
# names transformers' ``vision_utils`` pops, so it reads nothing from ``grid_thw`` on the host.
VISION_KEYS = (
    "vision_cu_seqlens",
    "vision_cu_seqlens_list",
    "vision_max_seqlen",
    "vision_position_ids",
    "vision_token_index",
    "vision_window_index",
    "vision_cu_window_seqlens",
    "vision_cu_window_seqlens_list",
    "vision_max_window_seqlen",
)

# Batch keys the wrapper takes out of a packed call (never passed into transformers). ``position_ids``
# is also taken, and handed back to HF as the packed 3-row ids. ``second_per_grid_ts`` only feeds
# HF's own position computation (Qwen2.5-VL), which the precomputed positions replace.
CONSUMED_KEYS = (
    "cu_seqlens",
    "cu_seqlens_list",
    "max_seqlen",
    "seq_lens",
    "text_position_ids",
    "num_loss_tokens",
    "second_per_grid_ts",
    *VISION_KEYS,
)

VISION_KWARG = "tokenbal_vision"

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")

_PREV_FORWARD = "_tokenbal_prev_forward"
_ENABLED = "_tokenbal_packed_enabled"
_IDLE_VISION = "_tokenbal_idle_vision"
_IDLE_INPUTS = "_tokenbal_idle_inputs"


@dataclasses.dataclass(frozen=True)
class PackedAttentionInfo:
    """Everything the patched attention layers need for one packed forward.

    It doubles as the ``batch`` argument of :func:`varlen_attention` (read by attribute name).
    """

    positions: torch.Tensor  # (3, 1, T) / (3, T) M-RoPE ids, or (1, T) 1-D ids
    cu_seqlens: torch.Tensor | None  # (n+1,) int32, on the device (flash-attn path)
    cu_seqlens_list: list[int] | None  # host segment ends, no leading 0 (CPU / NPU paths)
    max_seqlen: int | None  # host int
    inv_freq: torch.Tensor  # (R/2,) the text rotary module's buffer
    mrope_section: tuple[int, int, int]
    interleaved: bool
    attention_scaling: float


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


def _text_model(model: nn.Module) -> nn.Module:
    for attr_path in (("model", "language_model"), ("language_model",)):
        mod: Any = model
        for attr in attr_path:
            mod = getattr(mod, attr, None)
        if mod is not None and hasattr(mod, "rotary_emb") and hasattr(mod, "layers"):
            return mod
    raise TypeError(
        f"{type(model).__name__}: expected a Qwen2-VL / Qwen2.5-VL model with .model.language_model "
        "(ForConditionalGeneration) or .language_model (base model)"
    )


def _check_supported(model: nn.Module, text_model: nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(f"enable_packed supports {SUPPORTED_MODEL_TYPES}, got model_type={model_type!r}")
    rope = text_model.rotary_emb
    if getattr(rope, "rope_type", "default") in ("dynamic", "longrope"):
        # These rescale inv_freq from the sequence length seen by HF's rotary forward; the packed
        # path applies inv_freq itself, so it would silently diverge.
        raise NotImplementedError(f"rope_type={rope.rope_type!r} is not supported by the packed path")
    for layer in text_model.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) is not None:
            raise NotImplementedError(
                f"layer {attn.layer_idx} uses sliding-window attention; varlen_attention has no window yet"
            )
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
            if not hasattr(attn, name):
                raise TypeError(f"{type(attn).__name__} has no {name!r}; transformers version not supported")
    check_vision_attentions(model)


def check_vision_attentions(model: nn.Module) -> None:
    """Raise ``TypeError`` unless every vision block's attention has what the packed one uses."""
    for attn in _vision_attentions(model):
        for name in ("qkv", "proj", "num_heads", "scaling"):
            if not hasattr(attn, name):
                raise TypeError(f"{type(attn).__name__} has no {name!r}; transformers version not supported")
        if not hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb_vision"):
            raise TypeError(f"{type(attn).__module__} has no apply_rotary_pos_emb_vision; transformers "
                            "version not supported")


def _vision_attentions(model: nn.Module) -> list[nn.Module]:
    visual = getattr(getattr(model, "model", None), "visual", None)
    return [] if visual is None else [block.attn for block in visual.blocks]


def _install(module: nn.Module, fn: Any) -> None:
    # Per-instance bound method: deepcopy rebinds it to the copy, and the class stays untouched.
    setattr(module, _PREV_FORWARD, module.__dict__.get("forward"))
    module.forward = types.MethodType(fn, module)


def _uninstall(module: nn.Module) -> None:
    if "forward" in module.__dict__:
        del module.forward
    prev = module.__dict__.pop(_PREV_FORWARD, None)
    if prev is not None:
        module.forward = prev


def _call_original(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    prev = module.__dict__.get(_PREV_FORWARD)
    if prev is not None:
        return prev(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _packed_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: Any = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    info: PackedAttentionInfo | None = kwargs.pop(PACKED_KWARG, None)
    if info is None:
        return _call_original(
            self,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    if cache is not None:
        raise ValueError("packed forward does not fill a KV cache; call it with use_cache=False")
    return packed_text_attention(self, hidden_states, info)


def packed_text_attention(attn: nn.Module, hidden_states: torch.Tensor, info: PackedAttentionInfo,
                          norm_heads: bool = False) -> tuple[torch.Tensor, None]:
    """One Qwen-VL text attention layer on a packed ``(1, T, hidden)`` row: q/k/v as ``(T, H, D)``,
    (Qwen3: ``norm_heads``, its per-head ``q_norm`` / ``k_norm`` before the rotary), M-RoPE from the
    packed positions, causal :func:`varlen_attention` over the batch's segments."""
    bsz, num_tokens, _ = hidden_states.shape
    if bsz != 1:
        raise ValueError(f"packed hidden states must have batch size 1, got {bsz}")
    q = attn.q_proj(hidden_states).view(num_tokens, -1, attn.head_dim)
    k = attn.k_proj(hidden_states).view(num_tokens, -1, attn.head_dim)
    v = attn.v_proj(hidden_states).view(num_tokens, -1, attn.head_dim)
    if norm_heads:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_mrope(
        q, k, info.positions, info.inv_freq, info.mrope_section, info.interleaved, info.attention_scaling
    )
    out = varlen_attention(
        q,
        k,
        v,
        info,
        causal=True,
        scale=attn.scaling,
        dropout_p=attn.attention_dropout if attn.training else 0.0,
    )
    out = attn.o_proj(out.reshape(1, num_tokens, -1))
    return out, None  # no attention probabilities: same contract as HF's flash/sdpa paths


def _packed_vision_attention_forward(
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
        return _call_original(self, hidden_states, cu_seqlens=cu_seqlens,
                              position_embeddings=position_embeddings, max_seqlen=max_seqlen, **kwargs)
    # transformers splits q/k/v by ``cu_seqlens.tolist()`` for every non-flash backend; here the
    # host ends come with the batch and the backend is varlen_attention's (flash-attn, NPU, SDPA).
    num_tokens = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(num_tokens, 3, self.num_heads, -1).unbind(1)
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision
    q, k = rotate(q, k, *position_embeddings)
    dropout = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
    out = varlen_attention(q, k, v, segments, causal=False, scale=self.scaling, dropout_p=dropout)
    return self.proj(out.reshape(num_tokens, -1))


def _is_packed_call(kwargs: dict[str, Any]) -> bool:
    return kwargs.get("cu_seqlens") is not None or kwargs.get("cu_seqlens_list") is not None


def _take_packed_info(model: nn.Module, kwargs: dict[str, Any]) -> PackedAttentionInfo:
    """Pop the packing fields out of ``kwargs`` (in place) and validate them on the host."""
    fields = {name: kwargs.pop(name, None) for name in CONSUMED_KEYS}
    position_ids = kwargs.pop("position_ids", None)
    if fields["num_loss_tokens"] == 0 and kwargs.get("labels") is not None:
        # No loss token (an empty rank's dummy row): HF's mean over zero tokens is NaN, and NaN x 0
        # would poison every rank's gradients through the reduce-scatter. Summed over one "item",
        # the loss is 0 with zero gradients for every parameter.
        kwargs.setdefault("num_items_in_batch", 1)

    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        raise ValueError("packed batch needs input_ids (1, T) or inputs_embeds (1, T, H)")
    if tokens.shape[0] != 1:
        raise ValueError(f"packed batch must have batch size 1 (samples in one row), got {tokens.shape[0]}")
    num_tokens = tokens.shape[1]

    if kwargs.pop("attention_mask", None) is not None:
        raise ValueError("packed batch must not carry attention_mask: segments come from cu_seqlens")
    if kwargs.get("use_cache"):
        raise ValueError("packed forward does not fill a KV cache; pass use_cache=False")
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ValueError(f"packed forward cannot continue from a cache ({name}=...)")
    kwargs["use_cache"] = False

    ends: Sequence[int] | None = fields["cu_seqlens_list"]
    if ends is None and fields["seq_lens"] is not None:
        ends = segment_ends(fields["seq_lens"])
    if ends is not None:
        ends = [int(e) for e in ends]
        if not ends or ends[-1] != num_tokens:
            covered = ends[-1] if ends else 0
            raise ValueError(f"cu_seqlens_list / seq_lens cover {covered} tokens, batch has {num_tokens}")
    max_seqlen = fields["max_seqlen"]
    if isinstance(max_seqlen, torch.Tensor):
        raise ValueError("max_seqlen must be a python int (a tensor would force a host sync in every layer)")
    if max_seqlen is None and ends is not None:
        max_seqlen = max(b - a for a, b in zip([0, *ends[:-1]], ends, strict=True))
    cu_seqlens = fields["cu_seqlens"]
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int32)

    if position_ids is None:
        has_vision = kwargs.get("pixel_values") is not None or kwargs.get("pixel_values_videos") is not None
        if has_vision or fields["text_position_ids"] is None:
            raise ValueError("packed batch needs position_ids (3, 1, T): per-sample M-RoPE ids, concatenated")
        position_ids = fields["text_position_ids"]
    if position_ids.shape[-1] != num_tokens:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not cover the {num_tokens} tokens")
    kwargs["position_ids"] = position_ids

    rope = _text_model(model).rotary_emb
    return PackedAttentionInfo(
        positions=position_ids,
        cu_seqlens=cu_seqlens,
        cu_seqlens_list=ends,
        max_seqlen=None if max_seqlen is None else int(max_seqlen),
        inv_freq=rope.inv_freq,
        mrope_section=tuple(int(s) for s in rope.mrope_section),
        interleaved=False,  # Qwen2-VL / Qwen2.5-VL use the chunked layout
        attention_scaling=float(rope.attention_scaling),
    )


def _tower_kwargs(model: nn.Module, vision: dict[str, Any]) -> dict[str, Any]:
    """The batch's precomputed tower inputs under the names transformers pops, plus the host
    segment lists for the patched attention. Whatever the batch lacks (a hand-made batch),
    transformers derives from the grids itself, with host reads."""
    kwargs: dict[str, Any] = {}
    layouts: list[VisionSegments] = []

    def segments(layout: str, cu_name: str, max_name: str) -> None:
        cu, ends = vision.get(f"vision_cu_{layout}seqlens"), vision.get(f"vision_cu_{layout}seqlens_list")
        longest = vision.get(f"vision_max_{layout}seqlen")
        if cu is None:
            return
        kwargs[cu_name] = cu
        if longest:  # 0 is PackedBatch's "absent"
            kwargs[max_name] = int(longest)
            if ends is not None:
                layouts.append(VisionSegments(cu, [int(e) for e in ends], int(longest)))

    if vision.get("vision_position_ids") is not None:
        kwargs["position_ids"] = vision["vision_position_ids"]
    segments("", "cu_seqlens", "max_seqlen")
    if model.config.model_type == "qwen2_5_vl" and vision.get("vision_window_index") is not None:
        kwargs["window_index"] = vision["vision_window_index"]
        segments("window_", "cu_window_seqlens", "max_window_seqlen")
    if layouts:
        kwargs[VISION_KWARG] = VisionAttentionInfo(tuple(layouts))
    return kwargs


def _idle_tower_inputs(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A zero-valued ``merge x merge`` dummy image for ranks without vision, with its precomputed
    tower inputs; built once per device (copied there once), then reused by every idle step."""
    from collate.vision import tower_fields, window_in_merged_tokens

    cache = model.__dict__.setdefault(_IDLE_INPUTS, {})
    if device not in cache:
        visual = model.model.visual
        merge = visual.spatial_merge_size
        patch = visual.patch_embed
        patch_dim = patch.in_channels * patch.temporal_patch_size * patch.patch_size**2
        windowed = model.config.model_type == "qwen2_5_vl"
        window = window_in_merged_tokens(model.config.vision_config) if windowed else None
        grid = [[1, merge, merge]]
        fields = tower_fields(grid, merge, window)
        fields = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        cache[device] = (torch.zeros(merge * merge, patch_dim, device=device),
                         torch.tensor(grid, device=device), fields)
    return cache[device]


def embed_with_vision(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any], idle_vision: bool,
                      tower_kwargs: Callable[..., dict[str, Any]] | None = None,
                      idle_zero: Callable[[Any], torch.Tensor] | None = None
                      ) -> tuple[Any, torch.Tensor] | None:
    """Embed tokens and run the vision tower exactly once; put ``inputs_embeds`` into ``kwargs``.
    Returns the tower's output and the feature slots in the packed row, or None without vision.

    transformers calls the tower once for images and once more for videos, only when each is
    present. Under FSDP2 that makes the number of vision-block collectives depend on the rank's
    data, and ranks with different mixes pair the wrong all-gathers (a hang or a crash). Here every
    packed forward makes one call on images and videos together (each grid entry is attended to
    on its own, so this is the same math), and a batch with neither runs one zero-valued dummy
    image whose output enters the embeddings times ``idle_zero(output)`` (``idle_vision``; default
    zero times the merged features' sum). ``tower_kwargs(model, vision, grids, num_patches)`` builds
    the tower's extra inputs (default :func:`_tower_kwargs`). With the collator's precomputed
    ``vision_*`` fields nothing here or in the tower reads a device tensor back.
    """
    tower_kwargs = tower_kwargs or (lambda model, fields, grids, num_patches: _tower_kwargs(model, fields))
    idle_zero = idle_zero or (lambda out: 0.0 * out.pooler_output.sum())
    visual = model.model.visual
    config = model.config
    input_ids = kwargs.pop("input_ids", None)
    embeds = kwargs.pop("inputs_embeds", None)
    if embeds is None:
        embeds = model.model.get_input_embeddings()(input_ids)
    pixel_values, image_grid = kwargs.pop("pixel_values", None), kwargs.pop("image_grid_thw", None)
    pixel_values_videos = kwargs.pop("pixel_values_videos", None)
    video_grid = kwargs.pop("video_grid_thw", None)
    kwargs["inputs_embeds"] = embeds
    parts = [(pix, grid, token) for pix, grid, token in (
        (pixel_values, image_grid, config.image_token_id),
        (pixel_values_videos, video_grid, config.video_token_id)) if pix is not None]
    if not parts:
        if idle_vision:
            pixels, grid, fields = _idle_tower_inputs(model, embeds.device)
            out = visual(pixels.type(visual.dtype), grid_thw=grid,
                         **tower_kwargs(model, fields, grid, pixels.shape[0]))
            kwargs["inputs_embeds"] = embeds + idle_zero(out).to(embeds.dtype)
        return None
    if input_ids is None:
        raise ValueError("packed batches with images or videos need input_ids to place the vision features")
    for _, grid, _ in parts:
        if grid is None:
            raise ValueError("pixel_values / pixel_values_videos given without their grid_thw")
    pixels = torch.cat([pix for pix, _, _ in parts]).type(visual.dtype)
    grids = torch.cat([grid for _, grid, _ in parts])
    out = visual(pixels, grid_thw=grids, **tower_kwargs(model, vision, grids, pixels.shape[0]))
    features = out.pooler_output.to(embeds.dtype)
    slots = vision.get("vision_token_index")
    if slots is None:
        # A batch without the collator's slots (built by hand): find the placeholders on the
        # device (a host read), images first, then videos, as the tower's output is ordered.
        ids = input_ids[0]
        slots = torch.cat([torch.nonzero(ids == token).flatten() for _, _, token in parts])
        if slots.shape[0] != features.shape[0]:
            raise ValueError(f"{slots.shape[0]} image/video placeholder tokens in input_ids, but the grids "
                             f"give {features.shape[0]} vision features")
    kwargs["inputs_embeds"] = embeds[0].index_copy(0, slots, features)[None]
    return out, slots


def _packed_model_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not _is_packed_call(kwargs):
        return _call_original(self, *args, **kwargs)
    vision = {name: kwargs.get(name) for name in VISION_KEYS}
    info = _take_packed_info(self, kwargs)
    if hasattr(getattr(self, "model", None), "visual"):
        idle_vision = getattr(self, _IDLE_VISION, False)
        embed_with_vision(self, kwargs, vision, idle_vision)
    text_model = _text_model(self)
    # A prepared mask mapping: HF skips mask creation (no T x T mask) and hands each layer None.
    kwargs["attention_mask"] = {layer_type: None for layer_type in set(text_model.config.layer_types)}
    kwargs[PACKED_KWARG] = info
    return _call_original(self, *args, **kwargs)


def enable_packed(model: nn.Module, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on a zero-weighted dummy image when a packed batch has no
    image or video, so every FSDP rank issues the same collectives (see the module docstring).
    """
    if getattr(model, _ENABLED, False):
        return model
    text_model = _text_model(model)
    _check_supported(model, text_model)
    for layer in text_model.layers:
        _install(layer.self_attn, _packed_attention_forward)
    for attn in _vision_attentions(model):
        _install(attn, _packed_vision_attention_forward)
    _install(model, _packed_model_forward)
    setattr(model, _ENABLED, True)
    setattr(model, _IDLE_VISION, idle_vision and hasattr(getattr(model, "model", None), "visual"))
    return model


def disable_packed(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_packed` on this instance."""
    if not getattr(model, _ENABLED, False):
        return model
    for layer in _text_model(model).layers:
        _uninstall(layer.self_attn)
    for attn in _vision_attentions(model):
        _uninstall(attn)
    _uninstall(model)
    delattr(model, _ENABLED)
    delattr(model, _IDLE_VISION)
    model.__dict__.pop(_IDLE_INPUTS, None)
    return model
