"""Image width/height from the first bytes of a file, without decoding pixels.

* JPEG / PNG / GIF / BMP / TIFF …: Pillow's lazy ``Image.open(...).size`` on a prefix of the member
  (the first 4 KiB, then 64 KiB). Pillow reads only the header there, in ~10-20 µs whatever the
  image size. When the prefix is not enough (a JPEG whose SOF marker sits behind a large ICC/EXIF
  segment, a TIFF whose IFD is at the end) the whole member is read and opened again.
* WebP: parsed by hand from the first 30 bytes (VP8 / VP8L / VP8X chunk). Pillow's WebP ``open``
  builds a full animation decoder, costs time proportional to the file size and fails on a prefix.
* JPEG: parsed by hand (``jpeg_size``, ~2 µs instead of Pillow's ~40 µs, the largest per-sample cost
  of an index build) when the marker segments up to the start of scan are well formed and hold
  nothing Pillow would reject; anything else (junk between markers, a 12-bit or 2-layer frame, a
  short JFIF / Adobe / ICC segment, a segment cut by the prefix, a decompression bomb) goes to
  Pillow, so the result, or the error, is always Pillow's.

EXIF orientation: ``read_image_size(..., exif="transpose")`` (the index default) reports the size
after ``PIL.ImageOps.exif_transpose``, as transformers' ``load_image`` and tokenbal's reader see the
image: orientations 5-8 swap width and height. The orientation tag is read by hand from a JPEG's APP1
segment (no Pillow call, no extra read unless the segment is cut by the prefix) and from a WebP's
EXIF chunk (one small read per chunk header) and from a PNG's ``eXIf`` chunk before its pixel data
(one after it is not seen); a TIFF's size from Pillow is already the oriented one; GIF / BMP / PNM
carry none. ``"ignore"``
reports the size as stored.

End check: a member cut short (a JPEG without its end-of-image marker, a PNG without ``IEND``, a GIF
without its trailer, a WebP shorter than its RIFF header says) is an ``ImageSizeError``: its header
is intact, so its size reads fine, but it cannot be decoded. It costs one 32-byte read of the tail.
"""

from __future__ import annotations

import io
import os

from PIL import Image, UnidentifiedImageError

# Extensions (last dot-component, lower case) whose members are images.
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff",
                        "ppm", "pgm", "pbm", "pnm"})
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


def _jpeg_header(data: bytes) -> tuple[tuple[int, int] | None, bytes | None]:
    """``jpeg_size``, plus the first APP1 Exif payload met on the way (the orientation's source:
    the walk reads it for free)."""
    if data[:3] != b"\xff\xd8\xff":
        return None, None
    n = len(data)
    pos, size, exif = 2, None, None
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None, None                # junk between segments: Pillow skips it, we don't
        marker = data[pos + 1]
        if 0xD0 <= marker <= 0xD7 or marker == 0xD8:
            pos += 2                         # standalone markers
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        end = pos + 2 + length
        if length < 2 or end > n:
            return None, None                      # cut by the prefix (or broken): Pillow decides
        if marker == 0xDA:                   # start of scan: Pillow stops reading here
            if size is None or size[0] <= 0 or size[1] <= 0:
                return None, None
            limit = Image.MAX_IMAGE_PIXELS
            if limit is not None and size[0] * size[1] > 2 * limit:
                return None, None                  # Pillow raises DecompressionBombError
            return size, exif
        if marker in _SOF:
            seg = data[pos + 4:end]
            if len(seg) < 6 or seg[0] != 8 or seg[5] not in (1, 3, 4):
                return None, None                  # Pillow: "cannot handle ..." errors
            size = ((seg[3] << 8) | seg[4], (seg[1] << 8) | seg[2])
        elif marker == 0xDB:
            seg, i = data[pos + 4:end], 0
            while i < len(seg):              # Pillow rejects a table cut short
                i += 1 + (64 if seg[i] < 16 else 128)
                if i > len(seg):
                    return None, None
        elif 0xE0 <= marker <= 0xEF:
            if marker == 0xE1 and exif is None and data.startswith(b"Exif\0\0", pos + 4):
                exif = data[pos + 10:end]
            for app, head, need in _APP_MIN:
                if marker == app and data.startswith(head, pos + 4) and length - 2 < need:
                    return None, None
        elif marker not in _SKIP:
            return None, None                      # EOI before a scan, JPG-n, reserved markers
        pos = end
    return None, None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an image held (at least its header) in ``data``; raises ``ImageSizeError``."""
    if not data:
        raise ImageSizeError("empty (0 bytes)")
    wh = webp_size(data[:30]) or jpeg_size(data)
    if wh is None:
        try:
            with Image.open(io.BytesIO(data)) as im:
                wh = im.size
        # Pillow signals malformed input with many exception types (UnidentifiedImageError,
        # SyntaxError, struct.error, DecompressionBombError, ...): any of them means "no size".
        except UnidentifiedImageError:
            # Pillow's own message names a BytesIO object; the first bytes say more.
            raise ImageSizeError(f"not a known image format (starts with {data[:16]!r})") from None
        except Exception as e:
            raise ImageSizeError(f"{type(e).__name__}: {e}") from None
    w, h = int(wh[0]), int(wh[1])
    if w <= 0 or h <= 0:
        raise ImageSizeError(f"image header gives a size of {w}x{h}")
    return w, h


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
            wh, exif_block = _jpeg_header(head)     # the size and the orientation from one walk
            if wh is not None:
                found, orientation = (wh, False), tiff_orientation(exif_block) if exif_block else 1
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
    _check_end(head, tail, size)
    (w, h), full = found
    if exif == "transpose" and orientation is None:
        orientation = exif_orientation(fd, offset, size, head)
    if exif == "transpose" and orientation in (5, 6, 7, 8):
        w, h = h, w
    return (w, h), full


def _check_end(head: bytes, tail: bytes, size: int) -> None:
    """Raise ``ImageSizeError`` for an image whose end marker is missing (cut short)."""
    if head[:3] == b"\xff\xd8\xff":
        if b"\xff\xd9" not in tail:   # EOI; may be followed by padding, so search the tail
            raise ImageSizeError(f"JPEG cut short: no end-of-image marker (FF D9) in its last {len(tail)} "
                                 f"bytes ({size} bytes in all)")
    elif head[:8] == b"\x89PNG\r\n\x1a\n":
        if b"IEND" not in tail:
            raise ImageSizeError(f"PNG cut short: no IEND chunk at its end ({size} bytes in all)")
    elif head[:4] in (b"GIF8",):
        if not tail.rstrip(b"\0").endswith(b";"):
            raise ImageSizeError(f"GIF cut short: no trailer byte (0x3B) at its end ({size} bytes in all)")
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        riff = int.from_bytes(head[4:8], "little") + 8
        if riff > size:
            raise ImageSizeError(f"WebP cut short: its RIFF header says {riff} bytes, the member has {size}")


def exif_orientation(fd: int, offset: int, size: int, head: bytes) -> int:
    """The EXIF orientation (1-8; 1 when absent) of the image at ``[offset, offset + size)`` of
    ``fd``, whose first bytes are ``head``: the value ``PIL.ImageOps.exif_transpose`` acts on."""
    if head[:3] == b"\xff\xd8\xff":
        return _jpeg_orientation(fd, offset, size, head)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_orientation(fd, offset, size, head)
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return _png_orientation(head)
    # TIFF: Pillow's reader already reports the oriented size, and exif_transpose leaves it as is
    # (checked for orientations 1-8). GIF, BMP, PNM carry no EXIF.
    return 1


def _jpeg_orientation(fd: int, offset: int, size: int, head: bytes) -> int:
    pos = 2     # the rare path: the header walk of ``_jpeg_header`` gave up (Pillow read the size)
    while pos + 4 <= len(head) and head[pos] == 0xFF:
        marker = head[pos + 1]
        if 0xD0 <= marker <= 0xD8:
            pos += 2
            continue
        if marker in (0xDA, 0xD9) or marker in _SOF:
            return 1                          # EXIF sits in an APP1 before the frame
        length = (head[pos + 2] << 8) | head[pos + 3]
        if marker == 0xE1:
            seg = head[pos + 4:pos + 2 + length]
            if len(seg) < length - 2 and pos + 2 + length <= size:
                seg = pread_exact(fd, length - 2, offset + pos + 4)   # cut by the prefix
            if seg[:6] == b"Exif\0\0":
                return tiff_orientation(seg[6:])
        pos += 2 + length
    return 1


def _png_orientation(head: bytes) -> int:
    # Chunks up to the first IDAT (an eXIf after the pixel data is not looked for: Pillow itself
    # finds it only when it decodes the whole image).
    pos = 8
    while pos + 8 <= len(head):
        n = int.from_bytes(head[pos:pos + 4], "big")
        kind = head[pos + 4:pos + 8]
        if kind == b"eXIf":
            return tiff_orientation(head[pos + 8:pos + 8 + n])
        if kind in (b"IDAT", b"IEND"):
            return 1
        pos += 12 + n
    return 1


def _webp_orientation(fd: int, offset: int, size: int, head: bytes) -> int:
    if head[12:16] != b"VP8X" or len(head) < 21 or not head[20] & 0x08:
        return 1                              # no VP8X chunk, or its EXIF flag is off
    pos = 12
    while pos + 8 <= size:
        hdr = head[pos:pos + 8] if pos + 8 <= len(head) else pread_exact(fd, 8, offset + pos)
        n = int.from_bytes(hdr[4:8], "little")
        if hdr[:4] == b"EXIF":
            data = pread_exact(fd, min(n, size - pos - 8), offset + pos + 8)
            return tiff_orientation(data[6:] if data[:6] == b"Exif\0\0" else data)
        pos += 8 + n + (n & 1)
    return 1


def tiff_orientation(tiff: bytes) -> int:
    """Orientation tag (0x0112) of IFD0 of a TIFF-structured EXIF block; 1 when absent or invalid."""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    for k in range(int.from_bytes(tiff[ifd:ifd + 2], order)):
        p = ifd + 2 + 12 * k
        if p + 12 > len(tiff):
            break
        if int.from_bytes(tiff[p:p + 2], order) == 0x0112:
            kind = int.from_bytes(tiff[p + 2:p + 4], order)
            width = {3: 2, 4: 4}.get(kind)
            value = int.from_bytes(tiff[p + 8:p + 8 + width], order) if width else 1
            return value if 1 <= value <= 8 else 1
    return 1


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
