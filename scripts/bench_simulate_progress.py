"""What ``tokenbal plan simulate``'s progress reports cost, and what the resume fingerprint's sample-key
digest (``samples_sha256``) costs: ``simulate`` on 1,000,000 log-normal lengths over 512 ranks with and
without a progress callable (alternating, 3 runs each), and the digest of 1,000,000 keys (5 runs).

Run: ``PYTHONPATH=. python scripts/bench_simulate_progress.py``. Prints medians; numbers go to
docs/BENCHMARKS.md ("plan simulate progress and the sample-key digest").
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from tokenbal.balance.sampler import _sample_keys_digest
from tokenbal.balance.simulate import simulate
from tokenbal.index.store import KeyList


class _Keys:
    """What the digest reads of a TokenIndex: keys, shard ids, shard paths."""

    def __init__(self, n: int) -> None:
        keys = [f"shard{i // 1000:05d}/{i:09d}".encode() for i in range(n)]
        offsets = np.zeros(n + 1, np.int64)
        offsets[1:] = np.cumsum([len(k) for k in keys])
        self.keys = KeyList(np.frombuffer(b"".join(keys), np.uint8), offsets)
        self.shard_ids = np.arange(n) // 1000
        self.shard_paths = [f"/data/shard-{i:05d}.tar" for i in range(-(-n // 1000))]


def main() -> None:
    lengths = np.random.default_rng(0).lognormal(7, 1, 1_000_000).astype(np.int64) + 1
    reports: list[int] = []
    runs: dict[str, list[float]] = {"no progress": [], "progress": []}
    for _ in range(3):
        for mode in runs:
            report = None if mode == "no progress" else (lambda done, total, unit: reports.append(done))
            t0 = time.perf_counter()
            simulate(lengths, 512, 4096, progress=report)
            runs[mode].append(time.perf_counter() - t0)
    for mode, times in runs.items():
        print(f"simulate 1M samples / 512 ranks / batch 4096, {mode}: "
              f"{' / '.join(f'{t:.2f}' for t in times)} s, median {statistics.median(times):.2f} s")
    print(f"progress reports per run: {len(reports) // 3}")
    keys = _Keys(1_000_000)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        _sample_keys_digest(keys)
        times.append(time.perf_counter() - t0)
    print(f"samples_sha256 of 1M keys ({int(keys.keys._off[-1]) / 1e6:.0f} MB): median "
          f"{statistics.median(times) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
