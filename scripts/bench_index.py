"""Benchmark ``tokenbal index build`` against the decode-and-process path, and ``TokenIndex.open``.

For each image format (JPEG, PNG, WebP) it writes one webdataset shard (one image + a caption per
sample, photo-like sizes from 200 px to 1280 px), then in the same process:

* index: ``build_index([shard], model="qwen2-vl")`` in one process with the heuristic text
  counter, end to end (scan, token counts, writing the folder): samples/s per core;
* baseline: what a pipeline without an index does to learn the same numbers — stream the shard
  with ``tarfile``, decode every image with PIL (``convert("RGB")``), run transformers'
  ``Qwen2VLImageProcessorPil`` (official Qwen2-VL pixel limits) to get ``image_grid_thw``, count the
  text with the same counter: samples/s per core on the first ``--baseline`` samples;
* the ratio, and a check that both give the same vision tokens for every baseline sample;
* the index build with its fast paths switched off (``tarfile`` listing, Pillow for JPEG headers,
  64 KiB first read: the committed implementation before the speed-up), to show what they buy.

Then it writes a synthetic index of ``--open-rows`` samples (``write_index``, no shards) and times
``TokenIndex.open`` (median of 5) and a first full pass over ``lengths``.

    python scripts/bench_index.py [--samples 2000] [--baseline 150] [--open-rows 10000000]

``--remote``: instead, index shards served over HTTP by a loopback server (``tests.helpers.servers``)
that delays every request by ``--latency-ms`` (default 20) and optionally caps each connection at
``--mbps``: the ranged build (tar headers and image heads only, ``--inflight`` shards at a time) vs the
same build with one request per header missed (``read_through=0``, the walk before it read through
small members) and downloading every whole object first, in the same process; samples/s, requests,
MB read, and a check that all give the same index.

    PYTHONPATH=. python scripts/bench_index.py --remote [--shards 16] [--samples 150] [--mbps 50]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import statistics
import tarfile
import tempfile
import time

import numpy as np
from harness import environment_line, measure
from PIL import Image

from tokenbal.estimate import get_estimator, get_text_counter
from tokenbal.index import TokenIndex, build_index
from tokenbal.index.build import ShardResult, write_index

SIZES = [(320, 240), (640, 480), (800, 600), (1024, 768), (1280, 720), (448, 448), (1000, 300),
         (200, 800), (512, 384), (960, 540)]
WORDS = "a photo of the red cat sitting next to an old wooden door in the bright afternoon sun".split()
FORMATS = {"jpg": {"format": "JPEG", "quality": 85}, "png": {"format": "PNG"},
           "webp": {"format": "WEBP", "quality": 80}}


def encode(fmt: str, w: int, h: int, seed: int) -> bytes:
    """A photo-like image: a colour gradient with noise (so encoders produce realistic sizes)."""
    rng = random.Random(seed)
    base = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    tint = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    noise = Image.effect_noise((w, h), 40).convert("RGB")
    im = Image.blend(Image.blend(base, tint, 0.5), noise, 0.25)
    buf = io.BytesIO()
    im.save(buf, **FORMATS[fmt])
    return buf.getvalue()


LARGE_SIZES = [(2400, 1600), (3000, 2000), (4000, 3000)]   # camera photos: ~1-3 MB as JPEG


def write_shard(path: str, fmt: str, n: int, seed: int = 0, sizes: list | None = None) -> None:
    rng = random.Random(seed)
    sizes = sizes or SIZES
    pool = {(wh, v): encode(fmt, *wh, seed=v) for wh in sizes for v in range(2)}
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n):
            wh = rng.choice(sizes)
            caption = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 60)))
            for ext, data in ((fmt, pool[(wh, i % 2)]), ("txt", caption.encode())):
                ti = tarfile.TarInfo(f"s{i:07d}.{ext}")
                ti.size, ti.mtime = len(data), 1_700_000_000
                tf.addfile(ti, io.BytesIO(data))


def bench_build(shard: str, out: str, repeats: int) -> tuple[float, float, int]:
    """Median (wall s, CPU s) of a one-process build of ``shard``, and its sample count."""
    reports = []
    t = measure(lambda: reports.append(build_index([shard], out, model="qwen2-vl", progress=False,
                                                   incremental=False)), repeats=repeats, warmup=0)
    return t.wall_median, t.cpu_median, reports[-1].num_samples


@contextlib.contextmanager
def without_fast_paths():
    """The build as it was before the fast paths: tarfile lists members, Pillow reads every JPEG
    header, images are read with a 64 KiB prefix."""
    import tokenbal.index.imagesize as imagesize
    import tokenbal.index.scan as scan

    saved = scan.walk_members, imagesize.jpeg_size, imagesize.FIRST_READ
    scan.walk_members, imagesize.jpeg_size = (lambda fd, size: None), (lambda data: None)
    imagesize.FIRST_READ = imagesize.PREFIX_BYTES
    try:
        yield
    finally:
        scan.walk_members, imagesize.jpeg_size, imagesize.FIRST_READ = saved


def bench_decode(shard: str, limit: int) -> tuple[float, float, dict[str, int]]:
    """Decode-and-process: PIL decode + transformers' processor per sample; key -> vision tokens."""
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
    counter = get_text_counter(None)
    merge = proc.merge_size ** 2
    tokens: dict[str, int] = {}

    def run() -> None:
        with tarfile.open(shard, "r:") as tf:
            _decode_members(tf, proc, counter, merge, tokens, limit)

    t = measure(run, repeats=1, warmup=0)
    return t.wall[0], t.cpu[0], tokens


def _decode_members(tf, proc, counter, merge: int, tokens: dict[str, int], limit: int) -> None:
    """Decode each image, run the processor on it, count its sample's text: ``tokens[key]``."""
    images = []
    for ti in tf:
        key, ext = ti.name.split(".", 1)
        data = tf.extractfile(ti).read()
        if ext == "txt":
            counter.count(data.decode())
            img = images.pop()
            grid = proc(images=[img], return_tensors="np")["image_grid_thw"]
            tokens[key] = int(np.prod(grid[0])) // merge + 2
            if len(tokens) == limit:
                break
        else:
            with Image.open(io.BytesIO(data)) as im:
                images.append(im.convert("RGB"))


def bench_open(rows: int, folder: str) -> dict:
    """Write a ``rows``-sample index from synthetic columns, then time opening it."""
    out = os.path.join(folder, f"synthetic-{rows}")
    chunk = 1_000_000
    rng = np.random.default_rng(0)

    def results():
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            vision = rng.integers(4, 16384, n)
            text = rng.integers(1, 2000, n)
            ones = np.ones(n, np.int64)
            yield ShardResult(
                entry={"path": f"/synthetic/shard-{start // chunk:05d}.tar", "size": 0, "mtime_ns": 0,
                       "fingerprint": None, "status": "ok", "reason": None, "n_members": n,
                       "n_samples": n, "n_errors": 0},
                keys=[f"{i:09d}" for i in range(start, start + n)], member_counts=ones,
                member_exts=["jpg"] * n, member_offsets=np.arange(n, dtype=np.int64) * 4096,
                member_sizes=np.full(n, 4000, np.int64), image_counts=ones,
                image_wh=np.full((n, 2), 640, np.int64), vision=vision, text=text, errors=[])

    write_s = measure(lambda: write_index(out, results(), {"estimator": {"name": "synthetic", "config": {},
                                                                         "wrapper_tokens": 2},
                                                           "text_counter": {"name": "synthetic"}}),
                      repeats=1, warmup=0).wall[0]
    opened = []
    open_s = measure(lambda: opened.append(TokenIndex.open(out)), repeats=5, warmup=0).wall_median
    idx = opened[-1]
    n = len(idx)
    # First touches (page faults of the memory map): one timed call each, no warm-up.
    got: dict = {}
    sum_s = measure(lambda: got.update(total=int(np.asarray(idx.lengths).sum())), repeats=1, warmup=0).wall[0]
    access_s = measure(lambda: got.update(key=idx.keys[rows // 2], members=idx.members(rows // 2)),
                       repeats=1, warmup=0).wall[0]
    total, key, members = got["total"], got["key"], got["members"]
    assert n == rows and isinstance(idx.lengths, np.memmap) and total > 0 and key == f"{rows // 2:09d}"
    assert len(members) == 1
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    return {"rows": rows, "write_s": write_s, "open_s": open_s, "sum_s": sum_s,
            "access_s": access_s, "bytes": size, "memmap": isinstance(idx.lengths, np.memmap)}


def bench_remote(args) -> None:
    from http.server import ThreadingHTTPServer  # noqa: F401 - the server below is a ThreadingHTTPServer

    from tests.helpers.servers import RangeHandler, serve
    from tokenbal.io.remote import RemoteOptions

    work = args.workdir or tempfile.mkdtemp(prefix="bench-index-remote-")
    os.makedirs(work, exist_ok=True)
    tag = "large" if args.large else "r"
    names = [f"{tag}{k:03d}.tar" for k in range(args.shards)]
    for k, name in enumerate(names):
        if not os.path.exists(os.path.join(work, name)):
            write_shard(os.path.join(work, name), "jpg", args.samples, seed=k,
                        sizes=LARGE_SIZES if args.large else None)
    total_mb = sum(os.path.getsize(os.path.join(work, n)) for n in names) / 1e6
    rate = args.mbps * 1e6 if args.mbps else None

    class Throttled:
        """A connection's output at ``rate`` bytes/s (an object store's per-stream bandwidth)."""

        def __init__(self, raw):
            self.raw = raw

        def write(self, data):
            for k in range(0, len(data), 1 << 16):
                piece = data[k:k + (1 << 16)]
                self.raw.write(piece)
                time.sleep(len(piece) / rate)
            return len(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    class Handler(RangeHandler):
        def do_GET(self):
            if rate:
                self.wfile = Throttled(self.wfile)
            super().do_GET()

    with serve(work, latency=args.latency_ms / 1000, handler=Handler) as (base, httpd):
        urls = [f"{base}/{n}" for n in names]
        print(f"{args.shards} shards x {args.samples} JPEG samples ({total_mb:.0f} MB, "
              f"{total_mb / (args.shards * args.samples):.2f} MB each) over HTTP on "
              f"loopback, {args.latency_ms:.0f} ms per request, "
              f"{f'{args.mbps:.0f} MB/s per connection' if rate else 'no bandwidth cap'}, "
              f"{args.inflight} shards in flight, one process; median of {args.repeats}")
        results = {}
        # "per-header": the ranged walk without reading through small members (read_through=0), as
        # every build before it existed: one chunk-sized request per header missed.
        modes = {"ranges": RemoteOptions(mode="ranges", inflight=args.inflight),
                 "per-header": RemoteOptions(mode="ranges", inflight=args.inflight, read_through=0),
                 "whole": RemoteOptions(mode="whole", inflight=args.inflight)}
        for mode, opts in modes.items():
            walls, reqs, reps = [], [], []
            for _ in range(args.repeats):
                n0 = httpd.n

                def build(mode=mode, reps=reps, opts=opts) -> None:
                    reps.append(build_index(urls, os.path.join(work, f"idx-{mode}"), progress=False,
                                            incremental=False, remote=opts))

                walls.append(measure(build, repeats=1, warmup=0).wall[0])
                reqs.append(httpd.n - n0)
            rep = reps[-1]
            idx = TokenIndex.open(os.path.join(work, f"idx-{mode}"))
            read = sum(e.get("bytes_read", e["size"] if mode == "whole" else 0)
                       for e in idx.manifest["shards"]) / 1e6
            results[mode] = (statistics.median(walls), statistics.median(reqs), read, idx,
                             rep.num_samples)
        for mode, (wall, req, read, _, n) in results.items():
            print(f"  {mode:<10} {n / wall:>9,.0f} samples/s  {wall:6.2f} s  {req:>6.0f} requests  "
                  f"{read:>8.1f} MB read")
        a = results["ranges"][3]
        same = all(np.array_equal(np.asarray(a.lengths), np.asarray(r[3].lengths))
                   and list(a.keys) == list(r[3].keys) for r in results.values())
        for other in ("per-header", "whole"):
            print(f"  ranges / {other}: {results[other][0] / results['ranges'][0]:.2f}x samples/s, "
                  f"{results['ranges'][2] / results[other][2]:.3f}x bytes")
        print(f"  same index in every mode: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000, help="samples per format shard")
    ap.add_argument("--baseline", type=int, default=150, help="samples decoded by the baseline per format")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--open-rows", type=int, default=10_000_000, help="0 skips the open benchmark")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--formats", default="jpg,png,webp")
    ap.add_argument("--remote", action="store_true", help="benchmark remote (HTTP) builds instead")
    ap.add_argument("--shards", type=int, default=16, help="--remote: shards served")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="--remote: delay per request")
    ap.add_argument("--mbps", type=float, default=0.0, help="--remote: MB/s per connection (0: no cap)")
    ap.add_argument("--inflight", type=int, default=16, help="--remote: shards scanned at once")
    ap.add_argument("--large", action="store_true", help="--remote: 2400-4000 px photos (~1-3 MB each)")
    args = ap.parse_args()
    print(environment_line())
    if args.remote:
        bench_remote(args)
        return
    work = args.workdir or tempfile.mkdtemp(prefix="bench-index-")
    os.makedirs(work, exist_ok=True)
    est = get_estimator("qwen2-vl")
    print(f"workdir {work}; cores visible: {os.cpu_count()}; one process per measurement; "
          "rates per CPU-second of this process (= per core), wall-clock rates in brackets")
    print(f"{'format':<6} {'MB':>6} {'index samples/s':>24} {'decode+process samples/s':>25} "
          f"{'ratio (CPU)':>12} {'tokens agree':>13} {'no fast paths':>14}")
    for fmt in args.formats.split(","):
        shard = os.path.join(work, f"{fmt}.tar")
        if not os.path.exists(shard):
            write_shard(shard, fmt, args.samples)
        idx_wall, idx_cpu, n = bench_build(shard, os.path.join(work, f"idx-{fmt}"), args.repeats)
        dec_wall, dec_cpu, tokens = bench_decode(shard, args.baseline)
        with without_fast_paths():
            _, slow_cpu, _ = bench_build(shard, os.path.join(work, f"idx-{fmt}-slow"), args.repeats)
        idx = TokenIndex.open(os.path.join(work, f"idx-{fmt}"))
        agree = sum(int(idx.vision_tokens[int(k[1:])]) == v for k, v in tokens.items())
        assert est.wrapper_tokens == 2
        rate, base = n / idx_cpu, len(tokens) / dec_cpu
        walls = f"({n / idx_wall:,.0f})"
        print(f"{fmt:<6} {os.path.getsize(shard) / 1e6:>6.0f} {rate:>14,.0f} {walls:>9} "
              f"{base:>15,.1f} ({len(tokens) / dec_wall:,.1f}) {rate / base:>11,.0f}x "
              f"{agree:>6}/{len(tokens):<6} {n / slow_cpu:>14,.0f}")
    if args.open_rows:
        r = bench_open(args.open_rows, work)
        print(f"open: {r['rows']:,}-sample index ({r['bytes'] / 1e6:,.0f} MB on disk, written in "
              f"{r['write_s']:.1f}s): TokenIndex.open median {r['open_s'] * 1e3:.1f} ms; lengths is "
              f"np.memmap: {r['memmap']}; first lengths.sum() {r['sum_s'] * 1e3:.0f} ms; "
              f"keys[i] + members(i) {r['access_s'] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
