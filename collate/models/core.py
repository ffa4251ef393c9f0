"""The packed-patch core every model family shares.

``enable(model, family)`` patches one model instance (nothing global, nothing on the class):

1. ``model.forward`` is wrapped (:func:`packed_model_forward`). A call carrying packing fields
   (``cu_seqlens`` / ``cu_seqlens_list``) has them popped into one :class:`PackedAttentionInfo`
   that travels to every text attention layer as the single extra kwarg ``tokenbal_packed``.
   transformers forwards ``**kwargs`` to the vision tower as well, where a plain ``cu_seqlens`` /
   ``max_seqlen`` / ``position_ids`` kwarg could be *popped and used* for the image attention; one
   opaque object under a name nothing in transformers reads cannot leak like that. The wrapper
   embeds the tokens, runs the family's vision tower exactly once (:func:`embed_with_vision`) and
   scatters the features into the embeddings (:func:`scatter_features`), then calls the original
   forward with ``inputs_embeds``, the packed ``position_ids`` (so HF never recomputes positions)
   and the family's already-prepared attention mask (so no ``T x T`` mask is ever built).
2. Each text ``self_attn.forward`` is replaced (:func:`packed_attention_forward`). With
   ``tokenbal_packed`` present it runs :func:`packed_text_attention`: q/k/v as ``(T, H, D)``,
   :func:`collate.ops.apply_mrope` from the per-token positions (3-row M-RoPE, or 1 row for plain
   RoPE language models; HF's cos/sin are not used) and causal :func:`collate.ops.varlen_attention`
   over the batch's segments. Without it, it runs the original HF forward, so unpacked calls and
   ``generate`` behave exactly as before.

A :class:`Family` says only what differs between model families: which ``model_type`` values it
serves, its rotary layout, its vision tower call (and the idle dummy), its mask, and any extra
per-instance patches. ``disable(model)`` restores everything. Nothing in the packed path reads a
device tensor back to the host: boundaries come from host lists, maxima are python ints.

Sequence parallelism (``enable_packed(model, sp_group=group)``, batches cut by
:func:`collate.sp.shard_batch`): each rank holds a contiguous slice of the row. Two hooks, both
here: :func:`packed_text_attention` runs :func:`collate.ops.ulysses.ulysses_attention` (the
whole row's segments, this rank's head group) instead of :func:`varlen_attention`, and
:func:`embed_with_vision` sends the merged features of this rank's own images (and any
per-feature maps of the tower's output: Qwen3-VL's DeepStack) to the ranks whose slices hold
their placeholders (:func:`sp_exchange`) before the scatter.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from collate.fields import CONSUMED_BY_WRAPPER, SP_ROUTING, VISION_PLAN
from collate.ops import apply_mrope, varlen_attention
from collate.ops.attention.segments import check_segment_ends, segment_ends
from collate.ops.ulysses import all_to_all_rows, ulysses_attention, ulysses_kv_heads

PACKED_KWARG = "tokenbal_packed"

# Field names live in collate.fields; these are the names this module has always exported.
VISION_KEYS = VISION_PLAN
SP_KEYS = (*SP_ROUTING, "sp_padding")
CONSUMED_KEYS = CONSUMED_BY_WRAPPER

PREV_FORWARD = "_tokenbal_prev_forward"
ENABLED = "_tokenbal_packed_enabled"
IDLE_VISION = "_tokenbal_idle_vision"
IDLE_INPUTS = "_tokenbal_idle_inputs"
FAMILY = "_tokenbal_family"
SP_GROUP = "_tokenbal_sp_group"
HEAD_NORMS = "_tokenbal_head_norms"


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
    qk_norm: bool = False  # per-head q_norm / k_norm before the rotary (Qwen3, Qwen3-VL)
    sp_group: Any = None  # Ulysses over this process group (cu_seqlens* then cover the whole row)
    apply_rope: Any = None  # the family's own rotary (GLM-4V's partial pair-wise one); None: apply_mrope


@dataclasses.dataclass(frozen=True)
class RopeLayout:
    """How a family's text rotary is laid out, read from its rotary module."""

    inv_freq: torch.Tensor
    mrope_section: tuple[int, int, int]
    interleaved: bool
    attention_scaling: float


@dataclasses.dataclass
class Encoded:
    """What a family's tower call returns to the core.

    ``features``: ``(N, hidden)`` merged features in placeholder order (None for the idle pass);
    ``placeholder_ids``: the token ids that mark them (used only for a hand-made batch without the
    collator's ``vision_token_index``), in the order the features come; ``idle_zero``: a zero that
    depends on every tower output (the idle pass); ``raw``: the tower's own output, for family hooks.
    """

    features: torch.Tensor | None
    placeholder_ids: tuple[int, ...] = ()
    idle_zero: torch.Tensor | None = None
    raw: Any = None
    slots: torch.Tensor | None = None


# encode(model, kwargs, vision, idle_vision) -> Encoded | None; pops its pixel fields from kwargs.
EncodeFn = Callable[[nn.Module, dict[str, Any], dict[str, Any], bool], "Encoded | None"]


# The language models behind the 1-D RoPE families (LLaVA-NeXT, LLaVA-OneVision, InternVL: any
# transformers causal LM as ``text_config``) whose attention :func:`packed_text_attention`
# reproduces: q/k/v/o projections, Llama's rotate-half rotary over the rotary width, optional per-head
# q/k norms (Qwen3). Each is checked against transformers per sample
# (tests/collate/models/test_internvl.py::test_text_model_types). Others would differ without an
# error (Cohere's pair-wise rotary, GLM's partial pair-wise one, OLMo's clip_qkv, Gemma-2's logit
# soft-capping, GPT-OSS's sinks), so :func:`check_one_d_text_model` refuses them.
ONE_D_TEXT_MODELS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def check_one_d_text_model(model: nn.Module, text_model: nn.Module) -> None:
    """``NotImplementedError`` unless the language model is one of :data:`ONE_D_TEXT_MODELS`."""
    text_type = getattr(getattr(text_model, "config", None), "model_type", None)
    if text_type not in ONE_D_TEXT_MODELS:
        raise NotImplementedError(
            f"{model.config.model_type} with a {text_type!r} language model: its attention is not one the "
            f"packed path reproduces (checked: {', '.join(ONE_D_TEXT_MODELS)})")


def one_d_rope(model: nn.Module, text_model: nn.Module) -> RopeLayout:
    """Plain RoPE language models (Llama, Qwen2, ...): every frequency reads the one position row."""
    rope = text_model.rotary_emb
    half = int(rope.inv_freq.numel())
    return RopeLayout(rope.inv_freq, (half, 0, 0), False, float(rope.attention_scaling))


def _mrope(text_model: nn.Module, interleaved: bool) -> RopeLayout:
    from tokenbal import hf_compat

    rope = text_model.rotary_emb
    return RopeLayout(rope.inv_freq, hf_compat.mrope_section(text_model), interleaved,
                      float(rope.attention_scaling))


def chunked_mrope(model: nn.Module, text_model: nn.Module) -> RopeLayout:
    """M-RoPE in the chunked ``TTT..HHH..WWW`` layout (Qwen2-VL, Qwen2.5-VL, GLM-4V), the section
    and scaling read from the text rotary module."""
    return _mrope(text_model, interleaved=False)


def interleaved_mrope(model: nn.Module, text_model: nn.Module) -> RopeLayout:
    """M-RoPE in the interleaved ``THWTHW...`` layout (Qwen3-VL)."""
    return _mrope(text_model, interleaved=True)


def check_mrope_section(text_model: nn.Module) -> tuple[int, ...]:
    """The M-RoPE sections the text model's own forward uses (wherever the installed transformers
    keeps them: :func:`tokenbal.hf_compat.mrope_section`); ``TypeError`` when it has none,
    ``ValueError`` when they are not 3 sections covering the rotary's frequencies (transformers'
    interleaved layout runs such a config, :func:`collate.ops.apply_mrope` refuses it: said here,
    not at the first packed forward)."""
    from tokenbal import hf_compat

    section = hf_compat.mrope_section(text_model)
    if section is None:
        raise TypeError(f"{type(text_model).__name__}: no mrope_section on its rotary module or in "
                        "config.rope_parameters / config.rope_scaling")
    half = int(text_model.rotary_emb.inv_freq.numel())
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope_section {list(section)} must be 3 sections summing to the {half} rotary "
                         "frequencies")
    return section


def zero_of_output(out: Any) -> torch.Tensor:
    """A zero that depends on a vision tower's merged output (the idle pass)."""
    return 0.0 * out.pooler_output.sum()


def prepared_mask_mapping(model: nn.Module, text_model: nn.Module, embeds: torch.Tensor) -> Any:
    """A prepared mask mapping: models that accept one (Qwen2-VL) skip mask creation and hand each
    layer None."""
    return {layer_type: None for layer_type in set(text_model.config.layer_types)}


def empty_mask(model: nn.Module, text_model: nn.Module, embeds: torch.Tensor) -> torch.Tensor:
    """A zero-sized 4-D mask is "already prepared" for transformers' ``create_causal_mask``: it is
    returned as is, so no ``(T, T)`` mask is built. The patched attention layers never read it."""
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=embeds.device)


@dataclasses.dataclass(frozen=True)
class Family:
    """What one model family changes in the shared packed path."""

    name: str
    model_types: tuple[str, ...]
    rope: Callable[[nn.Module, nn.Module], RopeLayout]  # (model, text_model) -> layout
    encode: EncodeFn | None = None  # the vision tower call; None for text-only models
    attention_mask: Callable[[nn.Module, nn.Module, torch.Tensor], Any] = empty_mask
    qk_norm: bool = False
    # Extra checks / patches: check(model, text_model) raises TypeError when unsupported;
    # install(model) / uninstall(model) add and remove the family's own per-instance patches.
    check: Callable[[nn.Module, nn.Module], None] | None = None
    install: Callable[[nn.Module], None] | None = None
    uninstall: Callable[[nn.Module], None] | None = None
    # after_embed(model, kwargs, encoded): add family kwargs (Qwen3-VL's DeepStack maps).
    after_embed: Callable[[nn.Module, dict[str, Any], Encoded | None], None] | None = None
    # Host fields of the family's batches (beyond VISION_KEYS) that the core pops into the
    # ``vision`` mapping handed to ``encode`` (LLaVA's image sizes and crop counts).
    batch_keys: tuple[str, ...] = ()
    # A rotary other than :func:`collate.ops.apply_mrope`, with its signature (GLM-4V: partial,
    # pair-wise rotation).
    apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # Where the language model sits, tried in order.
    text_model_path: tuple[tuple[str, ...], ...] = (("model", "language_model"), ("language_model",))


def text_model_of(model: nn.Module, family: Family | None = None) -> nn.Module:
    """The language model (``.model.language_model`` of a ForConditionalGeneration)."""
    paths = family.text_model_path if family is not None else Family.text_model_path
    for attr_path in paths:
        mod: Any = model
        for attr in attr_path:
            mod = getattr(mod, attr, None)
        if mod is not None and hasattr(mod, "rotary_emb") and hasattr(mod, "layers"):
            return mod
    name = family.name if family is not None else "packed"
    raise TypeError(
        f"{type(model).__name__}: expected a {name} model with .model.language_model "
        "(ForConditionalGeneration) or .language_model (base model)"
    )


def check_text_model(model: nn.Module, text_model: nn.Module, family: Family) -> None:
    """Raise unless this model is one the family serves and its text layers have what the packed
    attention uses."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in family.model_types:
        raise TypeError(
            f"{family.name}.enable_packed supports {family.model_types}, got model_type={model_type!r}"
        )
    rope = text_model.rotary_emb
    if getattr(rope, "rope_type", "default") in ("dynamic", "longrope"):
        # These rescale inv_freq from the sequence length seen by HF's rotary forward; the packed
        # path applies inv_freq itself, so it would silently diverge.
        raise NotImplementedError(f"rope_type={rope.rope_type!r} is not supported by the packed path")
    for name in ("inv_freq", "attention_scaling"):
        if not hasattr(rope, name):
            raise TypeError(f"{type(rope).__name__} has no {name!r}; transformers version not supported")
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    needed += ("q_norm", "k_norm") if family.qk_norm else ()
    for layer in text_model.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) is not None:
            raise NotImplementedError(
                f"layer {attn.layer_idx} uses sliding-window attention; varlen_attention has no window yet"
            )
        for name in needed:
            if not hasattr(attn, name):
                raise TypeError(f"{type(attn).__name__} has no {name!r}; transformers version not supported")


def head_norms(text_model: nn.Module) -> bool:
    """Whether the text attention normalises every q and k head over ``head_dim`` before the rotary
    (Qwen3 and Qwen3-VL: ``q_norm`` / ``k_norm``), which :func:`packed_text_attention` then does
    too. A language model is the family's choice of checkpoint (InternVL3 ships Qwen2, InternVL3.5
    Qwen3), so this is read from the layers, not from the family. Norms of another shape (over the
    whole projection, e.g. OLMo2's) or on only some layers raise ``NotImplementedError``: skipped,
    they would give a silently different model."""
    found = set()
    for layer in text_model.layers:
        attn = layer.self_attn
        norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        found.add(all(n is not None for n in norms))
        for name, norm in zip(("q_norm", "k_norm"), norms, strict=True):
            weight = getattr(norm, "weight", None)
            if norm is not None and (weight is None or tuple(weight.shape) != (attn.head_dim,)):
                shape = None if weight is None else tuple(weight.shape)
                raise NotImplementedError(
                    f"layer {attn.layer_idx}: {name} ({type(norm).__name__}, weight {shape}) is not a "
                    f"per-head norm over head_dim={attn.head_dim}; the packed attention cannot apply it")
        if any(n is not None for n in norms) and not all(n is not None for n in norms):
            raise NotImplementedError(f"layer {attn.layer_idx} has only one of q_norm / k_norm")
    if len(found) > 1:
        raise NotImplementedError("q_norm / k_norm on some text layers only")
    return found == {True}


# -- per-instance installs --------------------------------------------------------------------------
def install(module: nn.Module, fn: Any) -> None:
    """Replace ``module.forward`` on this instance only (a bound method: deepcopy rebinds it to the
    copy, and the class stays untouched)."""
    setattr(module, PREV_FORWARD, module.__dict__.get("forward"))
    module.forward = types.MethodType(fn, module)


def uninstall(module: nn.Module) -> None:
    if "forward" in module.__dict__:
        del module.forward
    prev = module.__dict__.pop(PREV_FORWARD, None)
    if prev is not None:
        module.forward = prev


def call_original(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    prev = module.__dict__.get(PREV_FORWARD)
    if prev is not None:
        return prev(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


# -- text attention ---------------------------------------------------------------------------------
def packed_attention_forward(self: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A text attention layer: HF's forward unless the packed kwarg is present.

    Takes ``*args`` / ``**kwargs`` so the unpacked call reaches HF's forward exactly as the decoder
    layer made it (including the deprecated ``past_key_values`` spelling).
    """
    info: PackedAttentionInfo | None = kwargs.pop(PACKED_KWARG, None)
    if info is None:
        return call_original(self, *args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError("packed forward does not fill a KV cache; call it with use_cache=False")
    return packed_text_attention(self, hidden_states, info)


def packed_text_attention(attn: nn.Module, hidden_states: torch.Tensor,
                          info: PackedAttentionInfo) -> tuple[torch.Tensor, None]:
    """One text attention layer on a packed ``(1, T, hidden)`` row: q/k/v as ``(T, H, D)``, (Qwen3:
    its per-head ``q_norm`` / ``k_norm``), rotary from the packed positions, causal
    :func:`varlen_attention` over the batch's segments. The one place the core calls attention."""
    bsz, num_tokens, _ = hidden_states.shape
    if bsz != 1:
        raise ValueError(f"packed hidden states must have batch size 1, got {bsz}")
    q = attn.q_proj(hidden_states).view(num_tokens, -1, attn.head_dim)
    k = attn.k_proj(hidden_states).view(num_tokens, -1, attn.head_dim)
    v = attn.v_proj(hidden_states).view(num_tokens, -1, attn.head_dim)
    if info.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    rope = apply_mrope if info.apply_rope is None else info.apply_rope
    q, k = rope(
        q, k, info.positions, info.inv_freq, info.mrope_section, info.interleaved, info.attention_scaling
    )
    dropout = attn.attention_dropout if attn.training else 0.0
    if info.sp_group is not None:
        out = ulysses_attention(q, k, v, info, info.sp_group, causal=True, scale=attn.scaling,
                                dropout_p=dropout)
    else:
        out = varlen_attention(q, k, v, info, causal=True, scale=attn.scaling, dropout_p=dropout)
    out = attn.o_proj(out.reshape(1, num_tokens, -1))
    return out, None  # no attention probabilities: same contract as HF's flash/sdpa paths


# -- the packed call --------------------------------------------------------------------------------
def is_packed_call(kwargs: dict[str, Any]) -> bool:
    return kwargs.get("cu_seqlens") is not None or kwargs.get("cu_seqlens_list") is not None


def take_packed_info(model: nn.Module, kwargs: dict[str, Any], family: Family) -> PackedAttentionInfo:
    """Pop the packing fields out of ``kwargs`` (in place) and validate them on the host."""
    fields = {name: kwargs.pop(name, None) for name in CONSUMED_KEYS}
    position_ids = kwargs.pop("position_ids", None)

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

    sp_group = model.__dict__.get(SP_GROUP)
    sp_size = _check_sp_slice(sp_group, fields)
    if sp_group is not None and kwargs.get("labels") is not None:
        # A slice may hold no target at all; a summed loss over max(1, count) is then 0, not 0/0.
        kwargs.setdefault("num_items_in_batch", max(1, int(fields["num_loss_tokens"] or 0)))
    elif fields["num_loss_tokens"] == 0 and kwargs.get("labels") is not None:
        # No loss token (an empty rank's dummy row): HF's mean over zero tokens is NaN, and NaN x 0
        # would poison every rank's gradients through the reduce-scatter. Summed over one "item",
        # the loss is 0 with zero gradients for every parameter.
        kwargs.setdefault("num_items_in_batch", 1)
    ends: Sequence[int] | None = fields["cu_seqlens_list"]
    source = "cu_seqlens_list"
    if ends is None and fields["seq_lens"] is not None:
        ends, source = segment_ends(fields["seq_lens"]), "seq_lens"
    if ends is not None:
        ends = [int(e) for e in ends]
        check_segment_ends(ends, source)
        if not ends or ends[-1] != num_tokens * sp_size:
            covered = ends[-1] if ends else 0
            raise ValueError(f"cu_seqlens_list / seq_lens cover {covered} tokens, batch has {num_tokens}"
                             + (f" x sp_size {sp_size}" if sp_size > 1 else ""))
    max_seqlen = fields["max_seqlen"]
    if isinstance(max_seqlen, torch.Tensor):
        raise ValueError("max_seqlen must be a python int (a tensor would force a host sync in every layer)")
    if ends is not None:
        longest = max(b - a for a, b in zip([0, *ends[:-1]], ends, strict=True))
        if max_seqlen is None:
            max_seqlen = longest
        elif int(max_seqlen) < longest:
            # flash-attn sizes its grid by max_seqlen: the rows of a longer segment past it would
            # not be computed, without an error.
            raise ValueError(f"max_seqlen={max_seqlen} is shorter than the batch's longest segment "
                             f"({longest} tokens)")
    cu_seqlens = fields["cu_seqlens"]
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int32)

    if position_ids is None:
        has_vision = any(kwargs.get(k) is not None for k in ("pixel_values", "pixel_values_videos"))
        if has_vision or fields["text_position_ids"] is None:
            raise ValueError(
                "packed batch needs position_ids (3, 1, T) or (1, T): per-sample ids, concatenated"
            )
        position_ids = fields["text_position_ids"]
    if position_ids.shape[-1] != num_tokens:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not cover the {num_tokens} tokens")
    kwargs["position_ids"] = position_ids

    layout = family.rope(model, text_model_of(model, family))
    return PackedAttentionInfo(
        positions=position_ids,
        cu_seqlens=cu_seqlens,
        cu_seqlens_list=ends,
        max_seqlen=None if max_seqlen is None else int(max_seqlen),
        inv_freq=layout.inv_freq,
        mrope_section=layout.mrope_section,
        interleaved=layout.interleaved,
        attention_scaling=layout.attention_scaling,
        qk_norm=family.qk_norm or model.__dict__[HEAD_NORMS],
        sp_group=sp_group,
        apply_rope=family.apply_rope,
    )


def _check_sp_slice(group: Any, fields: dict[str, Any]) -> int:
    """The batch's SP size, checked against the model's SP group (host values only)."""
    sp_size = int(fields["sp_size"] or 1)
    if group is None:
        if sp_size > 1:
            raise ValueError(f"batch is an SP slice (sp_size={sp_size}) but the model has no SP group: "
                             "enable_packed(model, sp_group=group)")
        return 1
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if fields["sp_size"] is None:
        raise ValueError(f"the model runs sequence parallel over {size} ranks; feed it "
                         f"collate.sp.shard_batch(batch, sp_rank, {size}) slices")
    if (sp_size, int(fields["sp_rank"])) != (size, rank):
        raise ValueError(f"batch slice is sp_rank {fields['sp_rank']} of {sp_size}, but this rank is "
                         f"{rank} of the model's SP group of {size}")
    return sp_size


def set_sp_group(model: nn.Module, group: Any) -> None:
    """Run ``model``'s packed forward sequence parallel over ``group`` (see the module docstring).

    Raises ``ValueError`` when the text attention heads cannot be split over the group's size."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    text = getattr(model.config, "text_config", model.config)
    heads = int(text.num_attention_heads)
    ulysses_kv_heads(heads, int(getattr(text, "num_key_value_heads", None) or heads), size)
    model.__dict__[SP_GROUP] = group


def sp_exchange(encoded: Encoded, vision: dict[str, Any], group: Any) -> Encoded:
    """Send this rank's merged features to the ranks whose slices hold their placeholders and
    receive this slice's, in ``vision_token_index`` order: one all-to-all with the plan's host
    split sizes. Per-feature maps of the tower's output (``raw.deepstack_features``) travel in the
    same exchange and are replaced by this slice's. A rank without images of its own (the idle
    dummy ran) sends nothing and still receives."""
    raw = encoded.raw
    own = encoded.features if encoded.features is not None else raw.pooler_output
    maps = [own, *(getattr(raw, "deepstack_features", None) or ())]
    if encoded.features is None:
        send = [m[:0] for m in maps]
    else:
        index = vision["vision_sp_send_index"]
        send = [m.index_select(0, index) for m in maps]
    widths = [m.shape[-1] for m in send]
    recv = all_to_all_rows(torch.cat(send, dim=-1), group, vision["vision_sp_recv_counts"],
                           vision["vision_sp_send_counts"]).split(widths, dim=-1)
    if len(recv) > 1:
        raw.deepstack_features = list(recv[1:])
    return dataclasses.replace(encoded, features=recv[0])


def find_placeholders(input_ids: torch.Tensor, token_ids: Sequence[int], num_features: int) -> torch.Tensor:
    """The feature slots of a hand-made batch (no collator ``vision_token_index``): placeholders
    found on the device (a host read), one token id after the other, as the tower's output is
    ordered."""
    ids = input_ids[0]
    slots = torch.cat([torch.nonzero(ids == token).flatten() for token in token_ids])
    if slots.shape[0] != num_features:
        raise ValueError(f"{slots.shape[0]} image/video placeholder tokens in input_ids, but the vision "
                         f"inputs give {num_features} vision features")
    return slots


def scatter_features(embeds: torch.Tensor, slots: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Put the merged vision features at their slots of the packed ``(1, T, hidden)`` row: one
    ``index_copy`` (no boolean mask, no host read). The one place the core writes vision features
    into the text embeddings."""
    return embeds[0].index_copy(0, slots, features.to(embeds.dtype))[None]


def embed_with_vision(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any],
                      family: Family, idle_vision: bool) -> Encoded | None:
    """Embed tokens and run the family's vision tower exactly once; put ``inputs_embeds`` into
    ``kwargs``. Returns the tower's :class:`Encoded` (with its slots), or None when it did not run.

    transformers calls a tower once per modality, and only when each is present. Under FSDP2 that
    makes the number of vision-block collectives depend on the rank's data, and ranks with
    different mixes pair the wrong all-gathers (a hang or a crash). Every family's ``encode``
    makes one call on all the batch's images and videos together, and for a batch with neither
    (``idle_vision``) runs one zero-valued dummy input whose outputs enter the embeddings times zero.
    """
    input_ids = kwargs.pop("input_ids", None)
    embeds = kwargs.pop("inputs_embeds", None)
    if embeds is None:
        embeds = model.get_input_embeddings()(input_ids)
    kwargs["inputs_embeds"] = embeds
    if family.encode is None:
        return None
    group = model.__dict__.get(SP_GROUP)
    routed = group is not None and vision.get("vision_sp_send_counts") is not None
    # Under SP a rank without images of its own must still run the tower (idle) to take part in
    # the feature exchange.
    encoded = family.encode(model, kwargs, vision, idle_vision or routed)
    if encoded is None:
        return None
    if routed:
        encoded = sp_exchange(encoded, vision, group)
    if encoded.idle_zero is not None:
        embeds = embeds + encoded.idle_zero.to(embeds.dtype)
        kwargs["inputs_embeds"] = embeds
    if encoded.features is None:
        return encoded
    if input_ids is None:
        raise ValueError("packed batches with images or videos need input_ids to place the vision features")
    slots = vision.get("vision_token_index")
    if slots is None:
        slots = find_placeholders(input_ids, encoded.placeholder_ids, encoded.features.shape[0])
    encoded.slots = slots
    kwargs["inputs_embeds"] = scatter_features(embeds, slots, encoded.features)
    return encoded


def packed_model_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's forward: a packed call is prepared here, every other call is HF's."""
    if not is_packed_call(kwargs):
        return call_original(self, *args, **kwargs)
    family: Family = self.__dict__[FAMILY]
    vision = {name: kwargs.get(name) for name in (*VISION_KEYS, *SP_KEYS)}  # popped by take_packed_info
    vision.update((name, kwargs.pop(name, None)) for name in family.batch_keys)
    info = take_packed_info(self, kwargs, family)
    encoded = embed_with_vision(self, kwargs, vision, family, getattr(self, IDLE_VISION, False))
    if family.after_embed is not None:
        family.after_embed(self, kwargs, encoded)
    text_model = text_model_of(self, family)
    kwargs["attention_mask"] = family.attention_mask(self, text_model, kwargs["inputs_embeds"])
    kwargs[PACKED_KWARG] = info
    if kwargs.get("labels") is None:
        return call_original(self, *args, **kwargs)
    from tokenbal import hf_compat

    # a slice's shifted targets and the summed loss's divisor reach the loss on every release
    with hf_compat.loss_kwargs_reach_loss(self, shift_labels=kwargs.get("shift_labels"),
                                          num_items_in_batch=kwargs.get("num_items_in_batch")):
        return call_original(self, *args, **kwargs)


def enable(model: nn.Module, family: Family, idle_vision: bool = True) -> nn.Module:
    """Let ``model(**packed_batch)`` run packed; returns the same model. Idempotent, per instance.

    ``idle_vision``: run the vision tower on a zero-weighted dummy input when a packed batch has no
    image or video, so every FSDP rank issues the same collectives.
    """
    if getattr(model, ENABLED, False):
        return model
    text_model = text_model_of(model, family)
    check_text_model(model, text_model, family)
    norms = head_norms(text_model)  # refuses q / k norms the packed attention would not apply as HF does
    if family.check is not None:
        family.check(model, text_model)
    for layer in text_model.layers:
        install(layer.self_attn, packed_attention_forward)
    if family.install is not None:
        family.install(model)
    install(model, packed_model_forward)
    model.__dict__[FAMILY] = family
    model.__dict__[HEAD_NORMS] = norms
    setattr(model, ENABLED, True)
    setattr(model, IDLE_VISION, bool(idle_vision and family.encode is not None))
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable` on this instance."""
    if not getattr(model, ENABLED, False):
        return model
    family: Family = model.__dict__.pop(FAMILY)
    model.__dict__.pop(HEAD_NORMS, None)
    for layer in text_model_of(model, family).layers:
        uninstall(layer.self_attn)
    if family.uninstall is not None:
        family.uninstall(model)
    uninstall(model)
    delattr(model, ENABLED)
    delattr(model, IDLE_VISION)
    model.__dict__.pop(IDLE_INPUTS, None)
    model.__dict__.pop(SP_GROUP, None)
    return model


def idle_cache(model: nn.Module) -> dict[Any, Any]:
    """Per-instance cache of the idle dummy inputs, one entry per device (dropped by :func:`disable`)."""
    return model.__dict__.setdefault(IDLE_INPUTS, {})
