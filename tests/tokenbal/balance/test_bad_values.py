"""Bad per-sample numbers and bad CLI integers: one clear error naming the sample (or option) and
the value as the user gave it, never a value numpy's cast made up or a traceback."""

import re

import numpy as np
import pytest

from tokenbal import TokenBalancedBatchSampler
from tokenbal.balance.cost import resolve_costs, resolve_stage_costs, to_int_costs
from tokenbal.balance.plan import plan_epoch
from tokenbal.balance.simulate import simulate
from tokenbal.cli import main

BIG = 2**64 - 1

BAD_LENGTHS = [
    # value, what the message must say (sample 2 every time)
    (np.array([5, 7, 1e30]), "sample 2 is 1e+30"),
    (np.array([5, 7, BIG], np.uint64), f"sample 2 is {BIG}"),
    (np.array([5, 7, 2**63], np.uint64), f"sample 2 is {2**63}"),
    (np.array([5, 7, -4]), "sample 2 is -4"),
    (np.array([5, 7, -4.0]), "sample 2 is -4.0"),
    (np.array([5.0, 7.0, np.nan]), "sample 2 is nan"),
    (np.array([5.0, 7.0, np.inf]), "sample 2 is inf"),
    ([5, 7, 2**70], f"sample 2 is {2**70}"),
]


@pytest.mark.parametrize("lengths, says", BAD_LENGTHS)
def test_bad_lengths_name_the_sample_and_its_value(lengths, says):
    says = re.escape(says)
    with pytest.raises(ValueError, match=says):
        plan_epoch(lengths, 2, global_batch_size=2)
    with pytest.raises(ValueError, match=says):
        TokenBalancedBatchSampler(lengths, 2, 0, global_batch_size=2)


# Large finite float costs are scaled to ~1e6, not rejected (see the next test).
BAD_COSTS = [(v, says) for v, says in BAD_LENGTHS if "1e+30" not in says]


@pytest.mark.parametrize("costs, says", BAD_COSTS)
def test_bad_costs_name_the_sample_and_its_value(costs, says):
    says = re.escape(says)
    with pytest.raises(ValueError, match=says):
        to_int_costs(costs)
    with pytest.raises(ValueError, match=says):
        resolve_costs([1, 1, 1], np.asarray(costs))
    with pytest.raises(ValueError, match=says):
        TokenBalancedBatchSampler([1, 1, 1], 2, 0, global_batch_size=2, cost=np.asarray(costs))


def test_large_float_costs_are_scaled_and_huge_unsigned_ones_are_not_wrapped():
    assert to_int_costs(np.array([1.0, 2.0, 1e30])).tolist() == [1, 1, 1_000_000]
    # uint64 above int64 used to wrap to -1 silently and plan as a free sample.
    with pytest.raises(ValueError, match=f"costs must fit in int64.*sample 1 is {BIG}"):
        to_int_costs(np.array([3, BIG], np.uint64))


def test_stage_costs_name_the_sample_and_the_stage():
    stages = np.array([[1, 2], [3, BIG]], np.uint64)
    with pytest.raises(ValueError, match=f"stage costs must fit in int64.*sample 1 is {BIG} in stage 1"):
        resolve_stage_costs([1, 2], stages)
    with pytest.raises(ValueError, match="stage costs must be finite; sample 1 is nan in stage 0"):
        resolve_stage_costs([1, 2], np.array([[1.0, 2.0], [np.nan, 1.0]]))


def test_lengths_whose_sum_overflows_int64_are_an_error():
    with pytest.raises(ValueError, match="more than int64 holds"):
        plan_epoch(np.full(4, 2**62), 2, global_batch_size=2)


def test_simulate_checks_its_integers_before_dividing_by_them():
    lengths = np.arange(1, 50)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        simulate(lengths, 0, 8)
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        simulate(lengths, 2, 0)
    with pytest.raises(ValueError, match="baseline_steps must be an integer >= 0"):
        simulate(lengths, 2, 8, baseline_steps=-1)


@pytest.mark.parametrize("option, value, says", [
    ("--world-size", "0", "argument --world-size: must be an integer >= 1, got 0"),
    ("--world-size", "-2", "argument --world-size: must be an integer >= 1, got -2"),
    ("--world-size", "two", "argument --world-size: expected an integer, got 'two'"),
    ("--global-batch-size", "0", "argument --global-batch-size: must be an integer >= 1, got 0"),
    ("--grad-accum", "0", "argument --grad-accum: must be an integer >= 1, got 0"),
    ("--baseline-steps", "-1", "argument --baseline-steps: must be an integer >= 0, got -1"),
    ("--seed", "-3", "argument --seed: must be an integer >= 0, got -3"),
])
def test_plan_simulate_bad_integers_are_usage_errors(option, value, says, capsys, tmp_path):
    args = {"--world-size": "4", "--global-batch-size": "8", option: value}
    argv = ["plan", "simulate", "--index", str(tmp_path / "none"), *(x for kv in args.items() for x in kv)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--ranks", "--train-samples"])
def test_demo_bad_integers_are_usage_errors(option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", option, "0"])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be an integer >= 1, got 0" in capsys.readouterr().err
