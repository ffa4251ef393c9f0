"""Packed calls of LLaVA's crop towers (LLaVA-NeXT "anyres", LLaVA-OneVision "anyres_max_9" and
its videos): every image is a base view plus a grid of crops, every video a stack of frames, all
the same ``(C, S, S)`` size, so one tower call covers every crop and frame of the batch.

transformers runs the tower once for images (``get_image_features``) and once more for videos
(``get_video_features``), each only when present, and derives each image's crop count from
``image_sizes`` with ``.tolist()`` on a tensor. Here :func:`encode` concatenates the batch's crops
and frames (images first, the order of the collator's ``vision_token_index``), runs the tower once
(or on one zero crop when the batch has no vision: the idle pass), and then hands the outputs to
transformers' own post-processing methods — the projector, ``pack_image_features`` (unpad, newline,
OneVision's downsampling) and ``apply_pooling`` — with ``image_sizes`` and the crop / frame counts
as host lists from the collator, so nothing is read back from the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from collate.models import core

# Host fields of a LLaVA batch (collate.packing), popped by the core with the vision fields.
ANYRES_KEYS = ("image_sizes", "image_num_tiles", "batch_num_images", "video_num_frames", "image_sizes_videos")


def crop_counts(model: nn.Module, image_sizes: list[list[int]],
                batch_num_images: list[int] | None) -> list[int]:
    """Crops per image from its size (transformers' ``image_size_to_num_patches``), for a batch
    without the collator's ``image_num_tiles``; OneVision keeps only the base view of an image that
    shares its sample with others (``batch_num_images``)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    config = model.config
    if batch_num_images is None:
        patching = [True] * len(image_sizes)
    else:
        patching = [n == 1 for n in batch_num_images for _ in range(n)]
    side = config.vision_config.image_size
    return [image_size_to_num_patches(list(size), config.image_grid_pinpoints, side) if patch else 1
            for size, patch in zip(image_sizes, patching, strict=True)]


def _host_list(value: Any) -> list | None:
    # A hand-made batch may carry processor tensors; a collator batch carries host lists.
    if value is None:
        return None
    return value.tolist() if isinstance(value, torch.Tensor) else [list(v) if isinstance(v, (list, tuple))
                                                                   else v for v in value]


def _flat_crops(pixel_values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    if pixel_values.dim() == 4:  # the collator's (crops, C, S, S)
        return pixel_values
    if pixel_values.dim() != 5:
        raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: expected 4 or 5 dimensions")
    return torch.cat([pix[:n] for pix, n in zip(pixel_values, counts, strict=True)])


def tower_features(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Projected per-crop features ``(crops, tokens, hidden)``: tower, the configured hidden
    layer(s), CLS dropped for ``vision_feature_select_strategy="default"``, the projector."""
    inner = model.model
    config = model.config
    out = inner.vision_tower(pixels.to(inner.vision_tower.dtype), output_hidden_states=True, return_dict=True)
    layer = config.vision_feature_layer
    if isinstance(layer, int):
        selected = out.hidden_states[layer]
    else:
        selected = torch.cat([out.hidden_states[i] for i in layer], dim=-1)
    if config.vision_feature_select_strategy == "default":
        selected = selected[:, 1:]
    return inner.multi_modal_projector(selected)


def idle_crop(model: nn.Module, device: torch.device, height: int, width: int) -> torch.Tensor:
    """One zero ``(1, C, height, width)`` crop or tile for the idle pass, built once per device."""
    cache = core.idle_cache(model)
    if device not in cache:
        cache[device] = torch.zeros(1, model.config.vision_config.num_channels, height, width, device=device)
    return cache[device]


def _pack_images(model: nn.Module, features: list[torch.Tensor], sizes: list[list[int]],
                 pack_options: tuple[str, ...]) -> list[torch.Tensor]:
    # transformers' pack_image_features, with the config fields the family's version takes
    options = {name: getattr(model.config, name) for name in pack_options}
    packed, _ = model.model.pack_image_features(features, sizes, image_newline=model.model.image_newline,
                                                **options)
    return packed


def encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any], idle_vision: bool,
           pack_options: tuple[str, ...], videos: bool) -> core.Encoded | None:
    """One tower call on every crop and frame of the batch (or on the idle crop); pops the pixel
    fields from ``kwargs``. ``pack_options``: the config fields the family's
    ``pack_image_features`` takes as keywords; ``videos``: the family has a video path (OneVision's
    pooling)."""
    config = model.config
    pixel_values = kwargs.pop("pixel_values", None)
    pixel_values_videos = kwargs.pop("pixel_values_videos", None)
    sizes = _host_list(vision.get("image_sizes"))
    for name in ANYRES_KEYS:
        kwargs.pop(name, None)
    if pixel_values_videos is not None and not videos:
        raise ValueError(f"{config.model_type} has no video path; got pixel_values_videos")
    if pixel_values is None and pixel_values_videos is None:
        if not idle_vision:
            return None
        side = config.vision_config.image_size
        features = tower_features(model, idle_crop(model, kwargs["inputs_embeds"].device, side, side))
        # One crop takes the base-view branch of pack_image_features: features plus the newline.
        packed = _pack_images(model, [features], [[side, side]], pack_options)
        return core.Encoded(None, idle_zero=0.0 * torch.cat(packed).sum())

    parts, tokens = [], []
    counts: list[int] = []
    if pixel_values is not None:
        if sizes is None:
            raise ValueError("pixel_values given without image_sizes")
        counts = _host_list(vision.get("image_num_tiles")) or crop_counts(
            model, sizes, _host_list(vision.get("batch_num_images")))
        if len(counts) != len(sizes):
            raise ValueError(f"image_num_tiles has {len(counts)} entries for {len(sizes)} image_sizes")
        parts.append(_flat_crops(pixel_values, counts))
        tokens.append(int(config.image_token_id))
    frames: list[int] = []
    if pixel_values_videos is not None:
        if pixel_values_videos.dim() == 5:  # processor layout (videos, frames, C, S, S)
            frames = [pixel_values_videos.shape[1]] * pixel_values_videos.shape[0]
            pixel_values_videos = pixel_values_videos.flatten(0, 1)
        else:
            frames = _host_list(vision.get("video_num_frames"))
            if frames is None:
                raise ValueError("4-D pixel_values_videos need video_num_frames")
        parts.append(pixel_values_videos)
        tokens.append(int(config.video_token_id))
    features = tower_features(model, torch.cat(parts) if len(parts) > 1 else parts[0])
    outputs = []
    if counts:
        per_image = list(torch.split(features[:sum(counts)], counts))
        outputs += _pack_images(model, per_image, sizes, pack_options)
    if frames:
        pooled = model.model.apply_pooling(features[sum(counts):])
        newline = model.model.image_newline[None].to(pooled.dtype)
        for clip in torch.split(pooled, frames):
            outputs += [clip.flatten(0, 1), newline]
    return core.Encoded(torch.cat(outputs), placeholder_ids=tuple(tokens))


def check(model: nn.Module, text_model: nn.Module) -> None:
    inner = getattr(model, "model", None)
    for name in ("vision_tower", "multi_modal_projector", "image_newline", "pack_image_features"):
        if not hasattr(inner, name):
            raise TypeError(f"{type(model).__name__}.model has no {name!r}; "
                            "transformers version not supported")


def family(name: str, model_types: tuple[str, ...], encode: core.EncodeFn,
           check: Callable[[nn.Module, nn.Module], None]) -> core.Family:
    """The :class:`core.Family` of a plain 1-D RoPE language model behind a crop or tile tower
    (LLaVA-NeXT, LLaVA-OneVision, InternVL): the crop fields of :data:`ANYRES_KEYS` are popped
    with the vision fields."""
    def check_both(model: nn.Module, text_model: nn.Module) -> None:
        core.check_one_d_text_model(model, text_model)
        check(model, text_model)

    return core.Family(name=name, model_types=model_types, rope=core.one_d_rope, encode=encode,
                       check=check_both, batch_keys=ANYRES_KEYS)
