"""An image cut short (a download that stopped, a copy that ran out of disk) has an intact header, so
its size reads fine, but no loader decodes it: the index must count it as an error, never as a
sample that fails in training. The oracle is the installed Pillow decoding the bytes
(``ImageOps.exif_transpose(Image.open(f))`` then ``load``), which is what transformers'
``load_image`` does."""

from __future__ import annotations

import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps, features

from tests.helpers.corpus import Sample, write_shard
from tokenbal.index.imagesize import ImageSizeError, read_image_size
from tokenbal.index.scan import scan_shard

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _noise(w: int, h: int, mode: str = "RGB") -> Image.Image:
    return Image.effect_noise((w, h), 60).convert(mode)


def _encode(fmt: str, w: int = 64, h: int = 48, **kw) -> bytes:
    buf = io.BytesIO()
    _noise(w, h).save(buf, fmt, **kw)
    return buf.getvalue()


def _decoded_size(data: bytes) -> tuple[int, int] | None:
    """What load_image gives (None: Pillow fails to decode the bytes)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im = ImageOps.exif_transpose(im)
            im.load()
            return im.size
    except Exception:  # noqa: BLE001 - any decode failure is a failure in training
        return None


def _counted(data: bytes) -> tuple[int, int] | None:
    """The index's size of ``data`` (None: an ImageSizeError, i.e. the sample is an error)."""
    class Bytes:   # what read_image_size takes besides a descriptor (a remote shard has pread too)
        def pread(self, n: int, offset: int) -> bytes:
            return data[offset:offset + n]

    try:
        return read_image_size(Bytes(), 0, len(data), exif="transpose")[0]
    except ImageSizeError:
        return None


# -- tar shards: formats whose end the scan did not check ------------------------------------------

# Formats only some Pillow builds write (tokenbal needs pillow>=10; AVIF came with 11.3's wheels).
MISSING = {name for name, feature in (("avif", "avif"), ("jp2", "jpg_2000")) if not features.check(feature)}

CUT_FORMATS = {
    "bmp": lambda: _encode("BMP"),
    "tiff": lambda: _encode("TIFF"),
    "tiff-lzw": lambda: _encode("TIFF", compression="tiff_lzw"),
    "tiff-jpeg": lambda: _encode("TIFF", compression="jpeg"),
    "avif": lambda: _encode("AVIF"),
    "jp2": lambda: _encode("JPEG2000"),
}


@pytest.mark.parametrize("name", sorted(n for n in CUT_FORMATS if n.split("-")[0] not in MISSING))
def test_a_bmp_tiff_avif_or_jpeg2000_cut_short_is_an_error_not_a_sample(tmp_path, name):
    whole = CUT_FORMATS[name]()
    ext = name.split("-")[0]
    assert _decoded_size(whole) == (64, 48)
    cut = whole[:len(whole) - max(8, len(whole) // 5)]
    assert _decoded_size(cut) is None, "the cut image must fail to decode, or this test tests nothing"
    scan = scan_shard(write_shard(tmp_path / "s.tar", [
        Sample("whole", caption="ok", raw=[(ext, whole)]),
        Sample("cut", caption="cut", raw=[(ext, cut)])]))
    assert [s.key for s in scan.samples] == ["whole"]
    assert [s.image_sizes for s in scan.samples] == [[(64, 48)]]
    (err,) = scan.errors
    assert err["key"] == "cut" and "cut short" in err["reason"], err


def test_a_bmp_stored_top_down_or_with_bytes_after_its_pixels_is_no_error(tmp_path):
    bmp = bytearray(_encode("BMP", 7, 5))
    bmp[22:26] = (-5).to_bytes(4, "little", signed=True)   # negative height: rows stored top-down
    for data in (bytes(bmp), bytes(bmp) + b"\0" * 10):
        assert _decoded_size(data) == (7, 5) == _counted(data)


# -- formats whose pixel data the header places exactly, or whose end marker the spec fixes ------

def rle_bmp(w: int, h: int, rle4: bool, seed: int = 0, early_end: bool = False) -> bytes:
    """A BMP whose pixels are RLE8 / RLE4 coded as the format describes (Pillow writes none): each row
    encoded runs and word-aligned absolute runs, an end of line, then the end of bitmap (``00 01``;
    ``early_end``: one row early, which Pillow refuses: 'not enough image data')."""
    import random
    import struct

    rng = random.Random(seed)
    colors = 16 if rle4 else 256
    rows = [[rng.choice((rng.randrange(colors), 1)) for _ in range(w)] for _ in range(h)]
    out = bytearray()
    for y, row in enumerate(rows[:h - 1] if early_end and h > 1 else rows):
        x = 0
        while x < w:
            run = 1
            while x + run < w and row[x + run] == row[x] and run < 255:
                run += 1
            if run >= 2 or w - x < 3:
                n = min(run, w - x)
                out += bytes((n, row[x] << 4 | row[x] if rle4 else row[x]))
            else:
                n = min(w - x, rng.randint(3, 12))
                px = row[x:x + n] + [0] * (n % 2 if rle4 else 0)
                data = bytes(px[i] << 4 | px[i + 1] for i in range(0, n, 2)) if rle4 else bytes(px)
                out += bytes((0, n)) + data + b"\0" * (len(data) % 2)
            x += n
        if y < h - 1:
            out += b"\0\0"
    out += b"\0\1"
    palette = b"".join(bytes((i * 13 % 256, i * 7 % 256, i * 3 % 256, 0)) for i in range(colors))
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 4 if rle4 else 8, 2 if rle4 else 1, len(out), 2835, 2835,
                       colors, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(out), 0, 0, offset) + info + palette + bytes(out)


def sgi_rle(w: int, h: int, channels: int = 3, seed: int = 0) -> bytes:
    """An RLE SGI (Pillow writes only uncompressed ones): the 512-byte header, the row offset and
    length tables, then each channel's rows as runs and literal packets ending in 0."""
    import random
    import struct

    rng = random.Random(seed)
    header = struct.pack(">HBBHHHHII4s80sI", 474, 1, 1, 3, w, h, channels, 0, 255, b"", b"", 0)
    header = header.ljust(512, b"\0")
    data, starts, lengths = bytearray(), [], []
    for _ in range(channels * h):
        row = bytes(rng.choice((rng.randrange(256), 7)) for _ in range(w))
        packed, x = bytearray(), 0
        while x < w:
            run = 1
            while x + run < w and row[x + run] == row[x] and run < 127:
                run += 1
            n = run if run >= 3 else min(w - x, rng.randint(1, 8))
            packed += bytes((n, row[x])) if run >= 3 else bytes((0x80 | n,)) + row[x:x + n]
            x += n
        packed += b"\0"
        starts.append(512 + 8 * h * channels + len(data))
        lengths.append(len(packed))
        data += packed
    return header + struct.pack(f">{2 * h * channels}I", *starts, *lengths) + bytes(data)


def _netpbm(magic: bytes, w: int, h: int, maxval: int, samples: int) -> bytes:
    """A binary PPM / PGM whose maxval is not 255 or 65535 (Pillow scales those samples: its 'ppm'
    decoder, not the raw one), or a PFM (maxval: the scale, -1.0 little-endian floats)."""
    import random

    rng = random.Random(w * h)
    if magic == b"Pf":
        import struct

        floats = struct.pack(f"<{w * h}f", *(rng.random() for _ in range(w * h)))
        return b"Pf\n%d %d\n-1.0\n" % (w, h) + floats
    width = 1 if maxval < 256 else 2
    body = b"".join(rng.randrange(maxval + 1).to_bytes(width, "big") for _ in range(w * h * samples))
    return magic + b"\n%d %d\n%d\n" % (w, h, maxval) + body


def _plain_netpbm(magic: bytes, w: int, h: int, samples: int) -> bytes:
    """A plain (ASCII) PBM / PGM / PPM with a comment in its header and after its samples (Pillow
    writes none): a P1 bitmap's digits without spaces, as the format allows."""
    import random

    rng = random.Random(w + h)
    if magic == b"P1":
        return b"P1\n# bitmap\n%d %d\n" % (w, h) + bytes(rng.choice(b"01") for _ in range(w * h)) + b"\n"
    body = b" ".join(b"%d" % rng.randrange(256) for _ in range(w * h * samples))
    return magic + b"\n# plain\n%d %d\n255\n" % (w, h) + body + b"\n# the end\n"


EXACT_FORMATS = {
    "ppm-plain": ("ppm", lambda: _plain_netpbm(b"P3", 7, 5, 3)),
    "pgm-plain": ("pgm", lambda: _plain_netpbm(b"P2", 7, 5, 1)),
    "pbm-plain": ("pbm", lambda: _plain_netpbm(b"P1", 7, 5, 1)),
    "ppm": ("ppm", lambda: _encode("PPM", 7, 5)),
    "pgm": ("pgm", lambda: _encode_mode("PPM", "L")),
    "pgm-16": ("pgm", lambda: _encode_mode("PPM", "I;16")),
    "pbm": ("pbm", lambda: _encode_mode("PPM", "1")),
    "ppm-maxval-100": ("ppm", lambda: _netpbm(b"P6", 7, 5, 100, 3)),
    "pgm-maxval-1000": ("pgm", lambda: _netpbm(b"P5", 7, 5, 1000, 1)),
    "ppm-16": ("ppm", lambda: _netpbm(b"P6", 7, 5, 65535, 3)),
    "pfm": ("pfm", lambda: _netpbm(b"Pf", 7, 5, 0, 1)),
    "qoi": ("qoi", lambda: _encode("QOI", 7, 5)),
    "qoi-rgba": ("qoi", lambda: _encode_mode("QOI", "RGBA")),
    "j2k": ("j2k", lambda: _encode("JPEG2000", 17, 13, no_jp2=True)),
    "j2k-tiles": ("j2k", lambda: _encode("JPEG2000", 40, 30, no_jp2=True, tile_size=(16, 16))),
    "bmp-rle8": ("bmp", lambda: rle_bmp(13, 9, rle4=False, seed=1)),
    "bmp-rle4": ("bmp", lambda: rle_bmp(13, 9, rle4=True, seed=2)),
    "tga": ("tga", lambda: _encode("TGA", 7, 5)),
    "tga-rle": ("tga", lambda: _encode("TGA", 7, 5, compression="tga_rle")),
    "tga-rle-runs": ("tga", lambda: _blocks("TGA", 40, 9, compression="tga_rle")),
    "sgi": ("sgi", lambda: _encode("SGI", 7, 5)),
    "sgi-rle": ("sgi", lambda: sgi_rle(13, 6, 3, seed=4)),
    "msp": ("msp", lambda: _encode_mode("MSP", "1", 16, 8)),
}


def _blocks(fmt: str, w: int, h: int, **kw) -> bytes:
    """Flat colour with a noisy block: run-length formats write runs and literals both."""
    im = Image.new("RGB", (w, h), (200, 30, 90))
    im.paste(_noise(w // 3, h // 2), (w // 3, h // 4))
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _encode_mode(fmt: str, mode: str, w: int = 7, h: int = 5, **kw) -> bytes:
    buf = io.BytesIO()
    _noise(w, h, "L" if mode.startswith("I") else mode).convert(mode).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("name", sorted(n for n in EXACT_FORMATS if n[:3] != "j2k" or "jp2" not in MISSING))
def test_a_netpbm_qoi_j2k_rle_bmp_or_raw_image_cut_anywhere_is_an_error_or_decodes_to_its_count(name):
    """Binary and plain PPM / PGM / PBM, PFM, QOI, raw JPEG 2000 codestreams, RLE BMPs, TGAs and SGIs
    (and TGA / SGI / MSP, whose pixels are raw rows) cut at any byte: counted only where Pillow decodes
    the cut bytes to the counted size. Before, every cut past the header was counted (a 7x5 PPM: 108
    of its 115 cut points)."""
    data = EXACT_FORMATS[name][1]()
    assert _decoded_size(data) is not None and _counted(data) == _decoded_size(data)
    lax = [n for n in range(1, len(data)) if _counted(data[:n]) not in (None, _decoded_size(data[:n]))]
    assert lax == [], f"{len(lax)} of {len(data) - 1} cut points counted though Pillow fails: {lax[:10]}"
    # bytes after a whole image (padding), which Pillow ignores, are no error: a QOI is then walked
    # (a plain netpbm's NULs are not: Pillow refuses them as tokens, and so does the scan)
    padded = data + b"\0" * 40
    assert _counted(padded) == _decoded_size(padded) == (None if "plain" in name else _decoded_size(data))
    if name.startswith("qoi"):   # cut inside its end marker only: Pillow has every pixel, so does the walk
        assert _counted(data[:-3]) == _decoded_size(data[:-3]) == _decoded_size(data)


@pytest.mark.parametrize("name", ["ppm", "pgm-16", "qoi", "j2k", "bmp-rle8", "bmp-rle4", "tga-rle",
                                  "sgi-rle"])
def test_a_cut_netpbm_qoi_j2k_or_rle_bmp_in_a_shard_is_an_error_naming_it(tmp_path, name):
    if name == "j2k" and "jp2" in MISSING:
        pytest.skip("this Pillow writes no JPEG 2000")
    ext, make = EXACT_FORMATS[name]
    whole = make()
    size = _decoded_size(whole)
    cut = whole[:len(whole) - max(2, len(whole) // 5)]
    assert _decoded_size(cut) is None, "the cut image must fail to decode, or this test tests nothing"
    scan = scan_shard(write_shard(tmp_path / "s.tar", [
        Sample("whole", caption="ok", raw=[(ext, whole)]),
        Sample("cut", caption="cut", raw=[(ext, cut)])]))
    assert [(s.key, s.image_sizes) for s in scan.samples] == [("whole", [size])]
    (err,) = scan.errors
    assert err["key"] == "cut" and "cut short" in err["reason"], err


@pytest.mark.parametrize("rle4", [False, True])
def test_an_rle_bmp_whose_codes_end_before_its_last_row_is_an_error(rle4):
    """The end-of-bitmap code one row early: Pillow refuses it ('not enough image data'), the scan
    counted it."""
    data = rle_bmp(9, 6, rle4=rle4, seed=3, early_end=True)
    assert _decoded_size(data) is None
    with pytest.raises(ImageSizeError, match=r"BMP cut short: its RLE[48] codes give 45 of its 54 pixels"):
        read_image_size(_Bytes(data), 0, len(data))


def blp2_dxt(w: int, h: int, pixel_format: str) -> bytes:
    """A BLP2 whose first mipmap is DXT1 / DXT3 / DXT5 blocks (Pillow writes palette BLPs only): the
    blocks of a DDS Pillow wrote, behind a BLP2 header, mipmap table and (unused) palette."""
    import struct

    blocks = _encode_mode("DDS", "RGBA", w, h, pixel_format=pixel_format)[128:]
    alpha_encoding = {"DXT1": 0, "DXT3": 1, "DXT5": 7}[pixel_format]
    start = 20 + 128 + 1024
    return (b"BLP2" + struct.pack("<ibbbbII", 1, 2, 8, alpha_encoding, 0, w, h)
            + struct.pack("<16I16I", start, *[0] * 15, len(blocks), *[0] * 15) + bytes(1024) + blocks)


PAINT_FORMATS = {
    "pcx": ("pcx", lambda: _encode("PCX", 7, 5)),
    "pcx-runs": ("pcx", lambda: _blocks("PCX", 40, 9)),
    "pcx-palette": ("pcx", lambda: _encode_mode("PCX", "P")),          # its palette after the pixels
    "pcx-1": ("pcx", lambda: _encode_mode("PCX", "1", 13, 5)),
    "dds": ("dds", lambda: _encode("DDS", 7, 5)),                      # Pillow's dds_rgb decoder
    "dds-l": ("dds", lambda: _encode_mode("DDS", "L")),                # raw rows after the header
    "dds-dxt1": ("dds", lambda: _encode_mode("DDS", "RGBA", 9, 6, pixel_format="DXT1")),
    "dds-dxt5": ("dds", lambda: _encode_mode("DDS", "RGBA", 9, 6, pixel_format="DXT5")),
    "dds-bc5": ("dds", lambda: _encode("DDS", 9, 6, pixel_format="BC5")),   # a DX10 header
    "xbm": ("xbm", lambda: _encode_mode("XBM", "1", 13, 5)),
    # an 'x' Pillow's decoder reads as a digit of the byte before it ('0xx5'), a stray one (',x0x12')
    "xbm-stray-x": ("xbm", lambda: _encode_mode("XBM", "1", 13, 5).replace(b",0x", b",0xx", 1)
                    .replace(b",0x", b",x0x", 1)),
    "blp": ("blp", lambda: _encode_mode("BLP", "P", 8, 8)),
    "blp1": ("blp", lambda: _encode_mode("BLP", "P", 7, 5, blp_version="BLP1")),
    "blp-dxt1": ("blp", lambda: blp2_dxt(9, 6, "DXT1")),
    "blp-dxt5": ("blp", lambda: blp2_dxt(9, 6, "DXT5")),
}


@pytest.mark.parametrize("name", sorted(PAINT_FORMATS))
def test_a_pcx_dds_xbm_or_blp_cut_anywhere_is_an_error_or_decodes_to_its_count(name):
    """Cut at any byte: counted exactly where Pillow decodes the cut bytes (both ways). Before, every
    cut past the header was counted (a 7x5 PCX: 189 of its 256 cut points; an 8x8 BLP: 1,216 of
    1,235), as Pillow fails on them all ('image file is truncated', 'Truncated File Read')."""
    data = PAINT_FORMATS[name][1]()
    assert _decoded_size(data) is not None and _counted(data) == _decoded_size(data)
    wrong = [n for n in range(1, len(data)) if _counted(data[:n]) != _decoded_size(data[:n])]
    assert wrong == [], f"{len(wrong)} of {len(data) - 1} cut points judged unlike Pillow: {wrong[:10]}"
    padded = data + b"\0" * 40      # bytes after the image, which Pillow ignores, are no error
    assert _counted(padded) == _decoded_size(padded) == _decoded_size(data)


@pytest.mark.parametrize("name", ["pcx", "dds", "dds-dxt1", "xbm", "blp", "blp-dxt1"])
def test_a_cut_pcx_dds_xbm_or_blp_in_a_shard_is_an_error_naming_it(tmp_path, name):
    ext, make = PAINT_FORMATS[name]
    whole = make()
    cut = whole[:len(whole) - max(2, len(whole) // 20)]
    assert _decoded_size(cut) is None, "the cut image must fail to decode, or this test tests nothing"
    scan = scan_shard(write_shard(tmp_path / "s.tar", [
        Sample("whole", caption="ok", raw=[(ext, whole)]),
        Sample("cut", caption="cut", raw=[(ext, cut)])]))
    assert [(s.key, s.image_sizes) for s in scan.samples] == [("whole", [_decoded_size(whole)])]
    (err,) = scan.errors
    assert err["key"] == "cut" and "cut short" in err["reason"] and ext.upper() in err["reason"], err


def test_a_pcx_run_across_a_line_end_or_a_blp_short_of_pixels_is_an_error():
    """Damage rather than a cut: a PCX run longer than its line left (Pillow: 'buffer overrun'), a
    BLP whose first mipmap holds fewer palette indices than pixels ('not enough image data')."""
    import struct

    pcx = _encode_mode("PCX", "L", 4, 2)
    runs = pcx[:128] + bytes((0xC6, 7, 0xC2, 7)) + pcx[132:]     # 6 + 2 bytes for two lines of 4
    blp = bytearray(_encode_mode("BLP", "P", 8, 8))
    struct.pack_into("<I", blp, 20 + 64, 60)                     # the first mipmap's length: 60 of 64
    for data, why in ((runs, "PCX damaged: a run of its run-length data crosses the end of a line"),
                      (bytes(blp), "BLP damaged: its first mipmap holds 60 palette indices for its 64")):
        assert _decoded_size(data) is None
        with pytest.raises(ImageSizeError, match=why):
            read_image_size(_Bytes(data), 0, len(data))


# -- animations: Pillow, and so every loader of a PIL image, decodes the first frame only ----------

def _animation(fmt: str, w: int = 64, h: int = 48, frames: int = 3) -> bytes:
    buf = io.BytesIO()
    images = [_noise(w, h) for _ in range(frames)]
    images[0].save(buf, fmt, save_all=True, append_images=images[1:])
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_an_animated_png_or_gif_cut_in_a_later_frame_counts_its_first_frame(tmp_path, fmt):
    """An APNG or GIF cut inside a later frame: Pillow's load / convert("RGB") (transformers'
    load_image, tokenbal's readers) decodes its first frame, the only one the image processors get;
    it was an error ('PNG cut short: no IEND chunk', 'GIF cut short'). Now counted with its size; a
    cut inside the first frame stays an error, and no cut point is counted that Pillow cannot decode
    (a few just after the first frame's pixel data are still refused: its run of chunks / sub-blocks
    cannot be told ended there)."""
    data = _animation(fmt, 7, 5)
    with Image.open(io.BytesIO(data)) as im:
        assert im.n_frames == 3
    verdicts = [(_counted(data[:n]), _decoded_size(data[:n])) for n in range(1, len(data))]
    assert [n for n, (c, d) in enumerate(verdicts, 1) if c is not None and c != d] == []
    refused = [n for n, (c, d) in enumerate(verdicts, 1) if c is None and d is not None]
    first_counted = next(n for n, (c, _) in enumerate(verdicts, 1) if c is not None)
    assert len(refused) <= 16 and all(n < first_counted for n in refused), refused   # only at the frame's end
    assert all(c == (7, 5) for c, _ in verdicts[first_counted - 1:])                 # every later cut counted

    whole = _animation(fmt)
    second, first = whole[:len(whole) // 2], whole[:len(whole) // 6]
    assert _decoded_size(second) == (64, 48) and _decoded_size(first) is None
    scan = scan_shard(write_shard(tmp_path / "s.tar", [
        Sample("whole", caption="ok", raw=[(fmt.lower(), whole)]),
        Sample("later", caption="cut in a later frame", raw=[(fmt.lower(), second)]),
        Sample("first", caption="cut in the first frame", raw=[(fmt.lower(), first)])]))
    assert [(s.key, s.image_sizes) for s in scan.samples] == [("whole", [(64, 48)]), ("later", [(64, 48)])]
    (err,) = scan.errors
    assert err["key"] == "first" and f"{fmt} cut short" in err["reason"], err


def test_what_the_processors_get_from_an_animation_cut_in_a_later_frame_is_its_first_frame(
        tmp_path, qwen2_vl_ckpt):
    """The real path: the index over a shard holding an APNG and a GIF cut in their last frame, the
    shard read back by IndexedShardDataset(decode="pil") and tokenized by the checkpoint's Qwen2-VL
    processor (strict: the index's lengths must be what it gives), and LLaVA-NeXT's processor: both get
    exactly the pixels of the whole file's first frame, at the size the index counted."""
    import numpy as np

    pytest.importorskip("transformers")
    from transformers.image_utils import load_image

    from tests.helpers.processors import llava_next_processor, word_tokenizer
    from tokenbal.data import IndexedShardDataset, ProcessorDataset, load_processor
    from tokenbal.index import TokenIndex, build_index

    files = {fmt: _animation(fmt) for fmt in ("png", "gif")}
    cuts = {fmt: data[:len(data) * 5 // 6] for fmt, data in files.items()}
    shard = write_shard(tmp_path / "s.tar", [Sample(fmt, caption="a frame", raw=[(fmt, cut)])
                                             for fmt, cut in cuts.items()])
    build_index([shard], tmp_path / "idx", model="qwen2-vl", tokenizer=qwen2_vl_ckpt, progress=False)
    index = TokenIndex.open(tmp_path / "idx")
    assert list(index.keys) == ["png", "gif"] and not index.errors
    qwen = load_processor(qwen2_vl_ckpt)
    ds = ProcessorDataset(IndexedShardDataset(index, decode="pil"), qwen, strict=True)
    llava = llava_next_processor(word_tokenizer())
    for i, fmt in enumerate(index.keys):
        with Image.open(io.BytesIO(files[fmt])) as im:
            first = im.convert("RGB")                # the whole file's first frame
        item = ds[i]                                 # strict: raises unless the index's length is exact
        assert len(item["input_ids"]) == index.lengths[i]
        want = qwen.image_processor(images=first, return_tensors="np")
        assert np.array_equal(item["pixel_values"], want["pixel_values"])
        assert item["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
        path = tmp_path / f"cut.{fmt}"
        path.write_bytes(cuts[fmt])
        for image in (load_image(str(path)), IndexedShardDataset(index, decode="pil")[i][fmt]):
            got = llava.image_processor(images=image, return_tensors="np")
            ref = llava.image_processor(images=first, return_tensors="np")
            assert np.array_equal(got["pixel_values"], ref["pixel_values"])
            assert got["image_sizes"].tolist() == [[48, 64]]


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def pread(self, n: int, offset: int) -> bytes:
        return self.data[offset:offset + n]


# -- Parquet rows: the image bytes are a whole column value, but the image may still be cut ----------

def test_a_parquet_row_whose_image_is_cut_short_is_an_error_naming_the_row(tmp_path):
    from tokenbal.index.parquet import scan_parquet

    images = {"jpeg": _encode("JPEG"), "png": _encode("PNG"), "webp": _encode("WEBP", lossless=True)}
    rows = []
    for fmt, data in images.items():
        cut = data[:len(data) // 2]
        assert _decoded_size(cut) is None
        rows += [(f"{fmt} whole", data), (f"{fmt} cut", cut), (f"{fmt} padded", data + b"\0" * 40)]
    file = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"image": pa.array([data for _, data in rows], pa.binary()),
                             "text": [f"<image>{label}" for label, _ in rows]}), file)
    scan = scan_parquet(str(file), exif="transpose")
    kept = {int(s.key.rsplit(":", 1)[1]) for s in scan.samples}
    assert sorted(rows[r][0] for r in kept) == sorted(label for label, _ in rows if "cut" not in label)
    assert len(scan.errors) == 3
    for err, fmt in zip(scan.errors, images, strict=True):
        row = [label for label, _ in rows].index(f"{fmt} cut")
        assert f"rows.parquet row group 0 row {row}: image 0 is not a readable image" in err["reason"]
        assert "cut short" in err["reason"], err


# -- generated images: the counted size is the decoded one, and a cut never passes ----------------

def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


KINDS = ("jpeg", "jpeg-progressive", "jpeg-cmyk", "png", "png-palette", "png-16", "png-la",
         "png-animated", "gif", "gif-animated", "webp", "webp-lossless", "webp-animated", "bmp",
         "tiff", "tiff-lzw", *(() if "avif" in MISSING else ("avif",)))


def _generate(kind: str, w: int, h: int, orientation: int) -> bytes:
    buf = io.BytesIO()
    im = _noise(w, h)
    frames = [_noise(w, h) for _ in range(2)]
    exif = _exif(orientation)
    fmt = kind.split("-")[0].upper()
    if kind == "jpeg-progressive":
        im.save(buf, "JPEG", progressive=True, exif=exif)
    elif kind == "jpeg-cmyk":
        im.convert("CMYK").save(buf, "JPEG", exif=exif)
    elif kind == "png-palette":
        im.convert("P").save(buf, "PNG", exif=exif)
    elif kind == "png-16":
        im.convert("I;16").save(buf, "PNG", exif=exif)
    elif kind == "png-la":
        im.convert("LA").save(buf, "PNG", exif=exif)
    elif kind == "tiff-lzw":
        im.save(buf, "TIFF", compression="tiff_lzw", exif=exif)
    elif kind.endswith("-animated"):
        im.save(buf, fmt, save_all=True, append_images=frames, **({} if fmt == "GIF" else {"exif": exif}))
    elif kind == "webp-lossless":
        im.save(buf, "WEBP", lossless=True, exif=exif)
    elif fmt in ("GIF", "BMP"):
        im.save(buf, fmt)
    else:
        im.save(buf, fmt, exif=exif)
    return buf.getvalue()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), w=st.integers(1, 160), h=st.integers(1, 160),
       orientation=st.integers(1, 8), cut=st.floats(0.0, 1.0, exclude_max=True))
def test_generated_images_count_their_decoded_size_and_a_cut_one_never_passes(kind, w, h, orientation, cut):
    data = _generate(kind, w, h, orientation)
    assert _counted(data) == _decoded_size(data)
    short = data[:max(1, int(len(data) * cut))]
    counted = _counted(short)
    if counted is not None:   # stricter than Pillow is allowed (a PNG without IEND); laxer is not
        assert counted == _decoded_size(short), (kind, len(short), len(data))


# -- headers that disagree with the pixel data they hold ------------------------------------------

def test_a_still_webp_whose_canvas_disagrees_with_its_image_is_an_error(tmp_path):
    """A VP8X header whose canvas is not the size of the still image inside: the scan counted the
    canvas (100x40), libwebp refuses to decode it ('could not create decoder object')."""
    buf = io.BytesIO()
    _noise(50, 40).save(buf, "WEBP", exif=_exif(1))   # EXIF makes it an extended (VP8X) file
    good = buf.getvalue()
    assert good[12:16] == b"VP8X"
    lying = bytearray(good)
    lying[24:27] = (99).to_bytes(3, "little")         # canvas width - 1
    assert _decoded_size(good) == (50, 40) and _decoded_size(bytes(lying)) is None
    scan = scan_shard(write_shard(tmp_path / "s.tar", [
        Sample("good", caption="ok", raw=[("webp", good)]),
        Sample("lying", caption="x", raw=[("webp", bytes(lying))])]))
    assert [(s.key, s.image_sizes) for s in scan.samples] == [("good", [(50, 40)])]
    (err,) = scan.errors
    assert err["key"] == "lying" and "canvas (VP8X) is 100x40 but its image is 50x40" in err["reason"], err


@pytest.mark.skipif("avif" in MISSING, reason="this Pillow writes no AVIF")
@pytest.mark.parametrize("w,h", [(1, 1), (40, 30)])
def test_an_avif_cut_anywhere_is_an_error_or_decodes_to_its_count(w, h):
    # Cut inside its last box's header, or at the end of its meta box, an AVIF's top-level boxes still
    # tile it (hypothesis found 1x1, 310 bytes cut to 271, counted 1x1): where its items' data lies
    # (the meta box's iloc) says the pixels are missing. Every cut point: 32 were counted before.
    data = _generate("avif", w, h, 1)
    for n in range(1, len(data)):
        counted = _counted(data[:n])
        assert counted is None or counted == _decoded_size(data[:n]), (n, len(data), counted)
