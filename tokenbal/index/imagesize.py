"""Image width/height from the first bytes of a file, without decoding pixels.

* PNG / GIF / BMP / TIFF / AVIF / JPEG 2000 / every other format Pillow opens (``IMAGE_EXTS``):
  Pillow's lazy ``Image.open(...).size`` on a prefix of the member (the first 4 KiB, then 64 KiB).
  Pillow reads only the header there, in ~10-20 µs whatever the image size. When the prefix is not
  enough (a JPEG whose SOF marker sits behind a large ICC/EXIF segment, a TIFF whose IFD is at the
  end, an AVIF, which libavif parses whole) the whole member is read and opened again. A HEIC /
  HEIF / JPEG XL file Pillow has no opener for is an error naming the format (``unopened_format``).
* WebP: parsed by hand from the first 30 bytes (VP8 / VP8L / VP8X chunk). Pillow's WebP ``open``
  builds a full animation decoder, costs time proportional to the file size and fails on a prefix.
* JPEG: parsed by hand (``jpeg_size``, ~2 µs instead of Pillow's ~40 µs, the largest per-sample cost
  of an index build) when the marker segments up to the start of scan are well formed and hold
  nothing Pillow would reject; anything else (junk between markers, a 12-bit or 2-layer frame, a
  short JFIF / Adobe / ICC segment, a segment cut by the prefix, a decompression bomb) goes to
  Pillow, so the result, or the error, is always Pillow's.

EXIF orientation: ``read_image_size(..., exif="transpose")`` (the index default) reports the size
after ``PIL.ImageOps.exif_transpose``, as transformers' ``load_image`` and tokenbal's reader see the
image: orientations 5-8 swap width and height. The orientation is the one Pillow's ``getexif`` gives
``exif_transpose``: the EXIF tag, else an XMP ``tiff:Orientation`` (see "orientation" below for where
each format keeps them). It is read by hand from a JPEG's APP1 segments (from the same walk that
reads the size), a WebP's EXIF / XMP chunks (one small read per chunk header) and a PNG's metadata
chunks before its pixel data and after it (found from the tail); other formats ask Pillow's lazy
open. ``"ignore"`` reports the size as stored.

End check: a member cut short (a JPEG without its end-of-image marker, a PNG without ``IEND``, a WebP
shorter than its RIFF header says) is an ``ImageSizeError``: its header is intact, so its size reads
fine, but it cannot be decoded. It costs one 32-byte read of the tail. Where the tail holds no end
marker, a JPEG's or PNG's whole member is read and walked (``_ends_inside``): bytes after a complete
image (a motion photo's video after the JPEG, padding), which Pillow ignores, are no error. A GIF has
no length field and its data may end in the trailer byte by chance, so its blocks are walked to the end
of its first frame (read from its start as far as that). Animations: Pillow's ``load`` /
``convert("RGB")`` decode the first frame only, and that frame is all that transformers' ``load_image``,
the image processors given a PIL image (Qwen2-VL, LLaVA-NeXT: measured on transformers 4.57, 5.24,
5.25) and tokenbal's readers see; so an animated PNG or GIF cut after its first frame is counted, with
the first frame's size (``_apng_first_frame_whole``, ``_check_gif_first_frame``).

Formats that Pillow opens from a header declaring where the pixel data lies are checked against that
declaration (``_cut_short``): an AVIF / HEIF / JPEG 2000 file's
top-level boxes must fit in the member (one small read per box), a TIFF's first-page strips or tiles
(offsets + byte counts from its IFD), an uncompressed BMP's rows (offset + stride x height); and a
still extended (VP8X) WebP's canvas must be the size of its image, or libwebp refuses it. Any other
format Pillow opens is checked against the pixel data its lazy open places (``_tiles_cut``): raw rows
(offset + stride x rows: binary PPM / PGM / PBM / PFM, uncompressed TGA / SGI / MSP / ...), a PPM's
scaled samples (maxval not 255 / 65535), a BMP's RLE8 / RLE4 codes counted as Pillow's decoder counts
them (one pass over the codes: ~25-50 ms for a 640x480 noise image, rare in VLM data). Compressed
formats end in their documented end marker: a QOI's 8-byte end marker (``_qoi_cut``; a QOI without it
at its very end, cut or padded, has its ops walked as Pillow's decoder counts them), a raw JPEG 2000
codestream's tile-parts (SOT lengths) leading to its EOC marker (``_j2k_cut``); a plain (ASCII) PBM /
PGM / PPM must hold as many samples as its header needs, a run-length TGA's packets give every pixel
(``_tga_rle_short``), an RLE SGI's rows (its offset and length tables) lie inside it, a PCX's
run-length lines are all there (walked by Pillow's own decoder into a one-pixel-wide image:
``_pcx_short``), a DDS's blocks or pixels follow its header, an XBM holds a ``0x..`` byte for every 8
pixels of each row (``_xbm_short``), a BLP's mipmap table, palette and first mipmap lie inside it
(``_blp_short``). Still not end-checked: a 16-bit SGI, and the formats whose pixel data Pillow's
open does not place (PSD, ICNS, FLI, ...).
"""

from __future__ import annotations

import functools
import io
import os
import re
import struct
import warnings
import zlib
from typing import Any

from PIL import Image, UnidentifiedImageError

from tokenbal.index.boxes import boxes_fault, item_data_fault

# Extensions (last dot-component, lower case) whose members are images: one set for the index scan
# and the reader. Every format the installed Pillow opens by itself (the test compares it with
# ``PIL.Image.registered_extensions()``), less the ones it opens only through an outside program or
# a stub handler (EPS, WMF, HDF5, GRIB, BUFR), MPEG (a video here) and PDF / Palm (save only); plus
# HEIC / HEIF / JPEG XL, which it opens only with a plugin (pillow-heif, ...): without one such a
# member is a counted error naming its format, never a sample that silently lost its image.
PILLOW_EXTS = frozenset({
    "jpg", "jpeg", "jpe", "jfif", "mpo", "png", "apng", "webp", "gif", "bmp", "dib", "tif", "tiff",
    "ppm", "pgm", "pbm", "pnm", "pfm", "avif", "avifs", "jp2", "j2k", "jpc", "jpf", "jpx", "j2c",
    "ico", "cur", "icns", "tga", "icb", "vda", "vst", "qoi", "psd", "pcx", "dcx", "sgi", "rgb", "rgba",
    "bw", "ras", "xbm", "xpm", "dds", "blp", "ftc", "ftu", "fli", "flc", "gbr", "msp", "pcd", "pxr",
    "fit", "fits", "im", "iim"})
PLUGIN_EXTS = frozenset({"heic", "heif", "heics", "heifs", "hif", "jxl"})
IMAGE_EXTS = PILLOW_EXTS | PLUGIN_EXTS
PREFIX_BYTES = 64 * 1024
FIRST_READ = 4 * 1024
EXIF_POLICIES = ("transpose", "ignore")
TAIL_BYTES = 32            # bytes at a member's end read for the end-marker check (_check_end)


class ImageSizeError(ValueError):
    """The bytes are not an image whose size can be read; the message says why."""


def webp_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from the first 30 bytes of a WebP file; ``None`` if it is not WebP.

    Raises ``ImageSizeError`` for a RIFF/WEBP file whose first chunk is not a valid VP8/VP8L/VP8X.
    """
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WEBP":
        return None
    if len(head) < 30:
        raise ImageSizeError(f"WebP file too short for a header ({len(head)} bytes)")
    chunk = head[12:16]
    if chunk == b"VP8 ":
        # Lossy: 3-byte frame tag, start code 9d 01 2a, then 14-bit width and height (2 bits scale).
        if head[23:26] != b"\x9d\x01\x2a":
            raise ImageSizeError("WebP VP8 chunk without the key-frame start code")
        w = int.from_bytes(head[26:28], "little") & 0x3FFF
        h = int.from_bytes(head[28:30], "little") & 0x3FFF
    elif chunk == b"VP8L":
        # Lossless: signature 0x2f, then width-1 and height-1 as 14-bit fields, LSB first.
        if head[20] != 0x2F:
            raise ImageSizeError("WebP VP8L chunk without the 0x2f signature")
        bits = int.from_bytes(head[21:25], "little")
        w = (bits & 0x3FFF) + 1
        h = ((bits >> 14) & 0x3FFF) + 1
    elif chunk == b"VP8X":
        # Extended: 4 bytes of flags, then canvas width-1 and height-1 as 24-bit little endian.
        w = int.from_bytes(head[24:27], "little") + 1
        h = int.from_bytes(head[27:30], "little") + 1
    else:
        raise ImageSizeError(f"WebP file with unknown first chunk {chunk!r}")
    return w, h


# SOF markers Pillow reads a frame size from (0xFFDE, DHP, also goes to Pillow's SOF: rare, fallback).
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_SKIP = frozenset({0xC4, 0xCC, 0xDC, 0xDD, 0xDF, 0xFE})          # DHT, DAC, DNL, DRI, EXP, COM
# APP payloads whose fields Pillow indexes into: (start, minimum length Pillow reads safely).
_APP_MIN = ((0xE0, b"JFIF", 7), (0xE2, b"ICC_PROFILE\0", 14), (0xEE, b"Adobe", 12))


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a well-formed JPEG header in ``data``, the size Pillow's ``Image.open``
    reports; ``None`` when Pillow must judge the bytes (see the module docstring)."""
    return _jpeg_header(data)[0]


_JPEG_XMP = b"http://ns.adobe.com/xap/1.0/\x00"   # the APP1 XMP signature of Pillow's JPEG reader


def _jpeg_header(data: bytes) -> tuple[tuple[int, int] | None, bytes | None, bytes | None]:
    """``jpeg_size``, plus the orientation's sources met on the way (the walk reads them for free):
    the first APP1 Exif payload and the last APP1 XMP packet, the ones Pillow's reader keeps."""
    if data[:3] != b"\xff\xd8\xff":
        return None, None, None
    n = len(data)
    pos, size, exif, xmp = 2, None, None, None
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None, None, None              # junk between segments: Pillow skips it, we don't
        marker = data[pos + 1]
        if 0xD0 <= marker <= 0xD7 or marker == 0xD8:
            pos += 2                         # standalone markers
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        end = pos + 2 + length
        if length < 2 or end > n:
            return None, None, None                    # cut by the prefix (or broken): Pillow decides
        if marker == 0xDA:                   # start of scan: Pillow stops reading here
            if size is None or size[0] <= 0 or size[1] <= 0:
                return None, None, None
            limit = Image.MAX_IMAGE_PIXELS
            if limit is not None and size[0] * size[1] > 2 * limit:
                return None, None, None                # Pillow raises DecompressionBombError
            return size, exif, xmp
        if marker in _SOF:
            seg = data[pos + 4:end]
            if len(seg) < 6 or seg[0] != 8 or seg[5] not in (1, 3, 4):
                return None, None, None                # Pillow: "cannot handle ..." errors
            size = ((seg[3] << 8) | seg[4], (seg[1] << 8) | seg[2])
        elif marker == 0xDB:
            seg, i = data[pos + 4:end], 0
            while i < len(seg):              # Pillow rejects a table cut short
                i += 1 + (64 if seg[i] < 16 else 128)
                if i > len(seg):
                    return None, None, None
        elif 0xE0 <= marker <= 0xEF:
            if marker == 0xE1 and exif is None and data.startswith(b"Exif\0\0", pos + 4):
                exif = data[pos + 10:end]
            elif marker == 0xE1 and data.startswith(_JPEG_XMP, pos + 4):
                xmp = data[pos + 4 + len(_JPEG_XMP):end]
            for app, head, need in _APP_MIN:
                if marker == app and data.startswith(head, pos + 4) and length - 2 < need:
                    return None, None, None
        elif marker not in _SKIP:
            return None, None, None                    # EOI before a scan, JPG-n, reserved markers
        pos = end
    return None, None, None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an image held (at least its header) in ``data``; raises ``ImageSizeError``."""
    if not data:
        raise ImageSizeError("empty (0 bytes)")
    wh = webp_size(data[:30])
    if wh is not None:
        # Pillow refuses to open an image over twice its pixel limit (the JPEG walk hands those to
        # Pillow); the WebP parse must too, or the index counts an image no loader will open.
        limit = Image.MAX_IMAGE_PIXELS
        pixels = max(1, wh[0]) * max(1, wh[1])
        if limit is not None and pixels > 2 * limit:
            raise ImageSizeError(f"DecompressionBombError: Image size ({pixels} pixels) exceeds limit of "
                                 f"{2 * limit} pixels, could be decompression bomb DOS attack.")
    wh = wh or jpeg_size(data)
    if wh is None:
        try:
            with Image.open(io.BytesIO(data)) as im:
                wh = im.size
        # Pillow signals malformed input with many exception types (UnidentifiedImageError,
        # SyntaxError, struct.error, DecompressionBombError, ...): any of them means "no size".
        except UnidentifiedImageError as e:
            name = unopened_format(data)
            opened = name is not None and _PILLOW_ID.get(name) in Image.OPEN
            if opened and data[4:8] == b"ftyp":
                # Pillow's AVIF opener (libavif) refuses a file cut short as not an image at all: the
                # box sizes say what happened.
                cut = _boxes_cut(lambda n, at: data[at:at + n], len(data), name)
                if cut is not None:
                    raise ImageSizeError(cut) from None
            if data[:4] in _TIFF_SIGS[:2]:
                order = "little" if data[:2] == b"II" else "big"
                ifd = int.from_bytes(data[4:8], order)
                if ifd + 2 > len(data):   # libtiff writes the IFD after the pixel data
                    raise ImageSizeError(f"TIFF cut short: its first IFD (the page's tags) at byte {ifd} "
                                         f"lies past its end (byte {len(data)})") from None
            if opened:
                raise ImageSizeError(f"{name} image that the installed Pillow, which opens {name}, cannot "
                                     f"read: {e}") from None
            if name is not None:
                why = str(e) if "support not installed" in str(e) else "no opener for it is registered"
                raise ImageSizeError(f"{name} image, which the installed Pillow cannot open ({why}; "
                                     f"{_PLUGIN_HINT.get(name, 'install a Pillow plugin for it')})") from None
            # Pillow's own message names a BytesIO object; the first bytes say more.
            raise ImageSizeError(f"not a known image format (starts with {data[:16]!r})") from None
        except Exception as e:
            raise ImageSizeError(f"{type(e).__name__}: {e}") from None
    w, h = int(wh[0]), int(wh[1])
    if w <= 0 or h <= 0:
        raise ImageSizeError(f"image header gives a size of {w}x{h}")
    return w, h


_PILLOW_ID = {"AVIF": "AVIF", "HEIC": "HEIF", "HEIF": "HEIF", "JPEG XL": "JXL"}   # Image.OPEN's ids
_HEVC_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs"})
_PLUGIN_HINT = {"HEIC": "pillow-heif provides one: pillow_heif.register_heif_opener()",
                "HEIF": "pillow-heif provides one: pillow_heif.register_heif_opener()",
                "AVIF": "a Pillow built with libavif opens it", "JPEG XL": "a JPEG XL plugin provides one"}


def unopened_format(data: bytes) -> str | None:
    """The name of the image format of ``data`` from its signature, for the formats Pillow may not
    open (HEIC / HEIF / AVIF in an ISO-BMFF ``ftyp`` box, JPEG XL); ``None`` for anything else."""
    if data[4:8] == b"ftyp":
        end = min(len(data), int.from_bytes(data[:4], "big"))
        brands = {data[8:12]} | {data[i:i + 4] for i in range(16, end - 3, 4)}
        if brands & _HEVC_BRANDS:
            return "HEIC"
        if brands & {b"avif", b"avis"}:
            return "AVIF"
        if brands & {b"mif1", b"msf1"}:
            return "HEIF"
    if data[:2] == b"\xff\x0a" or data[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n":
        return "JPEG XL"
    return None


def read_image_size(fd, offset: int, size: int, prefix: int = PREFIX_BYTES,
                    exif: str = "ignore") -> tuple[tuple[int, int], bool]:
    """Size of the image stored at ``[offset, offset + size)`` of the open file ``fd``.

    Returns ``((width, height), full_read)``; ``full_read`` is True when the prefix was not enough
    and the whole member had to be read. ``exif="transpose"``: the size after EXIF orientation (see
    the module docstring). Raises ``ImageSizeError`` (not an image, or cut short) or ``OSError``.
    """
    if exif not in EXIF_POLICIES:
        raise ValueError(f"exif policy must be one of {EXIF_POLICIES}, got {exif!r}")
    if size == 0:
        raise ImageSizeError("empty (0 bytes)")
    # Headers almost always sit in the first KiBs; copying 64 KiB per image was the largest cost of a
    # build (measured: ~35 µs of ~250 µs per JPEG sample). So read 4 KiB, then the prefix, then all.
    found, orientation = None, None
    for n in sorted({min(size, FIRST_READ, prefix), min(size, prefix)}):
        head = pread_exact(fd, n, offset)
        if exif == "transpose" and head[:3] == b"\xff\xd8\xff":
            wh, exif_block, xmp = _jpeg_header(head)     # the size and the orientation from one walk
            if wh is not None:
                found, orientation = (wh, False), pillow_orientation(exif_block, xmp)
                break
        try:
            found = image_size(head), False
            break
        except ImageSizeError:
            if size <= n:
                raise
    if found is None:
        # The header did not fit in the prefix: retry on the whole member (the error from that
        # attempt, not the prefix one, is the one worth reporting).
        head = pread_exact(fd, size, offset)
        found = image_size(head), True
    n_tail = min(size, TAIL_BYTES)
    tail = head[-n_tail:] if len(head) == size else pread_exact(fd, n_tail, offset + size - n_tail)
    try:
        _check_end(head, tail, size)
    except ImageSizeError:
        # Bytes may follow a complete image (a motion photo's video after the JPEG, padding after
        # IEND), which Pillow ignores: the whole member's structure says whether its end is there.
        if not _ends_inside(head if len(head) == size else pread_exact(fd, size, offset)):
            raise
    if head[:4] == b"GIF8":
        # A GIF has no length field and its LZW data can end in 0x3B, so the tail alone cannot
        # tell a trailer from a cut: its block structure is walked, up to the end of its first
        # frame (all that Pillow decodes, so all that transformers' load_image and tokenbal's
        # readers see: a later frame cut short is no error).
        _check_gif_first_frame(fd, offset, size, head)
    why = _cut_short(fd, offset, size, head)
    if why is not None:
        raise ImageSizeError(why)
    (w, h), full = found
    if exif == "transpose" and orientation is None:
        orientation = exif_orientation(fd, offset, size, head)
    if exif == "transpose" and orientation in (5, 6, 7, 8):
        w, h = h, w
    return (w, h), full


def tail_bytes(name: str) -> int:
    """How many bytes at the end of the image member ``name`` the scan reads (a remote scan fetches
    them with the heads): the end marker's 32, a PNG's metadata window (``_png_after_pixels``), a
    GIF's whole member (its blocks are walked)."""
    ext = name.rsplit(".", 1)[-1].lower()
    return PNG_TAIL_WINDOW // 4 if ext in ("png", "apng") else (1 << 62) if ext == "gif" else TAIL_BYTES


def _check_end(head: bytes, tail: bytes, size: int) -> None:
    """Raise ``ImageSizeError`` for an image whose end marker is missing (cut short)."""
    if head[:3] == b"\xff\xd8\xff":
        if b"\xff\xd9" not in tail:   # EOI; may be followed by padding, so search the tail
            raise ImageSizeError(f"JPEG cut short: no end-of-image marker (FF D9) in its last {len(tail)} "
                                 f"bytes ({size} bytes in all)")
    elif head[:8] == b"\x89PNG\r\n\x1a\n":
        if b"IEND" not in tail:
            raise ImageSizeError(f"PNG cut short: no IEND chunk at its end ({size} bytes in all)")
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        riff = int.from_bytes(head[4:8], "little") + 8
        if riff > size:
            raise ImageSizeError(f"WebP cut short: its RIFF header says {riff} bytes, the member has {size}")


_JP2_SIG = b"\x00\x00\x00\x0cjP  \r\n\x87\n"
_TIFF_SIGS = (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")


def _cut_short(fd, offset: int, size: int, head: bytes) -> str | None:
    """Why a BMP, TIFF, AVIF / HEIF or JPEG 2000 member is cut short, or an extended WebP's header
    disagrees with its image (``None``: neither, or another format), from the structure its header
    declares: an ISO-BMFF / JP2 file's top-level box sizes, a TIFF's first-page strips or tiles
    (offsets + byte counts), an uncompressed BMP's rows, a still VP8X WebP's canvas against its
    image. Pillow opens each of them from its header alone and fails only on decoding the pixels."""
    def read(n: int, at: int) -> bytes:
        return head[at:at + n] if at + n <= len(head) else pread_exact(fd, min(n, size - at), offset + at)

    if head[4:8] == b"ftyp" or head[:12] == _JP2_SIG:
        return _boxes_cut(read, size, unopened_format(head) or "JPEG 2000")
    if head[:4] in _TIFF_SIGS:
        return _tiff_cut(fd, offset, size, head)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_canvas_mismatch(read, size, head)
    if head[:3] == b"\xff\xd8\xff" or head[:8] == _PNG_SIG or head[:4] == b"GIF8":
        return None                    # end markers: _check_end, _ends_inside, _check_gif_first_frame
    if head[:4] == b"qoif":
        return _qoi_cut(read, size)
    if head[:4] == _J2K_SIG:
        return _j2k_cut(read, size)
    # Any other format Pillow opens (BMP, PPM / PGM / PBM / PFM, TGA, SGI, IM, MSP, ...): the pixel
    # data its tiles declare (raw rows of a known stride, a BMP's RLE codes) must fit in the member.
    return _tiles_cut(read, size, head)


def _webp_canvas_mismatch(read, size: int, head: bytes) -> str | None:
    """Why an extended (VP8X) still WebP cannot be decoded though its header reads: libwebp refuses
    one whose canvas is not the size of its image (the VP8 / VP8L chunk after ICCP / ALPH / ...).
    An animation's frames are placed on the canvas and may be smaller: not checked."""
    if head[12:16] != b"VP8X" or len(head) < 30 or head[20] & 0x02:
        return None
    canvas = webp_size(head[:30])
    pos = 30
    while pos + 18 <= size:
        chunk = read(18, pos)          # a chunk header and the first 10 bytes of its payload
        if chunk[:4] in (b"VP8 ", b"VP8L"):
            try:
                image = webp_size(head[:12] + chunk)
            except ImageSizeError:
                return None            # a damaged bitstream: Pillow decides
            if image != canvas:
                return (f"WebP damaged: its canvas (VP8X) is {canvas[0]}x{canvas[1]} but its image is "
                        f"{image[0]}x{image[1]}; libwebp refuses to decode it")
            return None
        n = int.from_bytes(chunk[4:8], "little")
        pos += 8 + n + (n & 1)
    return None


def _boxes_cut(read, size: int, name: str) -> str | None:
    """Why an ISO-BMFF (AVIF, HEIF) or JPEG 2000 image ``name`` of ``size`` bytes is cut short, from
    its top-level box sizes (:func:`tokenbal.index.boxes.boxes_fault`) and, for ISO-BMFF, where its
    items' data lies (:func:`tokenbal.index.boxes.item_data_fault`: boxes can tile a copy cut before
    the pixels)."""
    fault = boxes_fault(read, size, whole="image")
    if fault is None and read(8, 0)[4:8] == b"ftyp":
        fault = item_data_fault(read, size, whole="image")
    return None if fault is None else f"{name} {fault}"


def _tiff_cut(fd, offset: int, size: int, head: bytes) -> str | None:
    """Why a TIFF is cut short: a strip or tile of its first page (what Pillow decodes) ends past the
    member. The offsets and byte counts are the IFD's, as Pillow reads them: from ``head`` when they
    lie there, else from the first ``PREFIX_BYTES``, else from the whole member."""
    found = _tiff_parts(head)
    for n in (PREFIX_BYTES, size):   # many strips: their arrays lie past the first KiBs
        if found is None and len(head) < n <= size:
            found = _tiff_parts(pread_exact(fd, n, offset))
    if found is None:
        return None
    what, starts, counts = found
    for k, (start, count) in enumerate(zip(starts, counts, strict=False)):
        if start + count > size:
            return (f"TIFF cut short: its {what} {k} runs to byte {start + count}, the image ends at byte "
                    f"{size} ({start + count - size} bytes missing)")
    return None


def _tiff_parts(data: bytes) -> tuple[str, tuple, tuple] | None:
    """``("strip" | "tile", offsets, byte counts)`` of the first page of the TIFF ``data`` as Pillow's
    lazy open reads its tags; ``None`` when they are not in ``data`` (or Pillow fails: it decides later)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "Truncated File Read": a tag's data past ``data``
            with Image.open(io.BytesIO(data)) as im:
                tags = getattr(im, "tag_v2", {})
                for offsets_tag, counts_tag, what in ((273, 279, "strip"), (324, 325, "tile")):
                    if offsets_tag in tags and counts_tag in tags:
                        starts, counts = tags[offsets_tag], tags[counts_tag]
                        return (what, starts if isinstance(starts, tuple) else (starts,),
                                counts if isinstance(counts, tuple) else (counts,))
    except Exception:  # noqa: BLE001 - the size was read from these bytes: Pillow judges the pixels
        return None
    return None


_QOI_END = b"\0" * 7 + b"\1"
_J2K_SIG = b"\xff\x4f\xff\x51"   # a raw JPEG 2000 codestream: SOC then SIZ


def _qoi_cut(read, size: int) -> str | None:
    """Why a QOI image is cut short. A file that ends in the specification's 8-byte end marker (seven
    0x00, one 0x01) is whole: one read. Any other (cut, or bytes after the marker) has its ops walked
    as Pillow's decoder walks them (``_qoi_pixels``): it decodes when they give every pixel before
    the data ends (a file cut inside the marker alone, or padded, decodes)."""
    if size >= 14 + len(_QOI_END) and read(len(_QOI_END), size - len(_QOI_END)) == _QOI_END:
        return None
    head = read(14, 0)
    want = int.from_bytes(head[4:8], "big") * int.from_bytes(head[8:12], "big")
    have, end = _qoi_pixels(read(size - 14, 14) if size > 14 else b"", want)
    if have < want:
        return (f"QOI cut short: its ops give {have} of its {want} pixels (they end at byte {14 + end} of "
                f"{size}; no end marker 7 x 00, 01 at its end)")
    return None


def _qoi_pixels(ops: bytes, want: int) -> tuple[int, int]:
    """(pixels, bytes read) of QOI ``ops`` counted as Pillow's ``QoiDecoder`` counts them, up to
    ``want`` pixels or the end of the data (an op cut short gives no pixel)."""
    have, pos, n = 0, 0, len(ops)
    while have < want and pos < n:
        op = ops[pos]
        step = 4 if op == 0xFE else 5 if op == 0xFF else 2 if op >> 6 == 2 else 1
        if pos + step > n:
            break
        pos += step
        have += (op & 0x3F) + 1 if op >> 6 == 3 and op < 0xFE else 1
    return have, pos


def _j2k_cut(read, size: int) -> str | None:
    """Why a raw JPEG 2000 codestream (.j2k / .j2c / .jpc) is cut short: its marker segments, then its
    tile-parts (each SOT's Psot gives the tile-part's length), do not lead to the end-of-codestream
    marker (EOC, FF D9) inside the member. One small read per marker segment and per tile-part; a
    last tile-part of unknown length (Psot 0: 'to the EOC') must end the member with EOC."""
    pos = 2
    while pos + 4 <= size:
        segment = read(4, pos)
        marker, length = segment[:2], int.from_bytes(segment[2:4], "big")
        if marker == b"\xff\xd9":
            return None
        if marker[:1] == b"\xff" and 0x30 <= marker[1] <= 0x3F:
            pos += 2                                # reserved markers without a segment
            continue
        if marker[:1] != b"\xff" or length < 2:
            # not the layout walked here: the member's last two bytes must then be the EOC
            return None if read(2, size - 2) == b"\xff\xd9" else (
                f"JPEG 2000 codestream cut short: no end-of-codestream marker (FF D9) at its end ({size} "
                "bytes in all)")
        if marker == b"\xff\x90":                  # SOT: Lsot, Isot, Psot, TPsot, TNsot
            if pos + 10 > size:
                break
            psot = int.from_bytes(read(10, pos)[6:10], "big")
            if psot == 0:
                if read(2, size - 2) == b"\xff\xd9":
                    return None
                break
            pos += psot
        else:
            pos += 2 + length
    if pos + 2 <= size and read(2, pos) == b"\xff\xd9":
        return None
    return (f"JPEG 2000 codestream cut short: its tile-parts run to byte {pos}, with no end-of-codestream "
            f"marker (FF D9) inside its {size} bytes")


_ROW_BITS: dict[tuple[str, str], int | None] = {}


def _row_bits(mode: str, rawmode: str) -> int | None:
    """Bits per pixel Pillow's raw decoder reads for ``rawmode`` into ``mode`` (None: it has no such
    unpacker). Read from the decoder itself: on an 8-pixel row it needs exactly that many bytes."""
    key = (mode, rawmode)
    if key not in _ROW_BITS:
        bits = None
        try:
            for n in range(1, 129):           # up to 128 bits a pixel (RGBA, 32-bit float samples)
                decoder = Image._getdecoder(mode, "raw", rawmode, ())
                decoder.setimage(Image.core.new(mode, (8, 1)), (0, 0, 8, 1))
                if decoder.decode(b"\0" * n)[0] < 0:
                    bits = n
                    break
        except Exception:  # noqa: BLE001 - an unpacker Pillow lacks: Pillow decides when it loads
            bits = None
        _ROW_BITS[key] = bits
    return _ROW_BITS[key]


@functools.cache
def _dds_rgb_refuses_short() -> bool:
    """Whether the installed Pillow refuses an uncompressed (masked RGB) DDS cut short. Pillow 13's
    ``DdsRgbDecoder`` stops at the end of the data ('not enough image data'); 11.3's reads the
    missing pixels as 0 and decodes the image, black where it was cut: that one must be counted.
    Asked of Pillow once, on a 2x1 DDS it writes, one pixel short."""
    buf = io.BytesIO()
    try:
        Image.new("RGB", (2, 1)).save(buf, "DDS")
    except Exception:  # noqa: BLE001 - a Pillow that writes no DDS: not checked
        return False
    try:
        with Image.open(io.BytesIO(buf.getvalue()[:-3])) as im:
            if im.tile[0].codec_name != "dds_rgb":
                return False
            im.load()
    except Exception:  # noqa: BLE001 - any failure is Pillow refusing the cut image
        return True
    return False


def _tiles_cut(read, size: int, head: bytes) -> str | None:
    """Why an image whose pixel data Pillow's lazy open places exactly is cut short: a raw tile's rows
    (offset + stride x rows; the stride given, or the row's bytes from the decoder's unpacker: PPM /
    PGM / PBM / PFM, uncompressed BMP / TGA / SGI / IM / MSP, ...), a PPM's scaled samples (maxval
    other than 255 / 65535: width x height x bands x 1 or 2 bytes) end past the member, or a BMP's
    RLE codes end before its last pixel (``_bmp_rle_short``); a DDS's BCn blocks (8 or 16 bytes per
    4x4) or masked pixels after its header, a PCX's / XBM's / BLP's data as their decoders read it
    (``_pcx_short``, ``_xbm_short``, ``_blp_short``). Other codecs are not checked."""
    try:
        with Image.open(io.BytesIO(head)) as im:
            tiles, mode, name = list(im.tile), im.mode, im.format or "image"
            # A DDS's tiles say offset 0 (its load_seek ignores them): its pixels follow the header
            # where the open stopped reading (128 bytes, 148 with a DX10 header, + 1024 of palette).
            start = im.fp.tell() if name == "DDS" else None
    except Exception:  # noqa: BLE001 - the size was read from these bytes: Pillow decides later
        return None
    for tile in tiles:
        args = tile.args
        width, rows = tile.extents[2] - tile.extents[0], tile.extents[3] - tile.extents[1]
        if start is not None:
            tile = tile._replace(offset=start)
        if tile.codec_name == "raw":
            rawmode, stride = (args, 0) if isinstance(args, str) else (*args[:2], 0)[:2]
            if not isinstance(rawmode, str) or not isinstance(stride, int) or stride < 0:
                continue
            if stride == 0:
                bits = _row_bits(mode, rawmode)
                if bits is None:
                    continue
                stride = (bits * width + 7) // 8
            end = tile.offset + stride * rows
        elif tile.codec_name == "ppm" and isinstance(args, tuple) and len(args) == 2:
            end = tile.offset + width * rows * Image.getmodebands(mode) * (1 if args[1] < 256 else 2)
        elif tile.codec_name == "ppm_plain":
            samples = width * rows * (1 if mode == "1" else Image.getmodebands(mode))
            why = _plain_netpbm_short(read, size, tile.offset, samples, mode)
            if why is not None:
                return f"{name} {why}"
            continue
        elif tile.codec_name == "tga_rle" and isinstance(args, tuple) and len(args) == 3:
            why = _tga_rle_short(read, size, tile.offset, width * rows, (int(args[2]) + 7) // 8)
            if why is not None:
                return f"{name} cut short: {why}"
            continue
        elif tile.codec_name == "sgi_rle":
            # the row offset and length tables (4-byte, big endian) after the 512-byte header say where
            # every compressed row of every channel lies
            n = rows * Image.getmodebands(mode)
            tables = read(8 * n, tile.offset)
            if len(tables) < 8 * n:
                return f"{name} cut short: its row tables run past its end ({size} bytes)"
            table = struct.unpack(f">{2 * n}I", tables)
            end = max(map(sum, zip(table[:n], table[n:], strict=True)), default=0)
        elif tile.codec_name == "bmp_rle" and isinstance(args, tuple) and len(args) == 3:
            why = _bmp_rle_short(read, size, tile.offset, width, rows, bool(args[1]))
            if why is not None:
                return f"{name} cut short: {why}"
            continue
        elif tile.codec_name == "bcn" and isinstance(args, tuple) and args and isinstance(args[0], int):
            # DDS block compression: 4x4 blocks of 8 bytes (BC1 / BC4) or 16 (BC2 / 3 / 5 / 6 / 7)
            end = tile.offset + (width + 3) // 4 * ((rows + 3) // 4) * (8 if args[0] in (1, 4) else 16)
        elif tile.codec_name == "dds_rgb" and isinstance(args, tuple) and len(args) == 2:
            if not _dds_rgb_refuses_short():
                continue                  # this Pillow decodes the missing pixels as black
            end = tile.offset + width * rows * (int(args[0]) // 8)   # whole bytes a pixel, masked
        elif tile.codec_name == "pcx" and isinstance(args, tuple) and len(args) == 2:
            why = _pcx_short(read, size, tile.offset, rows, int(args[1]))
            if why is not None:
                return f"{name} {why}"
            continue
        elif tile.codec_name == "xbm":
            why = _xbm_short(read, size, tile.offset, rows * ((width + 7) // 8))
            if why is not None:
                return f"{name} cut short: {why}"
            continue
        elif tile.codec_name in ("BLP1", "BLP2") and isinstance(args, tuple) and len(args) >= 3:
            why = _blp_short(read, size, tile.offset, tile.codec_name, args, width, rows)
            if why is not None:
                return f"{name} {why}"
            continue
        else:
            continue
        if end > size:
            return (f"{name} cut short: its pixel rows run to byte {end}, the image ends at byte {size} "
                    f"({end - size} bytes missing)")
    return None


_NETPBM_COMMENT = re.compile(rb"#[^\r\n]*")
_WHITESPACE = b" \t\n\r\x0b\x0c"          # what bytes.split() splits at
_NETPBM_NOT_DIGITS = re.compile(rb"[^0-9 \t\n\r\x0b\x0c]")
_TOKEN_MARKS = bytes(32 if chr(i).encode("latin-1") in _WHITESPACE else ord("x") for i in range(256))


def _plain_netpbm_short(read, size: int, offset: int, want: int, mode: str) -> str | None:
    """Why Pillow's plain decoder cannot decode a plain (ASCII: P1 / P2 / P3) PBM / PGM / PPM: its text
    after the header (``#`` comments dropped, split at whitespace as that decoder splits it) holds
    fewer samples than its header needs, or one it refuses (a P1 character other than 0 / 1: a P1
    bitmap's digits need no space between them; a P2 / P3 sample that is no decimal number, or a last
    token of more than 10 characters, which it holds back; a value above its maxval is not looked
    for)."""
    text = _NETPBM_COMMENT.sub(b"", read(size - offset, offset) if offset < size else b"")
    if mode == "1":
        bits = text.translate(None, _WHITESPACE)
        other = bits.translate(None, b"01")
        if other:   # Pillow checks every character of the blocks it reads: 'Invalid token for this mode'
            return f"damaged: its bitmap holds {len(other)} character(s) not 0 / 1, {other[:1]!r} first"
        have = len(bits)
    else:
        # tokens counted without making them (a 640 x 480 P3 has 921,600: split + join took ~0.7 s):
        # every whitespace byte to a space, everything else to "x", then the starts of runs of "x"
        marks = b" " + text.translate(_TOKEN_MARKS)
        have = marks.count(b" x")
        last = text[-64:].split()
        if last and not text[-1:].isspace() and len(last[-1]) > 10:
            return f"damaged: it ends in a token of {len(last[-1])} characters ('Token too long')"
        if have >= want and _NETPBM_NOT_DIGITS.search(text):
            # Pillow parses the samples it needs: one that is no decimal number fails it (bytes after
            # the last one it needs are not read: only then are the tokens made)
            tokens = text.split()[:want]
            if _NETPBM_NOT_DIGITS.search(b" ".join(tokens)):
                return "damaged: a sample of its text is no decimal number"
    if have < want:
        return f"cut short: its text holds {have} of the {want} samples its header needs"
    return None


def _pcx_short(read, size: int, offset: int, rows: int, stride: int) -> str | None:
    """Why Pillow's PCX decoder cannot decode a PCX's run-length data: its packets (a byte below 0xC0
    one byte of a line, else a run of ``byte & 0x3F`` copies of the next byte) give fewer than
    ``rows`` lines of ``stride`` bytes before the data ends, or a run crosses the end of a line
    ('buffer overrun'). Walked by Pillow's own decoder into a one-pixel-wide image: its walk depends
    on the line's bytes (``stride``) alone, so it judges exactly, in C, without the image's pixels
    (a Python walk of a 640 x 480 noise PCX's ~1M packets took ~25 ms; this ~1 ms)."""
    data = read(size - offset, offset) if offset < size else b""
    try:
        decoder = Image._getdecoder("L", "pcx", ("L", stride))
        decoder.setimage(Image.core.new("L", (1, rows)), (0, 0, 1, rows))
        used, error = decoder.decode(data)
        decoder.cleanup()
    except Exception:  # noqa: BLE001 - a Pillow without this decoder: Pillow decides when it loads
        return None
    if used >= 0:
        return f"cut short: its run-length data ends (byte {size}) before its {rows} lines of {stride} bytes"
    if error < 0:
        return "damaged: a run of its run-length data crosses the end of a line (Pillow: 'buffer overrun')"
    return None


_XBM_BYTE = re.compile(rb"x[\s\S]{2}")   # Pillow's XBM decoder: each 'x' and the two bytes after it
_XBM_NEAR = re.compile(rb"x[\s\S]?x")    # an 'x' that the decoder takes as a hex digit of the one before


def _xbm_short(read, size: int, offset: int, want: int) -> str | None:
    """Why Pillow's XBM decoder cannot decode an XBM: its text after the ``_bits[] = {`` line holds
    fewer than ``want`` bytes, each an ``x`` (the one of ``0x``) and the two characters after it,
    the decoder's reading of them (it skips anything to the next ``x``)."""
    text = read(size - offset, offset) if offset < size else b""
    if _XBM_NEAR.search(text) is None:
        # every 'x' starts a byte (the usual text): counted without making them (findall took ~6 ms
        # for a 640 x 480 XBM, this ~1 ms); the last one needs its two characters
        have = text.count(b"x") - (text.rfind(b"x") > len(text) - 3)
    else:
        have = len(_XBM_BYTE.findall(text))
    if have < want:
        return f"its bitmap holds {have} of its {want} bytes (0x..) before its end (byte {size})"
    return None


def _blp_short(read, size: int, offset: int, codec: str, args: tuple, width: int, rows: int) -> str | None:
    """Why Pillow's BLP decoders cannot decode a BLP: the mipmap table after the header (16 offsets
    and 16 lengths) and what the decoder reads after it (a 1024-byte palette, then the first mipmap:
    palette indices, DXT blocks or a JPEG stream) run past the member, or hold fewer palette indices
    than pixels ('not enough image data'). Other compressions: Pillow refuses them itself."""
    table = read(128, offset)
    if len(table) < 128:
        return f"cut short: its mipmap table (bytes {offset}-{offset + 128}) runs past its end ({size} bytes)"
    offsets, lengths = struct.unpack("<16I", table[:64]), struct.unpack("<16I", table[64:])
    compression, encoding = args[0], args[1]
    palette_end = offset + 128 + 1024
    if codec == "BLP1" and compression == 0:               # JPEG: a shared header, then the mipmap
        head = read(4, offset + 128)
        if len(head) < 4:
            return f"cut short: its JPEG header length (byte {offset + 128}) lies past its end ({size} bytes)"
        start, length = max(offsets[0], offset + 132 + int.from_bytes(head, "little")), lengths[0]
    elif codec == "BLP1" and compression == 1 and encoding in (4, 5):
        start, length = palette_end, lengths[0]           # BLP1 reads its indices right after the palette
    elif codec == "BLP2" and compression == 1 and encoding == 1:
        start, length = offsets[0], lengths[0]
    elif codec == "BLP2" and compression == 1 and encoding == 2 and len(args) >= 4 and args[3] in (0, 1, 7):
        start, length = offsets[0], (rows + 3) // 4 * ((width + 3) // 4) * (8 if args[3] == 0 else 16)
    else:
        return None
    if (codec == "BLP2" or compression == 1) and palette_end > size:
        return f"cut short: its palette runs to byte {palette_end}, the image ends at byte {size}"
    if start + length > size:
        return (f"cut short: its first mipmap runs to byte {start + length}, the image ends at byte {size} "
                f"({start + length - size} bytes missing)")
    if compression == 1 and encoding != 2 and length < width * rows:
        return f"damaged: its first mipmap holds {length} palette indices for its {width * rows} pixels"
    return None


def _tga_rle_short(read, size: int, offset: int, want: int, depth: int) -> str | None:
    """Why a run-length TGA's packets give fewer pixels than its width x height: each packet a header
    byte (bit 7: a run of one pixel value, else literal pixels; low 7 bits: count - 1), then one or
    count pixels of ``depth`` bytes. One pass over the packet headers."""
    data = read(size - offset, offset) if offset < size else b""
    have, pos, n = 0, 0, len(data)
    while have < want and pos < n:
        head = data[pos]
        count = (head & 0x7F) + 1
        step = 1 + (depth if head & 0x80 else count * depth)
        if pos + step > n:
            break
        pos += step
        have += count
    if have < want:
        return (f"its run-length packets give {have} of its {want} pixels (they end at byte "
                f"{offset + pos} of {size})")
    return None


def _bmp_rle_short(read, size: int, offset: int, width: int, rows: int, rle4: bool) -> str | None:
    """Why a BMP's RLE8 / RLE4 codes give fewer pixels than its width x height, counted as Pillow's
    ``BmpRleDecoder`` counts them (runs clipped at the row's end, end-of-line padding, deltas,
    absolute runs padded to 16 bits, the end-of-bitmap code ``00 01`` stopping it): Pillow refuses
    such an image ('not enough image data'). One pass over the codes, without the pixels."""
    data = read(size - offset, offset) if offset < size else b""
    want, have, x, pos, n = width * rows, 0, 0, 0, len(data)
    while have < want and pos + 2 <= n:
        count = data[pos]
        if count:                                   # encoded run (the hot path: kept lean)
            pos += 2
            if count > width - x:
                count = width - x if width > x else 0
            have += count
            x += count
            continue
        byte = data[pos + 1]
        pos += 2
        if byte == 0:                               # end of line
            if have % width:
                have += width - have % width
            x = 0
        elif byte == 1:                             # end of bitmap
            break
        elif byte == 2:                             # delta: right, up
            if pos + 2 > n:
                break
            have += min(want - have, data[pos] + data[pos + 1] * width)
            pos += 2
            x = have % width
        else:                                       # absolute run of ``byte`` pixels
            take = min(want - have, byte)
            need = (take + 1) // 2 if rle4 else take
            got = min(need, n - pos)
            have += min(take, 2 * got) if rle4 else got
            pos += got
            if got < need or have == want:
                break
            x += byte
            if (offset + pos) % 2:
                pos += 1
    if have < want:
        return (f"its RLE{4 if rle4 else 8} codes give {have} of its {want} pixels (the codes end at byte "
                f"{offset + pos} of {size})")
    return None


def _ends_inside(data: bytes) -> bool:
    """Whether the JPEG or PNG ``data`` holds its end marker before its last bytes (other formats:
    False): its segments or chunks are walked from the start, so an end marker followed by other
    bytes counts and a member cut before its end marker does not. An animated PNG cut after its
    first frame counts too (``_apng_first_frame_whole``)."""
    if data[:3] == b"\xff\xd8\xff":
        return _jpeg_end(data) is not None
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return _png_end(data) is not None or _apng_first_frame_whole(data)
    return False


def _apng_first_frame_whole(data: bytes) -> bool:
    """Whether the animated PNG ``data``, cut short (or damaged) after its first frame, still holds
    all that Pillow reads to decode that frame, the only one ``convert("RGB")`` / ``load`` (so
    transformers' ``load_image``, the Qwen2-VL / LLaVA-NeXT image processors and tokenbal's readers)
    decode: its IDAT chunks whole, the end of their run confirmed by the next chunk's header, then
    whole chunks up to the next frame's fcTL (Pillow's load stops there), an IEND, or a cut inside a
    CRC or a chunk header (Pillow stops reading there too). A chunk after the pixel data cut inside
    its data makes Pillow fail; so does one missing IDAT chunk, which a cut at a chunk boundary
    cannot tell apart from the end of the run: such cuts stay errors."""
    i, n, last, pixels_done = 8, len(data), b"", False
    while i + 8 <= n:
        length, kind = int.from_bytes(data[i:i + 4], "big"), data[i + 4:i + 8]
        if last == b"IDAT" and kind != b"IDAT":
            pixels_done = True                   # the run of IDAT chunks ended: the first frame's data
        if pixels_done and kind == b"IDAT":
            return False                         # IDAT chunks apart: not a layout Pillow reads whole
        if pixels_done and kind in (b"fcTL", b"IEND"):
            break
        if i + 8 + length > n:
            return False                         # a chunk cut inside its data
        last, i = kind, i + 12 + length
    if not pixels_done:
        return False
    try:
        with Image.open(io.BytesIO(data)) as im:  # Pillow's own reading of acTL: frames after the first
            return bool(getattr(im, "is_animated", False))
    except Exception:  # noqa: BLE001 - Pillow cannot open it: the size read failed before this
        return False


# A JPEG marker: FF then a byte that is not a stuffed zero, a restart marker (RST0-7: data) or a fill FF.
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def _jpeg_end(data: bytes) -> int | None:
    """The offset just past the JPEG's end-of-image marker (FF D9), or None if the data ends first.
    Marker segments are skipped by their lengths (an EXIF thumbnail's own FF D9 is inside one), the
    entropy-coded data after each start of scan up to its next marker; junk between segments is
    skipped to the next marker, as Pillow skips it."""
    i, n = 2, len(data)
    while i + 1 < n:
        marker = data[i + 1] if data[i] == 0xFF else None
        if marker is None or marker == 0xFF:            # junk, or fill bytes before a marker
            m = _JPEG_MARKER.search(data, i + 1 if marker == 0xFF else i)
            if m is None:
                return None
            i = m.start()
            continue
        if marker == 0xD9:
            return i + 2
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:    # markers without a length
            i += 2
            continue
        if i + 4 > n:
            return None
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:                              # start of scan: its data runs to the next marker
            m = _JPEG_MARKER.search(data, i)
            if m is None:
                return None
            i = m.start()
    return None


def _png_end(data: bytes) -> int | None:
    """The offset just past the PNG's IEND chunk, or None if the data ends first (chunks walked by
    their lengths)."""
    i, n = 8, len(data)
    while i + 12 <= n:
        length = int.from_bytes(data[i:i + 4], "big")
        kind = data[i + 4:i + 8]
        i += 12 + length
        if kind == b"IEND":
            return i if i <= n else None
    return None


def _check_gif_first_frame(fd, offset: int, size: int, head: bytes) -> None:
    """Raise ``ImageSizeError`` unless the GIF's blocks (extensions and images, each a run of
    length-prefixed sub-blocks) reach the end of its first image (its block terminator) or its
    trailer byte. Pillow decodes the first frame alone (``load``, ``convert("RGB")``: transformers'
    ``load_image``, the Qwen2-VL / LLaVA-NeXT image processors given a PIL image, tokenbal's readers),
    so a later frame cut short is no error. Stray bytes between blocks are skipped as Pillow's reader
    skips them. Reads the member from its start up to the end of that frame (doubling the read),
    not the frames after it."""
    data = head

    def holds(k: int) -> bool:       # whether ``data`` holds byte k - 1, reading further if need be
        nonlocal data
        if k > len(data) and len(data) < size:
            data = pread_exact(fd, min(size, max(k, 2 * len(data))), offset)
        return k <= len(data)

    pos = 13
    if holds(13) and data[10] & 0x80:
        pos += 3 * (2 << (data[10] & 7))           # global colour table
    while holds(pos + 1):
        byte, image = data[pos], False
        if byte == 0x3B:
            return
        if byte == 0x21:                           # extension: introducer, label, sub-blocks
            pos += 2
        elif byte == 0x2C:                         # image: descriptor, local table, LZW code size
            if not holds(pos + 10):
                break
            flags = data[pos + 9]
            pos += 10 + (3 * (2 << (flags & 7)) if flags & 0x80 else 0) + 1
            image = True
        else:
            pos += 1
            continue
        while holds(pos + 1) and data[pos]:
            pos += 1 + data[pos]
        if not holds(pos + 1):
            break
        if image:
            return                                 # the first frame is whole
        pos += 1                                   # the block terminator
    raise ImageSizeError(f"GIF cut short: its first frame's blocks end at byte {min(pos, size)} of {size} "
                         "without their terminator")


# -- orientation: the value PIL.ImageOps.exif_transpose acts on ------------------------------------
#
# exif_transpose loads the image, then takes ``Image.getexif().get(0x0112, 1)``: the EXIF tag when
# IFD0 holds it (whatever its value), else the first ``tiff:Orientation`` digit of the XMP packet
# (Pillow's own pattern below), else 1; it transposes for 2-8 (5-8 swap width and height). Where each
# format keeps the two is Pillow's reader's business, mirrored here: JPEG (first APP1 Exif, last APP1
# XMP), WebP (first EXIF / XMP chunk, when the VP8X flags announce it), PNG (eXIf, a tEXt "exif",
# "Raw profile type exif", "XML:com.adobe.xmp" text; the last of each, before the pixel data and
# after it, since exif_transpose decodes the image first: ``_png_after_pixels``) are read by hand;
# any other format is opened by Pillow itself on the bytes that gave its size (its whole member
# when Pillow found those cut).

ORIENTATION_TAG = 0x0112
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')   # PIL.Image.Image.getexif's pattern
_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_TEXT = (b"tEXt", b"zTXt", b"iTXt")
_PNG_KEYS = ("exif", "Raw profile type exif", "XML:com.adobe.xmp", "xmp")
PNG_TAIL_WINDOW = 64 * 1024   # where a PNG's metadata after its pixel data is looked for


def exif_orientation(fd, offset: int, size: int, head: bytes) -> Any:
    """The orientation ``PIL.ImageOps.exif_transpose`` acts on (1 when none) for the image at
    ``[offset, offset + size)`` of ``fd`` whose first bytes are ``head`` (at least the bytes its size
    was read from): the size Pillow's ``Image.open`` reports is to be transposed when it is 5-8.
    Raises ``ImageSizeError`` where Pillow's ``getexif`` (so ``exif_transpose``) fails."""
    if head[:3] == b"\xff\xd8\xff":
        return _pillow_orientation(fd, offset, size, head)   # the rare JPEG the header walk gave up on
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_orientation(fd, offset, size, head)
    if head[:8] == _PNG_SIG:
        return _png_orientation(fd, offset, size, head)
    return _pillow_orientation(fd, offset, size, head)


def pillow_orientation(exif: bytes | None, xmp: bytes | None) -> Any:
    """``Image.getexif().get(0x0112, 1)`` for an image whose EXIF block (with or without its
    ``Exif\\0\\0`` prefix) and XMP packet are these (``None``: the image has none)."""
    if exif:
        tag = exif_orientation_tag(exif)
        if tag is not None:
            return tag
    if xmp:
        match = _XMP_ORIENTATION.search(xmp)
        if match:
            return int(match[2])
    return 1


def exif_orientation_tag(block: bytes) -> Any:
    """The value of tag 0x0112 in IFD0 of an EXIF block as Pillow's ``Exif`` reads it; ``None`` when
    IFD0 does not hold it. The common layouts (one SHORT / LONG entry) are read by hand; anything
    else (another type or count, a repeated entry, an unusual TIFF header) by Pillow's ``Exif``."""
    tiff = block[6:] if block[:6] == b"Exif\0\0" else block
    order = {b"II*\0": "little", b"MM\0*": "big"}.get(tiff[:4])
    if order is None:
        return _pillow_exif_tag(tiff)
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return None                          # Pillow reads no IFD0 there: no tag
    found = None
    for k in range(int.from_bytes(tiff[ifd:ifd + 2], order)):
        p = ifd + 2 + 12 * k
        if p + 12 > len(tiff):
            break                            # Pillow keeps the entries before a cut
        if int.from_bytes(tiff[p:p + 2], order) != ORIENTATION_TAG:
            continue
        kind, count = int.from_bytes(tiff[p + 2:p + 4], order), int.from_bytes(tiff[p + 4:p + 8], order)
        width = {3: 2, 4: 4}.get(kind)
        if found is not None or width is None or count != 1:
            return _pillow_exif_tag(tiff)
        found = int.from_bytes(tiff[p + 8:p + 8 + width], order)
    return found


def _pillow_exif_tag(tiff: bytes) -> Any:
    exif = Image.Exif()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # "Possibly corrupt EXIF data": Pillow skips the entry
            exif.load(b"Exif\0\0" + tiff)
    except Exception as e:
        raise ImageSizeError(f"its EXIF block cannot be read by Pillow ({type(e).__name__}: {e}), so "
                             "PIL.ImageOps.exif_transpose (transformers' load_image) fails on it") from None
    return exif.get(ORIENTATION_TAG)


def _pillow_orientation(fd, offset: int, size: int, head: bytes) -> Any:
    """Pillow's own answer from a lazy ``Image.open`` (no pixels decoded): on ``head``, then on the
    usual prefix and the whole member while Pillow finds metadata cut off (it warns, e.g. a TIFF tag
    whose data lies further)."""
    for n in [len(head)] + [n for n in (PREFIX_BYTES, size) if len(head) < n <= size]:
        data = head if n == len(head) else pread_exact(fd, n, offset)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with Image.open(io.BytesIO(data)) as im:
                    orientation = im.getexif().get(ORIENTATION_TAG, 1)
                    # A TIFF reports the size after its own tag (Pillow swaps 5-8 at open and
                    # rotates on load, also clearing an XMP orientation): only an XMP one is left.
                    if im.format == "TIFF" and ORIENTATION_TAG in getattr(im, "tag_v2", {}):
                        orientation = 1
                error = None
            except Exception as e:
                error = e
        cut = [w for w in caught if issubclass(w.category, UserWarning)]   # "Truncated File Read"
        if error is None and not cut:
            break
    if error is not None:
        raise ImageSizeError(f"Pillow cannot read its orientation ({type(error).__name__}: {error}), so "
                             "PIL.ImageOps.exif_transpose (transformers' load_image) fails on it")
    return orientation


def _webp_orientation(fd, offset: int, size: int, head: bytes) -> Any:
    # libwebp's demuxer, which Pillow asks for the first EXIF / XMP chunk, keeps one only when the
    # VP8X flags announce it (0x08 EXIF, 0x04 XMP); the simple formats (VP8 / VP8L first) have none.
    if head[12:16] != b"VP8X" or len(head) < 21 or not head[20] & 0x0C:
        return 1
    want = {b"EXIF": bool(head[20] & 0x08), b"XMP ": bool(head[20] & 0x04)}
    got: dict[bytes, bytes] = {}
    pos = 12
    while pos + 8 <= size and any(want[k] and k not in got for k in want):
        hdr = head[pos:pos + 8] if pos + 8 <= len(head) else pread_exact(fd, 8, offset + pos)
        n = int.from_bytes(hdr[4:8], "little")
        kind = hdr[:4]
        if want.get(kind) and kind not in got:
            got[kind] = pread_exact(fd, min(n, size - pos - 8), offset + pos + 8)
        pos += 8 + n + (n & 1)
    return pillow_orientation(got.get(b"EXIF"), got.get(b"XMP "))


def _png_orientation(fd, offset: int, size: int, head: bytes) -> Any:
    # exif_transpose decodes the image, and Pillow then also reads the chunks after the pixel data
    # (an animated PNG's only up to its next frame: not looked for), where e.g. ExifTool writes
    # EXIF and XMP by default. The chunks before the first IDAT are walked (headers from ``head``,
    # else one small read each), the ones after the last IDAT found from the file's tail.
    info: dict[str, bytes] = {}
    pos, animated = 8, False
    while pos + 8 <= size:
        hdr = head[pos:pos + 8] if pos + 8 <= len(head) else pread_exact(fd, 8, offset + pos)
        n, kind = int.from_bytes(hdr[:4], "big"), hdr[4:8]
        if kind in (b"IDAT", b"IEND"):
            break
        if kind in (b"eXIf", b"acTL", *_PNG_TEXT) and pos + 8 + n <= size:
            end = pos + 8 + n
            data = head[pos + 8:end] if end <= len(head) else pread_exact(fd, n, offset + pos + 8)
            if kind == b"acTL":
                animated = int.from_bytes(data[:4], "big") > 1
            else:
                _png_chunk(kind, data, info)
        pos += 12 + n
    if not animated and pos + 8 <= size:
        for kind, data in _png_after_pixels(fd, offset, size, head, pos):
            _png_chunk(kind, data, info)
    exif = info.get("exif")
    if exif is None and "Raw profile type exif" in info:
        text = info["Raw profile type exif"].decode("latin-1")
        try:
            exif = bytes.fromhex("".join(text.split("\n")[3:]))
        except ValueError as e:
            raise ImageSizeError(f"its 'Raw profile type exif' text is not hex ({e}), so PIL.ImageOps."
                                 "exif_transpose (transformers' load_image) fails on it") from None
    return pillow_orientation(exif, info.get("XML:com.adobe.xmp") or info.get("xmp"))


def _png_after_pixels(fd, offset: int, size: int, head: bytes, first_idat: int) -> list[tuple[bytes, bytes]]:
    """The eXIf / text chunks between the last IDAT and IEND, in file order.

    Walking every IDAT chunk header touches every page of the file (measured 14x the cost of the
    size on a 1.8 MB PNG written in 8 KiB chunks, scripts/bench_orientation.py), so the last IDAT
    header is searched backwards in the last PNG_TAIL_WINDOW bytes, and taken when the chunks after
    it lead exactly to IEND (a chance ``IDAT`` inside the compressed data does not); only when no
    IDAT header lies there (chunks larger than the window, so few of them) are the headers walked."""
    for window in (PNG_TAIL_WINDOW // 4, PNG_TAIL_WINDOW):   # most last IDATs are under 16 KiB
        start = max(first_idat, size - window)
        tail = head[start:size] if size <= len(head) else pread_exact(fd, size - start, offset + start)
        at = len(tail)
        for _ in range(8):
            at = tail.rfind(b"IDAT", 4, at)
            if at < 0:
                break
            chunks = _png_walk_to_end(tail, at - 4 + 12 + int.from_bytes(tail[at - 4:at], "big"))
            if chunks is not None:
                return chunks
        if start == first_idat:
            break
    chunks, pos = [], first_idat
    while pos + 8 <= size:   # no IDAT header in the window: few, large chunks; walk them all
        hdr = head[pos:pos + 8] if pos + 8 <= len(head) else pread_exact(fd, 8, offset + pos)
        n, kind = int.from_bytes(hdr[:4], "big"), hdr[4:8]
        if kind == b"IEND":
            break
        if kind in (b"eXIf", *_PNG_TEXT) and pos + 8 + n <= size:
            chunks.append((kind, pread_exact(fd, n, offset + pos + 8)))
        pos += 12 + n
    return chunks


def _png_walk_to_end(tail: bytes, pos: int) -> list[tuple[bytes, bytes]] | None:
    """The metadata chunks from ``pos`` of ``tail`` on, if the chunk headers from there lead to an
    IEND chunk (None if they do not: ``pos`` was not a chunk boundary)."""
    chunks = []
    while pos + 12 <= len(tail):
        n, kind = int.from_bytes(tail[pos:pos + 4], "big"), tail[pos + 4:pos + 8]
        if kind == b"IEND":
            return chunks
        if kind == b"IDAT" or not kind.isalpha() or pos + 12 + n > len(tail):
            return None
        if kind in (b"eXIf", *_PNG_TEXT):
            chunks.append((kind, tail[pos + 8:pos + 8 + n]))
        pos += 12 + n
    return None


def _png_chunk(kind: bytes, data: bytes, info: dict[str, bytes]) -> None:
    if kind == b"eXIf":
        info["exif"] = b"Exif\0\0" + data
    else:
        _png_text(kind, data, info)


def _png_text(kind: bytes, data: bytes, info: dict[str, bytes]) -> None:
    """The keys of ``_PNG_KEYS`` that Pillow's tEXt / zTXt / iTXt handlers would set (as bytes)."""
    key, _, value = data.partition(b"\0")
    if kind == b"zTXt":
        if value[:1] not in (b"", b"\0"):
            return                              # Pillow: unknown compression method (an error)
        try:
            value = zlib.decompress(value[1:])
        except zlib.error:
            value = b""
    elif kind == b"iTXt":
        if len(value) < 2:
            return
        compressed, method, rest = value[0], value[1], value[2:]
        parts = rest.split(b"\0", 2)
        if len(parts) < 3:
            return
        value = parts[2]
        if compressed:
            if method != 0:
                return
            try:
                value = zlib.decompress(value)
            except zlib.error:
                return
        if key == b"XML:com.adobe.xmp":
            info["xmp"] = value
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return
    name = key.decode("latin-1")
    if name in _PNG_KEYS and (name != "exif" or kind == b"tEXt"):
        info[name] = value


def pread_exact(fd, n: int, offset: int) -> bytes:
    """Exactly ``n`` bytes at ``offset`` (one pread may return less, e.g. above 2 GiB on Linux).
    ``fd``: a file descriptor, or an object with ``pread(n, offset)`` (a remote shard)."""
    if hasattr(fd, "pread"):
        data = fd.pread(n, offset)
        if len(data) < n:
            raise OSError(f"file cut short: read {len(data)} of {n} bytes at offset {offset}")
        return data
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise OSError(f"file cut short: read {len(data)} of {n} bytes at offset {offset}")
        data += more
    return data
