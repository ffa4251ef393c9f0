"""PackedCollator: many samples -> one unpadded row with ``cu_seqlens`` and per-sample position ids.

All the work happens on the host with numpy. Everything an attention kernel needs as a *host*
value (``max_seqlen``, ``cu_seqlens_list`` for ``npu_fusion_attention``'s ``actual_seq_qlen``,
``seq_lens``, ``num_loss_tokens``) is a python int/list, computed here once, so nothing on the
device ever has to be read back (each ``.item()`` / ``.tolist()`` in a forward is a host sync).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.utils.data import get_worker_info

from collate.anyres import AnyresLayout, TileLayout, collate_anyres
from collate.positions import (
    TEMPORAL,
    VIDEO_TEXT_RESUME,
    _arange,
    as_grid,
    glm4v_token_types,
    packed_glm4v_positions,
    packed_mrope_positions_and_slots,
)
from collate.vision import tower_fields, window_in_merged_tokens

if TYPE_CHECKING:
    from tokenbal.parallel import ParallelLayout

__all__ = ["PackedBatch", "PackedCollator", "IGNORE_INDEX"]

IGNORE_INDEX = -100

# Model types whose get_rope_index collate.positions reproduces. Qwen2.5-VL adds tokens_per_second;
# Qwen3-VL (and its MoE / Qwen3.5 siblings, whose get_rope_index is the same code in transformers
# 5.24) splits every video into per-frame t=1 grids separated by timestamp text. PaddleOCR-VL's is
# Qwen2-VL's code and Cosmos3-Omni's Qwen3-VL's; Cosmos3-Edge's is Qwen2-VL's after splitting every
# video into frames, i.e. Qwen3-VL's layout (tests/collate/test_positions_families.py checks each
# against the installed get_rope_index).
_MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "paddleocr_vl")
_SPLIT_FRAME_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                            "cosmos3_omni", "cosmos3_edge")
# Families whose model takes no video input (no pixel_values_videos): video grids are refused,
# since the collator's Qwen2-VL rule after a multi-frame video is not the installed get_rope_index's.
_IMAGE_ONLY_MODEL_TYPES = ("paddleocr_vl",)
# 1-D RoPE behind LLaVA "anyres" crops: placeholder counts from image sizes (collate.anyres).
_ANYRES_MODEL_TYPES = ("llava_next", "llava_onevision")
# 1-D RoPE behind fixed-size tiles: placeholders = tiles x tokens per tile (collate.anyres).
_TILE_MODEL_TYPES = ("internvl",)
# GLM-4.1V / GLM-4.5V: their own M-RoPE layout (collate.positions.glm4v_positions); the two
# get_rope_index are the same code in transformers 5.24, and so are GLM-4.6V's and GLM-OCR's.
_GLM_MODEL_TYPES = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")


@dataclasses.dataclass(eq=False)
class PackedBatch:
    """One packed row. Reads like a read-only mapping too: ``b["input_ids"]``, ``b.keys()``, ``**b``.

    Tensors (torch, on the host until moved; pinned when the collator pins):
      input_ids (1, T) int64; labels (1, T) int64; position_ids (3, 1, T) M-RoPE or (1, T) 1-D;
      text_position_ids (1, T) per-sample ``arange``; cu_seqlens (n+1,) int32;
      pixel_values / image_grid_thw / pixel_values_videos / video_grid_thw / second_per_grid_ts
      (concatenated over samples, None when absent); vision_cu_seqlens (frames+1,) int32 or None:
      cumulative patch counts, one ``h*w`` entry per frame (``t`` per grid), all image frames then
      all video frames, with a leading 0 (what Qwen2-VL's vision tower builds from the grids).
      M-RoPE collators also precompute what the Qwen-VL vision tower would otherwise derive from
      the grids with host reads (:mod:`collate.vision`): vision_position_ids (patches, 2) int64,
      the rotary (row, column) of every patch; vision_token_index (vision tokens,) int64, where in
      the row each merged vision feature goes (image then video placeholders, in order); and, with
      ``vision_window`` set (Qwen2.5-VL), vision_window_index (merged tokens,) int64 and
      vision_cu_window_seqlens (windows+1,) int32.
    Host values (never on the device):
      cu_seqlens_list (cumulative ends, no leading 0: npu_fusion_attention's actual_seq_qlen),
      max_seqlen, seq_lens, num_loss_tokens (labels != -100 after HF's one-token shift),
      vision_max_seqlen (largest frame, 0 without vision), vision_cu_seqlens_list (frame ends, no
      leading 0), vision_cu_window_seqlens_list and vision_max_window_seqlen (windows, likewise).
    labels carry -100 at every sample's first token (and wherever the sample had -100), so no token
    is trained to predict across a sample boundary.
    sp_padding (host int): tokens appended by ``PackedCollator(sp_size=S)`` so that ``T % S == 0``;
    they form one extra segment at the end (its own entry in ``seq_lens`` / ``cu_seqlens``, plain
    1-D positions, labels -100), so no real token attends to them and none carries loss.
    The 4-row ``(4, 1, T)`` form transformers 5.x Qwen2-VL accepts (row 0 = text positions, used
    for its packed mask) is the property ``position_ids_4row``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    text_position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_list: list[int]
    max_seqlen: int
    seq_lens: list[int]
    num_loss_tokens: int
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    vision_cu_seqlens: torch.Tensor | None = None
    vision_max_seqlen: int = 0
    vision_cu_seqlens_list: list[int] | None = None
    vision_position_ids: torch.Tensor | None = None
    vision_token_index: torch.Tensor | None = None
    vision_window_index: torch.Tensor | None = None
    vision_cu_window_seqlens: torch.Tensor | None = None
    vision_cu_window_seqlens_list: list[int] | None = None
    vision_max_window_seqlen: int = 0
    sp_padding: int = 0
    # LLaVA-NeXT / LLaVA-OneVision (collate.anyres), host lists: (height, width) per image, crops per
    # image, images per sample, frames per video. pixel_values / pixel_values_videos are then
    # (crops, C, S, S) / (frames, C, S, S).
    image_sizes: list[list[int]] | None = None
    image_num_tiles: list[int] | None = None
    batch_num_images: list[int] | None = None
    video_num_frames: list[int] | None = None

    # -- mapping view ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, key: str) -> Any:
        if key not in self._field_names():
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self._field_names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._field_names())

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self.keys()]

    def values(self) -> list[Any]:
        return [getattr(self, k) for k in self.keys()]

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self else default

    @classmethod
    def _field_names(cls) -> frozenset[str]:
        return _FIELD_NAMES

    # -- derived views ----------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        # The sequence-parallel padding segment is not a sample.
        return len(self.seq_lens) - (1 if self.sp_padding else 0)

    @property
    def position_ids_4row(self) -> torch.Tensor:
        """``(4, 1, T)``: text positions stacked over the T/H/W rows (1-D mode repeats them)."""
        pos = self.position_ids
        rows = pos if pos.dim() == 3 else pos[None].expand(3, -1, -1)
        return torch.cat([self.text_position_ids[None], rows], dim=0)

    # -- moving ------------------------------------------------------------------------------------
    def map_tensors(self, fn: Any) -> PackedBatch:
        """A copy with ``fn`` applied to every tensor field; host fields are shared, not copied."""
        changes = {k: fn(v) for k, v in self.items() if isinstance(v, torch.Tensor)}
        return dataclasses.replace(self, **changes)

    def pin_memory(self) -> PackedBatch:
        # DataLoader(pin_memory=True) calls this in the main process (it checks for the method).
        return self.map_tensors(lambda t: t if t.is_pinned() else t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(PackedBatch))


def accelerator_available() -> bool:
    """True when torch sees an accelerator (CUDA, NPU, XPU, ...), without initialising one needlessly."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def _should_pin(pin_memory: bool | None) -> bool:
    if pin_memory is not None:
        return pin_memory
    # Inside a DataLoader worker, pinned memory would be copied into shared memory (losing the pin)
    # and touching the accelerator runtime in a forked worker can fail; DataLoader(pin_memory=True)
    # pins in the main process through PackedBatch.pin_memory instead.
    if get_worker_info() is not None:
        return False
    return accelerator_available()


@dataclasses.dataclass(frozen=True)
class PackedCollator:
    """Collate samples into one :class:`PackedBatch` (its fields: README.md, "Public API").

    ``rope="mrope"``: Qwen2-VL / Qwen2.5-VL / Qwen3-VL M-RoPE ids, per sample as
    :func:`collate.positions.mrope_positions` defines them, computed for the whole packed row at once
    by :func:`collate.positions.packed_mrope_positions` (needs ``image_token_id``);
    ``tokens_per_second`` is Qwen2.5-VL's video time scale, ``split_video_frames`` Qwen3-VL's
    per-frame video grids. ``rope="1d"``: plain
    per-sample ``arange``; vision tensors are still concatenated and passed through, and with
    ``image_token_id`` set every sample's placeholder count is checked against its grids (none: 0).
    ``vision_window``: Qwen2.5-VL's attention window side in merged tokens (``window_size //
    (spatial_merge_size * patch_size)``), for the precomputed window layout; None elsewhere.
    ``pin_memory=None`` pins when an accelerator is available (never on CPU-only machines, never in a
    DataLoader worker).

    An empty list (a rank the sampler gave no sample: fewer samples than ranks, or a token budget)
    gives a dummy row instead of an error: one text token (id 0, or the lowest id that is not a
    vision token) whose label is ignored, so ``num_loss_tokens == 0`` and ``seq_lens == [1]``. The
    packed model runs its forward and backward on it like on any batch (loss 0, gradients 0, the
    vision tower on its idle image), so the rank still joins every FSDP collective.

    Sample keys read: ``input_ids``, ``labels``, ``pixel_values``, ``image_grid_thw``,
    ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``, ``attention_mask`` (must
    be all ones: padding has to be stripped before packing). Other keys are ignored.

    ``sp_size=S`` (sequence parallelism): the row is padded to a multiple of ``S`` with
    ``sp_pad_token_id`` tokens forming one last segment without loss (``PackedBatch.sp_padding``),
    so :func:`collate.sp.shard_batch` can cut it into ``S`` equal contiguous slices.
    """

    rope: Literal["mrope", "1d"] = "mrope"
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    spatial_merge_size: int = 2
    tokens_per_second: float | None = None
    # Qwen2.5-VL: truncate second_per_grid_ts to whole seconds, as transformers 4.57-5.9 do
    # (from_config asks the installed version).
    whole_video_seconds: bool = False
    # Qwen2-VL / Qwen2.5-VL: where text resumes after a video, "temporal" (transformers 4.x and the
    # original code) or "spatial" (5.x); see collate.positions.mrope_positions. from_config asks the
    # installed transformers (hf_compat.qwen2_vl_video_text_resume), so positions equal its get_rope_index.
    video_text_resume: str = TEMPORAL
    split_video_frames: bool = False
    vision_window: int | None = None
    pin_memory: bool | None = None
    ignore_index: int = IGNORE_INDEX
    sp_size: int = 1
    sp_pad_token_id: int = 0
    # LLaVA-NeXT / LLaVA-OneVision crops (collate.anyres): samples carry image_sizes instead of grids.
    anyres: AnyresLayout | TileLayout | None = None
    # ``"glm4v"``: GLM-4.1V positions (collate.positions.packed_glm4v_positions): video frames use the
    # image token inside the ``video_span_token_ids`` = (<|begin_of_video|>, <|end_of_video|>) span,
    # ``vision_start_token_id`` is <|begin_of_image|>, and ``video_token_id`` (<|video|>) must not remain.
    mrope_style: Literal["qwen", "glm4v"] = "qwen"
    video_span_token_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.rope not in ("mrope", "1d"):
            raise ValueError(f"rope must be 'mrope' or '1d', got {self.rope!r}")
        if self.rope == "mrope" and self.image_token_id is None:
            raise ValueError("rope='mrope' needs image_token_id")
        if self.spatial_merge_size < 1:
            raise ValueError(f"spatial_merge_size must be >= 1, got {self.spatial_merge_size}")
        if self.vision_window is not None and self.vision_window < 1:
            raise ValueError(f"vision_window must be >= 1 merged tokens, got {self.vision_window}")
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {self.sp_size}")
        if self.sp_pad_token_id < 0:
            raise ValueError(f"sp_pad_token_id must be a token id >= 0, got {self.sp_pad_token_id}")
        if self.mrope_style not in ("qwen", "glm4v"):
            raise ValueError(f"mrope_style must be 'qwen' or 'glm4v', got {self.mrope_style!r}")
        if self.mrope_style == "glm4v" and (self.rope != "mrope" or self.video_span_token_ids is None):
            raise ValueError("mrope_style='glm4v' needs rope='mrope' and video_span_token_ids")
        if self.video_text_resume not in VIDEO_TEXT_RESUME:
            raise ValueError(f"video_text_resume must be one of {VIDEO_TEXT_RESUME}, got "
                             f"{self.video_text_resume!r}")
        vision_ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id)
        if self.sp_size > 1 and self.sp_pad_token_id in vision_ids:
            raise ValueError(f"sp_pad_token_id={self.sp_pad_token_id} is a vision token id; padding must "
                             "be plain text")

    @classmethod
    def from_config(cls, hf_config: Any, layout: ParallelLayout | None = None,
                    **overrides: Any) -> PackedCollator:
        """Build from a transformers config: Qwen2-VL / Qwen2.5-VL / Qwen3-VL -> M-RoPE, else 1-D.

        LLaVA / InternVL language models use plain 1-D RoPE, so anything without a Qwen-VL
        ``model_type`` gets ``rope="1d"``, except a multimodal family whose transformers model lays
        out its own M-RoPE positions (``get_rope_index``) in a layout the collator does not know (the
        Qwen omni thinkers, ERNIE-4.5-VL, ...), which raises ``ValueError`` unless ``rope`` is given
        explicitly. GLM-4.6V / GLM-OCR get GLM-4.1V's layout, Cosmos3-Omni / -Edge Qwen3-VL's and
        PaddleOCR-VL Qwen2-VL's for images (it takes no video: video grids are refused).
        ``overrides`` replace any field (e.g. ``pin_memory``).
        ``layout`` (a :class:`tokenbal.parallel.ParallelLayout`) sets ``sp_size``.
        """
        if layout is not None:
            if overrides.get("sp_size", layout.sp_size) != layout.sp_size:
                raise ValueError(f"sp_size={overrides['sp_size']} disagrees with the layout's "
                                 f"sp_size={layout.sp_size}")
            overrides["sp_size"] = layout.sp_size
        model_type = getattr(hf_config, "model_type", "")
        vision = getattr(hf_config, "vision_config", None)
        if model_type in _ANYRES_MODEL_TYPES + _TILE_MODEL_TYPES:
            kind = AnyresLayout if model_type in _ANYRES_MODEL_TYPES else TileLayout
            crops = kind.from_config(hf_config)
            kwargs_1d: dict[str, Any] = dict(
                rope="1d", image_token_id=int(hf_config.image_token_id),
                video_token_id=_opt_int(getattr(hf_config, "video_token_id", None)), anyres=crops)
            return cls(**{**kwargs_1d, **overrides})
        if model_type in _GLM_MODEL_TYPES:
            glm: dict[str, Any] = dict(
                rope="mrope", mrope_style="glm4v", image_token_id=int(hf_config.image_token_id),
                video_token_id=_opt_int(getattr(hf_config, "video_token_id", None)),
                vision_start_token_id=_opt_int(getattr(hf_config, "image_start_token_id", None)),
                video_span_token_ids=(int(hf_config.video_start_token_id), int(hf_config.video_end_token_id)),
                spatial_merge_size=int(getattr(vision, "spatial_merge_size", 2)))
            return cls(**{**glm, **overrides})
        if model_type in _MROPE_MODEL_TYPES + _SPLIT_FRAME_MODEL_TYPES and vision is not None:
            kwargs: dict[str, Any] = dict(
                rope="mrope",
                image_token_id=int(hf_config.image_token_id),
                video_token_id=None if model_type in _IMAGE_ONLY_MODEL_TYPES
                else _opt_int(getattr(hf_config, "video_token_id", None)),
                vision_start_token_id=_opt_int(getattr(hf_config, "vision_start_token_id", None)),
                spatial_merge_size=int(getattr(vision, "spatial_merge_size", 2)),
                # Only Qwen2.5-VL scales video time; Qwen2-VL's vision config has no such field and
                # Qwen3-VL ignores it (timestamps are text).
                tokens_per_second=getattr(vision, "tokens_per_second", None)
                if model_type == "qwen2_5_vl"
                else None,
                split_video_frames=model_type in _SPLIT_FRAME_MODEL_TYPES,
                vision_window=window_in_merged_tokens(vision) if model_type == "qwen2_5_vl" else None,
            )
            if model_type == "qwen2_5_vl":
                from tokenbal.hf_compat import qwen2_5_vl_whole_seconds

                kwargs["whole_video_seconds"] = qwen2_5_vl_whole_seconds()
            if model_type in ("qwen2_vl", "qwen2_5_vl") and kwargs["video_token_id"] is not None:
                from tokenbal.hf_compat import qwen2_vl_video_text_resume

                kwargs["video_text_resume"] = qwen2_vl_video_text_resume(model_type)
        else:
            if "rope" not in overrides:
                from tokenbal.hf_compat import builds_rope_index

                if builds_rope_index(hf_config):
                    # Plain per-sample positions would be silently wrong for its vision tokens.
                    known = sorted(_MROPE_MODEL_TYPES + _SPLIT_FRAME_MODEL_TYPES + _GLM_MODEL_TYPES)
                    raise ValueError(
                        f"model_type={model_type!r} lays out multi-row (M-RoPE) positions with its own "
                        "get_rope_index, which PackedCollator does not reproduce for this family; it "
                        f"does for {known}. Pass rope=... explicitly only if you know the layout is one "
                        "of those.")
            kwargs = dict(rope="1d")
        kwargs.update(overrides)
        return cls(**kwargs)

    # ------------------------------------------------------------------------------------------------
    def __call__(self, samples: Sequence[dict[str, Any]]) -> PackedBatch:
        if len(samples) == 0:
            return self(self._dummy_samples())
        n = len(samples)
        ids_list: list[np.ndarray] = []
        labels_list: list[np.ndarray] = []
        seq_lens: list[int] = []
        img_items: list[tuple[int, Any, Any]] = []
        vid_items: list[tuple[int, Any, Any]] = []
        sec_items: list[tuple[int, Any]] = []
        anyres_parts = []
        # Per sample only gathering and the checks that cost one attribute read; the vision fields
        # are checked for all samples at once below, and all arithmetic runs once on the packed row.
        for i, sample in enumerate(samples):
            try:
                get = sample.get
            except AttributeError:
                raise TypeError(f"sample {i} is a {type(sample).__name__}, not a mapping of fields "
                                "(input_ids, labels, ...)") from None
            ids = get("input_ids")
            if type(ids) is not np.ndarray or ids.dtype != np.int64 or ids.ndim != 1:
                ids = _int_1d(sample, i, "input_ids")
            length = ids.shape[0]
            if length == 0:
                raise ValueError(f"sample {i}: field 'input_ids' is empty")
            labels = get("labels")
            if labels is None:
                labels = ids
            else:
                if type(labels) is not np.ndarray or labels.dtype != np.int64 or labels.ndim != 1:
                    labels = _int_1d(sample, i, "labels")
                if labels.shape[0] != length:
                    raise ValueError(
                        f"sample {i}: field 'labels' has length {labels.shape[0]}, "
                        f"input_ids has {length}"
                    )
            mask = get("attention_mask")
            if mask is not None:
                mask = _np(mask)
                if mask.size != length:
                    raise ValueError(f"sample {i}: field 'attention_mask' has {mask.size} entries, "
                                     f"input_ids has {length}")
                if not bool((mask != 0).all()):
                    raise ValueError(f"sample {i}: field 'attention_mask' has zeros; strip padding first")
            ids_list.append(ids)
            labels_list.append(labels)
            seq_lens.append(length)
            if self.anyres is not None:
                part = self.anyres.take(sample, i, ids, self.image_token_id, self.video_token_id)
                anyres_parts.append(part)
                continue
            pv, grid = get("pixel_values"), get("image_grid_thw")
            if pv is not None or grid is not None:
                img_items.append((i, pv, grid))
            pv, grid = get("pixel_values_videos"), get("video_grid_thw")
            if pv is not None or grid is not None:
                vid_items.append((i, pv, grid))
            sec = get("second_per_grid_ts")
            if sec is not None:
                sec_items.append((i, sec))

        img_grids, img_per, pixels = _gather_vision(img_items, n, "pixel_values", "image_grid_thw")
        vid_grids, vid_per, videos = _gather_vision(vid_items, n, "pixel_values_videos", "video_grid_thw")
        if vid_grids is not None and self.video_token_id is None and self.rope == "mrope" \
                and self.mrope_style == "qwen":
            # A Qwen-style layout without a video token (an image-only family, e.g. PaddleOCR-VL):
            # say so rather than "0 video placeholder tokens".
            first = int(np.flatnonzero(vid_per)[0])
            raise ValueError(f"sample {first}: field 'video_grid_thw' given, but this collator takes no "
                             "video (video_token_id=None: the model has no video input)")
        any_seconds = bool(sec_items)
        sec_all = _seconds(sec_items, vid_per) if any_seconds else None

        total = sum(seq_lens)
        sp_padding = -total % self.sp_size
        if sp_padding:
            # A segment of its own: causal attention inside it only, positions from 0, no loss.
            ids_list.append(np.full(sp_padding, self.sp_pad_token_id, dtype=np.int64))
            labels_list.append(np.full(sp_padding, self.ignore_index, dtype=np.int64))
            seq_lens.append(sp_padding)
            img_per, vid_per = np.append(img_per, 0), np.append(vid_per, 0)
            n += 1
            total += sp_padding
        if total > _INT32_MAX:
            raise ValueError(f"packed length {total} does not fit cu_seqlens int32")
        lens = np.array(seq_lens, dtype=np.int64)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])

        # One buffer for both rows; concatenate copies, so the samples' arrays are untouched.
        rows = np.empty((2, total), dtype=np.int64)
        np.concatenate(ids_list, out=rows[0])
        np.concatenate(labels_list, out=rows[1])
        input_ids, labels = rows[0], rows[1]
        _check_values(input_ids, labels, cu, self.ignore_index)
        if self.rope == "1d" and self.image_token_id is not None and self.anyres is None:
            self._check_1d_counts(input_ids, cu, img_grids, img_per)
        # No token may learn to predict the first token of the next sample: HF shifts labels left
        # by one, so position start-1 is trained on labels[start]; masking it cuts every boundary.
        labels[cu[:-1]] = self.ignore_index
        num_loss_tokens = int(np.count_nonzero(labels[1:] != self.ignore_index))
        text_pos = _arange(total) - np.repeat(cu[:-1], lens)

        slots = None
        if self.mrope_style == "glm4v":
            video_start, video_end = self.video_span_token_ids  # type: ignore[misc]
            token_types = glm4v_token_types(input_ids, cu, image_token_id=self.image_token_id,  # type: ignore[arg-type]
                                            video_start_token_id=video_start, video_end_token_id=video_end)
            pos = packed_glm4v_positions(
                input_ids, cu, img_grids, vid_grids, images_per_sample=img_per, videos_per_sample=vid_per,
                image_token_id=self.image_token_id,  # type: ignore[arg-type]
                video_start_token_id=video_start, video_end_token_id=video_end,
                spatial_merge_size=self.spatial_merge_size, image_start_token_id=self.vision_start_token_id,
                video_token_id=self.video_token_id, token_types=token_types)
            position_ids = torch.from_numpy(pos[:, None, :])
            # GLM-4V's images, then its video frames (both the image token; told apart by span).
            slots = np.concatenate([np.flatnonzero(token_types == kind) for kind in (1, 2)])
        elif self.rope == "mrope":
            pos, slots = packed_mrope_positions_and_slots(
                input_ids,
                cu,
                img_grids,
                vid_grids,
                images_per_sample=img_per,
                videos_per_sample=vid_per,
                image_token_id=self.image_token_id,  # type: ignore[arg-type]
                video_token_id=self.video_token_id,
                vision_start_token_id=self.vision_start_token_id,
                spatial_merge_size=self.spatial_merge_size,
                second_per_grid_ts=sec_all,
                tokens_per_second=self.tokens_per_second,
                split_video_frames=self.split_video_frames,
                whole_seconds=self.whole_video_seconds,
                video_text_resume=self.video_text_resume,
            )
            position_ids = torch.from_numpy(pos[:, None, :])
        else:
            position_ids = torch.from_numpy(text_pos[None, :].copy())

        grids = [g for g in (img_grids, vid_grids) if g is not None]
        tower = self._tower_fields(np.concatenate(grids), slots) if grids else {}
        if self.anyres is not None:
            tower = collate_anyres(anyres_parts, input_ids, self.image_token_id, self.video_token_id)
        if "pixel_values" in tower:
            pixels = tower.pop("pixel_values")
        if "pixel_values_videos" in tower:
            videos = tower.pop("pixel_values_videos")

        batch = PackedBatch(
            input_ids=torch.from_numpy(rows[0:1]),
            labels=torch.from_numpy(rows[1:2]),
            position_ids=position_ids,
            text_position_ids=torch.from_numpy(text_pos[None, :]),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
            cu_seqlens_list=cu[1:].tolist(),
            max_seqlen=int(lens.max()),
            seq_lens=seq_lens,
            num_loss_tokens=num_loss_tokens,
            pixel_values=pixels,
            image_grid_thw=None if img_grids is None else torch.from_numpy(img_grids),
            pixel_values_videos=videos,
            video_grid_thw=None if vid_grids is None else torch.from_numpy(vid_grids),
            second_per_grid_ts=torch.from_numpy(sec_all) if any_seconds else None,
            sp_padding=sp_padding,
            **tower,
        )
        return batch.pin_memory() if _should_pin(self.pin_memory) else batch

    def _dummy_samples(self) -> list[dict[str, Any]]:
        """The one-token, no-loss sample that stands in for an empty rank's batch."""
        vision = {self.image_token_id, self.video_token_id, self.vision_start_token_id}
        token = next(t for t in range(4) if t not in vision)
        return [{"input_ids": np.array([token], np.int64), "labels": np.array([self.ignore_index], np.int64)}]

    def _tower_fields(self, grids: np.ndarray, slots: np.ndarray | None) -> dict[str, Any]:
        """The vision tower's inputs derived from the batch's grids (images then videos: the order
        the packed model feeds them) and, for M-RoPE models, where each vision feature goes
        (``slots``: the placeholders' row indices, image ones then video ones, found and checked
        against every sample's grids by the positions)."""
        if self.rope != "mrope":
            return tower_fields(grids)
        # The positions have checked the grids against spatial_merge_size (or raised).
        fields = tower_fields(grids, self.spatial_merge_size, self.vision_window, checked=True)
        fields["vision_token_index"] = torch.from_numpy(slots)
        return fields

    def _check_1d_counts(self, ids: np.ndarray, cu: np.ndarray, grids: np.ndarray | None,
                         per_sample: np.ndarray) -> None:
        """Every sample's image placeholders against its grids, a sample without grids included
        (its placeholders would have no features): the 1-D mode's only vision check."""
        m = self.spatial_merge_size
        need = np.zeros(cu.shape[0] - 1, dtype=np.int64)
        if grids is not None:
            owner = np.repeat(np.arange(per_sample.shape[0]), per_sample)
            np.add.at(need, owner, grids.prod(axis=1) // (m * m))
        found = np.diff(np.searchsorted(np.flatnonzero(ids == self.image_token_id), cu))
        bad = np.flatnonzero(found != need)
        if bad.size:
            i = int(bad[0])
            first = int(per_sample[:i].sum())
            grid = [] if grids is None else grids[first:first + int(per_sample[i])].tolist()
            raise ValueError(f"sample {i}: {int(found[i])} image placeholder tokens in input_ids but "
                             f"image_grid_thw {grid} needs {int(need[i])}")


_INT64_MAX = int(np.iinfo(np.int64).max)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _check_values(input_ids: np.ndarray, labels: np.ndarray, cu: np.ndarray, ignore_index: int) -> None:
    """No negative token id, and no negative label but ``ignore_index``: the embedding lookup or the
    loss would fail on them far from the sample (on an accelerator, as a device-side assert), and
    a stray negative label would count as a loss token. Checked on the packed row (a few
    vectorised passes); the first offender is then named by sample and index."""
    if input_ids.shape[0] and input_ids.min() < 0:
        _raise_at(np.flatnonzero(input_ids < 0)[0], input_ids, cu, "input_ids", "a token id must be >= 0")
    if ignore_index < 0:
        bad = (labels < 0) & (labels != ignore_index)
    else:  # an unusual but valid choice: then no label may be negative
        bad = labels < 0
    if bad.any():
        _raise_at(np.flatnonzero(bad)[0], labels, cu, "labels",
                  f"neither a token id nor the collator's ignore_index {ignore_index}")


def _raise_at(index: int, row: np.ndarray, cu: np.ndarray, field: str, why: str) -> None:
    i = int(np.searchsorted(cu, index, side="right")) - 1
    value, at = int(row[index]), int(index - cu[i])
    raise ValueError(f"sample {i}: field {field!r} holds {value} at index {at}, {why}")


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            # Reading it back would be a silent device sync inside the data pipeline.
            raise ValueError(f"samples must hold host data, got a tensor on {x.device}")
        return x.detach().numpy()
    return np.asarray(x)


def _int_1d(sample: dict[str, Any], i: int, field: str) -> np.ndarray:
    arr = sample.get(field)
    # The common case, a 1-D int64 numpy array, costs one type and one dtype check.
    if type(arr) is np.ndarray and arr.dtype == np.int64 and arr.ndim == 1:
        return arr
    if arr is None:
        raise ValueError(f"sample {i}: field {field!r} is missing")
    try:
        arr = _np(arr)
    except ValueError as e:
        raise ValueError(f"sample {i}: field {field!r}: {e}") from None
    if arr.dtype.kind not in "iu":
        raise ValueError(f"sample {i}: field {field!r} must hold integers, got dtype {arr.dtype}")
    if arr.ndim == 2 and arr.shape[0] == 1:  # processor output with return_tensors: (1, L)
        arr = arr[0]
    if arr.ndim != 1:
        raise ValueError(f"sample {i}: field {field!r} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > _INT64_MAX:
        # The cast below would wrap it to a negative id, and the error would name a value not in the sample.
        at = int(np.flatnonzero(arr > _INT64_MAX)[0])
        raise ValueError(f"sample {i}: field {field!r} holds {int(arr[at])} at index {at}, above int64 "
                         f"({_INT64_MAX}): not a token id")
    return arr.astype(np.int64, copy=False)


def _vision_pair(
    sample: dict[str, Any], i: int, pv_key: str, grid_key: str
) -> tuple[torch.Tensor | None, np.ndarray | None]:
    pv, grid = sample.get(pv_key), sample.get(grid_key)
    if pv is None and grid is None:
        return None, None
    if pv is None:
        raise ValueError(f"sample {i}: field {grid_key!r} given without {pv_key!r}")
    if grid is None:
        raise ValueError(f"sample {i}: field {pv_key!r} given without {grid_key!r}")
    try:
        grid_arr = grid if type(grid) is np.ndarray else _np(grid)
        if grid_arr.dtype.kind not in "iu" or grid_arr.ndim != 2 or grid_arr.shape[1] != 3:
            grid_arr = as_grid(grid_arr, grid_key)  # the general path words the error (or accepts (3,))
        # A few rows: a python loop over ints beats numpy reductions on tiny arrays.
        patches, smallest = 0, 1
        for t, h, w in grid_arr.tolist():
            patches += t * h * w
            smallest = min(smallest, t, h, w)
        if patches == 0 or smallest <= 0:
            grid_arr = as_grid(grid_arr, grid_key)  # raises for non-positive sizes; (0, 3) passes
    except ValueError as e:
        raise ValueError(f"sample {i}: field {grid_key!r}: {e}") from None
    pv_t = pv if isinstance(pv, torch.Tensor) else torch.from_numpy(np.asarray(pv))
    if not pv_t.is_cpu:
        raise ValueError(f"sample {i}: field {pv_key!r} is on {pv_t.device}; samples must hold host data")
    if not pv_t.is_floating_point():
        raise ValueError(f"sample {i}: field {pv_key!r} must be floating point, got {pv_t.dtype}")
    shape = pv_t.shape
    if len(shape) == 4 and shape[0] == patches:
        # One (C, P, P) image patch per row (PaddleOCR-VL's processor): the batch carries rows of
        # C*P*P values, the family's patch reshapes them for its tower. Other shapes stay errors.
        pv_t = pv_t.reshape(patches, -1)
        shape = pv_t.shape
    if len(shape) != 2 or shape[0] != patches:
        raise ValueError(
            f"sample {i}: field {pv_key!r} has shape {tuple(shape)} but {grid_key} "
            f"{grid_arr.tolist()} needs ({patches}, C*T*P*P) patches"
        )
    return pv_t, grid_arr


def _gather_vision(
    items: list[tuple[int, Any, Any]], n: int, pv_key: str, grid_key: str
) -> tuple[np.ndarray | None, np.ndarray, torch.Tensor | None]:
    """All samples' ``(grids (k, 3) int64, grid rows per sample (n,), pixel rows)`` of one kind.

    The common case (numpy grids, host float tensors, every sample consistent) is checked on the
    concatenated arrays; anything else goes through :func:`_vision_pair` sample by sample, which
    words the error of the first bad sample (or converts the unusual input types).
    """
    per = np.zeros(n, dtype=np.int64)
    if not items:
        return None, per, None
    grids = [g for _, _, g in items]
    pvs = [p for _, p, _ in items]
    fast = all(type(g) is np.ndarray for g in grids) and all(type(p) is torch.Tensor for p in pvs)
    if fast:
        try:
            out = _gather_checked(items, grids, pvs, pv_key, per)
        except (ValueError, RuntimeError):
            out = None
        if out is not None:
            return out
        per[:] = 0
    pairs = [(i, *_vision_pair({pv_key: p, grid_key: g}, i, pv_key, grid_key)) for i, p, g in items]
    for i, _, grid in pairs:
        per[i] = grid.shape[0]
    # A fresh array even for one sample: the batch must not alias (and later mutate) sample data.
    grid_all = np.concatenate([g for _, _, g in pairs]).astype(np.int64, copy=False)
    return grid_all, per, _cat_pixels(pv_key, [(i, p) for i, p, _ in pairs])


def _gather_checked(
    items: list[tuple[int, Any, Any]], grids: list[np.ndarray], pvs: list[torch.Tensor], pv_key: str,
    per: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, torch.Tensor] | None:
    """:func:`_gather_vision` for numpy grids and tensors; None where a sample needs the slow path."""
    counts = [g.shape[0] if g.ndim == 2 else 0 for g in grids]
    if 0 in counts:
        return None
    grid_all = np.concatenate(grids)  # a copy: the batch must not alias sample data
    if grid_all.ndim != 2 or grid_all.shape[1] != 3 or grid_all.dtype.kind not in "iu":
        return None
    grid_all = grid_all.astype(np.int64, copy=False)
    patches = grid_all.prod(axis=1)
    if not (grid_all > 0).all():
        return None
    starts = np.array(counts, dtype=np.int64)
    np.cumsum(starts, out=starts)
    starts -= counts
    rows = np.array([p.shape[0] if p.dim() == 2 else -1 for p in pvs], dtype=np.int64)
    if not np.array_equal(rows, np.add.reduceat(patches, starts)):
        return None
    pixels = _cat_pixels(pv_key, [(i, p) for (i, _, _), p in zip(items, pvs, strict=True)])
    if pixels is None or not pixels.is_cpu or not pixels.is_floating_point() or pixels.dim() != 2:
        return None
    per[[i for i, _, _ in items]] = counts
    return grid_all, per, pixels


def _seconds(items: list[tuple[int, Any]], vid_per: np.ndarray) -> np.ndarray:
    """``second_per_grid_ts`` of every video (float32), transformers' default 1 s per grid for
    videos of samples that give none."""
    out = np.ones(int(vid_per.sum()), dtype=np.float32)
    ends = np.cumsum(vid_per)
    for i, sec in items:
        sec_arr = _np(sec).reshape(-1)
        if sec_arr.dtype.kind not in "iuf":
            raise ValueError(
                f"sample {i}: field 'second_per_grid_ts' must be numeric, got dtype {sec_arr.dtype}"
            )
        if sec_arr.shape[0] != vid_per[i]:
            raise ValueError(
                f"sample {i}: field 'second_per_grid_ts' has {sec_arr.shape[0]} entries for "
                f"{vid_per[i]} videos"
            )
        if not (np.isfinite(sec_arr).all() and (sec_arr >= 0).all()):
            raise ValueError(f"sample {i}: field 'second_per_grid_ts' must be finite and >= 0, got "
                             f"{sec_arr.tolist()}")
        out[ends[i] - vid_per[i] : ends[i]] = sec_arr
    return out


def _cat_pixels(key: str, items: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
    if not items:
        return None
    first_i, first = items[0]
    if len(items) == 1:
        return first
    dtype = first.dtype
    tensors = [t for _, t in items]
    # torch.cat promotes mixed dtypes silently, so those are checked here; a mismatched row width
    # makes torch.cat raise, and only then is the sample found (per-item checks cost ~1 us each).
    if all(t.dtype == dtype for t in tensors):
        try:
            return torch.cat(tensors)
        except RuntimeError:
            pass
    for i, t in items[1:]:
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"sample {i}: field {key!r} is {t.dtype} {tuple(t.shape)}, sample {first_i} has "
                f"{first.dtype} {tuple(first.shape)}; all samples must agree"
            )
    return torch.cat(tensors)
