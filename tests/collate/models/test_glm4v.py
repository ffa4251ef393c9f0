"""enable_packed on a tiny random transformers GLM-4.1V (partial pair-wise M-RoPE, frames as image
tokens inside a video span): packed loss and every gradient equal the token-weighted mean of
per-sample unpacked HF forwards (HF computing its own positions from ``mm_token_type_ids``); the
collator's positions are HF's ``get_rope_index``; its placeholder counts are the tokenbal index's."""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import Glm4vForConditionalGeneration  # noqa: E402

import collate.models.core as packed_core  # noqa: E402
from collate import PackedCollator  # noqa: E402
from collate.models import disable_packed, enable_packed  # noqa: E402
from collate.positions import glm4v_positions  # noqa: E402
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.host_reads import (  # noqa: E402
    host_reads_of_step,
    host_tensors_of_step,
    skip_unless_tower_takes,
)
from tests.helpers.reference import (  # noqa: E402
    backward_and_compare,
    forward_calls,
    fully_shard_packed,
    text_only_rank_grads,
    token_weighted_loss,
)
from tests.helpers.samples import text_only  # noqa: E402
from tests.helpers.tiny_glm4v import (  # noqa: E402
    EST,
    IEND,
    IMG,
    ISTART,
    VEND,
    VIDEO_TOKEN,
    VSTART,
    make_sample,
    tiny_config,
    video_plan,
)
from tokenbal.hf_compat import checkpointing_enable, get_rope_index, tower_inputs  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return Glm4vForConditionalGeneration(tiny_config()).float().eval()


def collator(model) -> PackedCollator:
    return PackedCollator.from_config(model.config, pin_memory=False)



SPECS = [
    [("text", 9)],
    [("text", 3), ("image", (130, 90)), ("text", 5)],
    [("text", 2), ("image", (60, 130)), ("text", 4), ("image", (30, 30)), ("text", 3)],
    [("text", 4), ("video", (4, 56, 56)), ("text", 3)],
    [("text", 13)],
]
# HF's unpacked forward cannot take an image and a video in one sample (both use the image token);
# its get_rope_index can, so the positions are checked on this one too.
MIXED = [("text", 2), ("image", (56, 84)), ("text", 1), ("video", (6, 84, 56)), ("text", 2),
         ("image", (28, 28)), ("text", 3)]


def make_samples(seed: int = 1, specs: list = SPECS) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [make_sample(g, spec) for spec in specs]


def mm_token_type_ids(ids: torch.Tensor) -> torch.Tensor:
    """What ``Glm4vProcessor`` returns: 1 for image tokens, 2 for those inside a video span."""
    inside = (torch.cumsum(ids == VSTART, -1) - torch.cumsum(ids == VEND, -1)) > 0
    return torch.where(ids == IMG, torch.where(inside, 2, 1), 0).int()


def hf_inputs(sample: dict) -> dict:
    out = {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if key in sample:
            out[key] = sample[key]
    if len(out) > 2:
        out["mm_token_type_ids"] = mm_token_type_ids(out["input_ids"])
    return out


def reference_loss(model, samples: list[dict]) -> torch.Tensor:
    return token_weighted_loss(model, samples, hf_inputs)


def hf_positions(model, sample: dict) -> torch.Tensor:
    """HF's ``get_rope_index`` for one sample; a text-only one counts 0..n-1 on all 3 rows."""
    x = sample["input_ids"][None]
    if "image_grid_thw" in sample or "video_grid_thw" in sample:
        return get_rope_index(model.model, x, mm_token_type_ids=mm_token_type_ids(x),
                              image_grid_thw=sample.get("image_grid_thw"),
                              video_grid_thw=sample.get("video_grid_thw"))
    return torch.arange(x.shape[1]).view(1, 1, -1).expand(3, 1, -1)


def assert_positions_equal_hf(batch, samples: list[dict], model) -> None:
    """Each sample's slice of the packed ``position_ids`` equals HF's ``get_rope_index`` of it."""
    starts = [0, *batch.cu_seqlens_list[:-1]]
    for i, (s, start, end) in enumerate(zip(samples, starts, batch.cu_seqlens_list, strict=True)):
        assert torch.equal(batch.position_ids[:, :, start:end], hf_positions(model, s)), f"sample {i}"


def test_collator_positions_equal_hf_get_rope_index(reference):
    samples = make_samples() + make_samples(2, [MIXED])
    batch = collator(reference)(samples)
    starts = [0, *batch.cu_seqlens_list[:-1]]
    kinds = set()
    for i, (s, start, end) in enumerate(zip(samples, starts, batch.cu_seqlens_list, strict=True)):
        want = hf_positions(reference, s)
        kinds.update(k for k in ("image_grid_thw", "video_grid_thw") if k in s)
        assert torch.equal(batch.position_ids[:, :, start:end], want), f"sample {i}"
        one = glm4v_positions(s["input_ids"], s.get("image_grid_thw"), s.get("video_grid_thw"),
                              image_token_id=IMG, video_start_token_id=VSTART, video_end_token_id=VEND,
                              spatial_merge_size=2,
                              image_start_token_id=ISTART, video_token_id=VIDEO_TOKEN)
        assert np.array_equal(one, want[:, 0].numpy()), f"sample {i}"
    assert kinds == {"image_grid_thw", "video_grid_thw"}
    # The tower's order: all images, then all video frames; the features go to those slots.
    ids = batch.input_ids[0]
    assert torch.equal(torch.sort(batch.vision_token_index).values, torch.nonzero(ids == IMG).flatten())
    n_img = int(batch.image_grid_thw.prod(-1).sum()) // 4
    types = mm_token_type_ids(ids)
    assert bool((types[batch.vision_token_index[:n_img]] == 1).all())
    assert bool((types[batch.vision_token_index[n_img:]] == 2).all())


def test_random_rows_positions_equal_hf_get_rope_index(reference):
    """Random mixes of text, images (any grid, t = 1) and videos (1-3 frames) in every order, in
    one packed row: the vectorised positions equal HF's per sample."""
    rng = np.random.default_rng(3)
    samples = []
    for _ in range(30):
        ids: list[int] = []
        images, videos = [], []
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.choice(["text", "image", "video"])
            h, w = 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5))
            if kind == "text":
                ids += rng.integers(0, 100, int(rng.integers(1, 6))).tolist()
            elif kind == "image":
                ids += [ISTART] + [IMG] * (h * w // 4) + [IEND]
                images.append([1, h, w])
            else:
                t = int(rng.integers(1, 4))
                ids += [VSTART] + ([ISTART] + [IMG] * (h * w // 4) + [IEND, 7]) * t + [VEND]
                videos.append([t, h, w])
        sample = {"input_ids": torch.tensor(ids)}
        for key, grids in (("image", images), ("video", videos)):
            if grids:
                patches = int(np.prod(grids, axis=1).sum())
                sample[f"{key}_grid_thw"] = torch.tensor(grids)
                sample["pixel_values" if key == "image" else "pixel_values_videos"] = torch.zeros(patches, 4)
        samples.append(sample)
    assert_positions_equal_hf(collator(reference)(samples), samples, reference)


def test_packed_loss_and_grads_match_per_sample(reference):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = collator(ref)(samples)
    assert batch.pixel_values is not None and batch.pixel_values_videos is not None
    want = reference_loss(ref, samples)
    backward_and_compare(packed(**batch).loss, want)
    assert assert_grads_match(packed, ref) > 30
    names = {n for n, p in packed.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"model.visual.embeddings.position_embedding.weight", "model.visual.merger.proj.weight"} <= names


def test_eager_reference_and_gradient_checkpointing():
    torch.manual_seed(3)
    ref = Glm4vForConditionalGeneration(tiny_config("eager")).float().train()  # dropout 0 in this config
    packed = enable_packed(copy.deepcopy(ref))
    checkpointing_enable(packed)
    assert packed.model.language_model.layers[0].gradient_checkpointing
    samples = make_samples()
    want = reference_loss(ref, samples)
    backward_and_compare(packed(**collator(ref)(samples)).loss, want)
    assert assert_grads_match(packed, ref) > 30


def test_packed_path_uses_glm_rope_varlen_and_one_tower_call(reference, monkeypatch):
    packed = enable_packed(copy.deepcopy(reference))
    batch = collator(reference)(make_samples())
    calls = {"rope": 0, "attn": 0}
    real_attn = packed_core.varlen_attention

    def attn(q, k, v, info, **kwargs):
        calls["attn"] += 1
        return real_attn(q, k, v, info, **kwargs)

    def no_mrope(*args, **kwargs):
        raise AssertionError("GLM-4V must not use the Qwen rotary")

    def no_rope_index(*args, **kwargs):
        raise AssertionError("packed forward must not recompute positions")

    from collate.models import glm4v

    real_rope = glm4v.FAMILY.apply_rope

    def rope(q, k, pos, *args, **kwargs):
        calls["rope"] += 1
        assert pos is batch.position_ids
        return real_rope(q, k, pos, *args, **kwargs)

    monkeypatch.setattr(packed_core, "varlen_attention", attn)
    monkeypatch.setattr(packed_core, "apply_mrope", no_mrope)
    monkeypatch.setattr(packed.model, "get_rope_index", no_rope_index)
    family = dataclasses.replace(glm4v.FAMILY, apply_rope=rope)
    monkeypatch.setitem(packed.__dict__, packed_core.FAMILY, family)
    with forward_calls(packed.model.visual, record="inputs") as towers, torch.no_grad():
        packed(**batch)
    n_layers = len(packed.model.language_model.layers)
    # + the 2 vision blocks, where the tower takes the batch's segments (transformers 5.9+)
    n_vision = 2 if "cu_seqlens" in tower_inputs(packed.model.visual) else 0
    assert calls == {"rope": n_layers, "attn": n_layers + n_vision}
    assert len(towers) == 1  # images and video frames in one call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm_rope_equals_hf_rotary(dtype):
    """The packed rotary equals HF's cos/sin + apply_rotary_pos_emb on random q/k and positions,
    bit for bit (bf16 too: same casts, same elementwise operations)."""
    from transformers.models.glm4v import modeling_glm4v as hf

    from collate.models.glm4v import glm_rope
    from tokenbal.hf_compat import mrope_section

    config = tiny_config().text_config
    rotary = hf.Glm4vTextRotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 11, 32, generator=g).to(dtype), torch.randn(1, 1, 11, 32, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (3, 1, 11), generator=g)
    cos, sin = rotary(q, pos)
    section = mrope_section(SimpleNamespace(rotary_emb=rotary, config=config))
    if hasattr(hf, "apply_rotary_pos_emb"):  # 5.x: the rotary module applies the sections
        want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    else:  # 4.57: the attention does
        want_q, want_k = hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, list(section))
    got_q, got_k = glm_rope(q[0].transpose(0, 1), k[0].transpose(0, 1), pos, rotary.inv_freq,
                            section, False, rotary.attention_scaling)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., 16:], q[0].transpose(0, 1)[..., 16:])  # the unrotated half


def test_four_row_positions_equal_three_rows(reference):
    """transformers' GLM-4V takes ``(4, 1, T)`` position ids (row 0: text positions, dropped before
    the rotary); the packed rotary read rows 0-2 of them, text / T / H, without an error."""
    import inspect

    from transformers.models.glm4v import modeling_glm4v

    if "shape[0] == 4" not in inspect.getsource(modeling_glm4v.Glm4vTextModel.forward):
        pytest.skip("this transformers' GLM-4V takes (3, 1, T) position ids only (4.57)")
    packed = enable_packed(copy.deepcopy(reference))
    batch = collator(reference)(make_samples())
    with torch.no_grad():
        three = packed(**batch).loss
        four = packed(**{**dict(batch.items()), "position_ids": batch.position_ids_4row}).loss
    torch.testing.assert_close(four, three, rtol=0, atol=0)


def test_text_only_batch_runs_the_idle_tower(reference):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = text_only(make_samples())
    batch = collator(ref)(samples)
    with forward_calls(packed.model.visual) as towers:
        out = packed(**batch)
    assert len(towers) == 1
    backward_and_compare(out.loss, reference_loss(ref, samples))
    assert assert_grads_match(packed, ref) > 10
    assert packed.model.visual.merger.proj.weight.grad is not None  # in the graph, zero


@pytest.mark.parametrize("mix", ["vision", "text only"])
def test_packed_forward_and_backward_read_nothing_back(reference, mix, monkeypatch):
    skip_unless_tower_takes(reference.model.visual, "cu_seqlens", "position_ids")
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = collator(reference)(text_only(samples) if mix == "text only" else samples)
    packed(**batch).loss.backward()  # warm-up: the idle image's cached input
    assert host_reads_of_step(packed, batch, monkeypatch) == []
    # nor a tensor built from host data (glm_rope's section map was, in every layer)
    assert host_tensors_of_step(packed, batch) == []


def test_hand_made_batch_without_collator_fields(reference):
    """Processor tensors without the collator's tower fields: the tower derives them, the
    placeholders are found on the device; images and videos together need the collator."""
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    for one in (samples[2], samples[3]):
        single = dict(collator(reference)([one]).items())
        hand = {k: v for k, v in single.items() if not k.startswith("vision_")}
        with torch.no_grad():
            torch.testing.assert_close(packed(**hand).loss, packed(**single).loss, rtol=1e-6, atol=0)
    both = dict(collator(reference)(samples[2:4]).items())
    with pytest.raises(ValueError, match="vision_token_index"):
        packed(**{**both, "vision_token_index": None})


def test_collator_checks_placeholders_naming_the_sample(reference):
    samples = make_samples()
    short = dict(samples[1], input_ids=samples[1]["input_ids"][:-7], labels=samples[1]["labels"][:-7])
    short["input_ids"] = torch.cat([short["input_ids"][:4], short["input_ids"][5:]])  # one placeholder less
    short["labels"] = short["input_ids"].clone()
    with pytest.raises(ValueError, match=r"sample 1: image 0 with grid \[1, \d+, \d+\] needs \d+ placehol"):
        collator(reference)([samples[0], short])
    frames = dict(samples[3], video_grid_thw=samples[3]["video_grid_thw"] * torch.tensor([[2, 1, 1]]),
                  pixel_values_videos=torch.cat([samples[3]["pixel_values_videos"]] * 2))
    with pytest.raises(ValueError, match=r"sample 0: 2 video frame placeholder runs in input_ids but"):
        collator(reference)([frames])
    raw = dict(samples[0], input_ids=torch.cat([samples[0]["input_ids"], torch.tensor([VIDEO_TOKEN])]))
    raw["labels"] = raw["input_ids"]
    with pytest.raises(ValueError, match="sample 1: input_ids hold the unexpanded video token"):
        collator(reference)([samples[4], raw])
    ids = samples[1]["input_ids"]
    no_start = dict(samples[1], input_ids=torch.where(ids == ISTART, 7, ids))
    with pytest.raises(ValueError, match=f"sample 0: image 0 at token index 4 does not follow "
                                         f"image_start_token_id {ISTART}"):
        collator(reference)([no_start])


def test_index_counts_equal_collated_placeholders(reference, tmp_path):
    """The estimator ``tokenbal index build`` loads from the checkpoint's files, and its GLM video
    plan, give every sample's image and video placeholder count the collated batch holds."""
    from tokenbal.estimate.vision import load_estimator

    reference.config.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": EST["min_pixels"], "longest_edge": EST["max_pixels"]}, "patch_size": 14,
         "merge_size": 2, "temporal_patch_size": 2}))
    est = load_estimator(tmp_path)
    samples = make_samples()
    batch = collator(reference)(samples)
    types = mm_token_type_ids(batch.input_ids[0])
    starts = [0, *batch.cu_seqlens_list[:-1]]
    for i, (spec, start, end) in enumerate(zip(SPECS, starts, batch.cu_seqlens_list, strict=True)):
        images = sum(est.image_tokens(*arg) for kind, arg in spec if kind == "image")
        videos = sum(video_plan(*arg).tokens for kind, arg in spec if kind == "video")
        assert int((types[start:end] == 1).sum()) == images, f"sample {i}"
        assert int((types[start:end] == 2).sum()) == videos, f"sample {i}"
    assert any(kind == "video" for spec in SPECS for kind, _ in spec)


def test_unpacked_calls_unchanged_and_disable_restores(reference):
    sample = make_samples()[2]
    packed = enable_packed(copy.deepcopy(reference))
    with torch.no_grad():
        want = reference(**hf_inputs(sample)).logits
        torch.testing.assert_close(packed(**hf_inputs(sample)).logits, want, rtol=0, atol=0)
    assert enable_packed(packed) is packed
    disable_packed(packed)
    assert "forward" not in packed.__dict__
    assert "forward" not in packed.model.language_model.layers[0].self_attn.__dict__
    with torch.no_grad():
        torch.testing.assert_close(packed(**hf_inputs(sample)).logits, want, rtol=0, atol=0)


def _glm4v_model():
    return Glm4vForConditionalGeneration(tiny_config())


def _fsdp2_text_only_rank(rank: int, world_size: int, make_model=_glm4v_model) -> int:
    """Rank 1 gets only text while the vision blocks are FSDP units of their own: the idle image
    keeps the ranks' collectives paired, and the gradients equal the per-sample reference.
    ``make_model``: a module-level function building the tiny model (GLM-4.6V's test reuses it)."""
    torch.manual_seed(0)
    ref = make_model().float().eval()
    packed = enable_packed(copy.deepcopy(ref))
    fully_shard_packed(packed, packed.model.visual.blocks)
    return text_only_rank_grads(rank, world_size, ref, packed, make_samples(), collator(ref), reference_loss)


@pytest.mark.slow  # two processes, ~1 min on a loaded 2-core machine
def test_fsdp2_rank_without_images_still_runs_the_sharded_tower():
    from tests.helpers.dist_utils import run_ranks

    assert min(run_ranks(_fsdp2_text_only_rank, 2, timeout=180, collective_timeout=30)) > 30
