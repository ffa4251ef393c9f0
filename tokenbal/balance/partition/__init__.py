"""Bin packing: split item costs into bins with near-equal sums (see :mod:`.solvers`)."""

from tokenbal.balance.partition.solvers import (
    METHODS,
    bin_loads,
    fill_windows,
    first_fit_decreasing,
    partition,
    refine_partition,
    refine_stages,
    refine_stages_many,
    stage_objective,
    swap_stages_across_steps,
)

__all__ = ["METHODS", "partition", "refine_partition", "refine_stages", "refine_stages_many",
           "swap_stages_across_steps", "stage_objective", "bin_loads", "fill_windows",
           "first_fit_decreasing"]
