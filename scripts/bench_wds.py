"""Reading one rank's share by byte offset vs streaming the shards with plain webdataset.

Per worker (one process, no DataLoader), in the same run:

* ``indexed``: ``IndexedShardDataset`` reads the samples ``TokenBalancedBatchSampler`` gives rank 0
  of ``--ranks`` for one epoch (one ranked read per member, header verified), batch by batch;
* ``webdataset``: ``webdataset.WebDataset`` streams every shard (what a loader that cannot seek
  has to do to see the same samples), the baseline.

Both return raw bytes unless ``--decode pil``. Warm: the shards are read once first. Cold: each
shard's pages are dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each run (no root
needed; on a VM the host may still cache them, so cold numbers are a lower bound on disk latency).
Reports samples/s (median of ``--repeats``) and the ratio indexed / webdataset, plus the time for
the rank's share: indexed reads 1/R of the samples, webdataset streams all of them.

    python scripts/bench_wds.py --samples 2048 --ranks 8 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from harness import environment_line, measure


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_indexed(index, batches: list[list[int]], decode) -> int:
    from tokenbal.data.indexed import IndexedShardDataset

    ds = IndexedShardDataset(index, decode=decode)   # fresh: opening shards is part of the cost
    n = 0
    for b in batches:
        n += len(ds.__getitems__(b))
    ds.close()
    return n


def run_webdataset(shards: list[str], decode) -> int:
    import webdataset as wds

    ds = wds.WebDataset(shards, shardshuffle=False, empty_check=False)
    if decode is not None:
        ds = ds.decode(decode)
    return sum(1 for _ in ds)


def timed_once(fn):
    """``(fn(), wall seconds)`` of one call (no warm-up: the cache state is the point), timed by
    scripts/harness.py like every benchmark."""
    out = []
    timing = measure(lambda: out.append(fn()), repeats=1, warmup=0)
    return out[0], timing.wall[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--per-shard", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode", default=None, help="webdataset image spec, e.g. pil (default: raw bytes)")
    ap.add_argument("--data", default=None, help="folder to write / reuse shards and index in")
    args = ap.parse_args()


    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.index import TokenIndex, build_index
    from tokenbal.synthetic import make_samples, write_shards

    root = args.data or tempfile.mkdtemp(prefix="bench_wds_")
    shard_dir, index_dir = os.path.join(root, "shards"), os.path.join(root, "index")
    if not os.path.isdir(index_dir):
        def write() -> list[str]:
            out = write_shards(make_samples(args.samples, seed=0), shard_dir,
                               samples_per_shard=args.per_shard)
            build_index(out, index_dir, progress=False)
            return out

        shards, dt = timed_once(write)
        print(f"wrote {len(shards)} shards + index in {dt:.1f} s under {root}")
    index = TokenIndex.open(index_dir)
    shards = list(index.shard_paths)
    total_bytes = sum(os.path.getsize(s) for s in shards)
    sampler = TokenBalancedBatchSampler(index, num_replicas=args.ranks, rank=0,
                                        global_batch_size=args.global_batch_size, seed=0)
    batches = list(sampler)
    share = sum(len(b) for b in batches)
    share_bytes = sum(m.size + 512 for b in batches for i in b for m in index.members(i))
    print(f"{len(index)} samples, {len(shards)} shards, {total_bytes / 2**20:.1f} MiB; rank 0 of "
          f"{args.ranks}: {share} samples in {len(batches)} steps, {share_bytes / 2**20:.1f} MiB")

    results: dict[tuple[str, str], list[float]] = {}
    for cache in ("warm", "cold"):
        for _ in range(args.repeats):
            for name in ("indexed", "webdataset"):   # interleaved, so load drift hits both
                if cache == "warm":
                    run_webdataset(shards, None)     # pull everything into the page cache
                else:
                    drop_cache(shards)
                n, dt = timed_once(lambda name=name: run_indexed(index, batches, args.decode)
                                   if name == "indexed" else run_webdataset(shards, args.decode))
                results.setdefault((cache, name), []).append(n / dt)
                results.setdefault((cache, name + "_time"), []).append(dt)

    print(f"\n{'cache':<6}{'reader':<12}{'samples/s (median)':>20}{'min':>10}{'max':>10}"
          f"{'s per epoch (median)':>22}")
    for cache in ("warm", "cold"):
        for name in ("indexed", "webdataset"):
            r = results[(cache, name)]
            print(f"{cache:<6}{name:<12}{statistics.median(r):>20.0f}{min(r):>10.0f}{max(r):>10.0f}"
                  f"{statistics.median(results[(cache, name + '_time')]):>22.3f}")
    print()
    for cache in ("warm", "cold"):
        med = {k: statistics.median(v) for k, v in results.items() if k[0] == cache}
        sps = med[(cache, "indexed")] / med[(cache, "webdataset")]
        ratio_t = (statistics.median(results[(cache, "webdataset_time")])
                   / statistics.median(results[(cache, "indexed_time")]))
        print(f"{cache}: indexed / webdataset samples/s = {sps:.2f}x; time to get rank 0's share: "
              f"webdataset (all shards) / indexed (1/{args.ranks}) = {ratio_t:.2f}x")
    print(f"(decode={args.decode!r}, repeats={args.repeats}; {environment_line()})")


if __name__ == "__main__":
    main()
