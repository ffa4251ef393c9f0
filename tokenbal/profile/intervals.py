"""Interval arithmetic on (n, 2) arrays of [start, end) microseconds: union, clip, overlap."""

from __future__ import annotations

import numpy as np


def as_intervals(pairs) -> np.ndarray:
    arr = np.asarray(list(pairs), dtype=np.float64).reshape(-1, 2)
    return arr[arr[:, 1] > arr[:, 0]]


def union(iv: np.ndarray) -> np.ndarray:
    """Disjoint, sorted intervals covering the same time."""
    if len(iv) == 0:
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    ends = np.maximum.accumulate(iv[:, 1])
    # a new run starts where an interval begins after everything before it has ended
    starts_run = np.r_[True, iv[1:, 0] > ends[:-1]]
    out = np.empty((int(starts_run.sum()), 2))
    out[:, 0] = iv[starts_run, 0]
    out[:, 1] = ends[np.r_[starts_run[1:], True]]
    return out


def clip(iv: np.ndarray, start: float, end: float) -> np.ndarray:
    if len(iv) == 0:
        return iv.reshape(0, 2)
    out = np.clip(iv, start, end)
    return out[out[:, 1] > out[:, 0]]


def total(iv: np.ndarray) -> float:
    u = union(iv)
    return float((u[:, 1] - u[:, 0]).sum()) if len(u) else 0.0


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Time covered by both ``a`` and ``b``."""
    return total(a) + total(b) - total(np.concatenate([a.reshape(-1, 2), b.reshape(-1, 2)]))
