"""Videos indexed per CPU-second: container headers (``tokenbal.index.video.probe_video``) vs a
decode-based frame count (every frame decoded), on real clips written with PyAV into a tar shard,
read as byte ranges of the shard like ``tokenbal index build`` does.

    python scripts/bench_video.py [--videos 200] [--seconds 10] [--size 320x180] [--decode 4]

Both run in this process, one core, on the same members; the ratio is printed. CPU time
(process CPU seconds from scripts/harness.py's ``measure``), medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile
from fractions import Fraction

from harness import environment_line, measure


def make_clips(folder: str, n: int, seconds: float, w: int, h: int, distinct: int) -> str:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.helpers.videos import write_video

    shard = os.path.join(folder, "videos.tar")
    kinds = [("mp4", 30), ("webm", 25), ("mp4", Fraction(30000, 1001)), ("mkv", 24)]
    clips = []
    for i in range(distinct):   # encoding is slow; members repeat these clips under their own keys
        ext, fps = kinds[i % len(kinds)]
        path = os.path.join(folder, f"c{i}.{ext}")
        write_video(path, max(2, int(seconds * float(fps)) + i % 7), w, h, fps, noise=True)
        clips.append((ext, open(path, "rb").read()))
        os.remove(path)
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n):
            ext, data = clips[i % distinct]
            ti = tarfile.TarInfo(f"{i:06d}.{ext}")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return shard


def members(shard: str) -> list[tuple[str, int, int]]:
    with tarfile.open(shard) as tf:
        return [(m.name, m.offset_data, m.size) for m in tf.getmembers()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--videos", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--size", default="320x180")
    ap.add_argument("--decode", type=int, default=4, help="videos decoded for the baseline")
    ap.add_argument("--distinct", type=int, default=4, help="distinct clips encoded")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    w, h = (int(x) for x in args.size.split("x"))

    from tokenbal.index.video import count_decoded_frames, probe_video

    with tempfile.TemporaryDirectory() as d:
        made: list[str] = []
        write = measure(lambda: made.append(make_clips(d, args.videos, args.seconds, w, h, args.distinct)),
                        repeats=1, warmup=0)
        shard = made[0]
        ms = members(shard)
        size_mb = os.path.getsize(shard) / 1e6
        print(f"{len(ms)} clips of ~{args.seconds:g} s, {w}x{h} (h264 mp4, vp9 webm, h264 mkv), "
              f"{size_mb:.1f} MB shard, written in {write.wall[0]:.1f} s")
        fd = os.open(shard, os.O_RDONLY)
        try:
            header_counts: list[int] = []

            def headers() -> None:
                header_counts[:] = [probe_video((fd, off, size)).frames for _, off, size in ms]

            sub = ms[: args.decode]

            def decodes() -> None:
                for _, off, size in sub:
                    os.lseek(fd, off, 0)
                    count_decoded_frames(os.read(fd, size))

            # One warm-up (imports, page cache) before the header runs; CPU seconds, medians.
            t_head = measure(headers, repeats=args.repeats, warmup=1).cpu_median
            t_dec = measure(decodes, repeats=max(1, args.repeats - 1), warmup=0).cpu_median
            per_kind = {}
            for kind in sorted({n.rsplit(".", 1)[1] for n, _, _ in ms}):
                group = [m for m in ms if m[0].endswith("." + kind)]
                t = measure(lambda g=group: [probe_video((fd, o, z)) for _, o, z in g],
                            repeats=args.repeats, warmup=0).cpu_median
                per_kind[kind] = len(group) / t
                sub_k = group[:2]
                t_k = measure(lambda g=sub_k: [count_decoded_frames((fd, o, z)) for _, o, z in g],
                              repeats=max(1, args.repeats - 1), warmup=0).cpu_median
                per_kind[kind] = (per_kind[kind], len(sub_k) / t_k)
            for name, off, size in sub:
                os.lseek(fd, off, 0)
                assert count_decoded_frames(os.read(fd, size)) == header_counts[ms.index((name, off, size))]
        finally:
            os.close(fd)
    head_rate = len(ms) / t_head
    dec_rate = len(sub) / t_dec
    by_kind: dict[str, int] = {}
    for name, _, _ in ms:
        by_kind[name.rsplit(".", 1)[1]] = by_kind.get(name.rsplit(".", 1)[1], 0) + 1
    print(f"headers : {head_rate:10.1f} videos / CPU-second  ({t_head * 1e3 / len(ms):.2f} ms each; "
          f"{by_kind})")
    print(f"decoding: {dec_rate:10.2f} videos / CPU-second  ({t_dec * 1e3 / len(sub):.1f} ms each, "
          f"{len(sub)} clips)")
    print(f"ratio   : {head_rate / dec_rate:10.0f}x   (frame counts checked equal on the decoded clips)")
    for kind, (h, dr) in per_kind.items():
        print(f"  {kind:5s}: headers {h:8.1f} /s, decoding {dr:6.2f} /s, ratio {h / dr:6.0f}x")
    print(environment_line(av=_av_version()))


def _av_version() -> str:
    import av

    return av.__version__


if __name__ == "__main__":
    main()
