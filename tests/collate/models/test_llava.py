"""enable_packed on tiny random transformers LLaVA-NeXT and LLaVA-OneVision (1-D RoPE language
models behind crop towers): packed loss and every gradient equal the token-weighted mean of
per-sample unpacked HF forwards; the collator's placeholder counts are the tokenbal index's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LlavaNextForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
)

import collate.models.core as packed_core  # noqa: E402
from collate import PackedCollator  # noqa: E402
from collate.models import disable_packed, enable_packed  # noqa: E402
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.host_reads import host_reads_of_step, host_tensors_of_step  # noqa: E402
from tests.helpers.reference import (  # noqa: E402
    backward_and_compare,
    forward_calls,
    fully_shard_packed,
    text_only_rank_grads,
)
from tests.helpers.samples import text_only  # noqa: E402
from tests.helpers.tiny_llava import IMG, SIDE, VID, hf_kwargs, reference_loss, tiny_config  # noqa: E402

MODEL_CLASSES = {"llava_next": LlavaNextForConditionalGeneration,
                 "llava_onevision": LlavaOnevisionForConditionalGeneration}
FAMILIES = sorted(MODEL_CLASSES)


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request):
    torch.manual_seed(0)
    config = tiny_config(request.param)
    return MODEL_CLASSES[request.param](config).float().eval()


def collator(model) -> PackedCollator:
    return PackedCollator.from_config(model.config, pin_memory=False)


def make_sample(layout, g: torch.Generator, spec: list) -> dict:
    """``spec``: ("text", n) / ("image", (height, width)) / ("video", frames) pieces in order.
    Crops and placeholder counts follow the model's layout (:mod:`collate.anyres`)."""
    images = sum(kind == "image" for kind, _ in spec)
    ids: list[int] = []
    sizes, crops, videos = [], [], []
    for kind, arg in spec:
        if kind == "text":
            ids += torch.randint(0, 100, (arg,), generator=g).tolist()
        elif kind == "image":
            h, w = arg
            ids += [IMG] * layout.image_tokens(h, w, images)
            sizes.append([h, w])
            crops.append(torch.randn(layout.crops(h, w, images), 3, SIDE, SIDE, generator=g))
        else:
            ids += [VID] * layout.video_tokens(arg)
            videos.append(torch.randn(arg, 3, SIDE, SIDE, generator=g))
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[(input_ids == IMG) | (input_ids == VID)] = -100
    sample = {"input_ids": input_ids, "labels": labels}
    if sizes:
        # The processor's layout: (images, most crops, C, S, S), zero padded.
        pv = torch.zeros(len(crops), max(c.shape[0] for c in crops), 3, SIDE, SIDE)
        for j, c in enumerate(crops):
            pv[j, :c.shape[0]] = c
        sample.update(pixel_values=pv, image_sizes=torch.tensor(sizes))
    if videos:
        # the processor's (videos, frames, C, S, S); a list of (frames, C, S, S) where they differ
        same = len({v.shape[0] for v in videos}) == 1
        sample["pixel_values_videos"] = torch.stack(videos) if same else videos
    return sample


def make_samples(model, seed: int = 1) -> list[dict]:
    """Text-only, one image, two images, (OneVision) a downsampled image and a video, text-only."""
    layout = collator(model).anyres
    g = torch.Generator().manual_seed(seed)
    specs = [
        [("text", 9)],
        [("text", 3), ("image", (40, 70)), ("text", 5)],
        [("text", 2), ("image", (64, 30)), ("text", 4), ("image", (20, 20)), ("text", 3)],
        [("text", 6)],
    ]
    if layout.family == "llava_onevision":
        specs += [[("text", 2), ("image", (90, 120)), ("text", 2)],
                  [("text", 4), ("video", 3), ("text", 3)]]
    return [make_sample(layout, g, spec) for spec in specs]


def test_packed_loss_and_grads_match_per_sample(reference):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples(ref)
    batch = collator(ref)(samples)
    assert batch.position_ids.shape == (1, batch.input_ids.shape[1])  # 1-D RoPE
    want = reference_loss(ref, samples)
    backward_and_compare(packed(**batch).loss, want)
    assert assert_grads_match(packed, ref) > 20
    tower = [n for n, p in packed.named_parameters()
             if n.startswith("model.vision_tower.") and p.grad is not None]
    assert tower and dict(packed.named_parameters())["model.image_newline"].grad.abs().sum() > 0


def test_onevision_videos_of_different_frame_counts_in_one_sample(reference):
    """A row whose videos keep different numbers of frames (the packed Trainer's ``process_row``
    gives their frames as a list, one tensor per video): the collator takes it, the packed forward
    encodes video by video (placeholders per video: frames x pooled + 1 newline) and trains the
    tower; as a list of equal-frame videos it is the stacked sample exactly."""
    if reference.config.model_type != "llava_onevision":
        pytest.skip("LLaVA-NeXT has no video path")
    layout = collator(reference).anyres
    packed = enable_packed(copy.deepcopy(reference))
    g = torch.Generator().manual_seed(5)
    uneven = make_sample(layout, g, [("text", 3), ("video", 2), ("text", 2), ("image", (40, 70)),
                                     ("video", 4), ("text", 2)])
    assert isinstance(uneven["pixel_values_videos"], list)
    batch = collator(reference)([uneven, make_samples(reference)[1]])
    assert batch["video_num_frames"] == [2, 4]
    loss = packed(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in packed.named_parameters()
               if n.startswith("model.vision_tower."))
    even = make_sample(layout, torch.Generator().manual_seed(6), [("text", 3), ("video", 3), ("video", 3)])
    listed = {**even, "pixel_values_videos": list(even["pixel_values_videos"])}
    with torch.no_grad():
        want = packed(**collator(reference)([even])).loss
        got = packed(**collator(reference)([listed])).loss
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_packed_path_uses_ops_and_one_tower_call(reference, monkeypatch):
    packed = enable_packed(copy.deepcopy(reference))
    batch = collator(reference)(make_samples(reference))
    calls = {"rope": 0, "attn": 0}
    real_rope, real_attn = packed_core.apply_mrope, packed_core.varlen_attention

    def rope(q, k, pos, inv_freq, section, *args, **kwargs):
        calls["rope"] += 1
        assert pos is batch.position_ids and tuple(section) == (inv_freq.numel(), 0, 0)
        return real_rope(q, k, pos, inv_freq, section, *args, **kwargs)

    def attn(q, k, v, info, **kwargs):
        calls["attn"] += 1
        assert info.cu_seqlens_list == batch.cu_seqlens_list and isinstance(info.max_seqlen, int)
        return real_attn(q, k, v, info, **kwargs)

    monkeypatch.setattr(packed_core, "apply_mrope", rope)
    monkeypatch.setattr(packed_core, "varlen_attention", attn)
    with forward_calls(packed.model.vision_tower) as towers, torch.no_grad():
        packed(**batch)
    n_layers = len(packed.model.language_model.layers)
    assert calls == {"rope": n_layers, "attn": n_layers} and len(towers) == 1  # images and video together


def test_text_only_batch_runs_the_idle_tower(reference):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = text_only(make_samples(ref))
    batch = collator(ref)(samples)
    assert batch.pixel_values is None
    with forward_calls(packed.model.vision_tower) as towers:
        out = packed(**batch)
    assert len(towers) == 1
    backward_and_compare(out.loss, reference_loss(ref, samples))
    assert assert_grads_match(packed, ref) > 5
    assert dict(packed.named_parameters())["model.image_newline"].grad is not None  # in the graph, zero


@pytest.mark.parametrize("mix", ["vision", "text only"])
def test_packed_forward_and_backward_read_nothing_back(reference, mix, monkeypatch):
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples(reference)
    batch = collator(reference)(text_only(samples) if mix == "text only" else samples)
    packed(**batch).loss.backward()  # warm-up: the idle crop's cached input
    assert host_reads_of_step(packed, batch, monkeypatch) == []
    # nor a blocking host-to-device copy (transformers' pack_image_features builds its feature_lens
    # with torch.tensor(..., device=...) in every call: the packed path packs without it)
    assert host_tensors_of_step(packed, batch) == []


# (height, width) of images: wide, tall, square, tiny, and (OneVision's 96 x 128 pinpoint) large
# enough that anyres_max_9 downsamples the unpadded grid.
PACK_SIZES = [(40, 70), (64, 30), (20, 20), (32, 32), (1, 200), (200, 1), (90, 120), (128, 96), (96, 128),
              (33, 65)]


def test_pack_image_features_equals_transformers(reference):
    """The packed path's copy of transformers' ``pack_image_features`` (unpad, newline column,
    OneVision's downsampling, base view first) gives the installed transformers' values exactly,
    for every crop grid the tiny pinpoints make and for a single base view."""
    from collate.models.anyres_vision import crop_counts, pack_image_features

    model = reference
    counts = crop_counts(model, [list(size) for size in PACK_SIZES], None)
    g = torch.Generator().manual_seed(3)
    tokens = (SIDE // model.config.vision_config.patch_size) ** 2
    hidden = model.config.text_config.hidden_size
    features = [torch.randn(n, tokens, hidden, generator=g) for n in [*counts, 1]]
    sizes = [list(size) for size in PACK_SIZES] + [[SIDE, SIDE]]
    options = ({"vision_aspect_ratio": model.config.vision_aspect_ratio}
               if model.config.model_type == "llava_onevision" else
               {"vision_feature_select_strategy": model.config.vision_feature_select_strategy})
    want, _ = model.model.pack_image_features(features, sizes, image_newline=model.model.image_newline,
                                              **options)
    got = pack_image_features(model, features, sizes)
    assert len(got) == len(want) and len(set(counts)) > 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hand_made_batch_without_collator_fields(reference):
    """A batch without the collator's crop counts and slots (processor tensors) still trains the
    same loss: crop counts from the sizes, placeholders found on the device."""
    packed = enable_packed(copy.deepcopy(reference))
    samples = [s for s in make_samples(reference) if "pixel_values_videos" not in s]
    batch = dict(collator(reference)(samples).items())
    one = samples[1]
    hand = {**batch, "pixel_values": one["pixel_values"], "image_sizes": one["image_sizes"],
            "image_num_tiles": None, "vision_token_index": None, "batch_num_images": None}
    single = collator(reference)([one])
    hand.update(input_ids=single.input_ids, labels=single.labels, position_ids=single.position_ids,
                cu_seqlens=single.cu_seqlens, cu_seqlens_list=single.cu_seqlens_list,
                max_seqlen=single.max_seqlen, seq_lens=single.seq_lens,
                text_position_ids=single.text_position_ids)
    with torch.no_grad():
        torch.testing.assert_close(packed(**hand).loss, packed(**single).loss, rtol=1e-6, atol=0)
        no_images = torch.where(single.input_ids == IMG, 5, single.input_ids)
        with pytest.raises(ValueError, match="placeholder"):
            packed(**{**hand, "input_ids": no_images})


def test_collator_checks_placeholders_naming_the_sample(reference):
    samples = make_samples(reference)
    short = dict(samples[2], input_ids=samples[2]["input_ids"][1:], labels=samples[2]["labels"][1:])
    bad = dict(short, input_ids=torch.where(short["input_ids"] == IMG, 7, short["input_ids"]))
    with pytest.raises(ValueError, match=r"sample 1: 0 image placeholder tokens"):
        collator(reference)([samples[0], bad])
    no_sizes = {k: v for k, v in samples[1].items() if k != "image_sizes"}
    with pytest.raises(ValueError, match=r"sample 0: field 'pixel_values' given without 'image_sizes'"):
        collator(reference)([no_sizes])
    few = dict(samples[1], pixel_values=samples[1]["pixel_values"][:, :1])
    with pytest.raises(ValueError, match=r"sample 0: field 'pixel_values' has shape"):
        collator(reference)([few])
    # samples whose crops cannot be concatenated: both samples named
    wide = dict(samples[1], pixel_values=samples[1]["pixel_values"].double())
    with pytest.raises(ValueError, match=r"sample 2: field 'pixel_values' is torch.float64 .*, sample 1 has "
                                         r"torch.float32"):
        collator(reference)([samples[0], samples[1], wide])


def test_index_counts_equal_collated_placeholders(reference, tmp_path):
    """The estimator ``tokenbal index build`` loads from the checkpoint's files gives every
    sample's image (and video) placeholder count the collated batch holds, which the model's own
    feature count matches (the loss test)."""
    from tokenbal.estimate.vision import load_estimator

    config = reference.config
    config.save_pretrained(tmp_path)
    crop = {"height": SIDE, "width": SIDE}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"crop_size": crop, "size": crop, "image_grid_pinpoints": config.image_grid_pinpoints}))
    est = load_estimator(tmp_path)
    samples = make_samples(reference)
    batch = collator(reference)(samples)
    ids = batch.input_ids[0]
    starts = [0, *batch.cu_seqlens_list[:-1]]
    for i, (s, start, end) in enumerate(zip(samples, starts, batch.cu_seqlens_list, strict=True)):
        want = 0
        if "image_sizes" in s:
            sizes = s["image_sizes"].tolist()
            for h, w in sizes:
                if config.model_type == "llava_onevision":
                    want += est.image_tokens(w, h, images_in_sample=len(sizes))
                else:
                    want += est.image_tokens(w, h)
        assert int((ids[start:end] == IMG).sum()) == want, f"sample {i}"
        if "pixel_values_videos" in s:
            frames = s["pixel_values_videos"].shape[1]
            assert int((ids[start:end] == VID).sum()) == est.video_tokens(frames, SIDE, SIDE), f"sample {i}"


def test_unpacked_calls_unchanged_and_disable_restores(reference):
    sample = make_samples(reference)[2]
    packed = enable_packed(copy.deepcopy(reference))
    with torch.no_grad():
        want = reference(**hf_kwargs(reference, sample))
        got = packed(**hf_kwargs(reference, sample))
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert enable_packed(packed) is packed
    attn = packed.model.language_model.layers[0].self_attn
    assert "forward" in attn.__dict__ and "forward" in packed.__dict__
    clone = copy.deepcopy(packed)
    assert clone.forward.__self__ is clone
    disable_packed(packed)
    assert "forward" not in attn.__dict__ and "forward" not in packed.__dict__
    with torch.no_grad():
        again = packed(**hf_kwargs(reference, sample))
    torch.testing.assert_close(again.logits, want.logits, rtol=0, atol=0)


def _fsdp2_text_only_rank(rank: int, world_size: int, family: str) -> int:
    """Rank 1 gets only text while the tower's layers are FSDP units of their own: the idle crop
    keeps the ranks' collectives paired, and the gradients equal the per-sample reference."""
    torch.manual_seed(0)
    ref = MODEL_CLASSES[family](tiny_config(family)).float().eval()
    packed = enable_packed(copy.deepcopy(ref))
    tower = packed.model.vision_tower
    fully_shard_packed(packed, getattr(tower, "vision_model", tower).encoder.layers)
    return text_only_rank_grads(rank, world_size, ref, packed, make_samples(ref), collator(ref),
                                reference_loss)


@pytest.mark.slow  # two processes, ~1.5 min on a loaded 2-core machine
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_rank_without_images_still_runs_the_sharded_tower(family):
    from tests.helpers.dist_utils import run_ranks

    checked = run_ranks(_fsdp2_text_only_rank, 2, family, timeout=180, collective_timeout=30)
    assert min(checked) > 20
