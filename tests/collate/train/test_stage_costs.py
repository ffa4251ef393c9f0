"""Measured stage costs: features, the non-negative fit, and the timing helpers on a real tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenbal.balance.cost import StageCostModel, resolve_costs, resolve_stage_costs, stage_features

pytest.importorskip("transformers")

from collate import PackedCollator  # noqa: E402
from collate.models import enable_packed  # noqa: E402
from collate.train import (  # noqa: E402
    StepRecord,
    calibration_batches,
    median_records,
    profile_stage_costs,
    solo_stage_times,
    summarise,
)
from tests.helpers.tiny_mix import make_samples, tiny_config  # noqa: E402


def _index_of(samples: list[dict]):
    """What a TokenIndex offers the cost models: lengths, vision tokens, the per-image table."""
    per_image = [(g.prod(-1) // 4).tolist() if "image_grid_thw" in s else [] for s in samples
                 for g in [s.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))]]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in per_image])])
    return SimpleNamespace(lengths=np.array([len(s["input_ids"]) for s in samples]),
                           vision_tokens=np.array([sum(p) for p in per_image]),
                           image_tokens_table=(offsets, np.array(sum(per_image, []), np.int64)))


def test_stage_features_count_images_patches_and_tokens():
    idx = SimpleNamespace(lengths=np.array([10, 300, 50]), vision_tokens=np.array([0, 260, 30]),
                          image_tokens_table=(np.array([0, 0, 2, 3]), np.array([100, 160, 30])))
    f = stage_features(idx, merge_size=2)
    assert f.shape == (3, 2, 3)
    np.testing.assert_array_equal(f[:, 1], [[1, 10, 100], [1, 300, 90000], [1, 50, 2500]])
    np.testing.assert_array_equal(f[0, 0], [0, 0, 0])
    np.testing.assert_array_equal(f[1, 0], [2, 400 + 640, 400**2 + 640**2])   # per image, not one block
    np.testing.assert_array_equal(f[2, 0], [1, 120, 120**2])
    bare = stage_features(np.array([10, 20]))
    assert (bare[:, 0] == 0).all() and (bare[:, 1, 1] == [10, 20]).all()


def test_fit_recovers_the_coefficients_and_leaves_out_the_batch_constant():
    rng = np.random.default_rng(0)
    X = rng.random((40, 2, 3)) * np.array([3, 4000, 4e6])
    vision, language = np.array([2e-3, 3e-5, 4e-9]), np.array([8e-3, 1e-6, 2e-7])
    y = np.stack([X[:, 0] @ vision + 0.05, X[:, 1] @ language + 0.02], 1)
    model = StageCostModel.fit(X, y)
    np.testing.assert_allclose(model.vision, vision, rtol=1e-6)
    np.testing.assert_allclose(model.language, language, rtol=1e-6)


def test_fit_never_returns_a_negative_coefficient():
    # Times that fall with the token count: the unconstrained fit would give a negative slope.
    X = np.zeros((6, 2, 3))
    X[:, 1] = [[1, t, t * t] for t in (10, 20, 40, 80, 160, 320)]
    y = np.zeros((6, 2))
    y[:, 1] = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    model = StageCostModel.fit(X, y)
    assert min(model.language) >= 0 and min(model.vision) >= 0
    with pytest.raises(ValueError, match="at least 4"):
        StageCostModel.fit(X[:3], y[:3])
    with pytest.raises(ValueError, match=r"\(B, 2, 3\)"):
        StageCostModel.fit(X[:, :, :2], y)
    with pytest.raises(ValueError, match="coefficients >= 0"):
        StageCostModel(vision=(0, -1, 0), language=(0, 0, 0))


def test_a_fitted_model_is_a_cost_and_gives_stage_columns():
    idx = SimpleNamespace(lengths=np.array([10, 300, 50]), vision_tokens=np.array([0, 260, 30]),
                          image_tokens_table=(np.array([0, 0, 2, 3]), np.array([100, 160, 30])))
    model = StageCostModel(vision=(1e-3, 1e-5, 1e-8), language=(2e-3, 1e-6, 1e-8))
    stages = resolve_stage_costs(idx, True, model)
    np.testing.assert_array_equal(stages, model.stage_micros(idx))
    np.testing.assert_array_equal(resolve_costs(idx, model), stages.sum(1))
    assert stages[0, 0] == 0 and (stages[:, 1] > 0).all()
    assert StageCostModel.from_dict(model.to_dict()) == model


def test_calibration_batches_vary_in_size_and_are_reproducible():
    batches = calibration_batches(range(100, 140), 30, max_samples=4, seed=1)
    assert batches == calibration_batches(range(100, 140), 30, max_samples=4, seed=1)
    sizes = {len(b) for b in batches}
    assert sizes <= {1, 2, 3, 4} and len(sizes) > 1
    assert all(100 <= i < 140 and len(set(b)) == len(b) for b in batches for i in b)
    with pytest.raises(ValueError, match="no samples"):
        calibration_batches([], 3)


def test_solo_stage_times_and_profiling_on_a_real_model():
    config = tiny_config()
    torch.manual_seed(0)
    from transformers import Qwen2VLForConditionalGeneration

    model = enable_packed(Qwen2VLForConditionalGeneration(config).float())
    samples = make_samples(0)
    collate = PackedCollator.from_config(config)
    total, vision = solo_stage_times(model, collate([samples[1]]))        # one image
    assert 0 < vision < total
    assert all(p.grad is None for p in model.parameters())                # grads are not left behind
    text_total, text_vision = solo_stage_times(model, collate([samples[0]]))
    assert 0 <= text_vision < text_total        # the idle tower's dummy image, nothing more

    features = stage_features(_index_of(samples), merge_size=2)
    batches = [[0], [1, 5], [0, 1, 4], [5]]
    feats, secs = profile_stage_costs(model, collate, samples, features, batches, repeats=1)
    for b, idx in enumerate(batches):
        np.testing.assert_array_equal(feats[b], features[idx].sum(0))
    assert secs.shape == (4, 2) and np.isfinite(secs).all() and (secs[:, 1] > 0).all()
    assert secs[1, 0] > 0 and secs[3, 0] > 0                              # batches with images


def _rec(step, rank, step_s, compute_s, vision_s=0.5, tokens=10):
    return StepRecord(step=step, rank=rank, samples=1, tokens=tokens, compute_s=compute_s, step_s=step_s,
                      loss=1.0, vision_s=vision_s)


def test_median_records_and_the_stage_decomposition():
    reps = [[_rec(0, 0, s, c), _rec(0, 1, s, c / 2)] for s, c in [(2.0, 1.0), (9.0, 1.4), (2.2, 1.2)]]
    med = median_records(reps)
    assert [(r.step, r.rank, r.step_s, r.compute_s) for r in med] == [(0, 0, 2.2, 1.2), (0, 1, 2.2, 0.6)]
    with pytest.raises(ValueError, match="different batches"):
        median_records([[_rec(0, 0, 1, 1)], [_rec(0, 0, 1, 1, tokens=11)]])
    # Rank 0 heavy in vision, rank 1 in language: equal totals, but each stage waits once.
    s = summarise([_rec(0, 0, 3.0, 2.0, vision_s=1.5), _rec(0, 1, 3.0, 2.0, vision_s=0.5)])
    assert s["ideal_s"] == 2.0 and s["slowest_s"] == 2.0 and s["stages_s"] == 3.0
