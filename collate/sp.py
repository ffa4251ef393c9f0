"""Sequence parallelism for packed rows: each rank of an SP group gets a contiguous slice.

:func:`shard_batch` cuts a :class:`~collate.packing.PackedBatch` (built with
``PackedCollator(sp_size=S)``, so ``T % S == 0``) into ``S`` equal contiguous slices along the
sequence. Rank ``r`` keeps ``input_ids`` / ``labels`` / ``position_ids`` / ``text_position_ids`` of
its slice, and the *full-row* ``cu_seqlens`` / ``cu_seqlens_list`` / ``max_seqlen`` / ``seq_lens``:
Ulysses attention (:mod:`collate.ops.ulysses`) gathers the whole sequence for a subset of the
heads, so attention still runs over the row's real segments. The M-RoPE positions were computed
for the whole row on the host before the cut, so every sliced position is right, including those
of an image whose placeholders straddle the cut.

Labels: HF's loss shifts labels left by one *inside* the tensor it is given, so the last token of
a slice would lose its target (the first token of the next slice). The slice therefore carries
``shift_labels`` (the full row shifted once, then cut), which transformers' causal-LM loss uses as
is, and ``num_loss_tokens`` counts this slice's targets only: summed over an SP group it is the
row's count, summed over the world (every data-parallel group) each token is counted once.

Vision: no image (or video) is split. Every grid entry goes whole to one SP rank (longest first to
the least-loaded rank, a tie to the rank holding most of its placeholders); the rank runs the tower
on its grids only, and one all-to-all per forward sends each merged feature (and Qwen3-VL's
DeepStack features) to the rank whose slice holds its placeholder. The send/receive counts and
indexes are computed here on the host (the same plan on every rank of the group), so nothing is
read back from the device. A rank without a grid of its own runs the model's zero-weighted idle
image, as a rank without vision does without SP.

Everything here is host-side numpy on host tensors.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from collate.fields import SP_ROUTING
from collate.packing import IGNORE_INDEX, PackedBatch
from collate.vision import frame_seqlens

if TYPE_CHECKING:
    from tokenbal.parallel import ParallelLayout

__all__ = ["SPBatch", "shard_batch", "SP_KEYS", "assign_grids", "sp_mesh"]


@dataclasses.dataclass(eq=False)
class SPBatch(PackedBatch):
    """One SP rank's slice of a packed row (see the module docstring).

    ``input_ids`` / ``labels`` / ``position_ids`` / ``text_position_ids`` / ``shift_labels`` cover the
    slice; ``cu_seqlens*`` / ``max_seqlen`` / ``seq_lens`` the whole row; ``num_loss_tokens`` the
    slice's targets. The vision fields hold this rank's own grids (whole images and videos) and
    their tower inputs; ``vision_token_index`` is where, in this slice, the features received in the
    all-to-all go, in arrival order. ``vision_sp_send_index`` orders this rank's tower output by
    destination rank; ``vision_sp_send_counts`` / ``vision_sp_recv_counts`` are the all-to-all's
    host split sizes (None when the row has no vision at all).
    """

    shift_labels: torch.Tensor | None = None
    sp_rank: int = 0
    sp_size: int = 1
    vision_sp_send_index: torch.Tensor | None = None
    vision_sp_send_counts: list[int] | None = None
    vision_sp_recv_counts: list[int] | None = None

    @classmethod
    def _field_names(cls) -> frozenset[str]:
        return _SP_FIELD_NAMES


_SP_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SPBatch))
SP_KEYS = SP_ROUTING  # the keys an SP slice adds for the model wrapper (collate.fields)


def assign_grids(patches: np.ndarray, home: np.ndarray, sp_size: int) -> np.ndarray:
    """SP rank of every grid entry: longest first to the least-loaded rank (a tie goes to ``home``,
    the rank holding most of its placeholders, then to the lowest rank). Deterministic, so every
    rank of a group computes the same assignment."""
    load = np.zeros(sp_size, dtype=np.int64)
    owner = np.empty(len(patches), dtype=np.int64)
    for g in sorted(range(len(patches)), key=lambda i: (-int(patches[i]), i)):
        least = load.min()
        candidates = np.flatnonzero(load == least)
        r = int(home[g]) if home[g] in candidates else int(candidates[0])
        owner[g] = r
        load[r] += int(patches[g])
    return owner


def shard_batch(batch: PackedBatch, sp_rank: int | None = None, sp_size: int | None = None, *,
                layout: ParallelLayout | None = None) -> SPBatch:
    """This SP rank's slice of ``batch`` (host tensors in, host tensors out; see the module docstring).

    ``sp_size=1`` returns the whole row as an :class:`SPBatch`. The row's length must be a multiple
    of ``sp_size``: build it with ``PackedCollator(sp_size=...)``. ``layout`` (a
    :class:`tokenbal.parallel.ParallelLayout`) gives both, so the SP size is said once.
    """
    if layout is not None:
        if (sp_rank is not None and sp_rank != layout.sp_rank) or (
                sp_size is not None and sp_size != layout.sp_size):
            raise ValueError(f"sp_rank={sp_rank}, sp_size={sp_size} disagree with the layout's "
                             f"sp_rank={layout.sp_rank}, sp_size={layout.sp_size}")
        sp_rank, sp_size = layout.sp_rank, layout.sp_size
    elif sp_rank is None or sp_size is None:
        raise TypeError("shard_batch needs sp_rank and sp_size, or layout=")
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must lie in [0, sp_size={sp_size})")
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(f"shard_batch works on the host; field {name!r} is on {value.device}")
    total = int(batch.input_ids.shape[1])
    if total % sp_size:
        raise ValueError(f"packed row of {total} tokens is not a multiple of sp_size={sp_size}; build it "
                         f"with PackedCollator(sp_size={sp_size})")
    if isinstance(batch, SPBatch) and batch.sp_size != 1:
        raise ValueError("batch is already an SP slice")
    local = total // sp_size
    lo, hi = sp_rank * local, (sp_rank + 1) * local
    labels = batch.labels
    # The collator's ignore_index (IGNORE_INDEX unless it was given another): it masks every sample's
    # first token with it, so the row's first label is it.
    ignore = int(labels[0, 0]) if labels.numel() else IGNORE_INDEX
    shifted = torch.cat([labels[:, 1:], labels.new_full((1, 1), ignore)], dim=1)[:, lo:hi].clone()
    changes: dict[str, Any] = dict(
        input_ids=batch.input_ids[:, lo:hi].clone(),
        labels=labels[:, lo:hi].clone(),
        position_ids=batch.position_ids[..., lo:hi].clone(),
        text_position_ids=batch.text_position_ids[:, lo:hi].clone(),
        shift_labels=shifted,
        num_loss_tokens=int((shifted != ignore).sum()),
        sp_rank=sp_rank,
        sp_size=sp_size,
    )
    fields = {k: v for k, v in batch.items() if k in _PACKED_NAMES}
    fields.update(changes)
    grids = _grids(batch)
    if grids is None and (batch.pixel_values is not None or batch.pixel_values_videos is not None):
        # Crop / tile towers (LLaVA, InternVL) carry no grids to route whole images by.
        raise ValueError("shard_batch routes vision by image_grid_thw / video_grid_thw (Qwen-VL); this batch "
                         "has pixels without grids")
    if grids is not None:
        fields.update(_vision_slice(batch, grids, sp_rank, sp_size, local))
    return SPBatch(**fields)


_PACKED_NAMES = frozenset(f.name for f in dataclasses.fields(PackedBatch))


def _grids(batch: PackedBatch) -> np.ndarray | None:
    parts = [g.numpy().reshape(-1, 3) for g in (batch.image_grid_thw, batch.video_grid_thw) if g is not None]
    return np.concatenate(parts).astype(np.int64) if parts else None


def _vision_slice(batch: PackedBatch, grids: np.ndarray, sp_rank: int, sp_size: int, local: int
                  ) -> dict[str, Any]:
    """This rank's grids with their tower inputs, and the feature all-to-all's plan."""
    if batch.vision_token_index is None:
        raise ValueError("shard_batch needs vision_token_index (where each vision feature goes): build the "
                         "batch with PackedCollator(rope='mrope', ...)")
    slots = batch.vision_token_index.numpy().astype(np.int64)
    patches = grids.prod(1)
    if patches.sum() % max(len(slots), 1) or len(slots) == 0:
        raise ValueError(f"{len(slots)} vision placeholders for {int(patches.sum())} patches")
    merge_area = int(patches.sum()) // len(slots)  # spatial_merge_size ** 2
    merged = patches // merge_area
    feat_cu = np.concatenate(([0], np.cumsum(merged)))
    patch_cu = np.concatenate(([0], np.cumsum(patches)))
    dest = slots // local  # the SP rank whose slice holds each feature's placeholder
    home = np.array([np.bincount(dest[feat_cu[g]:feat_cu[g + 1]], minlength=sp_size).argmax()
                     for g in range(len(grids))])
    owner = assign_grids(patches, home, sp_size)

    # Tower output rows of each rank: its grids in tower order, each grid's features in order.
    def rows_of(r: int) -> np.ndarray:
        return np.concatenate([np.arange(feat_cu[g], feat_cu[g + 1]) for g in np.flatnonzero(owner == r)]
                              or [np.zeros(0, np.int64)])

    send_rows = [rows_of(r) for r in range(sp_size)]
    # Stable sort by destination: each destination gets a rank's features in that rank's order.
    orders = [np.argsort(dest[rows], kind="stable") for rows in send_rows]
    mine = send_rows[sp_rank]
    send_counts = np.bincount(dest[mine], minlength=sp_size).tolist()
    recv_counts = [int((dest[rows] == sp_rank).sum()) for rows in send_rows]
    arrivals = np.concatenate([rows[order][dest[rows[order]] == sp_rank]
                               for rows, order in zip(send_rows, orders, strict=True)])
    out: dict[str, Any] = dict(
        vision_sp_send_index=torch.from_numpy(orders[sp_rank].astype(np.int64)),
        vision_sp_send_counts=send_counts,
        vision_sp_recv_counts=recv_counts,
        vision_token_index=torch.from_numpy(slots[arrivals] - sp_rank * local),
    )
    out.update(_own_tower_inputs(batch, grids, np.flatnonzero(owner == sp_rank), patch_cu, feat_cu))
    return out


def _own_tower_inputs(batch: PackedBatch, grids: np.ndarray, own: np.ndarray, patch_cu: np.ndarray,
                      feat_cu: np.ndarray) -> dict[str, Any]:
    """Pixels, grids and precomputed ``vision_*`` fields of the grids ``own`` (tower-order indexes),
    cut out of the full batch's (so they are the collator's own values, re-based)."""
    n_img = 0 if batch.image_grid_thw is None else int(batch.image_grid_thw.shape[0])
    img_own, vid_own = own[own < n_img], own[own >= n_img]
    out: dict[str, Any] = {}
    img_patch0 = 0
    vid_patch0 = int(patch_cu[n_img])

    def pixel_rows(pix: torch.Tensor | None, sel: np.ndarray, base: int) -> torch.Tensor | None:
        if pix is None or len(sel) == 0:
            return None
        return torch.cat([pix[patch_cu[g] - base:patch_cu[g + 1] - base] for g in sel])

    out["pixel_values"] = pixel_rows(batch.pixel_values, img_own, img_patch0)
    out["image_grid_thw"] = torch.from_numpy(grids[img_own]) if len(img_own) else None
    out["pixel_values_videos"] = pixel_rows(batch.pixel_values_videos, vid_own, vid_patch0)
    out["video_grid_thw"] = torch.from_numpy(grids[vid_own]) if len(vid_own) else None
    if batch.second_per_grid_ts is not None:
        sec = batch.second_per_grid_ts
        out["second_per_grid_ts"] = sec[torch.from_numpy(vid_own - n_img)] if len(vid_own) else None
    own_grids = grids[own]
    frames = frame_seqlens(own_grids)
    cu = np.zeros(len(frames) + 1, dtype=np.int32)
    np.cumsum(frames, out=cu[1:])
    if batch.vision_cu_seqlens is not None:
        out.update(vision_cu_seqlens=torch.from_numpy(cu), vision_cu_seqlens_list=cu[1:].tolist(),
                   vision_max_seqlen=int(frames.max(initial=0)))
    if batch.vision_position_ids is not None:
        pos = batch.vision_position_ids
        out["vision_position_ids"] = (torch.cat([pos[patch_cu[g]:patch_cu[g + 1]] for g in own])
                                      if len(own) else pos[:0].clone())
    if batch.vision_window_index is not None:
        out.update(_own_windows(batch, own, patch_cu, feat_cu))
    return out


def _own_windows(batch: PackedBatch, own: np.ndarray, patch_cu: np.ndarray, feat_cu: np.ndarray
                 ) -> dict[str, Any]:
    """Qwen2.5-VL's window order and window segments of the grids ``own``: each grid's entries are
    a contiguous block of the batch's (numbered over the batch), so they are cut and re-numbered."""
    index = batch.vision_window_index.numpy()  # type: ignore[union-attr]
    ends = np.asarray(batch.vision_cu_window_seqlens_list or [], dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1]))
    parts, lengths = [], []
    offset = 0
    for g in own:
        block = index[feat_cu[g]:feat_cu[g + 1]]
        parts.append(block - feat_cu[g] + offset)
        offset += feat_cu[g + 1] - feat_cu[g]
        inside = (starts >= patch_cu[g]) & (ends <= patch_cu[g + 1])
        lengths.append(ends[inside] - starts[inside])
    window_index = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    windows = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    cu = np.zeros(len(windows) + 1, dtype=np.int32)
    np.cumsum(windows, out=cu[1:])
    return dict(vision_window_index=torch.from_numpy(window_index.astype(np.int64)),
                vision_cu_window_seqlens=torch.from_numpy(cu), vision_cu_window_seqlens_list=cu[1:].tolist(),
                vision_max_window_seqlen=int(windows.max(initial=0)))


def sp_mesh(sp_size: int, device_type: str = "cpu") -> Any:
    """A 2-D ``DeviceMesh`` ``("dp", "sp")`` over the default group: ranks ``[d*S, (d+1)*S)`` form
    data-parallel group ``d``'s SP group. FSDP2 shards over the flattened mesh (all ranks); the
    sampler plans over ``mesh["dp"]`` (``num_replicas=mesh["dp"].size()``,
    ``rank=mesh["dp"].get_local_rank()``), so both SP peers get the same packed row."""
    from tokenbal.parallel import ParallelLayout

    return ParallelLayout.init(sp_size, device_type).mesh
