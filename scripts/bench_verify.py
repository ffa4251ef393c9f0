"""What issue 33's index checks cost: ``verify``'s invariant pass (``store.index_problems``) on a large
synthetic index, and the reader's per-sample id / range checks (``TokenIndex.members`` / ``shard``)
against the unchecked lookups of the tree before them, loaded from git into the same process.

Run: ``python scripts/bench_verify.py [--rows 2000000] [--baseline-rev df34147]``. Prints medians
(``harness.measure``) and ratios; numbers go to docs/BENCHMARKS.md ("Issue 33").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import numpy as np
from harness import Timing, environment_line, measure, ratio

from tokenbal.index import TokenIndex
from tokenbal.index.build import ShardResult, write_index
from tokenbal.index.store import index_problems

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_index(out: str, rows: int, per_shard: int = 100_000) -> None:
    rng = np.random.default_rng(0)

    def results():
        for start in range(0, rows, per_shard):
            n = min(per_shard, rows - start)
            ones = np.ones(n, np.int64)
            yield ShardResult(
                entry={"path": f"/synthetic/shard-{start // per_shard:05d}.tar", "size": 0, "mtime_ns": 0,
                       "fingerprint": None, "status": "ok", "reason": None, "n_members": n,
                       "n_samples": n, "n_errors": 0},
                keys=[f"{i:09d}" for i in range(start, start + n)], member_counts=ones,
                member_exts=["jpg"] * n, member_offsets=np.arange(n, dtype=np.int64) * 4096,
                member_sizes=np.full(n, 4000, np.int64), image_counts=ones,
                image_wh=np.full((n, 2), 640, np.int64), vision=rng.integers(4, 16384, n),
                text=rng.integers(1, 2000, n), errors=[])

    write_index(out, results(), {"estimator": {"name": "synthetic", "config": {}, "wrapper_tokens": 2},
                                 "text_counter": {"name": "synthetic"}})


def baseline_store(rev: str):
    """``tokenbal/index/store.py`` as it was at ``rev``, imported as its own module."""
    src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:tokenbal/index/store.py"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "store_baseline.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("store_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["store_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--lookups", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline-rev", default="df34147", help="git revision of the unchecked reader")
    args = ap.parse_args()
    print(environment_line())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "idx")
        synthetic_index(out, args.rows)
        idx = TokenIndex.open(out)
        old = baseline_store(args.baseline_rev).TokenIndex(out)
        assert index_problems(idx) == []
        check = measure(lambda: index_problems(idx), repeats=5, warmup=1)
        total = measure(lambda: int(np.asarray(idx.lengths).sum()), repeats=5, warmup=1)
        print(f"index_problems over {args.rows:,} samples: {check.wall_median * 1e3:.0f} ms median "
              f"({check.wall_median / args.rows * 1e9:.0f} ns / sample); summing lengths.npy alone: "
              f"{total.wall_median * 1e3:.1f} ms")
        rows = np.random.default_rng(1).integers(0, args.rows, args.lookups).tolist()

        def lookups(index) -> None:
            for i in rows:
                index.members(i)
                index.shard(i)

        # Interleaved (A B A B ...), so that the load of a shared machine drifts over both alike.
        lookups(idx), lookups(old)
        new_w, old_w = [], []
        for _ in range(args.repeats):
            new_w += measure(lambda: lookups(idx), repeats=1, warmup=0).wall
            old_w += measure(lambda: lookups(old), repeats=1, warmup=0).wall
        new_t, old_t = Timing(wall=new_w, cpu=new_w), Timing(wall=old_w, cpu=old_w)
        def view(index, i):
            return index.shard(i), [(m.name, m.shard, m.offset, m.size) for m in index.members(i)]

        assert all(view(idx, i) == view(old, i) for i in rows[:1000])   # the same answers
        print(f"members(i) + shard(i), {args.lookups:,} random samples: checked "
              f"{new_t.wall_median * 1e3:.0f} ms, unchecked ({args.baseline_rev}) "
              f"{old_t.wall_median * 1e3:.0f} ms median; unchecked / checked time = "
              f"{ratio(old_t.wall_median, new_t.wall_median)}")


if __name__ == "__main__":
    main()
