"""Packed calls of LLaVA's crop towers (LLaVA-NeXT "anyres", LLaVA-OneVision "anyres_max_9" and
its videos): every image is a base view plus a grid of crops, every video a stack of frames, all
the same ``(C, S, S)`` size, so one tower call covers every crop and frame of the batch.

transformers runs the tower once for images (``get_image_features``) and once more for videos
(``get_video_features``), each only when present, and derives each image's crop count from
``image_sizes`` with ``.tolist()`` on a tensor. Here :func:`encode` concatenates the batch's crops
and frames (images first, the order of the collator's ``vision_token_index``), runs the tower once
(or on one zero crop when the batch has no vision: the idle pass), and then hands the outputs to
transformers' own post-processing — the projector and ``apply_pooling`` — and to
:func:`pack_image_features` (transformers' unpad, newline and OneVision's downsampling, without
the host-built ``feature_lens`` tensor), with ``image_sizes`` and the crop / frame counts as host
lists from the collator, so nothing is read back from the device and nothing is copied to it.
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


def pack_image_features(model: nn.Module, features: list[torch.Tensor],
                        sizes: list[list[int]]) -> list[torch.Tensor]:
    """transformers' ``pack_image_features`` of LLaVA-NeXT and LLaVA-OneVision (the same loop in
    every supported release, 4.57 to 5.x), without the ``feature_lens`` tensor it also builds with
    ``torch.tensor(..., device=...)``: a blocking host-to-device copy in every packed forward, for
    a value the packed path never reads. Per image (``features[i]``: ``(crops, tokens, hidden)``,
    ``sizes[i]`` its host ``[height, width]``): one crop is a base view plus the newline; more are
    the base view, then the crop grid (transformers' ``get_anyres_image_grid_shape`` and
    ``unpad_image`` from the model's own modeling module) downsampled above ``anyres_max_N`` views
    (OneVision's ``vision_aspect_ratio``), with a newline column. Equal to the installed
    transformers' method value for value (``tests/collate/models/test_llava.py``)."""
    import math
    import sys

    config = model.config
    modeling = sys.modules[type(model.model).__module__]
    newline = model.model.image_newline
    side = config.vision_config.image_size
    height = width = side // config.vision_config.patch_size
    aspect = getattr(config, "vision_aspect_ratio", None) if config.model_type == "llava_onevision" else None
    packed = []
    for feature, size in zip(features, sizes, strict=True):
        if feature.shape[0] == 1:
            packed.append(torch.cat((feature[0], newline[None].to(feature[0])), dim=0))
            continue
        base, crops = feature[0], feature[1:]
        if aspect is not None and height * width != base.shape[0]:
            raise ValueError("The number of patches is not consistent with the image size.")
        rows, cols = modeling.get_anyres_image_grid_shape(size, config.image_grid_pinpoints, side)
        grid = crops.view(rows, cols, height, width, -1).permute(4, 0, 2, 1, 3).contiguous()
        grid = modeling.unpad_image(grid.flatten(1, 2).flatten(2, 3), size)
        if aspect is not None:
            max_views = int(aspect.strip("anyres_max_"))  # noqa: B005 - transformers' parse, kept as is
            _, grid_h, grid_w = grid.shape
            ratio = math.sqrt(grid_h * grid_w / (max_views * height**2))
            if ratio > 1.1:
                grid = nn.functional.interpolate(grid[None], [int(grid_h // ratio), int(grid_w // ratio)],
                                                 mode="bilinear")[0]
        column = newline[:, None, None].expand(*grid.shape[:-1], 1).to(grid.device, grid.dtype)
        grid = torch.cat((grid, column), dim=-1).flatten(1, 2).transpose(0, 1)
        packed.append(torch.cat((base, grid), dim=0))
    return packed


def encode(model: nn.Module, kwargs: dict[str, Any], vision: dict[str, Any], idle_vision: bool,
           videos: bool) -> core.Encoded | None:
    """One tower call on every crop and frame of the batch (or on the idle crop); pops the pixel
    fields from ``kwargs``. ``videos``: the family has a video path (OneVision's pooling)."""
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
        packed = pack_image_features(model, [features], [[side, side]])
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
        outputs += pack_image_features(model, per_image, sizes)
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
