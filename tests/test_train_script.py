"""scripts/train_fsdp2.py, the script users start from: argument checks, and (slow) a real torchrun."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_fsdp2.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_fsdp2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stages_need_a_cost_with_a_vision_part():
    with pytest.raises(SystemExit, match="--stages needs --cost flops or fitted"):
        _script().main(["--synthetic", "8", "--stages"])


def test_defaults_and_help():
    args = _script().parse_args(["--synthetic", "8"])
    assert (args.cost, args.repeats, args.stages, args.sampler) == ("tokens", 1, None, "both")
    with pytest.raises(SystemExit):
        _script().parse_args(["--help"])


@pytest.mark.slow
def test_torchrun_two_ranks_fitted_costs_and_repeats(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--synthetic", "40", "--train-samples", "8", "--global-batch-size", "4",
           "--sampler", "both", "--cost", "fitted", "--calibration-batches", "4", "--repeats", "2",
           "--workdir", str(tmp_path / "data"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokenbal is" in done.stdout and "as fast as DistributedSampler" in done.stdout
    assert "vision+language stages" in done.stdout
    fitted = json.loads((out / "stage_costs.json").read_text())
    assert set(fitted) >= {"vision", "language"} and min(fitted["vision"] + fitted["language"]) >= 0
    rows = list(csv.DictReader(open(out / "steps.csv")))
    assert {r["sampler"] for r in rows} == {"distributed", "tokenbal"}
    for kind in ("distributed", "tokenbal"):
        mine = [r for r in rows if r["sampler"] == kind]
        assert len(mine) == 2 * 2          # 8 samples / 4 per step = 2 steps, x 2 ranks (medians of 2)
        assert all(0 <= float(r["vision_s"]) <= float(r["compute_s"]) for r in mine)
    assert (out / "timeline.png").stat().st_size > 0
