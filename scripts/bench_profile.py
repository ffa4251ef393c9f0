"""How right `tokenbal profile` is about stragglers, against the work every rank wrote down.

Each run spawns gloo ranks that do a step of matmuls, an all_reduce, a little work and a broadcast,
with one rank late per step (``constant``: always the last rank; ``alternating``: each rank in turn;
``none``), late by doing more work or (``--how sleep``) by sleeping. Every rank records how long it
worked between collectives; the traces are read twice in the same run: from the training thread's
launches (what `tokenbal profile` does) and from the collectives' durations (the previous reading,
``analyze(..., arrivals="durations")``). Printed per scenario: the true arrival skew and straggler
wait against both readings, and the verdict's top row. ``--hog N`` adds N spinning processes.

    python scripts/bench_profile.py --runs 3 --hog 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness import environment_line  # noqa: E402

from tests.helpers.stragglers import STEPS, straggler_rank  # noqa: E402
from tokenbal.launch import run_ranks  # noqa: E402
from tokenbal.profile import analyze, load_traces, verdict  # noqa: E402


def truth(worked: list[dict], world_size: int) -> tuple[float, float]:
    """(median skew of the all_reduce, mean wait per rank-step) from the recorded work."""
    steps = range(1, STEPS + 1)
    w = np.array([[[worked[r][s, j] for r in range(world_size)] for j in (0, 1)] for s in steps])
    skew = float(np.median(w[:, 0].max(axis=1) - w[:, 0].min(axis=1)))
    wait = float((w.max(axis=2, keepdims=True) - w).mean(axis=2).sum(axis=1).mean())
    return skew, wait


def one_run(world_size: int, pattern: str, how: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        worked = run_ranks(straggler_rank, world_size, d, pattern, how, timeout=600, collective_timeout=300)
        traces = load_traces(d)
        now, before = analyze(traces, d), analyze(traces, d, arrivals="durations")
    skew, wait = truth(worked, world_size)

    def reduce_skew(p):
        return next(c.skew_median_s for c in p.collectives if c.kind == "all_reduce")
    return {"skew": skew, "wait": wait, "skew_now": reduce_skew(now), "skew_before": reduce_skew(before),
            "wait_now": now.straggler_wait_s(), "wait_before": before.straggler_wait_s(),
            "unequal_now": now.unequal_work_s(), "top": verdict(now)[0].bottleneck.split(" (")[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    ap.add_argument("--hog", type=int, default=1, help="spinning processes beside the ranks (default 1)")
    ap.add_argument("--scenarios", nargs="*", default=["2:constant:work", "2:alternating:work", "2:none:work",
                                                        "2:alternating:sleep", "4:alternating:work"],
                    help="RANKS:PATTERN:HOW, pattern constant|alternating|none, how work|sleep")
    args = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    try:
        print(environment_line(), f"| {args.hog} CPU hog(s)")
        print(f"{'scenario':22s} {'true skew':>9s} {'now':>13s} {'before':>13s}  {'true wait':>9s} "
              f"{'now':>13s} {'before':>13s}  {'unequal':>7s}  verdict's top row (per run)")
        for spec in args.scenarios:
            ranks, pattern, how = spec.split(":")
            runs = [one_run(int(ranks), pattern, how) for _ in range(args.runs)]

            def col(key, ref, runs=runs, pattern=pattern):
                vals = [r[key] * 1e3 for r in runs]
                errs = [abs(r[key] - r[ref]) / r[ref] for r in runs if r[ref] > 0]
                worst = f"{max(errs):4.0%}" if errs and pattern != "none" else "   -"
                return f"{statistics.median(vals):7.1f} {worst}"
            unequal = statistics.median(r["unequal_now"] / r["wait_now"] if r["wait_now"] > 0 else 0.0
                                        for r in runs)
            print(f"{spec:22s} {statistics.median(r['skew'] for r in runs) * 1e3:9.1f} "
                  f"{col('skew_now', 'skew'):>13s} {col('skew_before', 'skew'):>13s}  "
                  f"{statistics.median(r['wait'] for r in runs) * 1e3:9.1f} "
                  f"{col('wait_now', 'wait'):>13s} {col('wait_before', 'wait'):>13s}  {unequal:7.0%}  "
                  + ", ".join(r["top"] for r in runs))
        print("(ms, medians over runs; the % beside each is the worst run's error against the truth; "
              "unequal: share of the wait read as unequal work)")
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    main()
