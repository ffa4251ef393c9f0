#!/usr/bin/env python3
"""What `tokenbal plan simulate --padded` spends, part by part, before and after the one-pass
baselines, in one process (wall s, median of --repeats runs, alternating before / after):

* DistributedSampler: one real ``DistributedSampler`` + ``BatchSampler`` per rank (before) vs every
  rank's indices from one permutation (``distributed_sampler_plan``, after);
* transformers' BatchRebalanceSampler: its own ``_balance_groups`` (before) vs the array port
  (after), both one pass handing out every rank's part of each step;
* tokenbal's two plans and ``simulate`` (the table printed before the padded one), unchanged.

    python scripts/bench_padded_baselines.py 1000000 512 4096 --repeats 3   # samples, ranks, global batch
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch.utils.data  # noqa: F401  (imported before the clocks start: the before side imports it)

from tokenbal.balance import baselines
from tokenbal.balance.plan import plan_epoch
from tokenbal.balance.simulate import simulate


def _distributed_sampler_per_rank(lens: np.ndarray, R: int, b: int) -> object:
    """The baseline as it was: a real DistributedSampler per rank (each one permutation of the epoch)."""
    from torch.utils.data import BatchSampler, DistributedSampler

    per_rank = []
    for r in range(R):
        ds = DistributedSampler(range(len(lens)), num_replicas=R, rank=r, seed=0)
        ds.set_epoch(0)
        per_rank.append([list(x) for x in BatchSampler(ds, b, drop_last=False)])
    return baselines._plan_from_lists(per_rank, R, 1)


def _batch_rebalance_own(lens: np.ndarray, R: int, b: int) -> object:
    """The baseline as it was: one pass, the class's own _balance_groups."""
    ported = baselines._balance_is_ported
    baselines._balance_is_ported = lambda cls: False
    try:
        return baselines.batch_rebalance_plan(lens, R, b, seed=0)
    finally:
        baselines._balance_is_ported = ported


def _time(run: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", type=int, help="epoch size (uniform lengths 50-3,999, seed 0)")
    parser.add_argument("ranks", type=int)
    parser.add_argument("global_batch", type=int, help="a multiple of ranks")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lens = np.random.default_rng(0).integers(50, 4000, args.samples)
    R, N = args.ranks, args.global_batch
    b = N // R
    pairs = [("DistributedSampler", lambda: _distributed_sampler_per_rank(lens, R, b),
              lambda: baselines.distributed_sampler_plan(lens, R, b)),
             ("BatchRebalanceSampler", lambda: _batch_rebalance_own(lens, R, b),
              lambda: baselines.batch_rebalance_plan(lens, R, b, seed=0))]
    for name, before, after in pairs:
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.repeats):
            t_before, plan_before = _time(before)
            t_after, plan_after = _time(after)
            # the same plan, or the comparison would mean nothing
            assert np.array_equal(plan_before.indices, plan_after.indices)
            assert np.array_equal(plan_before.offsets, plan_after.offsets)
            times["before"].append(t_before)
            times["after"].append(t_after)
        mb, ma = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"{name:22s} before {' / '.join(f'{t:.2f}' for t in times['before'])} s (median {mb:.2f}), "
              f"after {' / '.join(f'{t:.2f}' for t in times['after'])} s (median {ma:.2f}): "
              f"{mb / ma:.1f}x", flush=True)
    for name, run in [("tokenbal, tokens", lambda: plan_epoch(lens, R, global_batch_size=N)),
                      ("tokenbal, padded", lambda: plan_epoch(lens, R, global_batch_size=N, cost="padded")),
                      ("simulate (the first table)", lambda: simulate(lens, R, N)),
                      ("padded_comparison (all)", lambda: baselines.padded_comparison(lens, R, N))]:
        times = [_time(run)[0] for _ in range(args.repeats)]
        print(f"{name:26s} {' / '.join(f'{t:.2f}' for t in times)} s, median {statistics.median(times):.2f}",
              flush=True)


if __name__ == "__main__":
    main()
