"""Per-image cost of ``read_image_size`` (the index scan's size + end check) on the formats whose end
check session 27 added (PPM / PGM, QOI, raw JPEG 2000, RLE BMP / TGA / SGI, raw TGA / SGI, plain PPM)
and session 28 (PCX, DDS, XBM, BLP; a 10-frame GIF / APNG, whose first frame alone is now walked),
and on JPEG / PNG as a control, from a local file: min of ``--repeat`` x ``--calls`` calls, µs.

    python scripts/bench_image_end_checks.py                         # this tree's imagesize.py
    python scripts/bench_image_end_checks.py --module OLD/imagesize.py   # another version of it
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import sys
import tempfile
import time

from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _images(w: int, h: int) -> dict[str, bytes]:
    from tests.tokenbal.index.test_images_cut_short import _plain_netpbm, rle_bmp, sgi_rle

    noise = Image.effect_noise((w, h), 60).convert("RGB")
    out = {}
    for name, fmt, mode, kw in (("JPEG", "JPEG", "RGB", {}), ("PNG", "PNG", "RGB", {}),
                                ("PPM (P6)", "PPM", "RGB", {}), ("PGM 16-bit", "PPM", "I;16", {}),
                                ("QOI", "QOI", "RGB", {}),
                                ("J2K codestream", "JPEG2000", "RGB", {"no_jp2": True}),
                                ("TGA", "TGA", "RGB", {}), ("SGI", "SGI", "RGB", {})):
        buf = io.BytesIO()
        (noise.convert("L").convert(mode) if mode != "RGB" else noise).save(buf, fmt, **kw)
        out[name] = buf.getvalue()
    buf = io.BytesIO()
    noise.save(buf, "TGA", compression="tga_rle")
    out["TGA RLE"] = buf.getvalue()
    out["SGI RLE"] = sgi_rle(w, h, 3, seed=1)
    out["PPM plain (P3)"] = _plain_netpbm(b"P3", w, h, 3)
    out["BMP RLE8"] = rle_bmp(w, h, rle4=False, seed=1)
    for name, fmt, image, kw in (("PCX", "PCX", noise, {}), ("DDS", "DDS", noise, {}),
                                 ("DDS DXT1", "DDS", noise.convert("RGBA"), {"pixel_format": "DXT1"}),
                                 ("XBM", "XBM", noise.convert("1"), {}),
                                 ("BLP", "BLP", noise.convert("P"), {})):
        buf = io.BytesIO()
        image.save(buf, fmt, **kw)
        out[name] = buf.getvalue()
    frames = [Image.effect_noise((w, h), 60 + k).convert("RGB") for k in range(10)]
    for name, fmt in (("GIF 10 frames", "GIF"), ("APNG 10 frames", "PNG")):
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:])
        out[name] = buf.getvalue()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", help="an imagesize.py to time instead of tokenbal.index.imagesize")
    ap.add_argument("--size", default="640x480")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.module:
        spec = importlib.util.spec_from_file_location("imagesize_under_test", args.module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        from tokenbal.index import imagesize as mod
    w, h = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in _images(w, h).items():
            path = os.path.join(tmp, "img")
            with open(path, "wb") as f:
                f.write(data)
            fd = os.open(path, os.O_RDONLY)
            try:
                try:
                    mod.read_image_size(fd, 0, len(data), exif="transpose")
                    verdict = "counted"
                except mod.ImageSizeError as e:
                    verdict = f"error: {e}"
                best = float("inf")
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        try:
                            mod.read_image_size(fd, 0, len(data), exif="transpose")
                        except mod.ImageSizeError:
                            pass
                    best = min(best, (time.perf_counter() - t) / args.calls)
            finally:
                os.close(fd)
            print(f"{name:16s} {len(data):9d} bytes  {best * 1e6:9.1f} µs  {verdict}")


if __name__ == "__main__":
    main()
