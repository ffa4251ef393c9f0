"""`tokenbal profile --json`: every table of the report as plain JSON-ready values (seconds, counts).

NaN (a quantity with nothing to measure, e.g. the overlap of a step without communication)
becomes ``None``, so the output is strict JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from tokenbal.profile.analysis import RunProfile
from tokenbal.profile.report import verdict

SCHEMA = 1


def _clean(value):
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def profile_as_dict(p: RunProfile) -> dict:
    """The run's summary, per-rank-and-step rows, collectives and verdict."""
    steps = [dict(asdict(s), overlap=s.overlap, jitter_wait_s=s.jitter_wait_s) for s in p.steps]
    return _clean({
        "schema": SCHEMA,
        "source": p.source,
        "ranks": p.ranks,
        "world_size": p.world_size,
        "missing_ranks": p.missing_ranks,
        "files": p.files,
        "device": p.device,
        "arrival_source": p.arrival_source,
        "work_from_shapes": p.work_from_shapes,
        "has_python_stacks": p.has_python_stacks,
        "packed_model": p.packed_model,
        "summary": {"steps": len(p.per_step()), "mean_step_s": p.mean_step_s(),
                    "straggler_wait_s": p.straggler_wait_s(), "unequal_work_wait_s": p.unequal_work_s(),
                    "jitter_wait_s": p.jitter_s(), "compute_imbalance": p.compute_imbalance()},
        "steps": steps,
        "collectives": [asdict(c) for c in p.collectives],
        "verdict": [asdict(v) for v in verdict(p)],
        "notes": list(p.notes),
    })


def compare_as_dict(a: RunProfile, b: RunProfile) -> dict:
    """Both runs in full, and how much faster B's mean step is than A's."""
    ratio = a.mean_step_s() / b.mean_step_s() if b.mean_step_s() > 0 else float("nan")
    return _clean({"schema": SCHEMA, "a": profile_as_dict(a), "b": profile_as_dict(b),
                   "speedup_b_over_a": ratio})
