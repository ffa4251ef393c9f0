"""Deprecated old import path of :mod:`tokenbal.balance.plan` and :mod:`tokenbal.balance.simulate`
(removed in tokenbal 0.3.0): the public names of both, as the single-file planner had them. Import
them from :mod:`tokenbal.balance.plan` (planning) and :mod:`tokenbal.balance.simulate` (metrics,
the simulator) instead; module-level settings are only read from the mode modules of
:mod:`tokenbal.balance.plan`."""

import warnings

from tokenbal.balance.plan import (
    PLAN_VERSION,
    EpochPlan,
    check_lengths,
    check_settings,
    default_window,
    plan_epoch,
)
from tokenbal.balance.simulate import (
    Simulation,
    balance_summary,
    count_sharded_step_tokens,
    per_step_partition_tokens,
    plan_stage_costs,
    simulate,
    step_balance,
    step_lower_bound,
    step_stage_balance,
)

__all__ = ["PLAN_VERSION", "EpochPlan", "Simulation", "balance_summary", "check_lengths", "check_settings",
           "count_sharded_step_tokens", "default_window", "per_step_partition_tokens", "plan_epoch",
           "plan_stage_costs", "simulate", "step_balance", "step_lower_bound", "step_stage_balance"]

# stacklevel=2: the warning names the importing line (the import system's own frames are skipped).
warnings.warn("tokenbal.plan is deprecated and will be removed in tokenbal 0.3.0; import "
              "tokenbal.balance.plan (planning) or tokenbal.balance.simulate (metrics, simulate)",
              DeprecationWarning, stacklevel=2)
