"""Every difference between the transformers versions tokenbal supports, in one module.

The supported range is transformers 4.57 (MindSpeed-MM's pin, the oldest with Qwen3-VL) to the
newest 5.x. Everything here is *feature detection*: a signature, an attribute, a module-level
helper, or (for a rule buried inside a method body) the installed method's own answer on a tiny
input. No function compares version numbers, except :func:`require_class`, which only *words* an
error with the release that added a family. transformers is imported lazily, inside the
functions: ``import tokenbal.hf_compat`` does not import it.

The model patches (``collate.models``), the collator's positions (``collate.positions`` through
:func:`qwen2_5_vl_whole_seconds`), the estimators and the tests ask here; nothing else in the
package branches on what transformers has.

What differs, oldest first (found by reading each release's modeling files):

============================  ======================================================================
rotary ``mrope_section``       4.57: ``config.rope_scaling["mrope_section"]`` read by the attention;
                               5.6-5.9: ``config.rope_parameters["mrope_section"]``; 5.1x+: an
                               attribute of the text rotary module (:func:`mrope_section`)
text config rotary kwargs      4.57: ``rope_theta`` + ``rope_scaling``; 5.x: ``rope_parameters``
                               (:func:`rope_config`)
vision tower inputs            4.57-5.6 derive ``cu_seqlens`` / rotary ids from ``grid_thw`` (a
                               caller cannot hand them in); 5.9 pops precomputed ones
                               (``transformers.vision_utils``); 5.19+ also ``max_seqlen`` and
                               Qwen3-VL's interpolation taps (:func:`tower_inputs`)
vision tower output            4.57: a tensor (Qwen3-VL: ``(tensor, deepstack list)``); 5.x:
                               ``BaseModelOutputWithPooling`` (:func:`tower_output`)
InternVL image features        4.57: a tensor; 5.x: an output object (:func:`internvl_image_features`)
``get_rope_index``             5.x takes ``mm_token_type_ids`` (:func:`get_rope_index`)
Qwen2.5-VL video time steps    up to 5.9 ``second_per_grid_ts`` is truncated to whole seconds;
                               later releases keep the fraction (:func:`qwen2_5_vl_whole_seconds`)
text after a Qwen2(.5)-VL      4.57: max position so far + 1 (past the video's frames); 5.6-5.25: the
video                          block's start + max(h, w) / merge (:func:`qwen2_vl_video_text_resume`)
image processor class names    5.x ``XImageProcessorPil`` (PIL backend) is 4.57's ``XImageProcessor``
                               (:func:`image_processor_class`)
loss kwargs of a forward       4.57-5.9: Qwen3-VL, Qwen3-VL-MoE and GLM-4V's ``forward`` call
                               ``self.loss_function(logits, labels, vocab_size)`` and drop
                               ``shift_labels`` / ``num_items_in_batch``; later releases pass them
                               (:func:`loss_kwargs_reach_loss`)
Qwen2-VL image ``size``        4.57's slow ``Qwen2VLImageProcessor`` (loaded without torchvision)
                               drops a ``size`` from the files and keeps its class defaults unless
                               ``min_pixels`` / ``max_pixels`` are given; its fast class and 5.x keep
                               it (:func:`qwen2_vl_loaded_image_size_kept`)
placeholder replacement        5.1x+: ``processor.get_text_with_replacements`` replaces a row's
                               placeholders in one pass; 5.25's Qwen3-VL also folds the template's
                               ``<|vision_start|><video><|vision_end|>`` into the bare video token
                               first (its frames carry their own wrappers); before 5.25 the wrapper
                               stays (:func:`replace_placeholders`)
processor call defaults        5.19: ``_merge_kwargs(XProcessorKwargs, ...)`` (a ``_defaults``
                               TypedDict); 5.24+: defaults are attributes of the processor class and
                               the kwargs class is optional (:func:`processor_modality_kwargs`)
SmolVLM video text             5.19-5.24: ``replace_video_token`` writes the frame count of its
                               intro ("series of N frames") from ``pixel_values.shape[1]``: the
                               frames of the call's longest video (the others are padded to it;
                               a call without ``return_tensors`` raises there, its ``pixel_values``
                               a list); 5.25 counts this video's own timestamps. The stand-in that
                               tokenbal hands the method carries both (:func:`video_token_inputs`).
                               Rows with a video get SmolVLM's own video template (its
                               ``apply_chat_template`` swaps it in for a whole batch), which on 5.19
                               drops string message content: tokenbal renders SmolVLM rows one by
                               one through that method, so its counts follow on every release
Qwen2-VL live ``min_pixels`` /    4.57 and 5.19+ resize by an image processor's ``min_pixels`` /
``max_pixels`` attributes        ``max_pixels`` attributes (set after construction) over its
                               ``size``; 5.6-5.9 resize by ``size`` alone and ignore them
                               (:func:`qwen2_vl_pixel_attributes_honoured`)
vision sub-config model_type   4.57: the model's own name (``qwen2_5_vl``, ``glm4v``); 5.x:
                               ``<model>_vision`` (``qwen2_5_vl_vision``) (:func:`vision_model_type`)
Trainer ``num_items_in_batch``  4.57-5.9 count ``labels != -100`` over the whole label tensor; 5.19+
                               ``labels[..., 1:]`` for a loss that shifts them (a causal LM's), the
                               tokens the loss sums over (:func:`trainer_counts_shifted_labels`)
Trainer length grouping        4.57: ``group_by_length=True``; 5.x: ``train_sampling_strategy=
                               "group_by_length"``, from 5.25 also ``"batch_rebalance"``
                               (:func:`trainer_length_grouping`)
Trainer data-parallel split     every release: the train loader is sharded by accelerate's
                               ``prepare_data_loader`` over the data-parallel ranks of the
                               accelerator's device mesh (tensor / context parallel peers share a
                               batch). What builds that mesh differs: 4.57 hands a tensor-parallel
                               model's ``tp_size`` to accelerate as a ``TorchTensorParallelPlugin``
                               (a ``ParallelismConfig(tp_size)`` there), 5.6-5.9 as
                               ``ParallelismConfig(tp_size)``, 5.19+ with the model's
                               ``dp_shard_size`` too; ``parallelism_config`` is passed through on all.
                               DeepSpeed AutoTP (``tensor_parallel.autotp_size``) splits by the TP
                               size alone; ``sp_size`` > 1 (DeepSpeed ALST / Ulysses, 5.6+) wraps
                               the loader in DeepSpeed's adapter (:func:`trainer_data_parallel`)
============================  ======================================================================
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MIN_VERSION", "FAMILY_ADDED_IN", "transformers_version", "require_class", "rope_config",
    "mrope_section", "tower_inputs", "tower_output", "TowerOutput", "internvl_image_features",
    "get_rope_index", "qwen2_5_vl_whole_seconds", "qwen2_vl_video_text_resume", "image_processor_class",
    "accepts_kwarg",
    "checkpointing_enable", "image_processing_module", "qwen3_vl_video_resize", "glm4v_upscales_small",
    "qwen2_vl_loaded_image_size_kept", "loss_kwargs_reach_loss", "video_token_inputs",
    "TrainerDataParallel", "trainer_data_parallel",
    "builds_rope_index", "array_image_axes",
]

# The oldest transformers tokenbal supports (MindSpeed-MM pins 4.57.0; the first with Qwen3-VL).
MIN_VERSION = "4.57"

# The transformers release that added each family's model classes: only used to word the error
# when the installed transformers lacks one (every family here exists in MIN_VERSION).
FAMILY_ADDED_IN: dict[str, str] = {
    "Qwen2VL": "4.45", "Qwen2_5_VL": "4.49", "Qwen3VL": "4.57", "Qwen3VLMoe": "4.57",
    "Glm4v": "4.53", "InternVL": "4.52", "LlavaNext": "4.39", "LlavaOnevision": "4.45",
}


def transformers_version() -> str:
    """The installed transformers' version string ("none" when it is not installed)."""
    try:
        import transformers
    except ImportError:
        return "none"
    return str(transformers.__version__)


def require_class(name: str) -> Any:
    """``transformers.<name>``, or ``ImportError`` naming the installed version and the release
    that added the family (the prefix of ``name`` in :data:`FAMILY_ADDED_IN`)."""
    import transformers

    found = getattr(transformers, name, None)
    if found is not None:
        return found
    family = max((k for k in FAMILY_ADDED_IN if name.startswith(k)), key=len, default=None)
    added = f"; it was added in transformers {FAMILY_ADDED_IN[family]}" if family else ""
    raise ImportError(f"transformers {transformers.__version__} has no {name}{added} "
                      f"(tokenbal supports transformers >= {MIN_VERSION})")


def accepts_kwarg(fn: Any, name: str) -> bool:
    """Whether callable ``fn`` takes keyword ``name`` (explicitly, not just through ``**kwargs``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# -- array images ----------------------------------------------------------------------------------

def array_image_axes(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(height axis, width axis)`` of a numpy array / torch tensor image of ``shape`` as the
    installed transformers' image processor lays it out (its size: ``shape[w], shape[h]``): a 3-D
    array is channels-first when its first axis is a channel count (also when its last is:
    transformers warns 'ambiguous' and takes the first), else channels-last when its last is. The
    channel counts: 1, 3 or 4 in 5.x (``image_processing_backends``, where a 2-D array is one
    grayscale channel), 1 or 3 in 4.57, else 4 (where a 2-D array is an error). Raises ``ValueError`` with
    transformers' own words ('Unable to infer channel dimension format', 'Unsupported number of
    image dimensions') where it does. (4.57's slow CLIP-style processors lay out every image of a
    call as its first: a row mixing layouts may differ there.)"""
    from types import SimpleNamespace

    from transformers.image_utils import ChannelDimension, infer_channel_dimension_format

    backends = importlib.util.find_spec("transformers.image_processing_backends") is not None
    if backends and len(shape) == 2:
        return 0, 1
    array = SimpleNamespace(ndim=len(shape), shape=shape)
    try:
        fmt = infer_channel_dimension_format(array, num_channels=(1, 3, 4) if backends else (1, 3))
    except ValueError:
        if backends or len(shape) != 3:
            raise
        # 4.57's Idefics3 / SmolVLM count 4 channels too; where another refuses, its own call says so
        fmt = infer_channel_dimension_format(array, num_channels=(1, 3, 4))
    return (1, 2) if fmt == ChannelDimension.FIRST else (0, 1)


# -- configs ----------------------------------------------------------------------------------------
def rope_config(config_class: Any, rope_theta: float, rope_type: str = "default", **params: Any) -> dict:
    """The rotary kwargs of a text config (``config_class``: it, or the composite config whose
    ``text_config`` it is) for the installed transformers: ``rope_parameters``
    (5.x: theta, type, ``mrope_section``, ``partial_rotary_factor``, ... in one dict) or 4.x's
    ``rope_theta`` + ``rope_scaling`` (the type and sections) with ``partial_rotary_factor`` as its
    own argument. Detected from ``config_class.__init__``'s signature."""
    config_class = (getattr(config_class, "sub_configs", None) or {}).get("text_config", config_class)
    if accepts_kwarg(config_class.__init__, "rope_parameters"):
        return {"rope_parameters": {"rope_type": rope_type, "rope_theta": rope_theta, **params}}
    out: dict[str, Any] = {"rope_theta": rope_theta}
    if "partial_rotary_factor" in params:
        out["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    params.pop("mrope_interleaved", None)  # 4.x's Qwen3-VL always interleaves
    if params or rope_type != "default":
        out["rope_scaling"] = {"rope_type": rope_type, **params}
    return out


# -- text rotary ------------------------------------------------------------------------------------
def mrope_section(text_model: Any) -> tuple[int, ...] | None:
    """The M-RoPE section sizes the text model's own forward uses, or None if it has none.

    Newer releases keep them on the rotary module (``rotary_emb.mrope_section``); 5.6-5.9 read
    ``config.rope_parameters["mrope_section"]`` in the attention and 4.57 reads
    ``config.rope_scaling["mrope_section"]``."""
    rope = getattr(text_model, "rotary_emb", None)
    section = getattr(rope, "mrope_section", None)
    if section is None:
        config = getattr(text_model, "config", None)
        for name in ("rope_parameters", "rope_scaling"):
            params = getattr(config, name, None)
            if isinstance(params, dict) and params.get("mrope_section") is not None:
                section = params["mrope_section"]
                break
    return None if section is None else tuple(int(s) for s in section)


# -- vision towers ----------------------------------------------------------------------------------
# Helpers of ``transformers.vision_utils`` a tower module imports -> the kwargs that tower pops
# (so a caller may hand them in precomputed).
_TOWER_HELPERS: dict[str, tuple[str, ...]] = {
    "get_vision_cu_seqlens": ("cu_seqlens",),
    "get_vision_attention_seqlens": ("cu_seqlens", "max_seqlen"),
    "get_vision_position_ids": ("position_ids",),
    "get_vision_window_index": ("window_index", "cu_window_seqlens"),
    "get_vision_interpolation_indices_and_weights": ("interp_indices", "interp_weights"),
}


def tower_inputs(visual: Any) -> frozenset[str]:
    """The precomputed inputs this vision tower's forward takes from its kwargs (empty: it derives
    everything from ``grid_thw`` itself, and a kwarg of the same name would reach its blocks twice).

    Read from what the tower's modeling module imported from ``transformers.vision_utils`` (5.9+):
    each helper pops its inputs when given. ``max_seqlen`` (5.19+, ``get_vision_attention_seqlens``)
    and Qwen3-VL's taps (``interp_*``) came later than ``cu_seqlens``."""
    module = sys.modules.get(type(visual).__module__)
    names: set[str] = set()
    for helper, popped in _TOWER_HELPERS.items():
        if getattr(getattr(module, helper, None), "__module__", "").endswith("vision_utils"):
            names.update(popped)
    if "window_index" in names and hasattr(module, "get_max_seqlen"):
        names.add("max_window_seqlen")  # Qwen2.5-VL 5.19+: popped with ``get_max_seqlen``
    return frozenset(names)


@dataclass
class TowerOutput:
    """A grid tower's output on every version: the merged features and (Qwen3-VL) the DeepStack
    maps. ``raw`` is what the tower returned."""

    pooler_output: Any
    deepstack_features: list | None = None
    raw: Any = None


def tower_output(out: Any) -> TowerOutput:
    """Normalise a Qwen-VL / GLM-4V tower's return value: 5.x returns an output object with
    ``pooler_output`` (and ``deepstack_features``); 4.57 returns the merged tensor, or Qwen3-VL's
    ``(merged, deepstack list)`` tuple."""
    if hasattr(out, "pooler_output"):
        return TowerOutput(out.pooler_output, getattr(out, "deepstack_features", None), out)
    if isinstance(out, tuple):
        return TowerOutput(out[0], list(out[1]) if len(out) > 1 and out[1] is not None else None, out)
    return TowerOutput(out, None, out)


def internvl_image_features(model: Any, pixels: Any) -> Any:
    """InternVL's ``(tiles, tokens_per_tile, hidden)`` features from ``model.model.get_image_features``:
    5.x returns an output object (``return_dict=True`` asks for it), 4.57 the tensor."""
    config = model.config
    inner = model.model
    kwargs = dict(vision_feature_layer=config.vision_feature_layer,
                  vision_feature_select_strategy=config.vision_feature_select_strategy)
    if accepts_kwarg(inner.get_image_features, "kwargs") or accepts_kwarg(inner.get_image_features,
                                                                           "return_dict"):
        kwargs["return_dict"] = True
    out = inner.get_image_features(pixels, **kwargs)
    return out.pooler_output if hasattr(out, "pooler_output") else out


def paddleocr_vl_image_features(model: Any, pixels: Any, grids: Any) -> Any:
    """PaddleOCR-VL's projected features of all images, ``(merged tokens, hidden)`` in image order,
    from ``model.model.get_image_features``: 5.6-5.9 return them as one tensor in
    ``pooler_output``, 5.19+ as one tensor per image."""
    import torch

    out = model.model.get_image_features(pixels, grids, return_dict=True)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.cat(list(features)) if isinstance(features, (list, tuple)) else features


# -- positions --------------------------------------------------------------------------------------
def get_rope_index(model: Any, input_ids: Any, *, image_grid_thw: Any = None, video_grid_thw: Any = None,
                   attention_mask: Any = None, mm_token_type_ids: Any = None, **extra: Any) -> Any:
    """``model.get_rope_index`` (a Qwen-VL / GLM-4V ``...Model``) with the arguments the installed
    version takes: 5.x requires ``mm_token_type_ids`` (0 text, 1 image, 2 video; built from the
    config's token ids when not given), 4.57 has no such argument. Returns the position ids."""
    import torch

    fn = model.get_rope_index
    kwargs: dict[str, Any] = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                  attention_mask=attention_mask, **extra)
    if accepts_kwarg(fn, "mm_token_type_ids"):
        if mm_token_type_ids is None:
            config = model.config
            mm_token_type_ids = torch.zeros_like(input_ids, dtype=torch.int32)
            mm_token_type_ids[input_ids == config.image_token_id] = 1
            video = getattr(config, "video_token_id", None)
            if video is not None:
                mm_token_type_ids[input_ids == video] = 2
        kwargs["mm_token_type_ids"] = mm_token_type_ids
    return fn(input_ids, **kwargs)[0]


@functools.cache
def qwen2_5_vl_whole_seconds() -> bool:
    """Whether the installed transformers' Qwen2.5-VL ``get_rope_index`` truncates
    ``second_per_grid_ts`` to whole seconds before scaling by ``tokens_per_second`` (4.57 casts it
    to int64, 5.6-5.9 call ``int()``; later releases keep the fraction, so 0.5 s per grid at 2
    tokens/s steps the temporal position by 1, not 0).

    The rule sits inside the method body, so it is asked of the method itself: the installed
    ``Qwen2_5_VLModel.get_rope_index`` on a meta-device tiny model (no weights), one 2-frame video
    at 0.5 s per grid, 2 tokens per second. False (the newest rule) without transformers."""
    try:
        import torch
    except ImportError:
        return False
    model = _tiny_qwen_vl("qwen2_5_vl")
    if model is None:
        return False
    ids = torch.tensor([[12, 11, 11]])  # <vision_start>, then 2 frames x 1 merged token each
    pos = get_rope_index(model, ids, video_grid_thw=torch.tensor([[2, 2, 2]]),
                         second_per_grid_ts=torch.tensor([0.5]), attention_mask=torch.ones_like(ids))
    temporal = pos[0, 0, 1:].tolist()
    return temporal[1] == temporal[0]


@functools.cache
def qwen2_vl_video_text_resume(model_type: str) -> str:
    """Where the installed transformers' Qwen2-VL / Qwen2.5-VL ``get_rope_index`` resumes text after
    a video block: ``"temporal"`` (max position so far + 1, past the video's temporal extent: 4.57
    and the original Qwen2-VL code) or ``"spatial"`` (the block's start + max(h, w) / merge, as after
    an image: 5.6 to 5.25, measured). ``collate.positions.mrope_positions`` takes either.

    Asked of the method itself, as :func:`qwen2_5_vl_whole_seconds` is: one video of 3 frames of
    one merged token each, then a text token. ``"temporal"`` without transformers (the original
    rule). ``RuntimeError`` when the installed method follows neither rule: packed positions would
    then differ from the model's own."""
    try:
        import torch
    except ImportError:
        return "temporal"
    model = _tiny_qwen_vl(model_type)
    if model is None:
        return "temporal"
    ids = torch.tensor([[12, 11, 11, 11, 5]])  # <vision_start>, 3 frames x 1 merged token, text
    pos = get_rope_index(model, ids, video_grid_thw=torch.tensor([[3, 2, 2]]),
                         attention_mask=torch.ones_like(ids))[:, 0]
    start, text = int(pos[0, 1]), int(pos[0, -1])
    if text == int(pos[:, 1:4].max()) + 1:
        return "temporal"
    if text == start + 1:   # max(h, w) / merge = 1
        return "spatial"
    raise RuntimeError(f"transformers {transformers_version()}: {model_type}'s get_rope_index resumes text "
                       f"after a video at position {text} (video block from {start}, positions "
                       f"{pos[:, 1:4].tolist()}), neither rule tokenbal knows; packed positions would differ "
                       "from the model's own")


def _tiny_qwen_vl(model_type: str) -> Any:
    """A Qwen2-VL / Qwen2.5-VL ``...Model`` on the meta device (no weights) for asking its methods a
    rule: token ids 10 image, 11 video, 12 vision start; Qwen2.5-VL at 2 tokens per second. None when
    the installed transformers lacks the family."""
    import torch

    try:
        if model_type == "qwen2_vl":
            from transformers import Qwen2VLConfig as Config
            from transformers import Qwen2VLModel as Model
            from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig as TextConfig
            vision = dict(depth=1, embed_dim=8, hidden_size=8, mlp_ratio=1, num_heads=1)
        elif model_type == "qwen2_5_vl":
            from transformers import Qwen2_5_VLConfig as Config
            from transformers import Qwen2_5_VLModel as Model
            from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
                Qwen2_5_VLTextConfig as TextConfig,
            )
            vision = dict(depth=1, hidden_size=8, out_hidden_size=8, intermediate_size=8, num_heads=1,
                          tokens_per_second=2)
        else:
            raise ValueError(f"not a Qwen2-VL / Qwen2.5-VL model type: {model_type!r}")
    except ImportError:
        return None
    text = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    text.update(rope_config(TextConfig, 1e4, mrope_section=[1, 0, 1]))
    config = Config(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                    vision_start_token_id=12)
    with torch.device("meta"):
        return Model(config)


@functools.cache
def qwen3_vl_video_resize() -> dict[str, bool]:
    """The installed transformers' Qwen3-VL video ``smart_resize`` variant, as the keywords of
    :func:`tokenbal.estimate.qwen.smart_resize_3d`. Three generations: 4.57 (refuses a side shorter
    than the factor, needs ``t >= temporal_patch_size``, rounds ``t`` half to even), 5.6-5.9
    (refuses short sides, no frame check, rounds ``t`` up), 5.19+ (scales short sides up, frame
    check, rounds half to even). Asked of the function itself on three tiny inputs; the newest
    rule without transformers."""
    newest = {"check_frames": True, "upscale_small": True, "ceil_frames": False}
    try:
        import importlib

        fn = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl").smart_resize
    except (ImportError, AttributeError):
        return newest

    def raises(*args: int) -> bool:
        try:
            fn(*args)
        except ValueError:
            return True
        return False

    # (num_frames, height, width, temporal_factor, factor, min_pixels, max_pixels)
    return {
        "check_frames": raises(1, 64, 64, 2, 32, 1, 10**9),
        "upscale_small": not raises(2, 16, 64, 2, 32, 1, 10**9),
        # 5 frames of 64x64 under 20000 pixels: t rounded half to even (4) fits, rounded up (6) does not
        "ceil_frames": tuple(fn(5, 64, 64, 2, 32, 1, 20000)) != (64, 64),
    }


@functools.cache
def glm4v_upscales_small() -> bool:
    """Whether the installed GLM-4V image ``smart_resize`` scales a side shorter than its factor (28)
    up (5.x) or refuses the image (4.57). Asked of the function; True without transformers."""
    try:
        fn = image_processing_module("glm4v").smart_resize
    except (ImportError, AttributeError):
        return True
    try:
        fn(2, 16, 64, 2, 28, 1, 10**9)
    except ValueError:
        return False
    return True


# -- loss -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def loss_kwargs_reach_loss(model: Any, **loss_kwargs: Any) -> Any:
    """Within the block, ``model.loss_function`` receives ``loss_kwargs`` (``shift_labels``,
    ``num_items_in_batch``) even where ``model.forward`` does not hand them on.

    Some forwards call ``self.loss_function(logits=..., labels=..., vocab_size=...)`` and drop the
    ``**kwargs`` they were given (4.57-5.9: Qwen3-VL, Qwen3-VL-MoE, GLM-4V): a sequence-parallel
    slice's ``shift_labels`` never arrive, so transformers shifts the slice's own labels and loses
    the target across the cut, and ``num_items_in_batch`` (a summed loss's divisor) is ignored.
    Later releases pass them on. So for the block the instance's ``loss_function`` is a wrapper
    that adds the ones a call leaves out: a no-op where the forward passes them, no version test.
    ``loss_function`` is transformers' settable property (``_loss_function`` on the instance)."""
    loss_kwargs = {k: v for k, v in loss_kwargs.items() if v is not None}
    if not loss_kwargs or not hasattr(type(model), "loss_function"):
        yield
        return
    own = model.__dict__.get("_loss_function")
    inner = model.loss_function

    def loss_function(*args: Any, **kwargs: Any) -> Any:
        for name, value in loss_kwargs.items():
            kwargs.setdefault(name, value)
        return inner(*args, **kwargs)

    model.loss_function = loss_function
    try:
        yield
    finally:
        if own is None:
            model.__dict__.pop("_loss_function", None)
        else:
            model.loss_function = own


# -- configs ----------------------------------------------------------------------------------------
def vision_model_type(config: Any, vision_config: Any) -> str:
    """The model_type of a multimodal config's vision tower, spelled as its model's
    (``qwen2_5_vl``, ``glm4v``): the top-level config's when it has one (a config object, or a
    config.json read as a dict), else the vision sub-config's, which 5.x names
    ``<model>_vision`` and 4.57 names as the model."""
    def model_type(c: Any) -> str:
        v = c.get("model_type") if isinstance(c, dict) else getattr(c, "model_type", None)
        return v if isinstance(v, str) else ""

    top = model_type(config)
    if top:
        return top
    own = model_type(vision_config)
    return own[: -len("_vision")] if own.endswith("_vision") else own


def builds_rope_index(config: Any) -> bool:
    """True when ``config`` (or one of its sub-configs: an omni model's thinker) is a multimodal
    config (it has a ``vision_config``) whose transformers modeling module lays out multi-row
    position ids with a ``get_rope_index`` (the M-RoPE families). Which families exist, and on
    which class that method sits, differ between releases (4.57 maps no Qwen2.5-Omni thinker class;
    5.6 maps PaddleOCR-VL only by a class whose inner model has it), so the installed modeling
    module is asked rather than a list or the auto mappings."""
    import importlib

    import transformers

    candidates = [config, *(v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig))]
    for cfg in candidates:
        if getattr(cfg, "vision_config", None) is None:
            continue  # a text-only config: its positions are 1-D even where the family has M-RoPE
        name = type(cfg).__module__.replace(".configuration_", ".modeling_")
        try:
            module = importlib.import_module(name)
        except Exception:  # no modeling module beside the config (remote code elsewhere, ...)
            continue
        if any(isinstance(v, type) and hasattr(v, "get_rope_index") for v in vars(module).values()):
            return True
    return False


# -- processors -------------------------------------------------------------------------------------
def image_processor_class(name: str) -> Any:
    """An image processor class by its 5.x name: ``XImageProcessorPil`` (5.x's PIL backend) is
    4.57's slow ``XImageProcessor`` (its fast one needs torchvision), the same resizing rule."""
    import transformers

    found = getattr(transformers, name, None)
    if found is None and name.endswith("Pil"):
        found = getattr(transformers, name[: -len("Pil")], None)
    if found is None:
        return require_class(name)
    return found


@functools.cache
def qwen2_vl_loaded_image_size_kept() -> bool:
    """Whether the Qwen2-VL image processor ``AutoImageProcessor`` loads on this install keeps the
    ``size`` (pixel bounds) its files give. 4.57's slow ``Qwen2VLImageProcessor`` -- what 4.57 loads
    without torchvision, for every Qwen2/2.5/3-VL checkpoint -- replaces any valid ``size`` by its
    class defaults (56^2...28^2*1280 px) and honours only top-level ``min_pixels`` / ``max_pixels``;
    the torchvision class (4.57 forces it whenever torchvision is installed) and every 5.x class keep
    ``size``. Asked of the class that would load, on one probe size; True without transformers."""
    try:
        import transformers
        from transformers.utils import is_torchvision_available
    except ImportError:
        return True
    if is_torchvision_available():
        cls = getattr(transformers, "Qwen2VLImageProcessorFast", None) or transformers.Qwen2VLImageProcessor
    else:
        cls = image_processor_class("Qwen2VLImageProcessorPil")
    probe = {"shortest_edge": 1234, "longest_edge": 567890}
    size = cls(size=dict(probe)).size
    got = {k: size[k] if isinstance(size, dict) else getattr(size, k, None) for k in probe}
    return got == probe


@functools.cache
def qwen2_vl_pixel_attributes_honoured(image_processor_class: type) -> bool:
    """Whether a live Qwen2-VL image processor of this (transformers) class resizes by its
    ``min_pixels`` / ``max_pixels`` attributes when a user sets them after construction
    (``processor.image_processor.max_pixels = ...``), over its ``size``. 4.57's ``preprocess``
    reads the attributes and 5.19+ passes them as call kwargs that override ``size``; 5.6-5.9
    resize by ``size`` alone, so the attributes change nothing there. Asked of the class itself:
    a 28 x 28 image with ``min_pixels`` raised to 112 x 112 after construction is upscaled to 8 x 8
    patches where it counts, to the class default's 56 x 56 (4 x 4 patches) where it is ignored."""
    import numpy as np

    proc = image_processor_class()
    proc.min_pixels = 112 * 112
    out = proc(images=[np.zeros((28, 28, 3), np.uint8)], return_tensors="np",
               input_data_format="channels_last")
    return int(np.prod(np.asarray(out["image_grid_thw"])[0])) == 64


def processor_attributes(processor_or_class: Any) -> list[str]:
    """The sub-processor slots of a processor (``["image_processor", "tokenizer", ...]``): 5.x asks
    ``get_attributes()``, 4.57 keeps a class-level ``attributes`` list."""
    get = getattr(processor_or_class, "get_attributes", None)
    return list(get()) if callable(get) else list(getattr(processor_or_class, "attributes", []))


def set_processor_attributes(processor_or_class: Any, names: list[str]) -> None:
    """Narrow the sub-processor slots a processor saves and loads to ``names``, on either API."""
    names = list(names)
    if callable(getattr(processor_or_class, "get_attributes", None)):
        processor_or_class.get_attributes = lambda: list(names)
    if hasattr(processor_or_class, "attributes"):
        processor_or_class.attributes = list(names)


# -- training ---------------------------------------------------------------------------------------
def revert_weight_conversion(model: Any, state_dict: dict) -> dict:
    """``state_dict`` under the names ``save_pretrained`` writes: 5.x converts some weights at load
    (``transformers.core_model_loading``) and reverts that when saving; 4.57 renames keys by the
    model's ``_checkpoint_conversion_mapping`` (regex -> replacement) and saves under the reverse
    mapping (e.g. Qwen2-VL's ``model.visual.`` as ``visual.``), the first pattern that matches wins."""
    try:
        from transformers.core_model_loading import revert_weight_conversion as revert
    except ImportError:
        import re

        mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
        reverse = [(pattern, re.sub(r"\(.*\)", "", original.lstrip("^")))
                   for original, pattern in mapping.items()]
        saved = {}
        for key, value in state_dict.items():
            for pattern, replacement in reverse:
                key, replaced = re.subn(pattern, replacement, key)
                if replaced:
                    break
            saved[key] = value
        return saved
    return revert(model, state_dict)


def checkpointing_enable(model: Any, use_reentrant: bool = False) -> None:
    """Turn on the model's activation checkpointing: 5.x names it ``activation_checkpointing_enable``
    (``activation_checkpointing_kwargs``), 4.57 ``gradient_checkpointing_enable``
    (``gradient_checkpointing_kwargs``)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def image_processing_module(model: str) -> Any:
    """The module of ``model``'s (e.g. ``"qwen2_vl"``) PIL image processor and its ``smart_resize``:
    5.x ``image_processing_pil_<model>``, 4.57 ``image_processing_<model>`` (the slow, PIL one)."""
    import importlib

    try:
        return importlib.import_module(f"transformers.models.{model}.image_processing_pil_{model}")
    except ModuleNotFoundError:
        return importlib.import_module(f"transformers.models.{model}.image_processing_{model}")


def replace_placeholders(processor: Any, text: str, images: list[str], videos: list[str]) -> str:
    """``text`` with its image / video placeholders replaced by ``images`` / ``videos`` (in text
    order), as the processor's ``__call__`` replaces them: through its own
    ``get_text_with_replacements`` where it has one (a family may rewrite the text around a
    placeholder first: 5.25's Qwen3-VL folds the template's vision start / end wrapper of a video
    into the bare token), else one regex pass over the two placeholder tokens."""
    own = getattr(processor, "get_text_with_replacements", None)
    if callable(own):
        return own([text], list(images), list(videos))[0][0]
    import re

    video, image = getattr(processor, "video_token", None), getattr(processor, "image_token", None)
    pairs = ((video, videos), (image, images))
    queues = {token: iter(values) for token, values in pairs if token}
    pattern = re.compile("|".join(re.escape(t) for t in queues))
    return pattern.sub(lambda m: next(queues[m.group(0)]), text)


def processor_modality_kwargs(processor: Any, **kwargs: Any) -> dict[str, dict]:
    """The per-modality keyword arguments the processor's ``__call__`` hands its image / video
    processors and tokenizer (``{"images_kwargs": ..., "videos_kwargs": ..., "text_kwargs": ...}``):
    its class defaults (InternVL: ``crop_to_patches=True``, videos as ``"pt"``), the tokenizer's
    init kwargs, then ``kwargs``. 5.24+ read the defaults off the processor class
    (``_merge_kwargs(tokenizer_init_kwargs=...)``); 5.19 needs the kwargs class first."""
    init = getattr(getattr(processor, "tokenizer", None), "init_kwargs", {})
    merge = processor._merge_kwargs
    first = next(iter(inspect.signature(merge).parameters.values()), None)
    if first is not None and first.default is inspect.Parameter.empty:   # 5.19: the kwargs class is required
        return merge(processor.valid_processor_kwargs, tokenizer_init_kwargs=init, **kwargs)
    return merge(tokenizer_init_kwargs=init, **kwargs)


def video_token_inputs(grid: tuple[int, int, int] | None, metadata: Any, frames: int,
                       call_frames: int | None = None) -> dict:
    """A shape-only stand-in of a processed video for ``processor.replace_video_token(inputs, 0)``:
    what the families' methods read of it, on every release that has the method. ``grid``: the
    video's ``video_grid_thw`` (Qwen / GLM; None: ``(frames, 1, 1)``), ``metadata`` its
    ``VideoMetadata`` (sampled ``frames_indices``), ``frames`` the frames it keeps (InternVL /
    OneVision read ``pixel_values_videos[i].shape[0]``), ``call_frames`` the most frames any
    video of the same processor call keeps (SmolVLM 5.19-5.24 read the padded
    ``pixel_values.shape[1]``; 5.25 its timestamps; None: ``frames``). No pixel memory."""
    import numpy as np

    def shape_only(*shape: int) -> Any:
        return np.broadcast_to(np.zeros((), np.uint8), shape)

    padded = frames if call_frames is None else max(int(call_frames), frames)
    return {"video_grid_thw": np.asarray([grid if grid is not None else (frames, 1, 1)], np.int64),
            "video_metadata": [metadata], "pixel_values_videos": [shape_only(frames, 3, 1, 1)],
            "pixel_values": shape_only(1, padded, 3, 1, 1)}


def trainer_counts_shifted_labels(trainer: Any) -> bool:
    """Whether the Trainer's ``_get_num_items_in_batch`` counts a causal LM's labels shifted (5.19+:
    ``labels[..., 1:]`` where ``_loss_shifts_labels``); before, every label ``!= -100`` is counted, one
    token per row more than the loss sums over where a row's first label is real."""
    return hasattr(trainer, "_loss_shifts_labels")


def trainer_shuffles_train_data(args: Any) -> bool:
    """Whether ``TrainingArguments`` ask the Trainer to shuffle its train data. From 5.6 its
    ``train_sampling_strategy="sequential"`` trains in dataset order (``SequentialSampler``); 4.57
    has no such option and always shuffles (``group_by_length`` aside)."""
    return getattr(args, "train_sampling_strategy", "random") != "sequential"


def trainer_length_grouping(args: Any) -> str | None:
    """The ``TrainingArguments`` setting that asks the Trainer to group its train samples by length,
    as the user wrote it (``"group_by_length=True"`` on 4.57; ``"train_sampling_strategy='...'"``
    with ``"group_by_length"``, or from 5.25 ``"batch_rebalance"``, on 5.x), or ``None``. Each reads
    its lengths from the ``length_column_name`` column."""
    strategy = getattr(args, "train_sampling_strategy", None)
    if strategy is not None:
        return None if strategy in ("random", "sequential") else f"train_sampling_strategy={strategy!r}"
    return "group_by_length=True" if getattr(args, "group_by_length", False) else None


@dataclass(frozen=True)
class TrainerDataParallel:
    """How a ``Trainer``'s train data is split: ``size`` data-parallel ranks, this process being
    ``rank``; the tensor / context / sequence parallel sizes whose peers share one batch; ``source``
    names where the split was read (for messages)."""

    size: int
    rank: int
    tp_size: int = 1
    cp_size: int = 1
    sp_size: int = 1
    source: str = "the world size"


def trainer_data_parallel(trainer: Any) -> TrainerDataParallel:
    """The data-parallel split of ``trainer``'s train loader as accelerate's ``prepare_data_loader``
    makes it for the Trainer's own sampler (accelerate 1.11 and 1.16, ``data_loader.py``: 1109-1145
    and 1117-1153). The mesh it reads is ``Accelerator._prepare_device_mesh()`` (1.16
    ``accelerator.py``:2584-2592): under DeepSpeed the ``("tp",)`` mesh of size
    ``tensor_parallel.autotp_size`` (made in ``_prepare_deepspeed``, 2121-2135, when the loader is
    prepared; read here from the same config), else ``accelerator.torch_device_mesh``, which
    ``Accelerator.__init__`` builds from the ``ParallelismConfig`` (4.57: also from the
    ``TorchTensorParallelPlugin`` the Trainer makes for a tensor-parallel model, 4.57
    ``trainer.py``:5504-5507; 5.6+: the ``ParallelismConfig`` the Trainer makes from ``model.tp_size``,
    5.24 ``trainer.py``:777-790) in the order ``dp_replicate, dp_shard, cp, sp, tp``:

    - DeepSpeed: ``world // tp`` ranks, rank ``process_index // tp``;
    - a mesh: ``dp_replicate x dp_shard`` ranks, rank ``process_index // (tp x cp)``;
    - no mesh: the world, rank ``process_index``.

    ``sp_size`` is the ``ParallelismConfig``'s (DeepSpeed ALST / Ulysses; no mesh is built for it,
    5.24 ``trainer.py``:1803-1806 wraps the prepared loader in DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` instead). Raises ``ValueError`` when the mesh does not split the
    world into data-parallel x tp x cp ranks, or when the model is tensor-parallel
    (``Trainer.get_tp_size()``) and accelerate has no mesh to give its TP peers one batch."""
    args = trainer.args
    world, rank = max(1, int(args.world_size)), int(args.process_index) if int(args.world_size) > 1 else 0
    accelerator = trainer.accelerator
    pc = getattr(accelerator, "parallelism_config", None)        # accelerate >= 1.10
    sp = int(getattr(pc, "sp_size", 1) or 1) if pc is not None else 1
    mesh = getattr(accelerator, "torch_device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()

    def dim(name: str) -> int:
        return int(mesh.size(names.index(name))) if name in names else 1

    if getattr(trainer, "is_deepspeed_enabled", False):
        config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
        tp = int((config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0)
        tp = tp if tp > 1 else dim("tp")
        if world % tp:
            raise ValueError(f"DeepSpeed tensor_parallel.autotp_size={tp} does not divide the world size "
                             f"{world}")
        return TrainerDataParallel(world // tp, rank // tp, tp_size=tp, sp_size=sp,
                                   source=f"DeepSpeed tensor_parallel.autotp_size={tp}")
    if mesh is None:
        model_tp = int(trainer.get_tp_size()) if hasattr(trainer, "get_tp_size") else 1
        if model_tp > 1:
            raise ValueError(f"the model is tensor-parallel (tp_size={model_tp}) but accelerate has no "
                             "device mesh to give its TP peers one batch: pass TrainingArguments("
                             f"parallelism_config=ParallelismConfig(tp_size={model_tp}, ...))")
        return TrainerDataParallel(world, rank, sp_size=sp)
    tp, cp = dim("tp"), dim("cp")
    dp = dim("dp_replicate") * dim("dp_shard")
    sizes = {n: int(mesh.size(i)) for i, n in enumerate(names)}
    if dp * tp * cp != world:
        raise ValueError(f"accelerate's device mesh {sizes} does not split the {world} ranks into "
                         "data-parallel (dp_replicate x dp_shard) x tp x cp ranks; tokenbal cannot tell "
                         "which ranks share a batch")
    return TrainerDataParallel(dp, rank // (tp * cp), tp, cp, sp, source=f"accelerate's device mesh {sizes}")
