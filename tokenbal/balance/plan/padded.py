"""Padded mode (``cost="padded"``): steps composed for ``count × longest`` per micro-batch by
:func:`tokenbal.balance.partition.padded.plan_padded`, laid out as an :class:`EpochPlan`."""

from __future__ import annotations

import numpy as np

from tokenbal.balance.plan.common import EpochPlan, _count_steps, default_window


def _plan_epoch_padded(lens: np.ndarray, R: int, N: int, *, seed: int, epoch: int, shuffle: bool,
                      drop_last: bool, window: int | None, grad_accum: int) -> EpochPlan:
    """:func:`plan_epoch` for ``cost="padded"`` (same guarantees: exactly N samples per step but a
    merged tail, every sample once, no empty rank when n >= R·k); the steps from
    :func:`tokenbal.balance.partition.padded.plan_padded`."""
    from tokenbal.balance.partition.padded import plan_padded

    k = int(grad_accum)
    rng = np.random.default_rng([seed, epoch])
    n = len(lens)
    perm = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    caps, kept = _count_steps(n, N, R * k, drop_last)
    dropped = np.sort(perm[kept:])
    perm = perm[:kept]
    W = min(window or default_window(R * k, N), max(1, len(caps)))
    if window is None and len(caps):
        W = -(-len(caps) // max(1, len(caps) // W))      # equal windows, as plan_epoch's count mode
    perm, slot, S = plan_padded(lens, perm, caps, R, k, W, rng if shuffle else None)
    order = np.lexsort((perm, slot))
    offsets = np.zeros(int(S) * R * k + 1, np.int64)
    np.cumsum(np.bincount(slot, minlength=int(S) * R * k), out=offsets[1:])
    return EpochPlan(num_replicas=R, indices=perm[order].astype(np.int64), offsets=offsets,
                     dropped=dropped.astype(np.int64), grad_accum=k)
