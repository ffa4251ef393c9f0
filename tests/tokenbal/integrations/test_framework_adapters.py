"""The framework adapters' own pieces that run without the frameworks (their end-to-end checks,
through LLaMA-Factory's and ms-swift's real CLIs, are tests/tokenbal/integrations/frameworks,
`make test-frameworks`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenbal.integrations.llamafactory import lf_image_size, lf_video_frames, main
from tokenbal.integrations.swift import plugin_path, swift_lengths


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_lf_image_size_is_llamafactorys_resize(w, h):
    max_px, min_px = 160 * 160, 32 * 32
    out_w, out_h = lf_image_size(w, h, max_px, min_px)
    # LLaMA-Factory 0.9.5, BasePlugin._preprocess_image then Qwen2VLPlugin._preprocess_image
    ew, eh = w, h
    if ew * eh > max_px:
        f = math.sqrt(max_px / (ew * eh))
        ew, eh = int(ew * f), int(eh * f)
    if ew * eh < min_px:
        f = math.sqrt(min_px / (ew * eh))
        ew, eh = int(ew * f), int(eh * f)
    ew, eh = (max(ew, 28), max(eh, 28)) if min(ew, eh) < 28 else (ew, eh)
    if ew / eh > 200:
        ew, eh = eh * 180, eh
    if eh / ew > 200:
        ew, eh = ew, ew * 180
    assert (out_w, out_h) == (ew, eh)


def test_lf_image_size_examples():
    assert lf_image_size(420, 420, 160 * 160, 32 * 32) == (160, 160)     # shrunk before the processor
    assert lf_image_size(100, 50, 160 * 160, 32 * 32) == (100, 50)       # untouched
    assert lf_image_size(10, 300, 160 * 160, 32 * 32) == (28, 300)       # short side raised to 28


@given(st.integers(0, 5000), st.floats(0.01, 600), st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.integers(1, 256))
def test_lf_video_frames_is_llamafactorys_sampling(frames, duration, fps, maxlen):
    # LLaMA-Factory 0.9.5: BasePlugin._get_video_sample_indices (len of its linspace), then
    # Qwen2VLPlugin's even frame count (the last frame repeated)
    if frames == 0:
        n = len(np.linspace(0, maxlen - 1, maxlen))
    else:
        want = min(frames, maxlen, max(1, math.floor(duration * fps)))
        n = len(np.linspace(0, frames - 1, want).astype(np.int32))
    assert lf_video_frames(frames, duration, fps, maxlen) == n + n % 2


def test_swift_lengths_reads_per_row_lists():
    datasets = pytest.importorskip("datasets")
    # ms-swift's encoded dataset: one list per row, shape (n, 1) for sft rows
    ds = datasets.Dataset.from_dict({"lengths": [[5], [7], [3]], "input_ids": [[1] * 5, [1] * 7, [1] * 3]})
    np.testing.assert_array_equal(swift_lengths(ds), [5, 7, 3])
    bad = datasets.Dataset.from_dict({"lengths": [[5], []]})
    with pytest.raises(ValueError, match="train row 1 has an empty 'lengths' entry"):
        swift_lengths(bad)
    with pytest.raises(TypeError, match="neither a 'lengths' column nor a LazyLLMDataset"):
        swift_lengths(datasets.Dataset.from_dict({"text": ["a"]}))


def test_swift_plugin_file_exists_and_cli_usage(capsys):
    assert plugin_path().endswith("tokenbal/integrations/swift_plugin/tokenbal_plugin.py")
    with open(plugin_path()) as f:
        assert "register()" in f.read()
    assert main([]) == 2
    assert "usage: python -m tokenbal.integrations.llamafactory train CONFIG.yaml" in capsys.readouterr().err
