"""enable_packed on a tiny random transformers GLM-OCR (``GlmOcrForConditionalGeneration``: GLM-4V's
generation class and text stack, its vision attention adding per-head q / k RMS norms before the
rotary): the packed loss, logits and every gradient equal per-sample unpacked HF forwards. The
collator's positions against the installed ``GlmOcrModel.get_rope_index``:
tests/collate/test_positions_families.py."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GlmOcrConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no GLM-OCR", allow_module_level=True)

from collate import PackedCollator  # noqa: E402
from collate.models import enable_packed  # noqa: E402
from tests.collate.models.test_glm4v import (  # noqa: E402
    assert_positions_equal_hf,
    hf_inputs,
    make_samples,
    reference_loss,
)
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.reference import assert_logits_match_per_sample, backward_and_compare  # noqa: E402
from tests.helpers.tiny_glm4v import tiny_config as tiny_glm4v_config  # noqa: E402
from tokenbal.hf_compat import checkpointing_enable  # noqa: E402

_IDS = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
        "video_start_token_id", "video_end_token_id")


def tiny_config(attn: str = "sdpa"):
    """The tiny GLM-4.1V config's sizes and token ids as a GLM-OCR config (head_dim explicit: GLM-OCR's
    text attention reads it)."""
    base = tiny_glm4v_config().to_dict()
    text = {k: v for k, v in base["text_config"].items() if k != "model_type"}
    text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    vision = {k: v for k, v in base["vision_config"].items() if k != "model_type"}
    cfg = transformers.GlmOcrConfig(text_config=text, vision_config=vision, **{k: base[k] for k in _IDS})
    cfg._attn_implementation = attn
    for sub in (cfg.text_config, cfg.vision_config):
        sub._attn_implementation = attn
    return cfg


def build(attn: str = "sdpa"):
    torch.manual_seed(0)
    model = transformers.GlmOcrForConditionalGeneration(tiny_config(attn)).float().eval()
    with torch.no_grad():  # norms away from their ones init, so that skipping one shows
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def reference():
    return build()


def test_packed_loss_logits_and_grads_match_per_sample(reference):
    ref = copy.deepcopy(reference)
    assert hasattr(ref.model.visual.blocks[0].attn, "q_norm")
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = PackedCollator.from_config(ref.config, pin_memory=False)(samples)
    assert batch.pixel_values is not None and batch.pixel_values_videos is not None
    assert_positions_equal_hf(batch, samples, ref)
    out = packed(**batch)
    assert_logits_match_per_sample(out.logits, batch, samples, ref, hf_inputs)
    backward_and_compare(out.loss, reference_loss(ref, samples))
    assert assert_grads_match(packed, ref) > 30
    grads = {n: p.grad for n, p in packed.named_parameters()}
    assert grads["model.visual.blocks.0.attn.q_norm.weight"].abs().sum() > 0


def test_eager_reference_and_gradient_checkpointing():
    ref = build("eager").train()  # dropout 0 in this config
    packed = enable_packed(copy.deepcopy(ref))
    checkpointing_enable(packed)
    samples = make_samples()
    want = reference_loss(ref, samples)
    batch = PackedCollator.from_config(ref.config, pin_memory=False)(samples)
    backward_and_compare(packed(**batch).loss, want)
    assert assert_grads_match(packed, ref) > 30


def test_packed_vision_attention_applies_the_q_k_norms(reference):
    """GLM-OCR's tower hands its blocks no kwargs, so a packed forward runs transformers' own vision
    attention; the patched one, handed the segments directly (as a tower that forwards its kwargs
    would), must equal it: q / k RMS norms before the rotary included."""
    from collate.models import grid_vision

    packed = enable_packed(copy.deepcopy(reference))
    attn = packed.model.visual.blocks[0].attn
    ref_attn = reference.model.visual.blocks[0].attn
    g = torch.Generator().manual_seed(3)
    lengths = [6, 4, 8]
    hidden = torch.randn(sum(lengths), ref_attn.qkv.in_features, generator=g)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    cu = torch.tensor([0, *ends], dtype=torch.int32)
    half = ref_attn.head_dim // 2
    angles = torch.randn(sum(lengths), half, generator=g)
    emb = torch.cat([angles, angles], dim=-1)
    rotary = (emb.cos(), emb.sin())
    info = grid_vision.VisionAttentionInfo((grid_vision.VisionSegments(cu, ends, max(lengths)),))
    with torch.no_grad():
        want = ref_attn(hidden, cu_seqlens=cu, position_embeddings=rotary)
        got = attn(hidden, cu_seqlens=cu, position_embeddings=rotary, **{grid_vision.VISION_KWARG: info})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _glm_ocr_model():
    return build()


@pytest.mark.slow  # two processes, ~1 min on a loaded 2-core machine
def test_fsdp2_rank_without_images_still_runs_the_sharded_tower():
    from tests.collate.models.test_glm4v import _fsdp2_text_only_rank
    from tests.helpers.dist_utils import run_ranks

    assert min(run_ranks(_fsdp2_text_only_rank, 2, _glm_ocr_model, timeout=180, collective_timeout=30)) > 30
