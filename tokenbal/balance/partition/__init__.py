"""Bin packing: split item costs into bins with near-equal sums.

* :mod:`.solvers` — one problem (:func:`partition`: LPT, Karmarkar–Karp, CP-SAT; a swap polish;
  first-fit decreasing for a capacity);
* :mod:`.window` — many windows of steps × ranks at once (:func:`fill_windows`, the planner's fill);
* :mod:`.grouped` — one large window in a few sorts (:func:`grouped_fill`, the count-mode fill;
  :func:`grouped_stage_fill`, the same for steps of K stages);
* :mod:`.stages` — steps of K synchronised stages (``Σ_stage max_rank``): refinement inside a step
  swaps between the steps of a window, leveling swaps among many steps' bins, and the heaviest steps
  composed again from their pooled samples;
* :mod:`.compose` — which samples share a step, by their stage-cost vectors (stage mode).
* :mod:`.padded` — steps for padding collators (``cost="padded"``: ``count × longest`` per micro-batch).
"""

from tokenbal.balance.partition.grouped import grouped_fill, grouped_stage_fill
from tokenbal.balance.partition.solvers import (
    METHODS,
    bin_loads,
    first_fit_decreasing,
    partition,
    refine_partition,
)
from tokenbal.balance.partition.stages import (
    level_stage_bins,
    pool_heaviest_steps,
    refine_stages,
    refine_stages_many,
    stage_objective,
    swap_stages_across_steps,
)
from tokenbal.balance.partition.window import fill_windows

__all__ = ["METHODS", "partition", "refine_partition", "refine_stages", "refine_stages_many",
           "swap_stages_across_steps", "stage_objective", "bin_loads", "fill_windows", "grouped_fill",
           "grouped_stage_fill", "first_fit_decreasing", "level_stage_bins", "pool_heaviest_steps"]
