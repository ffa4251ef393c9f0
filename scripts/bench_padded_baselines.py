#!/usr/bin/env python3
"""What `tokenbal plan simulate --padded` spends, part by part (CPU s): the DistributedSampler and
transformers' BatchRebalanceSampler baselines, tokenbal's plans, and the whole comparison.

    python scripts/bench_padded_baselines.py 1000000 512 4096    # samples, ranks, global batch
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenbal.balance.baselines import batch_rebalance_plan, distributed_sampler_plan, padded_comparison
from tokenbal.balance.plan import plan_epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", type=int, help="epoch size (uniform lengths 50-3,999, seed 0)")
    parser.add_argument("ranks", type=int)
    parser.add_argument("global_batch", type=int, help="a multiple of ranks")
    args = parser.parse_args()
    lens = np.random.default_rng(0).integers(50, 4000, args.samples)
    R, N = args.ranks, args.global_batch
    parts = [("DistributedSampler", lambda: distributed_sampler_plan(lens, R, N // R)),
             ("batch_rebalance (one pass)", lambda: batch_rebalance_plan(lens, R, N // R, seed=0)),
             ("tokenbal, tokens", lambda: plan_epoch(lens, R, global_batch_size=N)),
             ("tokenbal, padded", lambda: plan_epoch(lens, R, global_batch_size=N, cost="padded")),
             ("padded_comparison (all)", lambda: padded_comparison(lens, R, N))]
    for name, run in parts:
        start = time.process_time()
        run()
        print(f"{name:28s} {time.process_time() - start:8.1f} s CPU", flush=True)


if __name__ == "__main__":
    main()
