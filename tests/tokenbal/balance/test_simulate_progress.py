"""``tokenbal plan simulate`` reports its progress (counted, not timed): the per-step baselines step by
step, the planner's plans one by one, through the CLI's progress bar; ``-q`` silences it."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbal.balance.simulate import simulate
from tokenbal.cli import main


def test_simulate_reports_each_baseline_step_and_each_plan():
    lengths = np.random.default_rng(0).integers(1, 4000, 50)
    reports: list[tuple[int, int, str]] = []
    simulate(lengths, 2, 8, baseline_steps=4, progress=lambda *r: reports.append(r))
    steps = [(i, 4, "LPT steps") for i in range(5)] + [(i, 4, "KK steps") for i in range(5)]
    assert reports == steps + [(0, 1, "plans"), (1, 1, "plans")]
    # the baselines' cap and an epoch shorter than it: the steps there are; with stages, two plans
    reports.clear()
    stages = np.stack([lengths // 3, lengths - lengths // 3], 1)
    simulate(lengths, 2, 8, stages=stages, baseline_steps=None, progress=lambda *r: reports.append(r))
    assert reports[:7] == [(i, 6, "LPT steps") for i in range(7)]
    assert reports[-3:] == [(0, 2, "plans"), (1, 2, "plans"), (2, 2, "plans")]
    reports.clear()
    simulate(lengths, 2, 8, baseline_steps=0, progress=lambda *r: reports.append(r))
    assert reports == [(0, 0, "LPT steps"), (0, 0, "KK steps"), (0, 1, "plans"), (1, 1, "plans")]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    from tokenbal.index import build_index
    from tokenbal.synthetic import make_samples, write_shards

    root = tmp_path_factory.mktemp("simprogress")
    samples = [s for s in make_samples(80, seed=5) if s.kind in ("text_short", "text_long", "icon")]
    return str(build_index(write_shards(samples, str(root / "shards"), 64), root / "idx", progress=False).out)


def test_plan_simulate_draws_the_progress_bar_on_stderr_and_q_silences_it(index_dir, capsys):
    args = ["plan", "simulate", "--index", index_dir, "--world-size", "2", "--global-batch-size", "4"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "simulating" in err and "LPT steps" in err and "KK steps" in err and "plans" in err
    assert "simulating" not in out and "tokenbal plan time" in out
    assert main([*args, "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "tokenbal plan time" in out
