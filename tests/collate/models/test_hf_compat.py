"""``tokenbal.hf_compat`` answers that no model test reaches: a family the installed transformers
lacks is refused naming the release that added it, and the probes agree with the installed
classes they describe."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")

from tokenbal import hf_compat  # noqa: E402


def installed():
    """The transformers module ``import transformers`` gives now (what hf_compat sees; a test
    elsewhere in the session may have re-imported it since this module was collected)."""
    return sys.modules["transformers"]


@pytest.mark.parametrize(("name", "added"), [("Qwen3VLForConditionalGeneration", "4.57"),
                                             ("Glm4vForConditionalGeneration", "4.53"),
                                             ("Qwen2_5_VLForConditionalGeneration", "4.49")])
def test_a_family_missing_from_the_installed_transformers_names_the_release_that_added_it(
        monkeypatch, name, added):
    assert hf_compat.require_class(name) is getattr(installed(), name)
    monkeypatch.setattr(installed(), name, None, raising=False)  # as an older release: absent
    with pytest.raises(ImportError) as err:
        hf_compat.require_class(name)
    message = str(err.value)
    assert f"transformers {hf_compat.transformers_version()} has no {name}" in message
    assert f"it was added in transformers {added}" in message
    assert f"tokenbal supports transformers >= {hf_compat.MIN_VERSION}" in message


def test_model_config_loader_refuses_a_missing_family_by_name(monkeypatch, tmp_path):
    from collate.train.builders import load_model_config

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen3_vl"}')
    monkeypatch.setattr(installed(), "Qwen3VLConfig", None, raising=False)
    with pytest.raises(ImportError, match="has no Qwen3VLConfig; it was added in transformers 4.57"):
        load_model_config(str(path))


def test_loaded_image_size_probe_matches_the_class_autoimageprocessor_loads(tmp_path):
    """The probe's answer is what loading a Qwen3-VL processor folder gives on this install."""
    import json

    size = {"shortest_edge": 65536, "longest_edge": 16777216}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessorFast", "size": size, "patch_size": 16}))
    transformers = installed()
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    except ImportError:  # 5.6-5.9 map the Fast type to the torchvision class only
        proc = hf_compat.image_processor_class("Qwen2VLImageProcessorPil").from_pretrained(tmp_path)
    kept = (proc.size["shortest_edge"], proc.size["longest_edge"]) == (65536, 16777216)
    assert hf_compat.qwen2_vl_loaded_image_size_kept() == kept
