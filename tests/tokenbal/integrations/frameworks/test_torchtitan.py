"""torchtitan 0.3.0 from the registry (tests/envs/torchtitan.txt): its multimodal data path on 2 gloo
CPU ranks (its tokenizer, cc12m sample processor and collator) through
``tokenbal.integrations.torchtitan.build_dataloader`` over webdataset shards, against its own
``MMDataLoader`` (split by node) on the same shards in the same run: one epoch, every sample once,
exact resume from the per-DP-rank state, and tokenbal's packed collator as the unpadded alternative.
torchtitan's trainer is not run (its Qwen-VL training is GPU-only; see docs/integrations.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import frameworks as fw

pytestmark = pytest.mark.frameworks

DRIVER = Path(__file__).with_name("torchtitan_driver.py")
ROWS = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchtitan")
    env = {**fw.driver_environ(), "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    python = fw.prepared_env("torchtitan", DRIVER, tmp, env)
    return fw.driver_on_ranks(python, DRIVER, tmp, env, "titan")


def test_one_epoch_every_sample_once_same_steps(run):
    assert len(run[0]["tokenbal"]) == len(run[1]["tokenbal"])
    assert sorted(i for r in run for s in r["tokenbal"] for i in s["rows"]) == list(range(ROWS))


def test_balance_against_torchtitans_own_loader(run):
    def imbalance(steps0, steps1):
        ratios = [max(a, b) / ((a + b) / 2) for a, b in zip(steps0, steps1, strict=False)]
        return sum(ratios) / len(ratios)

    tb = imbalance([s["real"] for s in run[0]["tokenbal"]], [s["real"] for s in run[1]["tokenbal"]])
    native = imbalance(run[0]["native"], run[1]["native"])
    packed = imbalance(run[0]["packed_real"], run[1]["packed_real"])
    steps = (len(run[0]["tokenbal"]), len(run[0]["native"]), len(run[1]["native"]))
    print(f"busiest/mean real tokens per step: tokenbal {tb:.4f} (packed {packed:.4f}), torchtitan "
          f"MMDataLoader {native:.4f}; steps tokenbal {steps[0]}, MMDataLoader {steps[1]} / {steps[2]}")
    assert tb < native and packed < native


def test_resume_from_the_per_dp_rank_state(run):
    for r in run:
        assert [s["rows"] for s in r["resumed"]] == [s["rows"] for s in r["tokenbal"][1:]]


def test_index_lengths_against_torchtitans_processed_lengths(run):
    seen = {i: n for r in run for s in r["tokenbal"] for i, n in zip(s["rows"], s["lengths"], strict=True)}
    diff = [run[0]["index_lengths"][i] - seen[i] for i in range(ROWS)]
    print(f"index - torchtitan tokens per sample: {diff}")
    assert max(abs(d) for d in diff) <= 4
