"""Sequence parallelism on the host: PackedCollator(sp_size=S) padding and collate.sp.shard_batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from collate import PackedCollator
from collate.packing import IGNORE_INDEX
from collate.sp import SPBatch, assign_grids, shard_batch
from collate.vision import tower_fields
from tests.helpers.samples import vl_sample

IMG, VID, VSTART, VEND = 90, 91, 92, 93
PATCH_DIM = 8


def make_sample(g: torch.Generator, spec: list) -> dict:
    """spec: ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w)); Qwen2-VL placeholder layout."""
    return vl_sample(g, spec, image=IMG, video=VID, start=VSTART, end=VEND, patch_dim=PATCH_DIM)


SPECS = [
    [("text", 7), ("image", (1, 4, 6)), ("text", 5)],
    [("text", 2), ("video", (3, 4, 8)), ("text", 6)],
    [("text", 4), ("image", (1, 2, 2)), ("text", 3), ("video", (2, 2, 4)), ("text", 2)],
    [("text", 9)],
]


def collator(sp_size: int = 1, window: int | None = None) -> PackedCollator:
    return PackedCollator(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART,
                          vision_window=window, pin_memory=False, sp_size=sp_size)


def samples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [make_sample(g, spec) for spec in SPECS]


def test_sp_padding_is_a_loss_free_segment_at_the_end():
    plain = collator()(samples())
    total = plain.input_ids.shape[1]
    for sp in (2, 3, 4, 8):
        b = collator(sp)(samples())
        pad = -total % sp
        assert b.input_ids.shape[1] == total + pad and b.input_ids.shape[1] % sp == 0
        assert b.sp_padding == pad and b.num_samples == len(SPECS)
        assert b.num_loss_tokens == plain.num_loss_tokens
        assert torch.equal(b.input_ids[:, :total], plain.input_ids)
        assert torch.equal(b.position_ids[..., :total], plain.position_ids)
        if pad:
            assert b.seq_lens == [*plain.seq_lens, pad] and b.cu_seqlens_list[-1] == total + pad
            assert (b.labels[0, total:] == IGNORE_INDEX).all()
            assert (b.input_ids[0, total:] == 0).all()
            assert torch.equal(b.position_ids[..., total:], torch.arange(pad).expand(3, 1, pad))
        else:
            assert b.seq_lens == plain.seq_lens
        assert torch.equal(b.vision_token_index, plain.vision_token_index)
    assert total % 4, "the specs give a row that needs padding"


def test_sp_collator_errors():
    with pytest.raises(ValueError, match="sp_size must be >= 1"):
        collator(0)
    with pytest.raises(ValueError, match="sp_pad_token_id=90 is a vision token"):
        PackedCollator(image_token_id=IMG, sp_size=2, sp_pad_token_id=IMG)
    with pytest.raises(ValueError, match="sp_pad_token_id must be a token id >= 0, got -100"):
        PackedCollator(rope="1d", sp_size=2, sp_pad_token_id=-100)


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_shard_batch_slices_and_keeps_full_row_segments(sp):
    b = collator(sp)(samples())
    total = b.input_ids.shape[1]
    local = total // sp
    shards = [shard_batch(b, r, sp) for r in range(sp)]
    shifted = torch.cat([b.labels[:, 1:], torch.full((1, 1), IGNORE_INDEX)], 1)
    for r, s in enumerate(shards):
        assert isinstance(s, SPBatch) and (s.sp_rank, s.sp_size) == (r, sp)
        cut = slice(r * local, (r + 1) * local)
        assert torch.equal(s.input_ids, b.input_ids[:, cut])
        assert torch.equal(s.labels, b.labels[:, cut])
        assert torch.equal(s.shift_labels, shifted[:, cut])
        assert torch.equal(s.position_ids, b.position_ids[..., cut])
        assert torch.equal(s.text_position_ids, b.text_position_ids[:, cut])
        assert s.cu_seqlens_list == b.cu_seqlens_list and s.max_seqlen == b.max_seqlen
        assert torch.equal(s.cu_seqlens, b.cu_seqlens) and s.seq_lens == b.seq_lens
        assert "shift_labels" in s and s["sp_size"] == sp
    # Each target is counted exactly once over the group.
    assert sum(s.num_loss_tokens for s in shards) == b.num_loss_tokens


@pytest.mark.parametrize("sp", [2, 3, 4])
@pytest.mark.parametrize("window", [None, 2])
def test_shard_batch_vision_whole_grids_and_feature_routing(sp, window):
    b = collator(sp, window)(samples())
    total = b.input_ids.shape[1]
    local = total // sp
    grids = torch.cat([b.image_grid_thw, b.video_grid_thw]).tolist()
    merged = [t * h * w // 4 for t, h, w in grids]
    feat_cu = np.cumsum([0, *merged])
    # A video's placeholders straddle some cut for these specs: features must cross ranks.
    slots = b.vision_token_index.numpy()
    straddles = [g for g in range(len(grids)) if len(set(slots[feat_cu[g]:feat_cu[g + 1]] // local)) > 1]
    assert straddles, "the row has a grid whose placeholders straddle an SP cut"
    shards = [shard_batch(b, r, sp) for r in range(sp)]
    # Every grid whole on exactly one rank.
    own = [[*(s.image_grid_thw.tolist() if s.image_grid_thw is not None else []),
            *(s.video_grid_thw.tolist() if s.video_grid_thw is not None else [])] for s in shards]
    assert sorted(g for o in own for g in o) == sorted(grids)
    # Pixels, the rank's own tower inputs: equal to what the collator computes for those grids.
    full_feats = torch.arange(sum(merged))  # stand-in tower output: feature j = j (tower order)
    received = {}
    outputs = []
    for r, s in enumerate(shards):
        fields = tower_fields(np.asarray(own[r]).reshape(-1, 3), 2, window)
        for key, value in fields.items():
            got = s[key]
            assert (torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value), key
        # This rank's tower output rows are its grids' features in its own tower order.
        mine = _owned_indexes(s, b)
        outputs.append(torch.cat([full_feats[feat_cu[g]:feat_cu[g + 1]] for g in mine])
                       if mine else full_feats[:0])
        n_pix = sum(int(np.prod(grids[g])) for g in mine)
        got_pix = sum(x.shape[0] for x in (s.pixel_values, s.pixel_values_videos) if x is not None)
        assert got_pix == n_pix
    # Simulate the all-to-all: rank r's send buffer is its output in send_index order, split by counts.
    sends = [out[s.vision_sp_send_index].split(s.vision_sp_send_counts)
             for out, s in zip(outputs, shards, strict=True)]
    for r, s in enumerate(shards):
        assert [sends[src][r].shape[0] for src in range(sp)] == s.vision_sp_recv_counts
        got = torch.cat([sends[src][r] for src in range(sp)])
        received[r] = got
        # Feature j lands at slot vision_token_index[j] of the full row: local slot + r * local.
        want_slots = b.vision_token_index[got]
        assert torch.equal(s.vision_token_index + r * local, want_slots)
        assert ((s.vision_token_index >= 0) & (s.vision_token_index < local)).all()
    assert sum(len(v) for v in received.values()) == sum(merged)


def _owned_indexes(shard: SPBatch, full) -> list[int]:
    """Tower-order indexes (images then videos) of the shard's grids, found through its pixels."""
    out = []
    n_img = full.image_grid_thw.shape[0]
    for pix_key, grid_key, base in (("pixel_values", "image_grid_thw", 0),
                                    ("pixel_values_videos", "video_grid_thw", n_img)):
        if shard[grid_key] is None:
            continue
        fpix, fgrid = full[pix_key], full[grid_key].tolist()
        starts = np.cumsum([0, *[int(np.prod(g)) for g in fgrid]])
        row = 0
        for g in shard[grid_key].tolist():
            n = int(np.prod(g))
            match = [i for i in range(len(fgrid)) if fgrid[i] == g
                     and torch.equal(fpix[starts[i]:starts[i] + n], shard[pix_key][row:row + n])]
            assert len(match) == 1
            out.append(base + match[0])
            row += n
    return out


def test_assign_grids_whole_and_balanced():
    owner = assign_grids(np.array([16, 4, 4, 24, 8]), np.array([0, 0, 1, 1, 1]), 2)
    load = np.bincount(owner, weights=[16, 4, 4, 24, 8], minlength=2)
    assert load.tolist() == [28, 28]
    assert owner[3] == 1  # the largest goes to its home rank when loads tie


@pytest.mark.parametrize("ignore", [IGNORE_INDEX, -1])
def test_shard_batch_keeps_the_collators_ignore_index(ignore):
    # The slices' shifted labels are the row's, cut; their loss tokens add up to the row's, whatever
    # ignore_index the collator masked boundaries and SP padding with.
    collator = PackedCollator(rope="1d", pin_memory=False, sp_size=4, ignore_index=ignore)
    samples = [{"input_ids": np.arange(1, 6), "labels": np.array([ignore, 2, 3, 4, 5])},
               {"input_ids": np.arange(1, 4), "labels": np.array([ignore, ignore, 3])}]
    row = collator(samples)
    slices = [shard_batch(row, r, 4) for r in range(4)]
    shifted = torch.cat([row.labels[:, 1:], row.labels.new_full((1, 1), ignore)], dim=1)
    assert torch.equal(torch.cat([s.shift_labels for s in slices], dim=1), shifted)
    assert sum(s.num_loss_tokens for s in slices) == row.num_loss_tokens == 5


def test_shard_batch_errors():
    b = collator()(samples())
    with pytest.raises(ValueError, match="not a multiple of sp_size=4"):
        shard_batch(b, 0, 4)
    with pytest.raises(ValueError, match="sp_rank=2 must lie in"):
        shard_batch(collator(2)(samples()), 2, 2)
    text = collator(2)([samples()[3]])
    assert shard_batch(text, 1, 2).vision_sp_send_counts is None
    crops = dataclasses.replace(collator(2)(samples()), image_grid_thw=None, video_grid_thw=None)
    with pytest.raises(ValueError, match="has pixels without grids"):
        shard_batch(crops, 0, 2)


def test_a_parallel_layout_says_the_sp_size_once():
    from transformers import Qwen2VLConfig

    from tokenbal.parallel import ParallelLayout

    b = collator(3)(samples())
    for rank in range(6):
        layout = ParallelLayout.from_world(6, 3, rank)
        by_layout, by_args = shard_batch(b, layout=layout), shard_batch(b, layout.sp_rank, 3)
        assert (by_layout.sp_rank, by_layout.sp_size) == (rank % 3, 3)
        assert all(torch.equal(v, by_args[k]) if isinstance(v, torch.Tensor) else v == by_args[k]
                   for k, v in by_layout.items())
    with pytest.raises(ValueError, match="disagree with the layout"):
        shard_batch(b, 0, 2, layout=ParallelLayout.from_world(6, 3))
    with pytest.raises(TypeError, match="or layout="):
        shard_batch(b, 0)
    config = Qwen2VLConfig(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART)
    layout = ParallelLayout.from_world(4, 2, 1)
    assert PackedCollator.from_config(config, layout=layout).sp_size == 2
    assert PackedCollator.from_config(config, layout=layout) == PackedCollator.from_config(config, sp_size=2)
    with pytest.raises(ValueError, match="disagrees with the layout"):
        PackedCollator.from_config(config, layout=layout, sp_size=4)
