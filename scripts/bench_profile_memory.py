"""Peak memory of `tokenbal profile` on large traces (issue 51): each rank's trace is read and reduced
before the next, so the peak is that of reading one trace, not of all of them.

Traces: a real 2-rank gloo run traced with torch.profiler (``tests.helpers.stragglers``), each
rank's events repeated (times and step numbers shifted) until the file holds ``--mb`` MB. Printed:
the files' size, the peak RSS of ``json.load`` of one of them alone, and of ``profile_run`` over
the folder, each in a fresh process (``ru_maxrss``). ``--code DIR`` reads with the tokenbal of
another checkout (e.g. the tree before the change) for comparison.

    python scripts/bench_profile_memory.py --mb 84 [--ranks 2] [--code /path/to/older/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness import environment_line  # noqa: E402

from tests.helpers.stragglers import straggler_rank  # noqa: E402
from tokenbal.launch import run_ranks  # noqa: E402

MEASURE = """
import json, resource, sys
what, path = sys.argv[1], sys.argv[2]
if what == "load":
    with open(path) as f:
        json.load(f)
else:
    from tokenbal.profile import profile_run
    p = profile_run(path)
    assert len(p.ranks) == int(sys.argv[3]), p.ranks
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def span_us(path: str) -> float:
    with open(path) as f:
        xs = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    return max(float(e["ts"]) + float(e.get("dur", 0)) for e in xs) - min(float(e["ts"]) for e in xs)


def grow(src: str, dst: str, rank: int, mb: float, span: float) -> None:
    """``src``'s events repeated until ``dst`` holds ``mb`` MB, each copy ``span`` µs after the last."""
    with open(src) as f:
        data = json.load(f)
    events = data["traceEvents"]
    unit = len(json.dumps(events))
    out = []
    for k in range(max(1, int(mb * 1e6 / unit))):
        for e in events:
            e2 = dict(e)
            if e2.get("ph") == "X" and "ts" in e2:
                e2["ts"] = float(e2["ts"]) + k * (span + 1000)
                if str(e2.get("name", "")).startswith("ProfilerStep#"):
                    e2["name"] = f"ProfilerStep#{int(e2['name'].split('#')[1]) + 10 * k}"
            out.append(e2)
    data["traceEvents"] = out
    data["distributedInfo"] = {**data["distributedInfo"], "rank": rank}
    with open(dst, "w") as f:
        json.dump(data, f)


def peak_mb(code: str, *args: str) -> int:
    env = {**os.environ, "PYTHONPATH": code}
    # cwd: not this checkout, which `python -c` would put first on sys.path
    done = subprocess.run([sys.executable, "-c", MEASURE, *args], env=env, capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(args[1]))
    return int(done.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=84, help="size of each rank's trace (default 84)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks traced (default 2)")
    ap.add_argument("--code", default=ROOT, help="the checkout whose tokenbal reads the traces")
    args = ap.parse_args()
    print(environment_line())
    with tempfile.TemporaryDirectory() as d:
        small, big = os.path.join(d, "small"), os.path.join(d, "big")
        os.makedirs(small)
        os.makedirs(big)
        run_ranks(straggler_rank, args.ranks, small, "constant", "work", 2, timeout=600,
                  collective_timeout=300)
        sources = [os.path.join(small, f"rank{r}.json") for r in range(args.ranks)]
        span = max(span_us(p) for p in sources)
        for r, src in enumerate(sources):
            grow(src, os.path.join(big, f"rank{r}.json"), r, args.mb, span)
        sizes = [os.path.getsize(os.path.join(big, f"rank{r}.json")) / 1e6 for r in range(args.ranks)]
        print(f"{args.ranks} traces of {min(sizes):.0f}-{max(sizes):.0f} MB")
        one = peak_mb(args.code, "load", os.path.join(big, f"rank{sizes.index(max(sizes))}.json"))
        print(f"json.load of the largest trace alone: peak RSS {one} MB")
        print(f"profile_run over all ({args.code}): peak RSS "
              f"{peak_mb(args.code, 'profile', big, str(args.ranks))} MB")


if __name__ == "__main__":
    main()
