"""enable_packed on a tiny random transformers Qwen3-VL (DeepStack on, interleaved M-RoPE, q/k head
norms): a packed batch of text, image and video samples gives the loss and gradients of
per-sample unpadded transformers forwards, with transformers computing its own positions."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

import collate.models.core as packed_core  # noqa: E402
import collate.models.qwen3_vl as qwen3_vl_patch  # noqa: E402
from collate import PackedCollator  # noqa: E402
from collate.models import disable_packed, enable_packed  # noqa: E402
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.host_reads import (  # noqa: E402
    host_reads_of_step,
    host_tensors_of_step,
    skip_unless_tower_takes,
)
from tests.helpers.reference import backward_and_compare, forward_calls, token_weighted_loss  # noqa: E402
from tests.helpers.samples import text_only  # noqa: E402
from tests.helpers.tiny_mix import tiny_config as qwen2_config  # noqa: E402
from tests.helpers.tiny_qwen3_vl import DEEPSTACK, IMG, VEND, VID, VOCAB, VSTART, make_sample, tiny_config  # noqa: E402
from tokenbal.hf_compat import checkpointing_enable, get_rope_index, tower_inputs, tower_output  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(tiny_config()).float().eval()


SPECS = [
    [("text", 9)],
    [("text", 3), ("image", (1, 4, 6)), ("text", 5)],
    [("text", 2), ("image", (1, 6, 4)), ("text", 3), ("video", (2, 4, 4)), ("text", 2),
     ("image", (1, 2, 2)), ("text", 3)],
    [("text", 4), ("video", (3, 2, 4)), ("text", 6)],
    [("text", 13)],
]


def make_samples(seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [make_sample(g, spec) for spec in SPECS]


def hf_inputs(sample: dict) -> dict:
    """One unpadded sample as transformers' processor would hand it over (no position ids)."""
    ids = sample["input_ids"][None]
    out = {k: v for k, v in sample.items() if k not in ("input_ids", "labels")}
    out.update(input_ids=ids, labels=sample["labels"][None])
    if "image_grid_thw" in sample or "video_grid_thw" in sample:
        out["mm_token_type_ids"] = (ids == IMG).int() + 2 * (ids == VID).int()
    return out


def reference_loss(model, samples: list[dict]) -> torch.Tensor:
    """Token-weighted mean of per-sample transformers losses, transformers computing positions."""
    return token_weighted_loss(model, samples, hf_inputs)


def collate(model, samples: list[dict]):
    return PackedCollator.from_config(model.config, pin_memory=False)(samples)


def assert_packed_matches(ref, packed, samples: list[dict]) -> None:
    """The collator's packed batch gives ``ref``'s per-sample loss and every gradient."""
    want = reference_loss(ref, samples)
    backward_and_compare(packed(**collate(ref, samples)).loss, want)
    assert assert_grads_match(packed, ref) > 50


def hand_made(batch) -> dict:
    """The batch without any precomputed tower input: transformers derives them from the grids."""
    return {k: (None if k.startswith("vision_") and not k.endswith("max_seqlen") else v)
            for k, v in batch.items()}


@pytest.mark.parametrize("source", ["collator", "hand-made"])
def test_packed_loss_and_grads_match_per_sample(reference, source):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = collate(ref, samples)
    if source == "hand-made":
        batch = hand_made(batch)

    want = reference_loss(ref, samples)
    out = packed(**batch)
    backward_and_compare(out.loss, want)
    assert out.logits.shape == (1, batch["input_ids"].shape[1], VOCAB)
    assert assert_grads_match(packed, ref) > 50
    grads = {n: p.grad for n, p in ref.named_parameters()}
    # Images, videos and both deepstack maps really are in the graph.
    for name in ("model.visual.patch_embed.proj.weight", "model.visual.pos_embed.weight",
                 "model.visual.deepstack_merger_list.0.linear_fc2.weight",
                 "model.visual.deepstack_merger_list.1.linear_fc2.weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


def test_qwen3_vl_moe_packed_loss_and_grads_match_per_sample():
    """Qwen3-VL-MoE (experts in every text layer's MLP, top-2 of 4) takes the same patch: routing is
    per token, so packing changes nothing but the attention segments."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    dense = tiny_config().to_dict()
    text = dict(dense["text_config"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                decoder_sparse_step=1)
    config = Qwen3VLMoeConfig(text_config=text, vision_config=dense["vision_config"], image_token_id=IMG,
                              video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
                              attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = Qwen3VLMoeForConditionalGeneration(config).float().eval()
    packed = enable_packed(copy.deepcopy(ref))
    samples = make_samples()
    assert_packed_matches(ref, packed, samples)
    experts = [n for n, p in ref.named_parameters() if "experts" in n and p.grad is not None]
    assert experts and all(dict(ref.named_parameters())[n].grad.abs().sum() > 0 for n in experts)


def test_collator_positions_equal_hf_get_rope_index(reference):
    samples = make_samples()
    batch = collate(reference, samples)
    start = 0
    for s in samples:
        x = hf_inputs(s)
        n = x["input_ids"].shape[1]
        if "mm_token_type_ids" in x:
            want = get_rope_index(reference.model, x["input_ids"], mm_token_type_ids=x["mm_token_type_ids"],
                                  image_grid_thw=x.get("image_grid_thw"),
                                  video_grid_thw=x.get("video_grid_thw"))
        else:
            want = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
        assert torch.equal(batch.position_ids[:, :, start:start + n], want)
        start += n
    assert start == batch.input_ids.shape[1]


def test_packed_path_uses_ops_deepstack_slots_and_batch_segments(reference, monkeypatch):
    """Every text layer: apply_mrope with Qwen3's interleaved layout on the batch positions and
    causal varlen attention on the batch's host segments; every vision block: non-causal varlen
    attention over the collator's per-frame segments; deepstack: one index_add per deepstack
    layer at the collator's slots; no position recomputation, one tower call."""
    packed = enable_packed(copy.deepcopy(reference))
    batch = collate(reference, make_samples())
    calls = {"rope": 0, "text_attn": 0, "vision_attn": 0, "deepstack": 0, "tower": 0}
    # Both families share qwen2_vl's attention bodies: the ops are looked up there.
    real_rope, real_attn = packed_core.apply_mrope, packed_core.varlen_attention
    text_model = packed.model.language_model
    real_deepstack = text_model._deepstack_process

    def rope(q, k, pos, inv_freq, section, interleaved, scaling):
        calls["rope"] += 1
        assert pos is batch.position_ids and interleaved is True and tuple(section) == (6, 5, 5)
        assert inv_freq is text_model.rotary_emb.inv_freq and scaling == 1.0
        return real_rope(q, k, pos, inv_freq, section, interleaved, scaling)

    def attn(q, k, v, info, causal, **kwargs):
        if causal:   # text
            calls["text_attn"] += 1
            assert info.cu_seqlens_list == batch.cu_seqlens_list and info.max_seqlen == batch.max_seqlen
        else:        # vision
            calls["vision_attn"] += 1
            assert info.cu_seqlens_list == batch.vision_cu_seqlens_list
        return real_attn(q, k, v, info, causal=causal, **kwargs)

    def deepstack(hidden, where, embeds):
        calls["deepstack"] += 1
        assert isinstance(where, qwen3_vl_patch.DeepstackSlots) and where.slots is batch.vision_token_index
        return real_deepstack(hidden, where, embeds)

    def no_rope_index(*args, **kwargs):
        raise AssertionError("packed forward must not recompute positions")

    def count_tower(module, args, kwargs):
        calls["tower"] += 1

    monkeypatch.setattr(packed_core, "apply_mrope", rope)
    monkeypatch.setattr(packed_core, "varlen_attention", attn)
    monkeypatch.setattr(text_model, "_deepstack_process", deepstack)
    monkeypatch.setattr(packed.model, "get_rope_index", no_rope_index)
    hook = packed.model.visual.register_forward_pre_hook(count_tower, with_kwargs=True)
    try:
        with torch.no_grad():
            loss = packed(**batch).loss
    finally:
        hook.remove()
    n_text, n_vision = len(text_model.layers), len(packed.model.visual.blocks)
    # A tower that derives its own segments (before transformers 5.9) runs its own attention.
    takes_segments = "cu_seqlens" in tower_inputs(packed.model.visual)
    n_vision = n_vision if takes_segments else 0
    assert calls == {"rope": n_text, "text_attn": n_text, "vision_attn": n_vision,
                     "deepstack": len(DEEPSTACK), "tower": 1}
    if not takes_segments:
        return
    # The vision segments are really used: one segment across all frames changes the result.
    monkeypatch.undo()
    merged = dict(batch.items(), vision_cu_seqlens_list=[batch.vision_cu_seqlens_list[-1]],
                  vision_cu_seqlens=batch.vision_cu_seqlens[[0, -1]])
    with torch.no_grad():
        assert not torch.equal(packed(**merged).loss, loss)


def test_text_only_batch_runs_the_idle_tower(reference):
    """A micro-batch without images or videos still runs the tower once (FSDP2: every rank issues
    the vision blocks' collectives); its outputs, deepstack maps included, enter times zero."""
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = text_only(make_samples())
    batch = collate(ref, samples)
    assert batch.pixel_values is None and batch.pixel_values_videos is None
    with forward_calls(packed.model.visual) as towers:
        out = packed(**batch)
    assert len(towers) == 1 and len(tower_output(towers[0]).deepstack_features) == len(DEEPSTACK)
    want = reference_loss(ref, samples)
    backward_and_compare(out.loss, want)
    assert assert_grads_match(packed, ref) > 10  # vision grads: zero here, None in the reference
    vision_grads = [p.grad for n, p in packed.named_parameters() if n.startswith("model.visual.")]
    assert all(g is not None for g in vision_grads)  # every vision parameter was in the graph

    quiet = enable_packed(copy.deepcopy(reference), idle_vision=False)
    with forward_calls(quiet.model.visual) as quiet_towers, torch.no_grad():
        torch.testing.assert_close(quiet(**batch).loss, want.detach(), rtol=1e-5, atol=0)
    assert not quiet_towers


def test_unpacked_calls_unchanged_and_disable_restores(reference):
    sample = make_samples()[2]
    packed = enable_packed(copy.deepcopy(reference))
    with torch.no_grad():
        want = reference(**hf_inputs(sample))
        got = packed(**hf_inputs(sample))
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)

    assert enable_packed(packed) is packed  # idempotent
    text_model = packed.model.language_model
    patched = [packed, text_model, text_model.layers[0].self_attn, packed.model.visual.blocks[0].attn]
    assert all("forward" in m.__dict__ for m in patched) and "_deepstack_process" in text_model.__dict__
    clone = copy.deepcopy(packed)  # the per-instance methods rebind to the copy
    assert clone.model.language_model._deepstack_process.__self__ is clone.model.language_model
    disable_packed(packed)
    assert not any("forward" in m.__dict__ for m in patched)
    assert "_deepstack_process" not in text_model.__dict__
    with torch.no_grad():
        again = packed(**hf_inputs(sample))
    torch.testing.assert_close(again.logits, want.logits, rtol=0, atol=0)


def test_eager_reference_and_gradient_checkpointing():
    torch.manual_seed(3)
    ref = Qwen3VLForConditionalGeneration(tiny_config("eager")).float().train()  # dropout is 0
    packed = enable_packed(copy.deepcopy(ref))
    checkpointing_enable(packed)
    assert packed.model.language_model.layers[0].gradient_checkpointing
    samples = make_samples(seed=2)
    assert_packed_matches(ref, packed, samples)


def test_bad_packed_batches_raise(reference):
    packed = enable_packed(copy.deepcopy(reference))
    batch = dict(collate(reference, make_samples()).items())
    with pytest.raises(ValueError, match="cover"):
        packed(**{**batch, "cu_seqlens_list": batch["cu_seqlens_list"][:-1]})
    with pytest.raises(ValueError, match="python int"):
        packed(**{**batch, "max_seqlen": torch.tensor(batch["max_seqlen"])})
    with pytest.raises(ValueError, match="attention_mask"):
        packed(**{**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    with pytest.raises(ValueError, match="placeholder"):
        no_images = torch.where(batch["input_ids"] == IMG, 5, batch["input_ids"])
        packed(**{**hand_made(batch), "input_ids": no_images})
    qwen2 = Qwen2VLForConditionalGeneration(qwen2_config())
    with pytest.raises(TypeError, match="qwen3_vl"):
        qwen3_vl_patch.enable_packed(qwen2)


def test_mrope_section_not_covering_the_frequencies_is_refused_at_enable():
    """Qwen3-VL's default sections (24, 20, 20) on a head_dim-32 text model (16 frequencies):
    transformers' interleaved layout runs it, the packed rotary cannot. enable_packed says so,
    rather than the model's first packed forward."""
    from transformers import Qwen3VLConfig

    from tokenbal.hf_compat import rope_config

    config = tiny_config()
    for key, value in rope_config(Qwen3VLConfig, 1e4, mrope_section=[24, 20, 20],
                                  mrope_interleaved=True).items():
        setattr(config.text_config, key, value)
    model = Qwen3VLForConditionalGeneration(config)
    with pytest.raises(ValueError, match="mrope_section"):
        enable_packed(model)
    assert not getattr(model, packed_core.ENABLED, False)


def test_device_interpolation_equals_transformers(reference):
    """The position-embedding taps the packed path computes from the collator's rotary ids are
    transformers' own, bit for bit (images and multi-frame videos of several shapes)."""
    skip_unless_tower_takes(reference.model.visual, "interp_indices")
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    batch = collate(reference, make_samples())
    visual = reference.model.visual
    grids = torch.cat([batch.image_grid_thw, batch.video_grid_thw])
    num_patches = batch.pixel_values.shape[0] + batch.pixel_values_videos.shape[0]
    got = qwen3_vl_patch.interpolation_kwargs(visual, grids, batch.vision_position_ids, num_patches)
    want = get_vision_interpolation_indices_and_weights(
        grids, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.spatial_merge_size)
    assert torch.equal(got["interp_indices"], want[0]) and torch.equal(got["interp_weights"], want[1])


@pytest.mark.parametrize("mix", ["text, images and videos", "text only"])
def test_packed_forward_and_backward_read_nothing_back(reference, mix, monkeypatch):
    """With the collator's fields nothing in a packed forward + backward reads the device: not the
    tower (rotary ids, frame segments, position-embedding taps), not the feature placement, not
    deepstack (no boolean masks). A text-only batch runs the idle dummy image."""
    skip_unless_tower_takes(reference.model.visual, "cu_seqlens", "position_ids", "interp_indices")
    packed = enable_packed(copy.deepcopy(reference))
    samples = text_only(make_samples()) if mix == "text only" else make_samples()
    batch = collate(reference, samples)
    packed(**batch).loss.backward()  # warm-up: lazy initialisation, the idle image's cached inputs
    reads = host_reads_of_step(packed, batch, monkeypatch)
    assert reads == []
    assert host_tensors_of_step(packed, batch) == []  # nor a blocking host-to-device copy
    if mix == "text only":
        return
    # The spy does see transformers' reads when the precomputed fields are missing.
    reads = host_reads_of_step(packed, hand_made(batch), monkeypatch)
    assert "aten.repeat_interleave.Tensor" in reads and "tolist" in reads


def _fsdp2_text_only_rank(rank: int, world_size: int) -> float:
    """Rank 1 gets only text while the vision blocks (and, in the root unit, the deepstack mergers)
    are sharded: the idle dummy image keeps the ranks' collectives paired, and the gradients equal
    the unsharded per-sample reference (FSDP2 averages the ranks' gradients). Sharded the way
    scripts/train_fsdp2.py shards, with layer prefetch."""
    from collate.train import shard_qwen2_vl

    torch.manual_seed(0)
    ref = Qwen3VLForConditionalGeneration(tiny_config()).float().eval()
    packed = shard_qwen2_vl(enable_packed(copy.deepcopy(ref)), prefetch_depth=1)
    samples = make_samples()
    vision = [s for s in samples if "pixel_values" in s or "pixel_values_videos" in s]
    shares = [vision, text_only(samples)]  # rank 1: text only
    packed(**collate(ref, shares[rank])).loss.backward()
    want = sum(reference_loss(ref, share) for share in shares) / world_size
    want.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst = 0.0
    for name, p in packed.named_parameters():
        got, g = p.grad.full_tensor(), ref_grads[name]
        torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-5 * float(g.abs().max()))
        worst = max(worst, float((got - g).abs().max() / g.abs().max().clamp_min(1e-30)))
    return worst


def test_fsdp2_rank_without_images_still_runs_the_sharded_vision_tower():
    from tests.helpers.dist_utils import run_ranks

    errs = run_ranks(_fsdp2_text_only_rank, 2, timeout=180, collective_timeout=30)
    assert max(errs) < 1e-5


def test_packed_loss_takes_num_items_in_batch_and_a_row_without_targets_is_zero(reference):
    """The packed call's ``num_items_in_batch`` reaches the loss (the summed loss over that divisor),
    also where transformers' own forward drops its loss kwargs (4.57-5.9 call ``loss_function``
    without them: ``hf_compat.loss_kwargs_reach_loss``); a row without a single target gives 0,
    not NaN, so an empty rank cannot poison the reduced gradients."""
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = collate(reference, samples)
    with torch.no_grad():
        mean = packed(**batch).loss
        summed = packed(**batch, num_items_in_batch=1000).loss
        assert summed == pytest.approx(float(mean) * batch.num_loss_tokens / 1000, rel=1e-5)
        empty = collate(reference, samples)
        empty.labels.fill_(-100)
        empty.num_loss_tokens = 0
        assert float(packed(**empty).loss) == 0.0
    assert "_loss_function" not in packed.__dict__  # the per-call wrapper is gone again
