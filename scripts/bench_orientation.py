"""Cost of counting an image's size as exif_transpose gives it (EXIF and XMP orientation, PNG chunks
after the pixel data, every Pillow format), against the imagesize module of an earlier commit.

The baseline is ``tokenbal/index/imagesize.py`` as it was at ``--baseline-rev`` (read with ``git
show`` and loaded in this process), so both run on the same files, in the same process, alternately.
Per format: microseconds per image (median of ``--repeats`` passes over ``--images`` files) with
``exif="transpose"`` (the index default) and ``"ignore"``, and the ratio new / baseline.

    python scripts/bench_orientation.py --images 200 --repeats 7
"""

from __future__ import annotations

import argparse
import io
import os
import struct
import subprocess
import sys
import tempfile
import types
import zlib

import numpy as np
from harness import environment_line, measure
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokenbal.index import imagesize as current  # noqa: E402

XMP = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF><rdf:Description xmlns:tiff="http://ns.adobe.com/'
       b'tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')


def baseline_module(rev: str) -> types.ModuleType:
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:tokenbal/index/imagesize.py"],
                            check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("imagesize_baseline")
    exec(compile(source, f"{rev}:imagesize.py", "exec"), mod.__dict__)
    return mod


def photo(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    return Image.fromarray((base + rng.integers(0, 40, (h, w, 3))).astype(np.uint8))


def rechunk_png(data: bytes, chunk: int) -> bytes:
    """The same PNG with its pixel data in ``chunk``-byte IDAT chunks (libpng writes 8 KiB ones)."""
    pos, head, idat, tail = 8, [], b"", []
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IDAT":
            idat += body
        else:
            (tail if idat else head).append(data[pos:pos + 12 + n])
        pos += 12 + n

    def chunk_of(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    parts = [chunk_of(b"IDAT", idat[i:i + chunk]) for i in range(0, len(idat), chunk)]
    return data[:8] + b"".join(head) + b"".join(parts) + b"".join(tail)


def encode(fmt: str, seed: int) -> bytes:
    im = photo(1024, 768, seed)
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    if fmt == "jpeg-exif":
        im.save(buf, "JPEG", quality=85, exif=exif.tobytes())
    elif fmt == "jpeg-xmp":
        im.save(buf, "JPEG", quality=85, xmp=XMP)
    elif fmt == "png-8k-chunks":
        im.save(buf, "PNG", compress_level=1)
        return rechunk_png(buf.getvalue(), 8192)
    elif fmt == "webp-xmp":
        im.save(buf, "WEBP", quality=80, xmp=XMP)
    elif fmt == "tiff":
        im.save(buf, "TIFF", tiffinfo={274: 6})
    elif fmt == "avif":
        im.save(buf, "AVIF", quality=60, exif=exif.tobytes())
    elif fmt == "gif":
        im.convert("P").save(buf, "GIF")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-rev", default="df34147", help="commit whose imagesize.py is the baseline")
    ap.add_argument("--formats", default="jpeg-exif,jpeg-xmp,png-8k-chunks,webp-xmp,tiff,avif,gif")
    args = ap.parse_args()
    old = baseline_module(args.baseline_rev)
    print(environment_line(pillow=Image.__version__, baseline=args.baseline_rev))
    print(f"{'format':<15}{'KiB':>6}  {'policy':<10}{'baseline µs':>12}{'new µs':>9}{'new/base':>9}  sizes")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            files = []
            for k in range(min(args.images, 8)):     # 8 distinct files, reused round-robin
                path = os.path.join(tmp, f"{fmt}-{k}")
                with open(path, "wb") as f:
                    f.write(encode(fmt, k))
                files.append(path)
            fds = [(os.open(p, os.O_RDONLY), os.path.getsize(p)) for p in files]
            order = [fds[i % len(fds)] for i in range(args.images)]
            for policy in ("transpose", "ignore"):
                def run(mod, policy=policy, order=order):
                    for fd, size in order:
                        mod.read_image_size(fd, 0, size, exif=policy)
                fd0, size0 = order[0]
                sizes = {name: m.read_image_size(fd0, 0, size0, exif=policy)[0]
                         for name, m in (("baseline", old), ("new", current))}
                t_old, t_new = [], []
                for _ in range(args.repeats):   # alternate, so load changes hit both
                    t_old.append(measure(lambda: run(old), repeats=1, warmup=0).cpu_median)
                    t_new.append(measure(lambda: run(current), repeats=1, warmup=0).cpu_median)
                a = float(np.median(t_old)) / args.images * 1e6
                b = float(np.median(t_new)) / args.images * 1e6
                kib = order[0][1] / 1024
                print(f"{fmt:<15}{kib:>6.0f}  {policy:<10}{a:>12.1f}{b:>9.1f}{b / a:>8.2f}x  {sizes}")
            for fd, _ in fds:
                os.close(fd)


if __name__ == "__main__":
    main()
