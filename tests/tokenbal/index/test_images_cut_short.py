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
