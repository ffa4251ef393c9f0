"""enable_packed on a tiny random transformers GLM-4.6V (``Glm46VForConditionalGeneration``: GLM-4V's
model subclassed, its towers built from its sub-configs): with GLM-4V's dense text model the packed
loss and every gradient equal the token-weighted mean of per-sample unpacked HF forwards; a MoE
text model is refused by name. The collator's positions against the installed
``Glm46VModel.get_rope_index``: tests/collate/test_positions_families.py."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm46VConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no GLM-4.6V", allow_module_level=True)

from collate import PackedCollator  # noqa: E402
from collate.models import enable_packed  # noqa: E402
from tests.collate.models.test_glm4v import assert_positions_equal_hf, make_samples, reference_loss  # noqa: E402
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.reference import backward_and_compare  # noqa: E402
from tests.helpers.tiny_glm4v import tiny_config as tiny_glm4v_config  # noqa: E402

_IDS = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
        "video_start_token_id", "video_end_token_id")


def tiny_config(text_model_type: str | None = None):
    """The tiny GLM-4.1V config's sizes and token ids as a GLM-4.6V config."""
    base = tiny_glm4v_config().to_dict()
    text = dict(base["text_config"])
    if text_model_type is not None:
        text["model_type"] = text_model_type
    cfg = transformers.Glm46VConfig(text_config=text, vision_config=base["vision_config"],
                                    **{k: base[k] for k in _IDS})
    cfg._attn_implementation = "sdpa"
    return cfg


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return transformers.Glm46VForConditionalGeneration(tiny_config()).float().eval()


def test_packed_loss_and_grads_match_per_sample(reference):
    ref = copy.deepcopy(reference)
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = PackedCollator.from_config(ref.config, pin_memory=False)(samples)
    assert batch.pixel_values is not None and batch.pixel_values_videos is not None
    assert_positions_equal_hf(batch, samples, ref)
    backward_and_compare(packed(**batch).loss, reference_loss(ref, samples))
    assert assert_grads_match(packed, ref) > 30


def test_moe_text_model_is_refused_by_name():
    cfg = tiny_config("glm4v_moe_text")
    with torch.device("meta"):
        model = transformers.Glm46VForConditionalGeneration(cfg)
    assert type(model.model.language_model).__name__ != "Glm4vTextModel"
    with pytest.raises(TypeError, match=r"'glm46v' with a 'glm4v_moe_text' text model is not patched"):
        enable_packed(model)


def _glm46v_model():
    return transformers.Glm46VForConditionalGeneration(tiny_config())


@pytest.mark.slow  # two processes, ~1 min on a loaded 2-core machine
def test_fsdp2_rank_without_images_still_runs_the_sharded_tower():
    from tests.collate.models.test_glm4v import _fsdp2_text_only_rank
    from tests.helpers.dist_utils import run_ranks

    assert min(run_ranks(_fsdp2_text_only_rank, 2, _glm46v_model, timeout=180, collective_timeout=30)) > 30
