"""Padding-free micro-batches (DataCollatorWithFlattening, trl's padding_free): planned with
cost="padded" (count x longest, what the Trainer mixin used for every collator) vs the token cost
(what it uses for them now), both measured by what such a collator runs: each rank's real tokens
per step.

    python scripts/bench_flattening_cost.py

Lengths: 90% short rows (50-399 tokens) and 10% long ones (2,000-7,999), three seeds. Metric per
step: max over ranks / mean over ranks of the step's tokens (1.00 = perfect); printed: the median
and 90th percentile over the epoch's steps, per seed. Every number is measured here; nothing asserted.
"""

from __future__ import annotations

import numpy as np

from tokenbal import TokenBalancedBatchSampler


def ratios(lengths: np.ndarray, ranks: int, batch: int, cost: str | None, seed: int) -> np.ndarray:
    kw = {} if cost is None else {"cost": cost}
    steps = [list(TokenBalancedBatchSampler(lengths, num_replicas=ranks, rank=r, global_batch_size=batch,
                                            seed=seed, **kw)) for r in range(ranks)]
    tokens = np.array([[lengths[b].sum() for b in rank_steps] for rank_steps in steps])
    return tokens.max(0) / tokens.mean(0)


def main() -> None:
    for ranks, batch in ((4, 32), (8, 64)):
        for seed in range(3):
            rng = np.random.default_rng(seed)
            lengths = np.concatenate([rng.integers(50, 400, 9000), rng.integers(2000, 8000, 1000)])
            line = [f"ranks {ranks} batch {batch} seed {seed}:"]
            for cost in ("padded", None):
                r = ratios(lengths, ranks, batch, cost, seed)
                line.append(f"{cost or 'tokens'} median {np.median(r):.3f} p90 {np.percentile(r, 90):.3f}")
            print("  ".join(line))


if __name__ == "__main__":
    main()
