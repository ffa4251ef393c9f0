"""Per-step records of a training run and their summary: epoch time, straggler overhead and each
rank's wait fraction (what ``tokenbal demo`` and ``scripts/train_fsdp2.py`` print)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["StepRecord", "median_records", "summarise"]


@dataclass(frozen=True)
class StepRecord:
    step: int
    rank: int
    samples: int
    tokens: int
    compute_s: float  # this rank's own compute (solo replica), or NaN when not measured
    step_s: float  # barrier to barrier: the same on every rank up to clock noise
    loss: float
    vision_s: float = float("nan")  # the vision tower's part of compute_s


def median_records(repeats: Sequence[Sequence[StepRecord]]) -> list[StepRecord]:
    """One record per (step, rank): the median step, compute and vision times over repeated epochs
    of the same batches (tokens, samples and loss from the first)."""
    import statistics

    by_key: dict[tuple[int, int], list[StepRecord]] = {}
    for records in repeats:
        for r in records:
            by_key.setdefault((r.step, r.rank), []).append(r)
    out = []
    for key in sorted(by_key):
        rs = by_key[key]
        if len({(r.tokens, r.samples) for r in rs}) > 1:
            raise ValueError(f"step {key[0]} rank {key[1]} got different batches in repeated epochs")
        out.append(replace(rs[0], step_s=statistics.median(r.step_s for r in rs),
                           compute_s=statistics.median(r.compute_s for r in rs),
                           vision_s=statistics.median(r.vision_s for r in rs)))
    return out


def summarise(records: Sequence[StepRecord]) -> dict:
    """Epoch time, straggler overhead and each rank's wait fraction from every rank's records."""
    import numpy as np

    ranks = sorted({r.rank for r in records})
    steps = sorted({r.step for r in records})
    grid = {(r.rank, r.step): r for r in records}
    step_s = np.array([[grid[q, s].step_s for s in steps] for q in ranks])
    compute = np.array([[grid[q, s].compute_s for s in steps] for q in ranks])
    tokens = np.array([[grid[q, s].tokens for s in steps] for q in ranks])
    vision = np.array([[grid[q, s].vision_s for s in steps] for q in ranks])
    step_time = step_s.max(0)  # a step ends when its slowest rank ends
    ideal = compute.mean(0)  # perfect balance: the step's total compute spread evenly
    # Under FSDP the vision tower and the language model each wait for their own slowest rank.
    stages = vision.max(0) + (compute - vision).max(0)
    return dict(
        steps=len(steps),
        epoch_s=float(step_time.sum()),
        ideal_s=float(ideal.sum()),
        slowest_s=float(compute.max(0).sum()),
        stages_s=float(stages.sum()),
        step_over_ideal=float(step_time.sum() / ideal.sum()),
        token_max_over_mean=float(np.mean(tokens.max(0) / np.maximum(tokens.mean(0), 1e-9))),
        compute_s=compute.sum(1).tolist(),
        wait_fraction=(1.0 - compute.sum(1) / step_time.sum()).clip(0).tolist(),
    )
