"""The packed vision path: PackedCollator precomputes what transformers' Qwen2-VL / Qwen2.5-VL vision
towers derive from ``grid_thw`` (rotary ids, frame and window segments, where each feature goes), so
a packed forward and backward read nothing back from the device, and the math is unchanged:
loss and gradients equal per-sample transformers forwards for text, image and video samples."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

from collate import PackedCollator  # noqa: E402
from collate.models import enable_packed  # noqa: E402
from collate.positions import mrope_positions  # noqa: E402
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.host_reads import (  # noqa: E402
    host_reads_of_step,
    host_tensors_of_step,
    skip_unless_tower_takes,
)
from tests.helpers.reference import backward_and_compare  # noqa: E402
from tests.helpers.tiny_mix import IMG, VEND, VID, VSTART, make_samples, tiny_config  # noqa: E402
from tokenbal.hf_compat import qwen2_5_vl_whole_seconds, qwen2_vl_video_text_resume  # noqa: E402

TOKENS_PER_SECOND = 2


def tiny_qwen2_5_config() -> Qwen2_5_VLConfig:
    # window_size 56 = 2 merged tokens: the test grids (4x6, 6x4, 4x4, 2x4 patches) are cut into
    # full and partial windows, and block 1 attends over whole frames.
    return Qwen2_5_VLConfig(
        text_config=tiny_config().text_config.to_dict(),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, tokens_per_second=TOKENS_PER_SECOND),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        attn_implementation="sdpa")


def build(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2_vl":
        config = tiny_config()
        return config, Qwen2VLForConditionalGeneration(config).float()
    config = tiny_qwen2_5_config()
    return config, Qwen2_5_VLForConditionalGeneration(config).float()


def with_video_seconds(samples: list[dict]) -> list[dict]:
    """Qwen2.5-VL samples: every video gets its seconds per temporal patch (0.5, 1.0, ...)."""
    out = []
    for i, s in enumerate(samples):
        s = dict(s)
        if "video_grid_thw" in s:
            s["second_per_grid_ts"] = torch.full((len(s["video_grid_thw"]),), 0.5 * (1 + i % 2))
        out.append(s)
    return out


def unpacked_loss_sum(model, sample: dict) -> torch.Tensor:
    """transformers' forward on one unpadded sample (its own tower call), times its loss tokens."""
    ids = sample["input_ids"]
    seconds = sample.get("second_per_grid_ts")
    # the installed transformers' time-step rule, as the collator uses it (whole seconds to 5.9)
    timing = {} if seconds is None else dict(second_per_grid_ts=seconds.numpy(),
                                             tokens_per_second=TOKENS_PER_SECOND,
                                             whole_seconds=qwen2_5_vl_whole_seconds())
    # and its rule for text after a video (4.57: past the frames; 5.x: past the rows)
    pos = mrope_positions(ids.numpy(), sample.get("image_grid_thw"), sample.get("video_grid_thw"),
                          image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART,
                          spatial_merge_size=2,
                          video_text_resume=qwen2_vl_video_text_resume(model.config.model_type), **timing)
    kwargs = {k: v for k, v in sample.items() if k not in ("input_ids", "labels")}
    out = model(input_ids=ids[None], labels=sample["labels"][None],
                position_ids=torch.from_numpy(pos)[:, None, :], **kwargs)
    return out.loss * int((sample["labels"][1:] != -100).sum())


def test_qwen2_5_vl_windowed_tower_from_collator_equals_per_sample_transformers():
    config, reference = build("qwen2_5_vl")
    packed = enable_packed(copy.deepcopy(reference))
    samples = with_video_seconds(make_samples())
    batch = PackedCollator.from_config(config, pin_memory=False)(samples)
    assert batch.vision_window_index is not None and len(batch.vision_cu_window_seqlens_list) > len(
        batch.vision_cu_seqlens_list)  # the windows really cut the frames

    want = sum(unpacked_loss_sum(reference, s) for s in samples) / batch.num_loss_tokens
    backward_and_compare(packed(**batch).loss, want)
    assert assert_grads_match(packed, reference) > 20
    assert dict(reference.named_parameters())["model.visual.blocks.0.attn.qkv.weight"].grad.abs().sum() > 0


def test_vision_attention_runs_on_the_batch_segments(monkeypatch):
    """Every vision block attends over the collator's host segments: frames in full-attention
    blocks, windows in the others (checked by replacing them: the loss changes)."""
    import collate.models.core as patch

    config, reference = build("qwen2_5_vl")
    skip_unless_tower_takes(reference.model.visual, "cu_seqlens", "window_index")
    packed = enable_packed(copy.deepcopy(reference))
    batch = PackedCollator.from_config(config, pin_memory=False)(with_video_seconds(make_samples()))
    seen = []
    real = patch.varlen_attention

    def spy(q, k, v, info, causal=True, **kwargs):
        if not causal:
            seen.append(list(info.cu_seqlens_list))
        return real(q, k, v, info, causal=causal, **kwargs)

    monkeypatch.setattr(patch, "varlen_attention", spy)
    with torch.no_grad():
        loss = packed(**batch).loss
    assert seen == [batch.vision_cu_window_seqlens_list, batch.vision_cu_seqlens_list]  # blocks 0, 1
    merged = dict(batch.items(), vision_cu_seqlens_list=[batch.vision_cu_seqlens_list[-1]],
                  vision_cu_seqlens=batch.vision_cu_seqlens[[0, -1]])
    with torch.no_grad():
        assert not torch.equal(packed(**merged).loss, loss)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("mix", ["text, images and videos", "text only"])
def test_packed_forward_and_backward_read_nothing_back(kind, mix, monkeypatch):
    """On an accelerator each such read is a host sync; on the CPU the same calls are what a sync
    would be, so counting them here is the CPU-side proof (scripts/check_gpu.py repeats it under
    ``torch.cuda.set_sync_debug_mode("error")``). A text-only batch runs the idle dummy image."""
    config, reference = build(kind)
    skip_unless_tower_takes(reference.model.visual, "cu_seqlens", "position_ids")
    packed = enable_packed(reference)
    samples = with_video_seconds(make_samples())
    if mix == "text only":
        samples = [s for s in samples if "pixel_values" not in s and "pixel_values_videos" not in s]
    collate = PackedCollator.from_config(config, pin_memory=False)
    batch = collate(samples)
    packed(**batch).loss.backward()  # warm-up: lazy initialisation, the idle image's cached inputs
    reads = host_reads_of_step(packed, batch, monkeypatch)
    assert reads == []
    assert host_tensors_of_step(packed, batch) == []  # nor a blocking host-to-device copy
    if mix == "text only":
        return
    # The spy does see the reads transformers makes when the precomputed fields are missing.
    bare = dict(batch.items(), vision_position_ids=None, vision_token_index=None)
    reads = host_reads_of_step(packed, bare, monkeypatch)
    assert "tolist" in reads


def test_collator_vision_fields_follow_the_tower_order():
    """Images first, then videos, as the packed model concatenates them; slots point at the
    placeholder tokens in that order."""
    config, _ = build("qwen2_5_vl")
    samples = with_video_seconds(make_samples())
    b = PackedCollator.from_config(config, pin_memory=False)(samples)
    ids = b.input_ids[0].numpy()
    slots = np.concatenate([np.flatnonzero(ids == IMG), np.flatnonzero(ids == VID)])
    np.testing.assert_array_equal(b.vision_token_index.numpy(), slots)
    grids = torch.cat([b.image_grid_thw, b.video_grid_thw])
    assert b.vision_position_ids.shape == (int(grids.prod(1).sum()), 2)
    assert b.vision_window_index.shape == (int(grids.prod(1).sum()) // 4,)
    assert b.vision_cu_seqlens_list == b.vision_cu_seqlens[1:].tolist()
    assert b.vision_cu_window_seqlens_list == b.vision_cu_window_seqlens[1:].tolist()
    assert sorted(b.vision_window_index.tolist()) == list(range(len(b.vision_window_index)))
    qwen2 = PackedCollator.from_config(tiny_config(), pin_memory=False)(make_samples())
    assert qwen2.vision_window_index is None and qwen2.vision_position_ids is not None


def transformers_own_loss_sum(model, sample: dict) -> torch.Tensor:
    """transformers' forward on one unpadded sample with the positions its own ``get_rope_index``
    lays out (no ``position_ids`` given), times its loss tokens."""
    from tokenbal.hf_compat import accepts_kwarg

    ids = sample["input_ids"][None]
    kwargs = {k: v for k, v in sample.items() if k not in ("input_ids", "labels")}
    if accepts_kwarg(model.model.forward, "mm_token_type_ids"):   # 5.x lays out positions from these
        kwargs["mm_token_type_ids"] = (ids == IMG).int() + 2 * (ids == VID).int()
    out = model(input_ids=ids, labels=sample["labels"][None], **kwargs)
    return out.loss * int((sample["labels"][1:] != -100).sum())


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_packed_equals_transformers_own_positions_after_a_long_video(kind):
    """Text after a video whose frames outnumber its merged rows (make_samples' ("video", (3, 4, 4))
    then text): transformers 5.x resumes that text after the video's spatial extent, 4.57 after its
    frames. PackedCollator.from_config takes the installed rule, so the packed loss and gradients
    equal transformers' own forward, positions included (on 5.x the collator kept 4.57's rule: the
    loss differed by ~1e-3 relative)."""
    config, reference = build(kind)
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    if kind == "qwen2_5_vl":
        samples = with_video_seconds(samples)
    batch = PackedCollator.from_config(config, pin_memory=False)(samples)
    want = sum(transformers_own_loss_sum(reference, s) for s in samples) / batch.num_loss_tokens
    backward_and_compare(packed(**batch).loss, want)
    assert assert_grads_match(packed, reference) > 20
