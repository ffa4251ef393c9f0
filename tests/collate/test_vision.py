"""collate.vision against its oracle, transformers' own ``vision_utils`` (what the Qwen2-VL /
Qwen2.5-VL towers compute from ``grid_thw`` when nothing is precomputed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
# The oracle: transformers 5.9+ (before, the towers compute these inline and take none of them).
pytest.importorskip("transformers.vision_utils")

from transformers.vision_utils import (  # noqa: E402
    get_vision_cu_seqlens,
    get_vision_position_ids,
    get_vision_window_index,
)

from collate.vision import (  # noqa: E402
    tower_fields,
    vision_rotary_positions,
    vision_window_index,
    window_in_merged_tokens,
)

PATCH = 14


@st.composite
def grids_and_merge(draw):
    merge = draw(st.sampled_from([1, 2, 3]))
    n = draw(st.integers(1, 5))
    rows = [(draw(st.integers(1, 4)), merge * draw(st.integers(1, 14)), merge * draw(st.integers(1, 14)))
            for _ in range(n)]
    return np.array(rows, dtype=np.int64), merge


@settings(max_examples=150, deadline=None)
@given(gm=grids_and_merge(), window=st.integers(1, 6))
def test_tower_fields_equal_transformers(gm, window):
    grids, merge = gm
    g = torch.from_numpy(grids)
    fields = tower_fields(grids, merge, window)
    cu = get_vision_cu_seqlens(g)
    assert torch.equal(fields["vision_cu_seqlens"], cu)
    assert fields["vision_cu_seqlens_list"] == cu[1:].tolist()
    assert fields["vision_max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    assert torch.equal(fields["vision_position_ids"], get_vision_position_ids(g, merge))
    index, cu_windows = get_vision_window_index(g, merge, window * merge * PATCH, PATCH)
    assert torch.equal(fields["vision_window_index"], index)
    assert torch.equal(fields["vision_cu_window_seqlens"], cu_windows)
    assert fields["vision_cu_window_seqlens_list"] == cu_windows[1:].tolist()
    assert fields["vision_max_window_seqlen"] == int((cu_windows[1:] - cu_windows[:-1]).max())


def test_window_size_not_a_multiple_of_the_merged_patch():
    """transformers floors window_size // merge // patch; 100 px with 14-px patches, merge 2 -> 3."""
    config = type("VisionConfig", (), dict(window_size=100, patch_size=14, spatial_merge_size=2))()
    window = window_in_merged_tokens(config)
    assert window == 3
    g = torch.tensor([[2, 14, 10]])
    index, cu = get_vision_window_index(g, 2, 100, 14)
    got_index, lengths = vision_window_index(g.numpy(), 2, window)
    assert torch.equal(torch.from_numpy(got_index), index)
    assert np.concatenate([[0], np.cumsum(lengths)]).tolist() == cu.tolist()
    assert window_in_merged_tokens(type("NoWindow", (), {})()) is None


def test_one_dimensional_models_get_segments_only():
    fields = tower_fields(np.array([[2, 3, 5]]))
    assert fields["vision_cu_seqlens"].tolist() == [0, 15, 30] and fields["vision_max_seqlen"] == 15
    assert "vision_position_ids" not in fields and "vision_window_index" not in fields


def test_bad_grids_name_the_grid():
    with pytest.raises(ValueError, match=r"vision grid 1 .*\[1, 4, 5\].*multiples of spatial_merge_size=2"):
        vision_rotary_positions(np.array([[1, 4, 4], [1, 4, 5]]), 2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        vision_window_index(np.array([[1, 4, 4]]), 2, 0)
