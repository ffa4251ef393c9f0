"""Registry of vision estimators: ``get_estimator(name, **overrides)`` and ``load_estimator(dir)``.

Every estimator has ``.name``, ``.config`` (JSON-serialisable, written into the index manifest),
``.image_tokens(width, height)``, ``.image_tokens_batch(widths, heights)``, ``.wrapper_tokens``;
models with video support also have ``.video_tokens(num_frames, width, height, fps)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenbal.estimate.families import FAMILIES
from tokenbal.estimate.glm4v import make_glm4v
from tokenbal.estimate.idefics import make_idefics3
from tokenbal.estimate.llava import LlavaNextEstimator, LlavaOneVisionEstimator
from tokenbal.estimate.phi4 import make_phi4
from tokenbal.estimate.qwen import QWEN_FAMILIES, make_qwen
from tokenbal.estimate.tiles import make_tiles
from tokenbal.hf_compat import qwen2_vl_loaded_image_size_kept, qwen2_vl_pixel_attributes_honoured

# accepted spellings (the keys, transformers' / the original repos' ``model_type``) -> key; the one
# table of families and their spellings is tokenbal.estimate.families.
_ALIASES = {name: f.key for f in FAMILIES for name in (f.key, *f.model_types, *f.aliases)}

# key -> the family's estimator with its defaults, then overrides (every key of FAMILIES has one)
_FACTORIES: dict[str, Callable[..., Any]] = {
    **{name: (lambda n: lambda **kw: make_qwen(n, **kw))(name) for name in QWEN_FAMILIES},
    "internvl": lambda **kw: make_tiles("internvl", **kw),
    "tiles": lambda **kw: make_tiles("tiles", **kw),
    "llava-next": lambda **kw: LlavaNextEstimator().replace(**kw),
    "llava-onevision": lambda **kw: LlavaOneVisionEstimator().replace(**kw),
    "idefics3": lambda **kw: make_idefics3("idefics3", **kw),
    "smolvlm": lambda **kw: make_idefics3("smolvlm", **kw),
    "glm-4.1v": make_glm4v,
    "phi-4-multimodal": make_phi4,
}


def estimator_names() -> list[str]:
    return sorted(_FACTORIES)


def get_estimator(name: str, **overrides: Any) -> Any:
    """The estimator for model family ``name`` with official-checkpoint defaults and ``overrides``.

    Names: "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "internvl", "tiles", "llava-next",
    "llava-onevision", "idefics3", "smolvlm", "glm-4.1v", "phi-4-multimodal" (transformers
    ``model_type`` spellings such as "qwen2_5_vl" are accepted too). Unknown names raise
    ``ValueError`` listing the known ones; unknown overrides raise
    ``TypeError`` listing the accepted settings.
    """
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in _FACTORIES:
        raise ValueError(f"unknown estimator {name!r}; known: {estimator_names()}")
    return _FACTORIES[key](**overrides)


# --------------------------------------------------------------------------------------------------
# load_estimator: read a local checkpoint folder the way transformers' Auto* classes would


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    return data


def _processor_dicts(model_dir: Path) -> tuple[dict | None, dict | None]:
    """(image processor dict, video processor dict) with transformers 5.x's lookup order:
    ``processor_config.json``'s nested entry, else ``preprocessor_config.json`` for images and
    ``video_preprocessor_config.json`` then ``preprocessor_config.json`` for videos."""
    nested = _read_json(model_dir / "processor_config.json") or {}
    pre = _read_json(model_dir / "preprocessor_config.json")
    image = nested.get("image_processor") or pre
    video = nested.get("video_processor") or _read_json(model_dir / "video_preprocessor_config.json") or pre
    return image, video


# transformers 5.24 class defaults, used for keys a checkpoint's file leaves out (that is what
# AutoProcessor would use), as opposed to get_estimator's hub defaults.
# One row per processor class, the same keys in the same order so the rows read as a table.
_QWEN_IMAGE_CLASS = dict(shortest_edge=56 * 56, longest_edge=28 * 28 * 1280,
                         patch_size=14, merge_size=2, temporal_patch_size=2)
_QWEN2_VIDEO_CLASS = dict(shortest_edge=128 * 28 * 28, longest_edge=768 * 28 * 28,
                          patch_size=14, merge_size=2, temporal_patch_size=2, max_video_tokens=128000)
_QWEN3_VIDEO_CLASS = dict(shortest_edge=128 * 32 * 32, longest_edge=768 * 32 * 32,
                          patch_size=16, merge_size=2, temporal_patch_size=2, max_video_tokens=768)


def _qwen_size(d: dict, class_defaults: dict, legacy_keys: bool, size_kept: bool = True) -> tuple[int, int]:
    size = dict(d.get("size") or {}) if size_kept else {}
    lo = size.get("shortest_edge", size.get("min_pixels"))
    hi = size.get("longest_edge", size.get("max_pixels"))
    if legacy_keys:  # Qwen2VL{Image,Video}Processor.__init__: top-level min/max_pixels win over size
        lo = d.get("min_pixels") if d.get("min_pixels") is not None else lo
        hi = d.get("max_pixels") if d.get("max_pixels") is not None else hi
    lo = class_defaults["shortest_edge"] if lo is None else lo
    hi = class_defaults["longest_edge"] if hi is None else hi
    return int(lo), int(hi)


def _qwen_settings(family: str, image: dict | None, video: dict | None, image_size_kept: bool = True,
                   image_pixel_keys: bool = True) -> dict:
    """``image_size_kept``: False where the image processor these files load drops their ``size``
    (4.57's slow class, :func:`tokenbal.hf_compat.qwen2_vl_loaded_image_size_kept`).
    ``image_pixel_keys``: False where a live image processor's ``min_pixels`` / ``max_pixels``
    attributes do not count (5.6-5.9, :func:`tokenbal.hf_compat.qwen2_vl_pixel_attributes_honoured`)."""
    out: dict[str, Any] = {}
    img = image or {}
    out["min_pixels"], out["max_pixels"] = _qwen_size(img, _QWEN_IMAGE_CLASS, legacy_keys=image_pixel_keys,
                                                      size_kept=image_size_kept)
    for k in ("patch_size", "merge_size", "temporal_patch_size"):
        out[k] = int(img.get(k, _QWEN_IMAGE_CLASS[k]))
    vid = video or {}
    qwen3 = family == "qwen3-vl"
    vdef = _QWEN3_VIDEO_CLASS if qwen3 else _QWEN2_VIDEO_CLASS
    out["video_min_pixels"], out["video_max_pixels"] = _qwen_size(vid, vdef, legacy_keys=not qwen3)
    out["max_video_tokens"] = int(vid.get("max_video_tokens", vdef["max_video_tokens"]))
    for src, dst in (
        ("fps", "video_fps"),
        ("min_frames", "video_min_frames"),
        ("max_frames", "video_max_frames"),
    ):
        if vid.get(src) is not None:
            out[dst] = vid[src]
    if vid.get("cap_pixels_per_frame") is not None:
        out["cap_pixels_per_frame"] = bool(vid["cap_pixels_per_frame"])
    # The video processor's geometry must match the image one for the model to work; if a file
    # disagrees we cannot represent it with one set of fields, so say so rather than guess.
    for k in ("patch_size", "merge_size", "temporal_patch_size"):
        v = int(vid.get(k, vdef[k]))
        if video is not None and v != out[k]:
            raise ValueError(f"{family}: video processor {k}={v} differs from image processor {k}={out[k]}")
    return out


def load_estimator(model_dir: str | Path, **overrides: Any) -> Any:
    """The estimator for a local checkpoint folder (``config.json`` + processor configs).

    The family comes from ``config.json``'s ``model_type``; settings from the processor configs,
    read in transformers' order (see ``_processor_dicts``); keys a file leaves out take
    transformers' class defaults, exactly as ``AutoProcessor.from_pretrained`` would. ``overrides``
    are applied last.
    """
    d = Path(model_dir)
    cfg = _read_json(d / "config.json")
    image, video = _processor_dicts(d)
    if cfg is None:
        # A processor folder (processor.save_pretrained): the family comes from its processor class.
        family = _family_from_processor_files(d, image)
        if family is None:
            raise FileNotFoundError(f"{str(d)!r} has no config.json, and no processor_class / "
                                    "image_processor_type in its processor configs names a known family")
        cfg, model_type = {}, family
    else:
        model_type = str(cfg.get("model_type", ""))
        family = _ALIASES.get(model_type) or ("llava" if model_type == "llava" else None)
    if family is None:
        raise ValueError(
            f"{str(d / 'config.json')!r}: model_type {model_type!r} has no estimator; "
            f"known: {sorted(set(_ALIASES))}"
        )
    if image is not None:
        _refuse_unresized(family, image, str(d))
    if family == "internvl" and model_type == "internvl_chat":  # original (remote-code) checkpoint
        settings = _internvl_chat_settings(cfg)
    elif image is None:
        raise FileNotFoundError(f"{str(d)!r} has neither preprocessor_config.json nor processor_config.json")
    elif family in QWEN_FAMILIES:
        # the counts of the image processor these files load here (4.57 without torchvision drops size)
        settings = _qwen_settings(family, image, video, image_size_kept=qwen2_vl_loaded_image_size_kept())
    elif family == "internvl":
        settings = _internvl_hf_settings(image, _read_json(d / "processor_config.json") or {})
    elif family in ("idefics3", "smolvlm"):
        settings = _idefics3_settings(image, _read_json(d / "processor_config.json") or {})
    elif family == "glm-4.1v":
        settings = _glm4v_settings(image)
    elif family == "phi-4-multimodal":
        settings = _phi4_settings(image, str(d))
    elif family == "llava":   # LLaVA-1.5: one fixed count per image, a one-tile ``tiles`` estimator
        return get_estimator("tiles", **{**_llava_folder_settings(d, cfg, image), **overrides})
    else:
        settings = _llava_settings(family, cfg, image)
    return get_estimator(family, **{**settings, **overrides})


# transformers processor classes -> estimator family. A processor is resolved by what it is: the
# first transformers class of its MRO named here (so a user's subclass resolves like its base),
# else its image processor's transformers class (see ``_IMAGE_PROCESSOR_FAMILIES``). Each family's
# placeholder expansion is in ``tokenbal.estimate.chat`` (``_FAMILY_EXPANSIONS``).
_PROCESSOR_FAMILIES = {
    "Qwen2VLProcessor": "qwen2-vl",
    "Qwen2_5_VLProcessor": "qwen2.5-vl",
    "Qwen3VLProcessor": "qwen3-vl",
    "Qwen3VLMoeProcessor": "qwen3-vl",
    "LlavaNextProcessor": "llava-next",
    "LlavaOnevisionProcessor": "llava-onevision",
    "LlavaProcessor": "llava",
    "InternVLProcessor": "internvl",
    "Glm4vProcessor": "glm-4.1v",
    "Idefics3Processor": "idefics3",
    "SmolVLMProcessor": "smolvlm",
    "Phi4MultimodalProcessor": "phi-4-multimodal",
}

# image processor classes (without the ``Fast`` / ``Pil`` backend suffix) -> family, for processors
# whose own class is not one of the above (a processor written from scratch around a known image
# processor). Only image processors that one family alone uses; a shared one (CLIP's, used by
# LLaVA and others) does not say which processor expands its placeholders how.
_IMAGE_PROCESSOR_FAMILIES = {
    "Qwen2VLImageProcessor": "qwen2-vl",
    "LlavaNextImageProcessor": "llava-next",
    "LlavaOnevisionImageProcessor": "llava-onevision",
    "GotOcr2ImageProcessor": "internvl",
    "Glm4vImageProcessor": "glm-4.1v",
    "Idefics3ImageProcessor": "idefics3",
    "SmolVLMImageProcessor": "smolvlm",
    "Phi4MultimodalImageProcessor": "phi-4-multimodal",
}


def _family_from_processor_files(d: Path, image: dict | None) -> str | None:
    """The family a processor folder's files name: its processor class, else (a user's subclass
    saved with ``save_pretrained`` names its own class) its image processor's type, as
    :func:`processor_family` resolves a loaded processor."""
    names = [(_read_json(d / "processor_config.json") or {}).get("processor_class"),
             (image or {}).get("processor_class")]
    for name in names:
        if name in _PROCESSOR_FAMILIES:
            return _PROCESSOR_FAMILIES[name]
    image_type = (image or {}).get("image_processor_type")
    if not isinstance(image_type, str):
        return None
    return _IMAGE_PROCESSOR_FAMILIES.get(_image_processor_base(image_type))


def _transformers_classes(obj: Any) -> list[type]:
    return [c for c in type(obj).__mro__ if c.__module__.split(".")[0] == "transformers"]


def _image_processor_base(name: str) -> str:
    for suffix in ("Fast", "Pil"):
        if name.endswith(suffix) and name[: -len(suffix)] in _IMAGE_PROCESSOR_FAMILIES:
            return name[: -len(suffix)]
    return name


def processor_family(processor: Any) -> str:
    """The tokenbal family of a loaded transformers processor, by what it is: the nearest
    transformers class in its MRO that tokenbal knows (a subclass resolves as its base), else the
    transformers class of its image processor. ``ValueError`` naming the processor, its
    transformers base classes and the supported processors when neither is known."""
    for cls in _transformers_classes(processor):
        if cls.__name__ in _PROCESSOR_FAMILIES:
            return _PROCESSOR_FAMILIES[cls.__name__]
    image_proc = getattr(processor, "image_processor", None)
    if image_proc is not None:
        for cls in _transformers_classes(image_proc):
            family = _IMAGE_PROCESSOR_FAMILIES.get(_image_processor_base(cls.__name__))
            if family is not None:
                return family
    bases = [c.__name__ for c in _transformers_classes(processor)]
    image_name = type(image_proc).__name__ if image_proc is not None else None
    raise ValueError(
        f"no tokenbal estimator for processor {type(processor).__name__} (transformers bases: "
        f"{', '.join(bases) or 'none'}; image processor: {image_name}); supported processors (and "
        f"their subclasses): {', '.join(sorted(_PROCESSOR_FAMILIES))}; or one built around the image "
        f"processors {', '.join(sorted(_IMAGE_PROCESSOR_FAMILIES))}")


def estimator_from_processor(processor: Any, **overrides: Any) -> Any:
    """The estimator of a loaded transformers processor, from its own image (and video) processor
    settings, read exactly as :func:`load_estimator` reads them from the files the processor would
    save (``image_processor.to_dict()``): no setting is retyped. The family comes from
    :func:`processor_family` (class hierarchy, then image processor); per family the processor's
    own attributes that change counts are read too (LLaVA's patch size and feature strategy,
    InternVL's ``image_seq_length``, Idefics3 / SmolVLM's ``image_seq_len``, OneVision's
    ``num_image_tokens``). ``llava`` (LLaVA-1.5: one fixed count per image) is a ``tiles``
    estimator of one tile. Unknown processors raise ``ValueError`` (see :func:`processor_family`)."""
    name = type(processor).__name__
    family = processor_family(processor)
    image_proc = getattr(processor, "image_processor", None)
    if image_proc is None:
        raise ValueError(f"{name} has no image_processor")
    image = image_proc.to_dict()
    _refuse_unresized(family, image, name)
    if family in ("llava-next", "llava"):
        strategy = getattr(processor, "vision_feature_select_strategy", "default")
        extra = getattr(processor, "num_additional_image_tokens", 1 if family == "llava-next" else 0)
        patch = getattr(processor, "patch_size", None)
        if patch is None:
            raise ValueError(f"{name}: patch_size is not set, so the processor itself cannot count "
                             "image tokens")
        if family == "llava":
            return get_estimator("tiles", **{**_llava_fixed_settings(name, image, int(patch), strategy,
                                                                     int(extra or 0)), **overrides})
        if (strategy, extra) != ("default", 1):   # the estimator models the CLS-dropping checkpoints
            raise ValueError(f"{name}: vision_feature_select_strategy={strategy!r} with "
                             f"num_additional_image_tokens={extra} is not modelled (only 'default' with 1)")
        cfg = {"vision_config": {"patch_size": patch}, "vision_feature_select_strategy": strategy}
        return get_estimator(family, **{**_llava_settings(family, cfg, image), **overrides})
    if family == "llava-onevision":
        strategy = getattr(processor, "vision_feature_select_strategy", "full")
        ratio = str(getattr(processor, "vision_aspect_ratio", "anyres_max_9"))
        if strategy != "full" or not ratio.startswith("anyres_max_"):
            raise ValueError(f"{name}: vision_feature_select_strategy={strategy!r}, vision_aspect_ratio="
                             f"{ratio!r} are not modelled (only 'full' with 'anyres_max_N')")
        crop = image.get("size") or {}
        side = int(round(int(getattr(processor, "num_image_tokens", 729)) ** 0.5))
        crop_size = int(crop.get("height", crop.get("shortest_edge", 384)))
        # SigLIP-384 / patch 14 gives a 27 x 27 grid (384 // 14): the patch that gives the processor's grid
        if side <= 0 or crop_size // (crop_size // side) != side:
            raise ValueError(f"{name}: no patch size gives a {side}x{side} feature grid on {crop_size}-px "
                             f"crops (num_image_tokens={getattr(processor, 'num_image_tokens', None)})")
        settings = {**_llava_settings(family, {"vision_feature_select_strategy": "full"}, image),
                    "patch_size": crop_size // side, "max_num_views": int(ratio[len("anyres_max_"):])}
        return get_estimator(family, **{**settings, **overrides})
    if family == "internvl":
        seq = getattr(processor, "image_seq_length", 256)
        settings = _internvl_hf_settings(image, {"image_seq_length": seq})
        return get_estimator(family, **{**settings, **overrides})
    if family in ("idefics3", "smolvlm"):
        settings = _idefics3_settings(image, {"image_seq_len": getattr(processor, "image_seq_len", 169)})
        return get_estimator(family, **{**settings, **overrides})
    if family == "glm-4.1v":
        return get_estimator(family, **{**_glm4v_settings(image), **overrides})
    if family == "phi-4-multimodal":
        return get_estimator(family, **{**_phi4_settings(image, name), **overrides})
    video_proc = getattr(processor, "video_processor", None)
    video = video_proc.to_dict() if video_proc is not None else None
    # a user may have set min_pixels / max_pixels on the live object; whether the processor then
    # resizes by them depends on the release
    pixel_keys = (image.get("min_pixels") is None and image.get("max_pixels") is None) \
        or qwen2_vl_pixel_attributes_honoured(_transformers_classes(image_proc)[0])
    return get_estimator(family, **{**_qwen_settings(family, image, video, image_pixel_keys=pixel_keys),
                                    **overrides})


def _refuse_unresized(family: str, image: dict, where: str) -> None:
    """Raise for an image processor set not to resize (``do_resize=False``): it keeps every image at its
    own size (or fails on it), which no estimator models, so a count would be wrong rather than close.
    Phi-4-multimodal's processor ignores the flag (its crops are always resized)."""
    if family != "phi-4-multimodal" and image.get("do_resize") is False:
        raise ValueError(f"{where}: a {family} image processor with do_resize=False is not modelled (it "
                         "keeps each image at its own size); set do_resize=True, or count with the "
                         "processor itself")


def _phi4_settings(image: dict, where: str) -> dict:
    """Phi-4-multimodal's ``dynamic_hd``; its 256 + 16 global-view tokens are fixed by the 448-px
    crop and 14-px patch (transformers writes them as constants), so other sizes are refused."""
    size = image.get("size") or {}
    crop = (int(size.get("height", 448)), int(size.get("width", 448)))
    patch = int(image.get("patch_size", 14))
    if crop != (448, 448) or patch != 14:
        raise ValueError(f"{where}: Phi-4-multimodal image processor with size {crop[0]}x{crop[1]} and "
                         f"patch_size {patch} is not modelled (only 448x448 crops of 14-px patches)")
    return {"dynamic_hd": int(image.get("dynamic_hd", 36))}


def _llava_folder_settings(d: Path, cfg: dict, image: dict) -> dict:
    """LLaVA-1.5 from a folder: the patch size, feature strategy and extra tokens the processor
    reads (``processor_config.json``, which ``LlavaProcessor.save_pretrained`` writes; a key it
    lacks takes ``LlavaProcessor``'s default), else the checkpoint's ``config.json``
    (``vision_config.patch_size``, ``vision_feature_select_strategy``) with the CLIP tower's CLS
    position counted (``num_additional_image_tokens`` 1, what the llava-hf processor configs say:
    576 tokens per 336-px image with the ``default`` strategy)."""
    proc = _read_json(d / "processor_config.json")
    extra = 1 if proc is None else proc.get("num_additional_image_tokens", 0)
    proc = proc or {}
    patch = proc.get("patch_size") or (cfg.get("vision_config") or {}).get("patch_size")
    if patch is None:
        raise ValueError(f"{str(d)!r}: LLaVA folder without a patch size (processor_config.json patch_size "
                         "or config.json vision_config.patch_size), so its image tokens are unknown")
    strategy = proc.get("vision_feature_select_strategy") or cfg.get("vision_feature_select_strategy",
                                                                     "default")
    return _llava_fixed_settings(str(d), image, int(patch), str(strategy), int(extra or 0))


def _llava_fixed_settings(name: str, image: dict, patch: int, strategy: str, extra: int) -> dict:
    """LLaVA-1.5 (``LlavaProcessor``): every image is resized and centre-cropped to one size, so each
    costs ``(h // patch) * (w // patch) + num_additional_image_tokens`` tokens, one less with the
    ``default`` strategy (CLS dropped): a one-tile ``tiles`` estimator with that count."""
    if not image.get("do_center_crop", False):
        raise ValueError(f"{name}: an image processor without a centre crop gives images of varying "
                         "size; LLaVA counts are modelled for the centre-cropped processor only")
    crop = image.get("crop_size") or {}
    h, w = int(crop.get("height", 336)), int(crop.get("width", 336))
    tokens = (h // patch) * (w // patch) + extra - (1 if strategy == "default" else 0)
    return {"tokens_per_tile": tokens, "max_tiles": 1, "min_tiles": 1, "use_thumbnail": False,
            "wrapper_tokens": 0, "tile_size": max(h, w)}


def _internvl_chat_settings(cfg: dict) -> dict:
    # OpenGVLab/InternVL* config.json: force_image_size, max/min_dynamic_patch, use_thumbnail,
    # downsample_ratio and the ViT patch size give the tile geometry directly.
    vision = cfg.get("vision_config") or {}
    tile = int(cfg.get("force_image_size") or vision.get("image_size", 448))
    patch = int(vision.get("patch_size", 14))
    ratio = float(cfg.get("downsample_ratio", 0.5))
    return {
        "tile_size": tile,
        "tokens_per_tile": int((tile // patch) ** 2 * ratio**2),
        "max_tiles": int(cfg.get("max_dynamic_patch", 12)),
        "min_tiles": int(cfg.get("min_dynamic_patch", 1)),
        "use_thumbnail": bool(cfg.get("use_thumbnail", True)),
    }


def _internvl_hf_settings(image: dict, processor: dict) -> dict:
    # transformers InternVL: GotOcr2ImageProcessor (crop_to_patches forced on by the processor,
    # thumbnail always added) + InternVLProcessor.image_seq_length
    size = image.get("size") or {}
    tile = int(size.get("height", 384))  # GotOcr2 class default 384
    if int(size.get("width", tile)) != tile:
        raise ValueError(f"internvl: non-square tiles {size} are not supported")
    return {
        "tile_size": tile,
        "max_tiles": int(image.get("max_patches", 12)),
        "min_tiles": int(image.get("min_patches", 1)),
        "tokens_per_tile": int(processor.get("image_seq_length", 256)),
        "use_thumbnail": True,
    }


def _idefics3_settings(image: dict, processor: dict) -> dict:
    # transformers class defaults for missing keys: size 1456, tile 364 (both Idefics3 and SmolVLM
    # image processors), processor image_seq_len 169
    return {
        "longest_edge": int((image.get("size") or {}).get("longest_edge", 4 * 364)),
        "tile_size": int((image.get("max_image_size") or {}).get("longest_edge", 364)),
        "do_image_splitting": bool(image.get("do_image_splitting", True)),
        "image_seq_len": int(processor.get("image_seq_len", 169)),
    }


def _glm4v_settings(image: dict) -> dict:
    size = image.get("size") or {}
    return {  # Glm4vImageProcessor class defaults for missing keys
        "min_pixels": int(size.get("shortest_edge", 112 * 112)),
        "max_pixels": int(size.get("longest_edge", 28 * 28 * 15000)),
        "patch_size": int(image.get("patch_size", 14)),
        "merge_size": int(image.get("merge_size", 2)),
        "temporal_patch_size": int(image.get("temporal_patch_size", 2)),
    }


def _llava_settings(family: str, cfg: dict, image: dict) -> dict:
    # LLaVA-NeXT configs give the crop as crop_size; OneVision's give it as size {height, width}
    crop = image.get("crop_size") or image.get("size") or {}
    default_crop = 336 if family == "llava-next" else 384
    out: dict[str, Any] = {"crop_size": int(crop.get("height", crop.get("shortest_edge", default_crop)))}
    if image.get("image_grid_pinpoints"):
        out["pinpoints"] = [tuple(int(x) for x in p) for p in image["image_grid_pinpoints"]]
    patch = (cfg.get("vision_config") or {}).get("patch_size")
    if patch:
        out["patch_size"] = int(patch)
    strategy = cfg.get("vision_feature_select_strategy", "default" if family == "llava-next" else "full")
    if (family == "llava-next") != (strategy == "default"):
        raise ValueError(f"{family}: vision_feature_select_strategy={strategy!r} is not modelled")
    return out


def image_tokens_checked(est: Any, widths: Any, heights: Any) -> tuple[np.ndarray, dict[int, str]]:
    """``est.image_tokens_batch`` that does not fail the whole batch for one bad image.

    Returns ``(tokens, errors)``: ``tokens`` is int64 with ``-1`` where the image cannot be counted,
    and ``errors`` maps those indices to the estimator's message (e.g. a 0 side, or an aspect ratio
    the model's processor rejects). The vectorised path runs when the batch is clean; otherwise the
    elements are counted one by one, so the cost of a bad element is one scalar pass over its batch.
    """
    try:
        return np.asarray(est.image_tokens_batch(widths, heights), dtype=np.int64), {}
    except ValueError:
        pass
    ws, hs = list(np.asarray(widths, dtype=object)), list(np.asarray(heights, dtype=object))
    if len(ws) != len(hs):
        raise ValueError(f"widths and heights differ in length: {len(ws)} vs {len(hs)}")
    out = np.full(len(ws), -1, dtype=np.int64)
    errors: dict[int, str] = {}
    for i, (w, h) in enumerate(zip(ws, hs, strict=True)):
        try:
            out[i] = est.image_tokens(w, h)
        except ValueError as e:
            errors[i] = str(e)
    return out, errors
