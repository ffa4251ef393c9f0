"""The demo's data path, end to end: synthetic shards -> index -> dataset with transformers'
real image processor and a real tokenizer. The index's predicted length of every sample must be
the number of tokens the training pipeline actually produces."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from collate.train.builders import DEMO_MAX_PIXELS, DEMO_MIN_PIXELS, IndexedSamples, prepare_data
from tokenbal.index import build_index
from tokenbal.synthetic import make_samples


def test_synthetic_samples_are_deterministic_and_mixed():
    a, b = make_samples(200, seed=3), make_samples(200, seed=3)
    assert a == b and make_samples(200, seed=4) != a
    kinds = {s.kind for s in a}
    assert {"photo", "document", "screenshot", "icon", "multi_image", "text_short", "text_long"} <= kinds
    assert all(len(s.images) >= 2 for s in a if s.kind == "multi_image")
    assert all(not s.images for s in a if s.kind.startswith("text"))


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    paths = prepare_data(str(tmp_path_factory.mktemp("demo")), num_samples=40, seed=1)
    build_index(list(paths.shards), paths.index, model="qwen2-vl", tokenizer=paths.tokenizer,
                estimator_overrides=dict(min_pixels=DEMO_MIN_PIXELS, max_pixels=DEMO_MAX_PIXELS),
                progress=False)
    return paths


def test_index_lengths_equal_what_the_processor_and_tokenizer_produce(demo_data):
    ds = IndexedSamples(demo_data.index, demo_data.tokenizer)
    assert len(ds) == 40
    for i in range(len(ds)):  # __getitem__ itself raises on any mismatch; check explicitly too
        sample = ds[i]
        assert len(sample["input_ids"]) == int(ds.index.lengths[i])
        n_images = len(ds.index.image_sizes(i))
        assert (sample["image_grid_thw"].shape[0] if n_images else 0) == n_images


def test_stale_index_is_an_error_naming_the_sample(demo_data, tmp_path):
    # An index built with another pixel budget no longer matches what the processor produces.
    out = tmp_path / "other"
    build_index(list(demo_data.shards), out, model="qwen2-vl", tokenizer=demo_data.tokenizer, progress=False)
    ds = IndexedSamples(str(out), demo_data.tokenizer)
    big = next(i for i in range(len(ds)) if ds.index.vision_tokens[i] > 1400)
    with pytest.raises(ValueError, match=f"sample {big} .* tokens but the index says"):
        ds[big]


def test_identical_control_gives_every_rank_tokenbals_rank0_batches(demo_data):
    from collate.train.builders import make_loader

    ds = IndexedSamples(demo_data.index, demo_data.tokenizer)

    def steps(kind, rank):
        loader = make_loader(ds, kind, rank, 2, global_batch_size=8, seed=0, collator=list)
        return list(loader.batch_sampler)

    tokenbal = [steps("tokenbal", r) for r in range(2)]
    assert tokenbal[0] != tokenbal[1]
    assert steps("identical", 0) == steps("identical", 1) == tokenbal[0]
    # Every rank claims rank 0 there: the cross-rank check (on by default under torch.distributed)
    # would be joined by process 0 alone and wait forever, so the control turns it off.
    identical = make_loader(ds, "identical", 1, 2, global_batch_size=8, seed=0, collator=list)
    assert identical.batch_sampler.verify is False
    balanced = make_loader(ds, "tokenbal", 1, 2, global_batch_size=8, seed=0, collator=list)
    assert balanced.batch_sampler.verify is None
    with pytest.raises(ValueError, match="'identical'"):
        make_loader(ds, "random", 0, 2, global_batch_size=8, seed=0, collator=list)


def test_summarise_takes_the_slowest_rank_per_step():
    from collate.train import StepRecord, summarise

    def rec(rank, step, t, c, n):
        return StepRecord(step=step, rank=rank, samples=1, tokens=n, compute_s=c, step_s=t, loss=0.0)

    summary = summarise([rec(0, 0, 1.0, 1.0, 100), rec(0, 1, 2.0, 1.0, 50),
                         rec(1, 0, 0.9, 0.5, 50), rec(1, 1, 2.0, 2.0, 150)])
    assert summary["epoch_s"] == 3.0 and summary["steps"] == 2
    np.testing.assert_allclose(summary["ideal_s"], 0.75 + 1.5)
    np.testing.assert_allclose(summary["wait_fraction"], [1 - 2.0 / 3.0, 1 - 2.5 / 3.0])
    np.testing.assert_allclose(summary["token_max_over_mean"], np.mean([100 / 75, 150 / 100]))


@pytest.mark.slow
def test_demo_runs_end_to_end(capsys):
    from collate.demo import run_demo

    assert run_demo(num_samples=64, train_samples=16) == 0
    out = capsys.readouterr().out
    assert "TokenBalancedBatchSampler" in out and "-> OK" in out


def test_demo_speedup_is_told_only_when_alternating_repeats_agree_beyond_their_noise():
    from collate.demo import alternating_order, speedup_verdict

    assert alternating_order(("d", "t"), 3) == ("d", "t", "t", "d", "d", "t")
    steady = [5.0, 5.0]     # the same samples' total compute, measured equal by a steady machine
    ratio, text = speedup_verdict([10.0, 10.4], [7.0, 7.1], steady, steady)
    assert ratio is not None and abs(ratio - 10.2 / 7.05) < 1e-9 and "as fast as" in text
    # One repeat says faster, the other slower: no speed-up claimed.
    ratio, text = speedup_verdict([10.0, 9.0], [9.5, 9.6], steady, steady)
    assert ratio is None and "too noisy to tell" in text
    # Both say faster, but the same sampler's epoch varied more between repeats than the gap.
    ratio, text = speedup_verdict([10.0, 13.0], [9.5, 12.5], steady, steady)
    assert ratio is None and "too noisy to tell" in text
    # Both say slower, beyond the repeat spread, but the machine measured the same work 1.75x
    # slower during tokenbal's epochs (what a loaded 2-core VM did): no claim, and epoch / ideal (a
    # measured time over a measured time, which moved between runs) is reported, not offered as a
    # prediction.
    ratio, text = speedup_verdict([42.0, 43.0], [55.0, 65.0], [32.0, 33.0], [56.0, 58.0])
    assert ratio is None and "too noisy to tell" in text and "epoch / ideal" in text
    assert "predicts" not in text and "speed" not in text.split("epoch / ideal")[1]
    ratio, text = speedup_verdict([10.0], [8.0], [5.0], [5.0])
    assert ratio is None and "one repeat" in text


def test_the_verdict_reads_no_clock():
    from collate.demo import bound_verdict, token_bound
    from collate.train import StepRecord

    def records(grid, step_s):
        return [StepRecord(step=s, rank=r, samples=1, tokens=t, compute_s=step_s, step_s=step_s, loss=0.0)
                for r, row in enumerate(grid) for s, t in enumerate(row)]

    uneven = [[300, 100], [100, 100]]     # per rank, per step: step 0 waits for rank 0
    even = [[200, 100], [200, 100]]
    # The same batches timed on a fast and on a loaded machine: the same figures.
    for step_s in (0.01, 9.0):
        b, t = token_bound(records(uneven, step_s)), token_bound(records(even, step_s))
        assert b == {"steps": 2, "max_over_mean": 400 / 300, "idle": 0.25}
        assert t == {"steps": 2, "max_over_mean": 1.0, "idle": 0.0}
        text = bound_verdict(b, t)
        assert "1.33x the mean rank's tokens with DistributedSampler and 1.00x with tokenbal" in text
        assert "25% vs 0%" in text and "1.33x less straggling" in text and " steps, tokenbal " not in text
    three = token_bound(records([[100, 100, 100], [100, 100, 100]], 1.0))
    assert "DistributedSampler 2 steps, tokenbal 3" in bound_verdict(b, three)


@pytest.mark.parametrize("config,message", [
    (None, "not a readable config.json"),
    ({"model_type": "bert"}, "model_type 'bert' is not one the demo trains; valid: glm4v"),
])
def test_demo_model_is_a_config_file_not_an_estimator_name(tmp_path, capsys, config, message):
    from tokenbal.cli import main

    path = tmp_path / "config.json"
    if config is not None:
        path.write_text(json.dumps(config))
    assert main(["demo", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenbal demo: error: --model") and message in err and "unknown --model" not in err


@pytest.mark.slow
def test_demo_trains_the_model_of_a_config_json(tmp_path, capsys):
    from tests.helpers.tiny_qwen2_vl import tiny_config
    from tokenbal.cli import main

    cfg = tmp_path / "config.json"
    tiny_config().to_json_file(cfg)
    assert main(["demo", "--model", str(cfg), "--train-samples", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "random Qwen2VL on 2 CPU ranks" in out and "verdict (exact" in out and "-> OK" in out
