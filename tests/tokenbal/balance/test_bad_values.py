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

SIMULATE = "tokenbal plan simulate: error: "   # the CLI's error prefix names the command

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
    # Stage costs each below int64 whose sums are not: refused as the scalar costs are, not planned on
    # wrapped (negative) sums.
    with pytest.raises(ValueError, match=r"stage costs sum to 5.53e\+19, more than int64 holds"):
        plan_epoch(np.full(6, 100), 2, global_batch_size=2, stages=np.full((6, 2), 2**62))


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


# --- issue 51: settings that cannot work are refused when they are set --------------------------------

@pytest.mark.parametrize("setting, value", [("global_batch_size", 99999999999999999999),
                                            ("global_batch_size", 2**62), ("max_tokens_per_rank", 2**62),
                                            ("max_tokens_per_rank", 2**63)])
def test_huge_batch_sizes_and_budgets_are_refused_at_construction(setting, value):
    with pytest.raises(ValueError, match=rf"^{setting} must be below 2\*\*62 \(4611686018427387904\), "
                                         rf"got {value}: larger than any data set"):
        TokenBalancedBatchSampler(np.arange(1, 20), num_replicas=2, rank=0, **{setting: value})
    ok = TokenBalancedBatchSampler(np.arange(1, 20), num_replicas=2, rank=0, **{setting: 2**62 - 1})
    assert sum(len(b) for b in ok) > 0


def test_plan_simulate_huge_global_batch_is_one_line_before_the_index(capsys, tmp_path):
    code = main(["plan", "simulate", "--index", str(tmp_path / "none"), "--world-size", "2",
                 "--global-batch-size", "99999999999999999999"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (SIMULATE + "global_batch_size must be below 2**62 (4611686018427387904), got "
                   "99999999999999999999: larger than any data set, and the planner's int64 arithmetic would "
                   "overflow\n")


def test_padded_cost_with_a_token_budget_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"cost='padded' plans fixed-size padded batches"):
        TokenBalancedBatchSampler(np.arange(1, 20), num_replicas=2, rank=0, max_tokens_per_rank=100,
                                  cost="padded")


@pytest.mark.parametrize("change, says", [
    (lambda s: [1, 2], "a list, not a dict"),
    (lambda s: {**s, "seed": "x"}, "state['seed'] is 'x', not an integer"),
    (lambda s: {**s, "cursor": [1]}, "state['cursor'] is [1], not an integer >= 0"),
    (lambda s: {**s, "epoch": -1}, "state['epoch'] is -1, not an integer >= 0"),
    (lambda s: {**s, "epoch": True}, "state['epoch'] is True, not an integer >= 0"),
    (lambda s: {**s, "fingerprint": None}, "state['fingerprint'] is None, not a dict"),
    (lambda s: {**s, "segments": 5}, "state['segments'] is 5, not a list"),
    (lambda s: {**s, "segments": [{"x": 1}]}, "state['segments'][0] is {'x': 1}, not {'fingerprint'"),
    (lambda s: {**s, "segments": [{"fingerprint": {}, "cursor": "2"}]},
     "state['segments'][0]['cursor'] is '2', not an integer >= 0"),
])
def test_malformed_sampler_states_name_the_key(change, says):
    sampler = TokenBalancedBatchSampler(np.arange(1, 20), num_replicas=2, rank=0, global_batch_size=4)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="^not a TokenBalancedBatchSampler state: " + re.escape(says)):
        sampler.load_state_dict(change(state))
    sampler.load_state_dict(state)     # the good one still loads


def test_sampler_seed_and_epoch_are_checked_not_truncated():

    lengths = np.arange(1, 9)
    for seed in (1.5, "3", True, -1):
        with pytest.raises(ValueError, match=rf"seed must be an integer >= 0, got {seed!r}"):
            TokenBalancedBatchSampler(lengths, global_batch_size=4, seed=seed)
    sampler = TokenBalancedBatchSampler(lengths, global_batch_size=4, seed=np.int64(3))
    sampler.set_epoch(2.0)                  # a loop's float epoch that is an integer
    assert sampler.epoch == 2
    for epoch in (1.7, -1, "2", True):
        with pytest.raises(ValueError, match=rf"epoch must be an integer >= 0, got {epoch!r}"):
            sampler.set_epoch(epoch)
    assert sampler.epoch == 2


def test_sampler_settings_without_a_rank_outside_torch_distributed():
    from tokenbal.balance.settings import PlanSettings

    lengths = np.arange(1, 9)
    one = TokenBalancedBatchSampler(lengths, settings=PlanSettings(num_replicas=1, global_batch_size=4))
    assert (one.rank, one.num_replicas, len(one)) == (0, 1, 2)
    with pytest.raises(ValueError, match=r"settings has num_replicas=2, and no rank was given while "
                                         r"torch.distributed is not initialised: pass rank="):
        TokenBalancedBatchSampler(lengths, settings=PlanSettings(num_replicas=2, global_batch_size=4))
    assert TokenBalancedBatchSampler(lengths, settings=PlanSettings(num_replicas=2, global_batch_size=4),
                                     rank=1).rank == 1
