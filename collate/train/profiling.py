"""Timing a rank's own compute, apart from the collectives that make it wait for the slowest rank.

- :func:`solo_compute_time` / :func:`solo_stage_times`: a micro-batch's forward + backward timed on
  an unsharded replica with no collective in it. Under FSDP every collective waits for the slowest
  rank, so the time a rank spends *computing* cannot be read off its own step; the replica gives
  it, and ``wait = step time - compute`` is then what the straggler costs that rank.
- :func:`calibration_batches` / :func:`profile_stage_costs`: timed micro-batches for
  :meth:`tokenbal.balance.cost.StageCostModel.fit`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["calibration_batches", "profile_stage_costs", "solo_compute_time", "solo_stage_times",
           "synchronize"]


def solo_compute_time(replica: nn.Module, batch) -> float:
    """Seconds this micro-batch's forward + backward take on an unsharded ``replica``."""
    return solo_stage_times(replica, batch)[0]


def solo_stage_times(replica: nn.Module, batch) -> tuple[float, float]:
    """(total, vision tower) seconds of this micro-batch's forward + backward on ``replica``.

    The vision part is timed with hooks: its forward from the tower's pre-hook to its output, its
    backward from the moment the gradient reaches the tower's output to the end of ``backward()``
    (the tower is the first module of the forward, so it is the last of the backward). Under FSDP
    every layer's all-gather synchronises the ranks, so the vision and the language stages each
    wait for their own slowest rank; these two numbers show that.
    """
    device = next(replica.parameters()).device
    visual = getattr(getattr(replica, "model", None), "visual", None)
    marks: dict[str, float] = {}
    handles = []
    if visual is not None:
        def before(module, args, kwargs):
            marks["vf0"] = _now(device)

        def after(module, args, kwargs, out):
            marks["vf1"] = _now(device)
            tensor = out.pooler_output if hasattr(out, "pooler_output") else out
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: marks.__setitem__("vb0", _now(device)))

        handles = [visual.register_forward_pre_hook(before, with_kwargs=True),
                   visual.register_forward_hook(after, with_kwargs=True)]
    try:
        synchronize(device)
        t0 = time.perf_counter()
        replica(**batch).loss.backward()
        synchronize(device)
        t1 = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    replica.zero_grad(set_to_none=True)
    vision = 0.0
    if "vf1" in marks:
        vision = marks["vf1"] - marks["vf0"] + (t1 - marks["vb0"] if "vb0" in marks else 0.0)
    return t1 - t0, vision


def calibration_batches(candidates: Sequence[int], num_batches: int, max_samples: int = 4, seed: int = 0
                        ) -> list[list[int]]:
    """``num_batches`` micro-batches of 1..``max_samples`` samples drawn from ``candidates``.

    Varying the batch size is what lets :meth:`tokenbal.balance.cost.StageCostModel.fit` tell the
    per-sample cost from the per-batch constant.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = np.asarray(candidates, np.int64)
    if not len(pool):
        raise ValueError("no samples to calibrate on")
    sizes = rng.integers(1, max_samples + 1, num_batches)
    return [sorted(rng.choice(pool, min(int(k), len(pool)), replace=False).tolist()) for k in sizes]


def profile_stage_costs(replica: nn.Module, collator, dataset, features, batches: Sequence[Sequence[int]],
                        repeats: int = 3):
    """Time each micro-batch of ``batches`` on ``replica`` (forward + backward, vision and language
    apart, median of ``repeats``). Returns ``(batch_features (B, 2, 3), batch_seconds (B, 2))`` for
    :meth:`tokenbal.balance.cost.StageCostModel.fit`; ``features`` is
    :func:`tokenbal.balance.cost.stage_features` of the dataset's index."""
    import numpy as np

    feats = np.zeros((len(batches), 2, 3))
    secs = np.zeros((len(batches), 2))
    for b, idx in enumerate(batches):
        batch = collator([dataset[i] for i in idx])
        if b == 0:
            solo_stage_times(replica, batch)    # warm-up: allocator, lazy initialisation
        times = np.array([solo_stage_times(replica, batch) for _ in range(repeats)])
        total, vision = np.median(times, 0)
        feats[b] = np.asarray(features)[list(idx)].sum(0)
        secs[b] = vision, total - vision
    return feats, secs


def _now(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
