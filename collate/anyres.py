"""Collating LLaVA-NeXT / LLaVA-OneVision samples: crops, image sizes and placeholder counts.

A processor gives each sample ``pixel_values`` as ``(images, max_crops, C, S, S)`` (padded to the
sample's largest crop count) or ``(crops, C, S, S)``, ``image_sizes`` ``(images, 2)`` as
``(height, width)``, and OneVision videos as ``pixel_values_videos`` ``(videos, frames, C, S, S)`` (or a
list of ``(frames, C, S, S)``, one per video, where a sample's videos differ in frames).
:class:`AnyresLayout` works out each image's crop count and placeholder count on the host from its
size, with the tokenbal estimator the index uses (:mod:`tokenbal.estimate.llava`, a port of
transformers' own arithmetic), so the collated count *is* the index's count; a sample whose
``<image>`` / ``<video>`` tokens disagree raises, naming the sample. The batch gets every crop and
frame as one ``(N, C, S, S)`` tensor and the sizes / counts as host lists, which
:mod:`collate.models.anyres_vision` hands to the model without reading anything back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

__all__ = ["AnyresLayout", "AnyresSample", "TileLayout"]


@dataclasses.dataclass(frozen=True)
class AnyresSample:
    """One sample's vision inputs, validated: crops flattened, sizes and counts on the host."""

    crops: torch.Tensor | None  # (crops, C, S, S)
    image_sizes: list[list[int]]  # (height, width) per image
    crops_per_image: list[int]
    frames: torch.Tensor | None  # (frames, C, S, S), all videos of the sample
    frames_per_video: list[int]


@dataclasses.dataclass(frozen=True)
class AnyresLayout:
    """How a LLaVA "anyres" model turns an image size into crops and placeholder tokens.

    ``family``: ``"llava_next"`` or ``"llava_onevision"`` (multi-image samples keep base views only,
    large grids are downsampled to ``max_num_views`` base views, videos are pooled 2x2).
    ``pinpoints``: the config's ``image_grid_pinpoints`` as ``(height, width)``.
    """

    family: str
    crop_size: int
    patch_size: int
    pinpoints: tuple[tuple[int, int], ...]
    max_num_views: int = 9

    @classmethod
    def from_config(cls, hf_config: Any) -> AnyresLayout:
        vision = hf_config.vision_config
        ratio = str(getattr(hf_config, "vision_aspect_ratio", "anyres_max_9"))
        return cls(
            family=hf_config.model_type,
            crop_size=int(vision.image_size),
            patch_size=int(vision.patch_size),
            pinpoints=tuple((int(h), int(w)) for h, w in hf_config.image_grid_pinpoints),
            max_num_views=int(ratio.removeprefix("anyres_max_")) if ratio.startswith("anyres_max_") else 9,
        )

    def estimator(self) -> Any:
        """The tokenbal estimator with this model's settings (what ``tokenbal index build`` uses)."""
        from tokenbal.estimate.llava import LlavaNextEstimator, LlavaOneVisionEstimator

        if self.family == "llava_onevision":
            return LlavaOneVisionEstimator(crop_size=self.crop_size, patch_size=self.patch_size,
                                           pinpoints=self.pinpoints, max_num_views=self.max_num_views)
        return LlavaNextEstimator(crop_size=self.crop_size, patch_size=self.patch_size,
                                  pinpoints=self.pinpoints)

    def crops(self, height: int, width: int, images_in_sample: int) -> int:
        """Base view plus the best pinpoint's crop grid (transformers' ``image_size_to_num_patches``);
        OneVision gives an image that shares its sample with others its base view only."""
        if self.family == "llava_onevision" and images_in_sample > 1:
            return 1
        from tokenbal.estimate.llava import select_best_resolution

        bh, bw = select_best_resolution(height, width, self.pinpoints)
        return math.ceil(bh / self.crop_size) * math.ceil(bw / self.crop_size) + 1

    def image_tokens(self, height: int, width: int, images_in_sample: int) -> int:
        est = self.estimator()
        if self.family == "llava_onevision":
            return int(est.image_tokens(width, height, images_in_sample=images_in_sample))
        return int(est.image_tokens(width, height))

    def video_tokens(self, frames: int) -> int:
        if self.family != "llava_onevision":
            raise ValueError(f"{self.family} has no video path")
        pooled = math.ceil(self.crop_size // self.patch_size / 2)
        return frames * pooled * pooled + 1

    def take(self, sample: dict[str, Any], i: int, ids: np.ndarray, image_token_id: int | None,
             video_token_id: int | None) -> AnyresSample:
        """Validate sample ``i``'s vision inputs against its ``input_ids`` and flatten them."""
        pv, sizes = sample.get("pixel_values"), sample.get("image_sizes")
        if (pv is None) != (sizes is None):
            given, missing = ("pixel_values", "image_sizes") if sizes is None else \
                ("image_sizes", "pixel_values")
            raise ValueError(f"sample {i}: field {given!r} given without {missing!r}")
        crops, size_rows, per_image = None, [], []
        expected_images = 0
        if pv is not None:
            size_rows = _sizes(sizes, i)
            n = len(size_rows)
            per_image = [self.crops(h, w, n) for h, w in size_rows]
            crops = _crops(_tensor(pv, i, "pixel_values"), per_image, i, self.crop_size)
            expected_images = sum(self.image_tokens(h, w, n) for h, w in size_rows)
        _check_count(ids, image_token_id, expected_images, i, "image", "image_sizes", size_rows)
        frames, per_video = None, []
        videos = sample.get("pixel_values_videos")
        expected_videos = 0
        if videos is not None:
            # (videos, frames, C, S, S) as the processor stacks them, or a list of (frames, C, S, S),
            # one per video, for a sample whose videos keep different numbers of frames
            if isinstance(videos, (list, tuple)):
                clips = [_tensor(c, i, "pixel_values_videos") for c in videos]
            else:
                v = _tensor(videos, i, "pixel_values_videos")
                clips = list(v) if v.dim() == 5 else [v]
            for c in clips:
                if c.dim() != 4 or tuple(c.shape[-2:]) != (self.crop_size, self.crop_size):
                    raise ValueError(f"sample {i}: field 'pixel_values_videos' holds a video of shape "
                                     f"{tuple(c.shape)}; expected (videos, frames, C, {self.crop_size}, "
                                     f"{self.crop_size}) or a list of (frames, C, {self.crop_size}, "
                                     f"{self.crop_size})")
            per_video, frames = [int(c.shape[0]) for c in clips], (torch.cat(clips) if clips else None)
            expected_videos = sum(self.video_tokens(f) for f in per_video)
        if video_token_id is not None:
            _check_count(ids, video_token_id, expected_videos, i, "video", "pixel_values_videos", per_video)
        elif videos is not None:
            raise ValueError(f"sample {i}: has pixel_values_videos but the collator has no video_token_id")
        return AnyresSample(crops, size_rows, per_image, frames, per_video)


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """InternVL: every tile (crops plus thumbnail) gives ``tokens_per_tile`` placeholders after the
    pixel shuffle, whatever image it came from, so a sample's ``<IMG_CONTEXT>`` count is its tile
    count (``pixel_values`` ``(tiles, C, S, S)``) times ``tokens_per_tile``."""

    family: str
    tile_size: int
    tokens_per_tile: int

    @classmethod
    def from_config(cls, hf_config: Any) -> TileLayout:
        vision = hf_config.vision_config
        side, patch = _side(vision.image_size), _side(vision.patch_size)
        per_side = side // patch * float(hf_config.downsample_ratio)
        return cls(family=hf_config.model_type, tile_size=side, tokens_per_tile=int(per_side) * int(per_side))

    def take(self, sample: dict[str, Any], i: int, ids: np.ndarray, image_token_id: int | None,
             video_token_id: int | None) -> AnyresSample:
        if sample.get("pixel_values_videos") is not None:
            # the tiles below are all the tower sees: separate frames would be dropped silently
            raise ValueError(f"sample {i}: field 'pixel_values_videos' given, but {self.family}'s processor "
                             "hands video frames as tiles in 'pixel_values' (under the image token)")
        pv = sample.get("pixel_values")
        tiles = None
        if pv is not None:
            tiles = _tensor(pv, i, "pixel_values")
            if tiles.dim() != 4 or tuple(tiles.shape[-2:]) != (self.tile_size, self.tile_size):
                raise ValueError(f"sample {i}: field 'pixel_values' has shape {tuple(tiles.shape)}; expected "
                                 f"(tiles, C, {self.tile_size}, {self.tile_size})")
        n = 0 if tiles is None else int(tiles.shape[0])
        _check_count(ids, image_token_id, n * self.tokens_per_tile, i, "image", "pixel_values tiles", n)
        return AnyresSample(tiles, [], [n] if n else [], None, [])


def _side(x: Any) -> int:
    return int(x[0]) if isinstance(x, (list, tuple)) else int(x)


def collate_anyres(parts: list[AnyresSample], ids: np.ndarray, image_token_id: int | None,
                   video_token_id: int | None) -> dict[str, Any]:
    """The batch fields of the samples' vision inputs (images then videos, in sample order)."""
    crops = [(i, p.crops) for i, p in enumerate(parts) if p.crops is not None]
    frames = [(i, p.frames) for i, p in enumerate(parts) if p.frames is not None]
    out: dict[str, Any] = {}
    if crops:
        out["pixel_values"] = _cat("pixel_values", crops)
        out["image_sizes"] = [s for p in parts for s in p.image_sizes] or None
        out["image_num_tiles"] = [c for p in parts for c in p.crops_per_image]
        out["batch_num_images"] = [len(p.image_sizes) for p in parts]
    if frames:
        out["pixel_values_videos"] = _cat("pixel_values_videos", frames)
        out["video_num_frames"] = [f for p in parts for f in p.frames_per_video]
    if crops or frames:
        slots = [np.flatnonzero(ids == image_token_id)] if crops else []
        if frames:
            slots.append(np.flatnonzero(ids == video_token_id))
        out["vision_token_index"] = torch.from_numpy(np.concatenate(slots))
    return out


def _tensor(x: Any, i: int, name: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if t.device.type != "cpu":
        raise ValueError(f"sample {i}: field {name!r} is on {t.device}; samples must hold host data")
    if not t.is_floating_point():
        raise ValueError(f"sample {i}: field {name!r} must be floating point, got {t.dtype}")
    return t


def _sizes(sizes: Any, i: int) -> list[list[int]]:
    arr = sizes.numpy() if isinstance(sizes, torch.Tensor) else np.asarray(sizes)
    if arr.ndim == 1 and arr.shape[0] == 2:
        arr = arr[None]
    if arr.dtype.kind not in "iu" or arr.ndim != 2 or arr.shape[1] != 2 or (arr <= 0).any():
        raise ValueError(f"sample {i}: field 'image_sizes' must be positive (height, width) ints of shape "
                         f"(images, 2), got {arr.tolist()}")
    return arr.astype(np.int64).tolist()


def _crops(pv: torch.Tensor, per_image: list[int], i: int, side: int) -> torch.Tensor:
    total = sum(per_image)
    if pv.dim() == 5 and pv.shape[0] == len(per_image) and pv.shape[1] >= max(per_image):
        pv = torch.cat([img[:n] for img, n in zip(pv, per_image, strict=True)])
    if pv.dim() != 4 or pv.shape[0] != total or tuple(pv.shape[-2:]) != (side, side):
        raise ValueError(f"sample {i}: field 'pixel_values' has shape {tuple(pv.shape)} but its image_sizes "
                         f"need {per_image} crops of {side}x{side}: ({total}, C, {side}, {side}) or "
                         f"({len(per_image)}, >={max(per_image)}, C, {side}, {side})")
    return pv


def _check_count(ids: np.ndarray, token: int | None, expected: int, i: int, kind: str, field: str,
                 detail: Any) -> None:
    if token is None:
        if expected:
            raise ValueError(f"sample {i}: has {kind} inputs but the collator has no {kind}_token_id")
        return
    found = int(np.count_nonzero(ids == token))
    if found != expected:
        raise ValueError(f"sample {i}: {found} {kind} placeholder tokens in input_ids but {field} {detail} "
                         f"need {expected}")


def _cat(name: str, items: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The samples' tensors ``(sample index, tensor)`` concatenated; a mismatch names both samples."""
    first_i, first = items[0]
    for i, t in items[1:]:
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            raise ValueError(f"sample {i}: field {name!r} is {t.dtype} {tuple(t.shape)}, sample {first_i} "
                             f"has {first.dtype} {tuple(first.shape)}; all samples must agree")
    return torch.cat([t for _, t in items]) if len(items) > 1 else first.clone()
