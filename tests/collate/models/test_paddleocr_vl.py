"""enable_packed on a tiny random transformers PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``,
5.6+: an ERNIE-4.5 text stack with Qwen2-VL's chunked M-RoPE behind a SigLIP tower with a 2-D rotary
and a per-image 2 x 2 projector): the packed positions equal the installed
``PaddleOCRVLModel.get_rope_index`` per sample, and the packed loss, logits and every gradient equal
per-sample unpacked transformers forwards."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "PaddleOCRVLForConditionalGeneration"):
    pytest.skip(f"transformers {transformers.__version__} has no PaddleOCR-VL", allow_module_level=True)

from collate import PackedCollator  # noqa: E402
from collate.models import disable_packed, enable_packed  # noqa: E402
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.reference import (  # noqa: E402
    assert_logits_match_per_sample,
    backward_and_compare,
    forward_calls,
    fully_shard_packed,
    text_only_rank_grads,
    token_weighted_loss,
)
from tests.helpers.samples import text_only  # noqa: E402
from tokenbal.hf_compat import checkpointing_enable, get_rope_index, rope_config  # noqa: E402

IMG, VID, VSTART, VEND = 120, 121, 122, 123
MERGE, PATCH = 2, 4


def tiny_config(attn: str = "sdpa"):
    cls = transformers.PaddleOCRVLConfig
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                use_bias=True,
                **rope_config(cls, 1e4, mrope_section=[2, 1, 1]))
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=4 * PATCH, patch_size=PATCH, spatial_merge_size=MERGE)
    cfg = cls(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
              vision_start_token_id=VSTART, vision_end_token_id=VEND)
    for sub in (cfg, cfg.text_config, cfg.vision_config):
        sub._attn_implementation = attn
    return cfg


def build(attn: str = "sdpa"):
    torch.manual_seed(0)
    model = transformers.PaddleOCRVLForConditionalGeneration(tiny_config(attn)).float().eval()
    with torch.no_grad():  # biases and norms away from their init, so that skipping one shows
        for name, p in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                # attention far from uniform (as at random init), so that a wrong rotary shows
                p.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def reference():
    return build()


# (kind, arg): text of n tokens, or an image of (gh, gw) merged tokens (2 gh x 2 gw patches)
SPECS = [[("text", 9)], [("text", 3), ("image", (2, 3)), ("text", 5)],
         [("text", 2), ("image", (1, 2)), ("text", 4), ("image", (3, 1)), ("text", 3)], [("text", 6)],
         [("image", (2, 2)), ("text", 7)]]


def make_samples(seed: int = 1, specs: list = SPECS) -> list[dict]:
    """Samples laid out as PaddleOCR-VL's processor writes them: ``<|IMAGE_START|>``, one image
    placeholder per merged token, ``<|IMAGE_END|>``; pixel values one ``(C, P, P)`` patch per row."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for spec in specs:
        ids: list[int] = []
        grids, pixels = [], []
        for kind, arg in spec:
            if kind == "text":
                ids += torch.randint(0, 100, (arg,), generator=g).tolist()
                continue
            gh, gw = arg
            grids.append([1, MERGE * gh, MERGE * gw])
            pixels.append(torch.randn(MERGE * gh * MERGE * gw, 3, PATCH, PATCH, generator=g))
            ids += [VSTART] + [IMG] * (gh * gw) + [VEND]
        input_ids = torch.tensor(ids)
        sample = {"input_ids": input_ids, "labels": torch.where(input_ids == IMG, -100, input_ids)}
        if grids:
            sample["image_grid_thw"] = torch.tensor(grids)
            sample["pixel_values"] = torch.cat(pixels)
        samples.append(sample)
    return samples


def mm_token_type_ids(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMG).int()


def hf_inputs(sample: dict) -> dict:
    out = {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]}
    if "pixel_values" in sample:
        out.update(pixel_values=sample["pixel_values"], image_grid_thw=sample["image_grid_thw"],
                   mm_token_type_ids=mm_token_type_ids(out["input_ids"]))
    return out


def reference_loss(model, samples: list[dict]) -> torch.Tensor:
    return token_weighted_loss(model, samples, hf_inputs)


def collator(model) -> PackedCollator:
    return PackedCollator.from_config(model.config, pin_memory=False)


def test_positions_equal_hf_get_rope_index(reference):
    samples = make_samples() + make_samples(3)
    batch = collator(reference)(samples)
    starts = [0, *batch.cu_seqlens_list[:-1]]
    for i, (s, start, end) in enumerate(zip(samples, starts, batch.cu_seqlens_list, strict=True)):
        x = s["input_ids"][None]
        if "image_grid_thw" in s:
            want = get_rope_index(reference.model, x, mm_token_type_ids=mm_token_type_ids(x),
                                  image_grid_thw=s["image_grid_thw"])
        else:
            want = torch.arange(x.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        assert torch.equal(batch.position_ids[:, :, start:end], want), f"sample {i}"


def test_packed_loss_logits_and_grads_match_per_sample(reference):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = collator(ref)(samples)
    assert batch.pixel_values.shape[1:] == (3 * PATCH * PATCH,) and batch.image_grid_thw.shape[0] == 4
    with forward_calls(packed.model.visual) as towers:
        out = packed(**batch)
    assert len(towers) == 1  # one tower call on all images of the row
    assert_logits_match_per_sample(out.logits, batch, samples, ref, hf_inputs)
    backward_and_compare(out.loss, reference_loss(ref, samples))
    assert assert_grads_match(packed, ref) > 40
    grads = {n: p.grad for n, p in packed.named_parameters()}
    assert grads["model.visual.vision_model.encoder.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_eager_reference_and_gradient_checkpointing():
    ref = build("eager").train()  # dropout 0 in this config
    packed = enable_packed(copy.deepcopy(ref))
    checkpointing_enable(packed)
    samples = make_samples(2)
    want = reference_loss(ref, samples)
    backward_and_compare(packed(**collator(ref)(samples)).loss, want)
    assert assert_grads_match(packed, ref) > 40


def test_text_only_row_runs_the_idle_image_and_gives_hf_loss(reference):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = text_only(make_samples())
    with forward_calls(packed.model.visual) as towers:
        loss = packed(**collator(ref)(samples)).loss
    assert len(towers) == 1  # the zero image: every FSDP rank issues the same collectives
    backward_and_compare(loss, reference_loss(ref, samples))
    grads = {n: p.grad for n, p in packed.named_parameters()}
    tower = grads["model.visual.vision_model.encoder.layers.0.self_attn.q_proj.weight"]
    assert tower is not None and not tower.any()
    assert assert_grads_match(packed, ref) > 10


def test_unpacked_calls_and_disable_are_transformers_own(reference):
    packed = enable_packed(copy.deepcopy(reference))
    s = make_samples()[1]
    with torch.no_grad():
        want = reference(**hf_inputs(s)).logits
        torch.testing.assert_close(packed(**hf_inputs(s)).logits, want, rtol=0, atol=0)
        disable_packed(packed)
        torch.testing.assert_close(packed(**hf_inputs(s)).logits, want, rtol=0, atol=0)


def test_video_fields_are_refused(reference):
    packed = enable_packed(copy.deepcopy(reference))
    batch = collator(reference)(make_samples()[:2])
    batch = dict(batch)
    batch["pixel_values_videos"] = batch["pixel_values"]
    batch["video_grid_thw"] = batch["image_grid_thw"]
    with pytest.raises(ValueError, match="PaddleOCR-VL takes no video"):
        packed(**batch)


def _fsdp2_text_only_rank(rank: int, world_size: int) -> int:
    """Rank 1 gets only text while the tower's encoder layers are FSDP units of their own: the idle
    image keeps the ranks' collectives paired, and the gradients equal the per-sample reference."""
    ref = build()
    packed = enable_packed(copy.deepcopy(ref))
    fully_shard_packed(packed, packed.model.visual.vision_model.encoder.layers)
    return text_only_rank_grads(rank, world_size, ref, packed, make_samples(), collator(ref), reference_loss)


@pytest.mark.slow  # two processes, ~1 min on a loaded 2-core machine
def test_fsdp2_rank_without_images_still_runs_the_sharded_tower():
    from tests.helpers.dist_utils import run_ranks

    assert min(run_ranks(_fsdp2_text_only_rank, 2, timeout=180, collective_timeout=30)) > 40


def test_collator_takes_the_processors_patch_pixels_and_names_a_bad_sample(reference):
    """PaddleOCR-VL's processor gives ``(patches, C, P, P)``: the batch carries them as rows of
    ``C*P*P`` values; a patch count that does not match the grid names the sample."""
    samples = make_samples()[:2]
    batch = collator(reference)(samples)
    assert torch.equal(batch.pixel_values, samples[1]["pixel_values"].reshape(24, -1))
    bad = {**samples[1], "pixel_values": samples[1]["pixel_values"][:-1]}
    with pytest.raises(ValueError, match=r"sample 1: field 'pixel_values' has shape \(23, 3, 4, 4\)"):
        collator(reference)([samples[0], bad])
