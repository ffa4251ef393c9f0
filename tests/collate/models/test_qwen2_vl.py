"""enable_packed on a tiny random transformers Qwen2-VL: packed loss and gradients equal the
token-weighted mean of per-sample unpacked HF forwards (HF computing its own positions)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Qwen2VLForConditionalGeneration  # noqa: E402

import collate.models.core as packed_core  # noqa: E402
from collate.models import disable_packed, enable_packed  # noqa: E402
from tests.helpers.reference import backward_and_compare, fully_shard_packed, token_weighted_loss  # noqa: E402
from tests.helpers.tiny_qwen2_vl import IMG, PATCH_DIM, VEND, VID, VOCAB, VSTART, tiny_config  # noqa: E402
from tokenbal.hf_compat import checkpointing_enable, get_rope_index, tower_inputs  # noqa: E402


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ref = Qwen2VLForConditionalGeneration(tiny_config()).eval()
    packed = enable_packed(copy.deepcopy(ref))
    return ref, packed


def _text(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 100, (n,), generator=g).tolist()


def make_samples() -> list[dict]:
    """Text-only, one image, two images (different grids), text-only: host tensors, unpadded."""
    g = torch.Generator().manual_seed(1)
    specs = [
        [("text", 9)],
        [("text", 3), ("image", (1, 4, 6)), ("text", 5)],
        [("text", 2), ("image", (1, 6, 4)), ("text", 4), ("image", (1, 2, 2)), ("text", 3)],
        [("text", 13)],
    ]
    samples = []
    for spec in specs:
        ids: list[int] = []
        grids, pixels = [], []
        for kind, arg in spec:
            if kind == "text":
                ids += _text(g, arg)
            else:
                t, h, w = arg
                ids += [VSTART] + [IMG] * (t * h * w // 4) + [VEND]
                grids.append(list(arg))
                pixels.append(torch.randn(t * h * w, PATCH_DIM, generator=g))
        input_ids = torch.tensor(ids)
        labels = input_ids.clone()
        labels[input_ids == IMG] = -100  # typical SFT masking; also exercises ignored labels
        sample = {"input_ids": input_ids, "labels": labels}
        if grids:
            sample["pixel_values"] = torch.cat(pixels)
            sample["image_grid_thw"] = torch.tensor(grids)
        samples.append(sample)
    return samples


def hf_unpacked_inputs(sample: dict) -> dict:
    ids = sample["input_ids"][None]
    out = {"input_ids": ids, "labels": sample["labels"][None]}
    if "pixel_values" in sample:
        out["pixel_values"] = sample["pixel_values"]
        out["image_grid_thw"] = sample["image_grid_thw"]
        out["mm_token_type_ids"] = (ids == IMG).int()
    return out


def manual_packed_batch(model, samples: list[dict]) -> dict:
    """What PackedCollator produces, built by hand: positions from HF's own get_rope_index per sample."""
    pos, text_pos, ids, labels, pixels, grids, lens = [], [], [], [], [], [], []
    for s in samples:
        n = s["input_ids"].numel()
        x = s["input_ids"][None]
        if "image_grid_thw" in s:
            p = get_rope_index(model.model, x, mm_token_type_ids=(x == IMG).int(),
                               image_grid_thw=s["image_grid_thw"])
            pixels.append(s["pixel_values"])
            grids.append(s["image_grid_thw"])
        else:
            p = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
        pos.append(p)
        text_pos.append(torch.arange(n))
        ids.append(s["input_ids"])
        lab = s["labels"].clone()
        lab[0] = -100  # no token learns to predict the next sample's first token
        labels.append(lab)
        lens.append(n)
    ends = torch.tensor(lens).cumsum(0).tolist()
    labels_t = torch.cat(labels)[None]
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": labels_t,
        "position_ids": torch.cat(pos, dim=2),
        "text_position_ids": torch.cat(text_pos)[None],
        "cu_seqlens": torch.tensor([0, *ends], dtype=torch.int32),
        "cu_seqlens_list": ends,
        "max_seqlen": max(lens),
        "seq_lens": lens,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": torch.cat(grids) if grids else None,
        "pixel_values_videos": None,
        "video_grid_thw": None,
        "vision_cu_seqlens": None,
        "num_loss_tokens": int((labels_t[0, 1:] != -100).sum()),
    }


def collator_batch(model, samples: list[dict]):
    packing = pytest.importorskip("collate.packing")
    coll = packing.PackedCollator.from_config(model.config, pin_memory=False)
    return coll(samples)


def reference_loss(model, samples: list[dict]) -> torch.Tensor:
    """Token-weighted mean of per-sample HF losses (each sample alone, HF computing positions)."""
    return token_weighted_loss(model, samples, hf_unpacked_inputs)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(want) > 0
    for name, g in want.items():
        scale = g.abs().max().item() + 1e-12
        err = (got[name] - g).abs().max().item()
        assert err <= 1e-5 * scale, f"{name}: max err {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("source", ["manual", "collator"])
def test_packed_loss_and_grads_match_per_sample(models, source):
    ref, packed = models
    samples = make_samples()
    batch = manual_packed_batch(ref, samples) if source == "manual" else collator_batch(ref, samples)

    ref.zero_grad(set_to_none=True)
    want = reference_loss(ref, samples)
    want.backward()

    packed.zero_grad(set_to_none=True)
    out = packed(**batch)
    got = out.loss
    got.backward()

    assert out.logits.shape == (1, batch["input_ids"].shape[1], VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    g_got, g_want = _grads(packed), _grads(ref)
    assert any(n.startswith("model.visual.") for n in g_want)  # the images are really in the graph
    _assert_grads_close(g_got, g_want)


ROPE_TYPES = {
    "linear": dict(factor=2.0),
    "yarn": dict(factor=4.0, original_max_position_embeddings=1024),  # attention_scaling 1.14
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=1024),
}


def _rope_typed_model(rope_type: str, params: dict):
    from transformers import Qwen2VLConfig

    from tokenbal.hf_compat import rope_config

    config = tiny_config()
    for key, value in rope_config(Qwen2VLConfig, 10000.0, rope_type=rope_type, mrope_section=[2, 3, 3],
                                  **params).items():
        setattr(config.text_config, key, value)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_scaled_rope_types_match_per_sample(rope_type):
    """rope_scaling types fixed at init (the rotary module's inv_freq and attention_scaling) train
    exactly as transformers per sample."""
    ref = _rope_typed_model(rope_type, ROPE_TYPES[rope_type])
    assert ref.model.language_model.rotary_emb.rope_type == rope_type
    packed = enable_packed(copy.deepcopy(ref))
    samples = make_samples()
    want = reference_loss(ref, samples)
    want.backward()
    got = packed(**collator_batch(ref, samples)).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    _assert_grads_close(_grads(packed), _grads(ref))


@pytest.mark.parametrize("rope_type", ["dynamic"])
def test_sequence_dependent_rope_types_are_refused(rope_type):
    """dynamic NTK rescales inv_freq inside transformers' rotary forward from the sequence length:
    refused rather than trained differently."""
    model = _rope_typed_model(rope_type, dict(factor=2.0))
    with pytest.raises(NotImplementedError, match=rope_type):
        enable_packed(model)


def test_collator_positions_equal_hf_get_rope_index(models):
    ref, _ = models
    samples = make_samples()
    manual = manual_packed_batch(ref, samples)
    coll = collator_batch(ref, samples)
    for key in ("input_ids", "labels", "position_ids", "text_position_ids", "cu_seqlens", "image_grid_thw"):
        assert torch.equal(torch.as_tensor(coll[key]), manual[key]), key
    assert coll["cu_seqlens_list"] == manual["cu_seqlens_list"] and coll["max_seqlen"] == manual["max_seqlen"]
    assert coll["num_loss_tokens"] == manual["num_loss_tokens"]


def test_packed_path_uses_ops_and_batch_positions(models, monkeypatch):
    ref, packed = models
    samples = make_samples()
    batch = manual_packed_batch(ref, samples)
    calls = {"rope": 0, "attn": 0}
    real_rope, real_attn = packed_core.apply_mrope, packed_core.varlen_attention

    def rope(q, k, pos, *args, **kwargs):
        calls["rope"] += 1
        assert pos is batch["position_ids"]
        return real_rope(q, k, pos, *args, **kwargs)

    def attn(q, k, v, info, **kwargs):
        calls["attn"] += 1
        assert info.cu_seqlens_list == batch["cu_seqlens_list"] and isinstance(info.max_seqlen, int)
        return real_attn(q, k, v, info, **kwargs)

    def no_rope_index(*args, **kwargs):
        raise AssertionError("packed forward must not recompute positions")

    monkeypatch.setattr(packed_core, "apply_mrope", rope)
    monkeypatch.setattr(packed_core, "varlen_attention", attn)
    monkeypatch.setattr(packed.model, "get_rope_index", no_rope_index)
    with torch.no_grad():
        loss = packed(**batch).loss
        # The collator's per-frame vision boundaries are handed to the tower instead of being
        # recomputed there: the right ones give the same loss.
        grid = batch["image_grid_thw"]
        frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        vision_cu = torch.nn.functional.pad(frames.cumsum(0, dtype=torch.int32), (1, 0))
        loss2 = packed(**{**batch, "vision_cu_seqlens": vision_cu}).loss
        # ... and they are really used: one segment across all images changes the result (where
        # the tower takes them: transformers 5.9+; before, it derives its own from the grids).
        merged = torch.tensor([0, int(vision_cu[-1])], dtype=torch.int32)
        forwards = 2
        if "cu_seqlens" in tower_inputs(packed.model.visual):
            assert not torch.equal(packed(**{**batch, "vision_cu_seqlens": merged}).loss, loss)
            forwards = 3
    n_layers = len(packed.model.language_model.layers)
    assert calls == {"rope": forwards * n_layers, "attn": forwards * n_layers}
    assert torch.equal(loss, loss2)


def test_text_only_packed_forward_has_no_host_sync(models, monkeypatch):
    """No tensor is read back to the host in a text-only packed forward of a hand-made batch: no
    ``aten::_local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``) and no ``.tolist()`` /
    ``.cpu()`` / ``.numpy()`` call. (Batches with images and videos, and the idle vision pass, are
    covered with the collator's precomputed tower inputs in tests/collate/models/test_packed_vision.py.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    ref, _ = models
    packed = enable_packed(copy.deepcopy(ref), idle_vision=False)
    samples = [s for s in make_samples() if "pixel_values" not in s]
    batch = manual_packed_batch(ref, samples)
    seen: list[str] = []

    class SyncSpy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for name in ("tolist", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _real=real, **k):
            seen.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    with torch.no_grad(), SyncSpy():
        out = packed(**batch)
    monkeypatch.undo()
    assert out.loss is not None and seen == []
    with torch.no_grad():
        want = reference_loss(ref, samples)
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=0)


def test_unpacked_calls_unchanged_and_disable_restores(models):
    ref, packed = models
    sample = make_samples()[2]
    with torch.no_grad():
        want = ref(**hf_unpacked_inputs(sample))
        got = packed(**hf_unpacked_inputs(sample))
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)

    model = enable_packed(copy.deepcopy(ref))
    assert enable_packed(model) is model  # idempotent
    attn = model.model.language_model.layers[0].self_attn
    assert "forward" in attn.__dict__ and "forward" in model.__dict__
    disable_packed(model)
    assert "forward" not in attn.__dict__ and "forward" not in model.__dict__
    with torch.no_grad():
        again = model(**hf_unpacked_inputs(sample))
    torch.testing.assert_close(again.logits, want.logits, rtol=0, atol=0)


def test_deepcopy_of_patched_model_is_independent(models):
    ref, packed = models
    clone = copy.deepcopy(packed)
    assert clone.forward.__self__ is clone
    attn = clone.model.language_model.layers[1].self_attn
    assert attn.forward.__self__ is attn
    batch = manual_packed_batch(ref, make_samples())
    with torch.no_grad():
        torch.testing.assert_close(clone(**batch).loss, packed(**batch).loss, rtol=0, atol=0)


def test_eager_reference_and_gradient_checkpointing():
    torch.manual_seed(3)
    ref = Qwen2VLForConditionalGeneration(tiny_config("eager")).train()  # dropout is 0 in this config
    packed = enable_packed(copy.deepcopy(ref))
    checkpointing_enable(packed)
    assert packed.model.language_model.layers[0].gradient_checkpointing
    samples = make_samples()
    batch = manual_packed_batch(ref, samples)
    want = reference_loss(ref, samples)
    backward_and_compare(packed(**batch).loss, want)
    _assert_grads_close(_grads(packed), _grads(ref))


def test_qwen2_5_vl_packed_matches_per_sample():
    """Qwen2.5-VL shares the text stack. This hand-made batch has no precomputed tower inputs, so
    transformers' tower derives its windows itself (the collator's are in
    tests/collate/models/test_packed_vision.py)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    base = tiny_config()
    cfg = Qwen2_5_VLConfig(
        text_config=base.text_config.to_dict(),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            window_size=56,
            patch_size=14,
            spatial_merge_size=2,
        ),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        attn_implementation="sdpa",
    )
    torch.manual_seed(5)
    ref = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    packed = enable_packed(copy.deepcopy(ref))
    samples = make_samples()
    batch = manual_packed_batch(ref, samples)
    want = reference_loss(ref, samples)
    backward_and_compare(packed(**batch).loss, want)
    _assert_grads_close(_grads(packed), _grads(ref))


def test_bad_packed_batches_raise(models):
    ref, packed = models
    batch = manual_packed_batch(ref, make_samples())
    with pytest.raises(ValueError, match="cover"):
        packed(**{**batch, "cu_seqlens_list": batch["cu_seqlens_list"][:-1]})
    with pytest.raises(ValueError, match="python int"):
        packed(**{**batch, "max_seqlen": torch.tensor(batch["max_seqlen"])})
    # flash-attn would leave the longest segment's rows past max_seqlen uncomputed, silently
    with pytest.raises(ValueError, match=r"max_seqlen=19 is shorter than the batch's longest segment \(20"):
        packed(**{**batch, "max_seqlen": batch["max_seqlen"] - 1})
    lens = batch["seq_lens"]
    with pytest.raises(ValueError, match=r"seq_lens: segment 1 has length -1"):
        packed(**{**batch, "cu_seqlens_list": None, "seq_lens": [lens[0] + lens[1] + 1, -1, *lens[2:]]})
    with pytest.raises(ValueError, match="position_ids"):
        packed(**{**batch, "position_ids": None})
    with pytest.raises(ValueError, match="attention_mask"):
        packed(**{**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    with pytest.raises(TypeError, match="model_type"):
        enable_packed(torch.nn.Linear(2, 2))


def _fsdp2_packed_rank(rank: int, world_size: int) -> float:
    """One rank: FSDP2-sharded packed model on this rank's samples vs the unsharded per-sample reference."""
    torch.manual_seed(0)
    ref = Qwen2VLForConditionalGeneration(tiny_config()).eval()
    packed = enable_packed(copy.deepcopy(ref))
    fully_shard_packed(packed)
    samples = make_samples()
    packed(**manual_packed_batch(ref, samples[rank::world_size])).loss.backward()
    # FSDP2 reduce-scatters the mean over ranks of each rank's gradient.
    want = sum(reference_loss(ref, samples[r::world_size]) for r in range(world_size)) / world_size
    want.backward()
    got = {n: p.grad.full_tensor() for n, p in packed.named_parameters() if p.grad is not None}
    _assert_grads_close(got, _grads(ref))
    return max(((got[n] - g).abs().max() / g.abs().max()).item() for n, g in _grads(ref).items())


@pytest.mark.slow
def test_fsdp2_two_ranks_packed_grads_match():
    from tests.helpers.dist_utils import run_ranks

    errs = run_ranks(_fsdp2_packed_rank, 2, timeout=180)
    assert max(errs) < 1e-5


def _fsdp2_text_only_rank(rank: int, world_size: int) -> float:
    """Rank 1 gets only text-only samples while the vision blocks are FSDP units of their own.

    Without the idle vision pass rank 1 would skip the blocks' all-gathers and the ranks would
    pair the wrong collectives (a hang or garbage); with it, gradients equal the reference.
    """
    torch.manual_seed(0)
    ref = Qwen2VLForConditionalGeneration(tiny_config()).eval()
    packed = enable_packed(copy.deepcopy(ref))
    fully_shard_packed(packed, packed.model.visual.blocks)
    samples = make_samples()
    shares = [[samples[1], samples[2]], [samples[0], samples[3]]]  # rank 1: text only
    packed(**manual_packed_batch(ref, shares[rank])).loss.backward()
    want = sum(reference_loss(ref, share) for share in shares) / world_size
    want.backward()
    got = {n: p.grad.full_tensor() for n, p in packed.named_parameters() if p.grad is not None}
    _assert_grads_close(got, _grads(ref))
    return max(((got[n] - g).abs().max() / g.abs().max()).item() for n, g in _grads(ref).items())


def test_fsdp2_rank_without_images_still_runs_the_sharded_vision_tower():
    from tests.helpers.dist_utils import run_ranks

    errs = run_ranks(_fsdp2_text_only_rank, 2, timeout=180, collective_timeout=30)
    assert max(errs) < 1e-5


def test_idle_vision_pass_leaves_a_text_only_loss_unchanged(models):
    ref, packed = models
    samples = [make_samples()[0], make_samples()[3]]
    batch = manual_packed_batch(ref, samples)
    torch.testing.assert_close(packed(**batch).loss, reference_loss(ref, samples), rtol=1e-5, atol=0)
