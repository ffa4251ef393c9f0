"""Every image format Pillow opens is counted, its orientation is the one ``exif_transpose`` acts on
(EXIF and XMP), and a format it cannot open is a counted error naming it (docs/RELIABILITY.md).
The oracle is the installed Pillow itself: ``ImageOps.exif_transpose(Image.open(f)).size``, which is
what transformers' ``load_image`` hands the processor."""

from __future__ import annotations

import io
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from tests.helpers.corpus import Sample, image_bytes, write_shard
from tokenbal.data.indexed import IndexedShardDataset
from tokenbal.index import TokenIndex, build_index
from tokenbal.index.imagesize import IMAGE_EXTS, PILLOW_EXTS, PLUGIN_EXTS, read_image_size
from tokenbal.index.scan import scan_shard

W, H = 60, 40
XMP_ATTR = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-'
            b'syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="%d"/>'
            b"</rdf:RDF></x:xmpmeta>")
XMP_ELEM = (b"<x:xmpmeta><rdf:Description><tiff:Orientation>%d</tiff:Orientation></rdf:Description>"
            b"</x:xmpmeta>")
# Pillow opens these only with an outside program or a stub handler, or they are videos / save-only.
NOT_COUNTED = {"eps", "ps", "wmf", "emf", "h5", "hdf", "grib", "bufr", "mpeg", "mpg", "pdf", "palm"}


def _picture(mode: str = "RGB") -> Image.Image:
    im = Image.new(mode, (W, H), (200, 30, 10) if mode == "RGB" else 90)
    im.paste((10, 200, 40) if mode == "RGB" else 200, (0, 0, W // 3, H // 2))
    return im


def _encode(fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    _picture("L" if fmt == "XBM" else "RGB").convert("1" if fmt == "XBM" else "RGB").save(buf, fmt, **kw)
    return buf.getvalue()


def _exif(orientation: int | None, **tags) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    for tag, value in tags.items():
        exif[int(tag[1:])] = value
    return exif.tobytes()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with(chunk: bytes, after_pixels: bool) -> bytes:
    png = _encode("PNG")
    return png[:-12] + chunk + png[-12:] if after_pixels else png[:33] + chunk + png[33:]


def _encode_photo_png() -> bytes:
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def _rechunk(png: bytes, size: int) -> bytes:
    """``png`` with its pixel data in IDAT chunks of ``size`` bytes."""
    pos, before, idat = 8, [], b""
    while png[pos + 4:pos + 8] != b"IEND":
        n = int.from_bytes(png[pos:pos + 4], "big")
        if png[pos + 4:pos + 8] == b"IDAT":
            idat += png[pos + 8:pos + 8 + n]
        else:
            before.append(png[pos:pos + 12 + n])
        pos += 12 + n
    chunks = [_png_chunk(b"IDAT", idat[i:i + size]) for i in range(0, len(idat), size)]
    return png[:8] + b"".join(before) + b"".join(chunks) + png[pos:]


def _oracle(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as im:
        return ImageOps.exif_transpose(im).size


def _counted(tmp_path, data: bytes, exif: str = "transpose", prefix: int = 64 * 1024) -> tuple[int, int]:
    path = tmp_path / "img.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_image_size(fd, 0, len(data), prefix=prefix, exif=exif)[0]
    finally:
        os.close(fd)


def test_the_image_extensions_are_every_format_pillow_opens_by_itself():
    Image.init()
    # MPO files are opened by the JPEG reader (Image.OPEN lists no MPO entry of its own).
    opened = {ext[1:] for ext, fmt in Image.registered_extensions().items()
              if fmt in Image.OPEN or fmt == "MPO"}
    assert PILLOW_EXTS == opened - NOT_COUNTED, "IMAGE_EXTS must follow the installed Pillow"
    assert IMAGE_EXTS == PILLOW_EXTS | PLUGIN_EXTS and {"heic", "heif", "avif", "jp2"} <= IMAGE_EXTS


# The formats this Pillow writes (so the test can make them), with the member extension used.
WRITTEN = [("AVIF", "avif"), ("JPEG2000", "jp2"), ("JPEG2000", "j2k"), ("WEBP", "webp"), ("TIFF", "tif"),
           ("BMP", "bmp"), ("GIF", "gif"), ("PNG", "png"), ("JPEG", "jpg"), ("TGA", "tga"), ("QOI", "qoi"),
           ("PPM", "ppm"), ("PCX", "pcx"), ("SGI", "sgi"), ("DDS", "dds"), ("ICO", "ico")]


def _heic_bytes() -> bytes:
    # An ISO-BMFF file with HEIC brands (what an iPhone writes first); no opener here without pillow-heif.
    ftyp = b"ftyp" + b"heic" + b"\0\0\0\0" + b"mif1heic"
    return struct.pack(">I", 8 + len(ftyp)) + ftyp + struct.pack(">I", 16) + b"meta" + bytes(8)


def test_every_format_pillow_opens_is_counted_and_read_and_heic_is_a_named_error(tmp_path):
    # The reproduction: "<image>" text plus a .avif member was indexed as 2 text tokens, no error.
    samples = [Sample(f"s{n}", caption="<image> what is it", raw=[(ext, _encode(fmt))])
               for n, (fmt, ext) in enumerate(WRITTEN)]
    pillow_heif = any(fmt == "HEIF" for fmt in Image.registered_extensions().values())
    samples.append(Sample("heic", caption="<image> a phone photo", raw=[("heic", _heic_bytes())]))
    shard = write_shard(tmp_path / "formats.tar", samples)
    scan = scan_shard(shard, exif="transpose")
    by_key = {s.key: s for s in scan.samples}
    for n, (fmt, _) in enumerate(WRITTEN):
        sample = by_key.get(f"s{n}")
        assert sample is not None, (fmt, [e["reason"] for e in scan.errors])
        assert sample.image_sizes == [_oracle(_encode(fmt))], fmt
        assert sample.text == " what is it"
    errors = {e["key"]: e["reason"] for e in scan.errors}
    if not pillow_heif:
        assert "heic" not in by_key
        assert "HEIC image, which the installed Pillow cannot open" in errors["heic"]
        assert "pillow-heif" in errors["heic"]
    # The reader decodes each one (both orientation policies) to the size the index counted.
    for policy in ("transpose", "ignore"):
        idx = TokenIndex.open(build_index([shard], tmp_path / f"idx-{policy}", exif=policy,
                                          progress=False).out)
        assert len(idx) == len(WRITTEN)
        ds = IndexedShardDataset(idx, decode="pil")
        for i in range(len(idx)):
            got = ds[i]
            ext = next(k for k in got if not k.startswith("__") and k != "txt")
            assert isinstance(got[ext], Image.Image), ext
            assert got[ext].size == tuple(idx.image_sizes(i)[0])


def _orientation_cases() -> list[tuple[str, bytes]]:
    cases = []
    for o in (1, 3, 5, 6, 8):
        for fmt in ("JPEG", "WEBP", "AVIF"):
            cases += [(f"{fmt} xmp={o}", _encode(fmt, xmp=XMP_ATTR % o)),
                      (f"{fmt} xmp-element={o}", _encode(fmt, xmp=XMP_ELEM % o)),
                      (f"{fmt} exif=1 xmp={o}", _encode(fmt, exif=_exif(1), xmp=XMP_ATTR % o)),
                      (f"{fmt} exif=none xmp={o}",
                       _encode(fmt, exif=_exif(None, t306="2020"), xmp=XMP_ATTR % o)),
                      (f"{fmt} exif={o} xmp=6", _encode(fmt, exif=_exif(o), xmp=XMP_ATTR % 6))]
        for after in (False, True):
            where = "after" if after else "before"
            xmp = XMP_ATTR % o
            cases += [
                (f"PNG iTXt xmp={o} {where}",
                 _png_with(_png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + xmp), after)),
                (f"PNG zipped iTXt xmp={o} {where}",
                 _png_with(_png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\1\0\0\0" + zlib.compress(xmp)), after)),
                (f"PNG tEXt xmp={o} {where}",
                 _png_with(_png_chunk(b"tEXt", b"XML:com.adobe.xmp\0" + xmp), after)),
                (f"PNG eXIf={o} {where}", _png_with(_png_chunk(b"eXIf", _exif(o)[6:]), after))]
        raw = b"Exif\0\0" + _exif(o)[6:]
        profile = b"\nexif\n%8d\n%s\n" % (len(raw), raw.hex().encode())
        cases += [(f"PNG raw profile={o}", _png_with(_png_chunk(b"zTXt", b"Raw profile type exif\0\0"
                                                                + zlib.compress(profile)), False)),
                  (f"TIFF xmp={o}", _encode("TIFF", tiffinfo={700: XMP_ATTR % o})),
                  (f"TIFF tag={o} xmp=6", _encode("TIFF", tiffinfo={274: o, 700: XMP_ATTR % 6}))]
    # Photo-sized PNGs: the metadata after the pixel data is found from the tail (IDAT chunks of
    # 8 KiB as libpng writes them, Pillow's 64 KiB ones, and one IDAT larger than the tail window).
    for idat in (8192, 65536, 1 << 22):
        png = _rechunk(_encode_photo_png(), idat)
        for o in (6, 8):
            exif = _png_chunk(b"eXIf", _exif(o)[6:]) + _png_chunk(b"tEXt", b"date:create\0" + b"2020")
            xmp = _png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + XMP_ATTR % o)
            cases += [(f"large PNG idat={idat} eXIf={o} after", png[:-12] + exif + png[-12:]),
                      (f"large PNG idat={idat} iTXt xmp={o} after", png[:-12] + xmp + png[-12:])]
    # libwebp keeps an XMP chunk only when the VP8X flags announce it: one that does not is ignored.
    unflagged = bytearray(_encode("WEBP", xmp=XMP_ATTR % 6, lossless=True))
    unflagged[20] &= ~0x04
    cases.append(("WEBP xmp=6 unflagged", bytes(unflagged)))
    return cases


def test_the_counted_size_is_exif_transposes_for_exif_and_xmp_orientation_in_every_place(tmp_path):
    mismatches = []
    swapped = 0
    for name, data in _orientation_cases():
        want = _oracle(data)
        swapped += want == (H, W)
        for prefix in (64 * 1024, 16):   # the header walk, and the rare path (Pillow read the size)
            got = _counted(tmp_path, data, prefix=prefix)
            if got != want:
                mismatches.append(f"{name} (prefix {prefix}): counted {got}, exif_transpose gives {want}")
        assert _counted(tmp_path, data, exif="ignore") == Image.open(io.BytesIO(data)).size
    assert not mismatches, "\n".join(mismatches)
    assert swapped > 40, "the cases must exercise the swap"


def test_xmp_orientation_llava_next_counts_what_load_image_gives(tmp_path, next_proc):
    # The reproduction: one photo with tiff:Orientation=6 in XMP only; the index counted the stored
    # 1,360 tokens where the processor, after load_image, gives 792; the reader then failed forever.
    from transformers.image_utils import load_image

    path = tmp_path / "photo.jpg"
    Image.new("RGB", (1280, 480), (9, 99, 199)).save(path, "JPEG", xmp=XMP_ATTR % 6)
    shard = write_shard(tmp_path / "xmp.tar", [Sample("p", caption="a photo",
                                                      raw=[("jpg", path.read_bytes())])])
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", model="llava-next", progress=False).out)

    def count(w, h):
        out = next_proc(text="hi <image>", images=Image.new("RGB", (w, h)), return_tensors="np")
        return int((out["input_ids"] == 1).sum())

    offsets, tokens = idx.image_tokens_table
    assert int(tokens[offsets[0]]) == count(*load_image(str(path)).size) != count(1280, 480)
    got = IndexedShardDataset(idx, decode="pil")[0]["jpg"]
    assert got.size == (480, 1280) == tuple(idx.image_sizes(0)[0])


@pytest.mark.parametrize("side", [8192, 16384])
def test_a_webp_over_pillows_pixel_limit_is_refused_as_pillow_refuses_it(tmp_path, side):
    # The WebP header is parsed by hand; a canvas over twice Image.MAX_IMAGE_PIXELS must be refused as
    # Pillow (and so every loader) refuses it, not counted. 8192² is under the limit: counted.
    buf = io.BytesIO()
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue")]
    frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:], duration=100)
    data = bytearray(buf.getvalue())
    assert data[12:16] == b"VP8X"
    data[24:27] = data[27:30] = (side - 1).to_bytes(3, "little")      # the VP8X canvas
    data = bytes(data)
    over = side * side > 2 * Image.MAX_IMAGE_PIXELS
    try:
        pillow = Image.open(io.BytesIO(data)).size
    except Image.DecompressionBombError:
        pillow = None
    assert (pillow is None) == over
    if over:
        with pytest.raises(ValueError, match=r"DecompressionBombError: Image size \(268435456 pixels\)"):
            _counted(tmp_path, data)
    else:
        assert _counted(tmp_path, data) == pillow == (side, side)


def test_a_gif_cut_where_its_last_byte_is_0x3b_is_cut_short(tmp_path):
    whole = image_bytes("gif", 64, 48)
    with_trailer_byte = [n for n in range(20, len(whole) - 1) if whole[n - 1] == 0x3B]
    cut = whole[:with_trailer_byte[0]] if with_trailer_byte else None
    if cut is None:   # make one: a cut whose last byte is 0x3B, inside the LZW data
        cut = whole[:len(whole) // 2 - 1] + b";"
    samples = [Sample("whole", caption="ok", raw=[("gif", whole)]),
               Sample("cut", caption="cut", raw=[("gif", cut)]),
               Sample("padded", caption="ok", raw=[("gif", whole + b"\0\0")])]
    scan = scan_shard(write_shard(tmp_path / "gif.tar", samples))
    assert [s.key for s in scan.samples] == ["whole", "padded"]
    (err,) = scan.errors
    assert err["key"] == "cut" and "GIF cut short" in err["reason"]
