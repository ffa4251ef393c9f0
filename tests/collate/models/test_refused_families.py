"""Families transformers has next to a patched one but that tokenbal does not patch: enable_packed
refuses them with a TypeError that names the model type and says why (not the nearest patch forced
on, nor a bare "no patch")."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from collate.models import PACKED_ONLY, REFUSED, enable_packed  # noqa: E402
from tokenbal.estimate.families import FAMILIES  # noqa: E402


def test_refused_types_are_not_in_the_family_table():
    patched = {mt for f in FAMILIES if f.packed for mt in f.model_types} | set(PACKED_ONLY)
    assert patched.isdisjoint(REFUSED)


@pytest.mark.parametrize("config_name", ["Cosmos3OmniConfig", "Cosmos3EdgeConfig"])
def test_real_classes_are_refused_naming_the_reason(config_name):
    from tests.collate.test_positions_families import tiny_config

    config = tiny_config(config_name)  # skips where this transformers has no such class
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    with pytest.raises(TypeError, match=rf"model_type={config.model_type!r} .* is not patched: "
                                         rf"{REFUSED[config.model_type][:20]}"):
        enable_packed(model)


def test_qwen2_5_omni_thinker_is_refused_naming_the_audio_layout():
    if not hasattr(transformers, "Qwen2_5OmniThinkerForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen2.5-Omni")
    config = transformers.Qwen2_5OmniThinkerConfig()
    with torch.device("meta"):
        model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(config)
    with pytest.raises(TypeError, match=r"'qwen2_5_omni_thinker' .* Qwen2.5-Omni thinker: .*audio"):
        enable_packed(model)
