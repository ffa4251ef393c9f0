"""torchtitan 0.3.0 from the registry (tests/envs/torchtitan.txt): its multimodal data path on 2 gloo
CPU ranks (its tokenizer, cc12m sample processor and collator) through
``tokenbal.integrations.torchtitan.build_dataloader`` over webdataset shards, against its own
``MMDataLoader`` (split by node) on the same shards in the same run: one epoch, every sample once,
exact resume from the per-DP-rank state, and tokenbal's packed collator as the unpadded alternative.
torchtitan's trainer is not run (its Qwen-VL training is GPU-only; see docs/integrations.md)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.dist_utils import free_port
from tests.helpers.envs import env_python
from tests.helpers.paths import REPO

pytestmark = pytest.mark.frameworks

DRIVER = Path(__file__).with_name("torchtitan_driver.py")
ROWS = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    start = time.monotonic()
    python = env_python("torchtitan")
    print(f"torchtitan env ready in {time.monotonic() - start:.0f} s")
    tmp = tmp_path_factory.mktemp("torchtitan")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    prep = subprocess.run([str(python), str(DRIVER), "prepare", str(tmp)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert prep.returncode == 0, prep.stdout[-3000:] + prep.stderr[-6000:]
    start = time.monotonic()
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(DRIVER), str(tmp)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(f"torchtitan data path, 2 ranks: {time.monotonic() - start:.0f} s")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    return [json.loads((tmp / f"titan.rank{r}.json").read_text()) for r in range(2)]


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
